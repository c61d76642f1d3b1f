"""The installed DeepFusion's version, for ``deepfusion --version`` and the metadata that
``deepfusion export`` writes into a file."""
from __future__ import annotations

import configparser
import os
from importlib.metadata import PackageNotFoundError, version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def package_version() -> str:
    """The installed distribution's version, else (a source tree run without installing) the
    one setup.cfg states."""
    try:
        return version("deepfusion")
    except PackageNotFoundError:
        cfg = configparser.ConfigParser()
        cfg.read(os.path.join(ROOT, "setup.cfg"))
        return cfg.get("metadata", "version", fallback="unknown")
