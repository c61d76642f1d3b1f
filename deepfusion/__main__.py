"""``python -m deepfusion ...`` is the ``deepfusion`` command (what launchers call)."""
import sys

from .app.cli import main

sys.exit(main())
