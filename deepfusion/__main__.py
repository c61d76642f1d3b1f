"""``python -m deepfusion ...`` is the ``deepfusion`` command (what launchers call)."""
import sys

from deepfusion.cli import main

sys.exit(main())
