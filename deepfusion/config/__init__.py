"""The configuration layer: typed, validated TOML sections (no PDE, no MPI, no hardware).

``schema`` holds the generic machinery (field helper, type checks, "did you mean", TOML
writing), ``sections`` the seven tables and :class:`Config`, ``files`` reading files and
``--set`` overrides. What callers outside the layer use is re-exported here.
"""
from deepfusion.config.files import (apply_overrides, config_changes, describe, dump_toml,
                                     load_config, stated)
from deepfusion.config.schema import ConfigError
from deepfusion.config.sections import (Config, DataConfig, OptimConfig, ParallelConfig,
                                        config_from_dict, config_to_dict)

__all__ = [
    "Config", "ConfigError", "DataConfig", "OptimConfig", "ParallelConfig", "apply_overrides",
    "config_changes", "config_from_dict", "config_to_dict", "describe", "dump_toml",
    "load_config", "stated",
]
