"""The version of DeepFusion, stated once: ``deepfusion --version`` prints it, the launch
agreement of the ranks and the files ``deepfusion export`` writes carry it, and setup.cfg reads
it through ``deepfusion.__version__``. A leaf every room of the package may import."""
__version__ = "0.1.0"
