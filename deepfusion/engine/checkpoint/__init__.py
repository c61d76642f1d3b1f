"""Checkpoints: atomic, sealed, self-verifying HDF5 files (no pickle), the nested state and RNG states they carry."""
