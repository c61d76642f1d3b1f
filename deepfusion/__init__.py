"""DeepFusion: the engine that trains DiffNet generators data-parallel on CPU clusters."""
__version__ = "0.1.0"
