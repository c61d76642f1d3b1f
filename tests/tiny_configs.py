"""The tiny training config the tests run, and its variants written as ``--set`` overrides.

TINY is a 16x16 Burgers run of 20 float64 steps (16 samples, batch 4, 5 epochs) on a depth-2,
width-4 U-Net: small enough for ``mpiexec -n 4`` oversubscribed on 2 cores. A test that needs
another run names only what differs (``variant``), so what it changes is what it reads.
"""
from __future__ import annotations

from deepfusion.config import apply_overrides
from deepfusion.config.files import import_toml
from deepfusion.config.schema import dump_tables

TINY = """
[run]
plots = false  # figures are checked where asserted (test_3d, test_multigrid)
[problem]
name = "burgers"
grid = [16, 16]
[model]
name = "unet"
options = {depth = 2, base_width = 4}
channels_last = false
[data]
n_samples = 16
global_batch = 4
eval_samples = 2
[optim]
name = "adam"
lr = 3e-3
schedule = "constant"
[train]
epochs = 5
dtype = "float64"
log_every = 5
checksum_every = 5
[parallel]
threads_per_rank = 1
"""


def variant(base: str, *overrides: str, drop: tuple[str, ...] = ()) -> str:
    """TOML text: ``base`` with each ``key=value`` override applied (the CLI's ``--set``
    syntax, values parsed as TOML) and each dotted key in ``drop`` removed (back to its
    default)."""
    raw = apply_overrides(import_toml().loads(base), overrides)
    for key in drop:
        *tables, last = key.split(".")
        node = raw
        for t in tables:
            node = node[t]
        del node[last]  # a KeyError names a key the base does not set: fix the test
    return dump_tables("# a variant of a test config (tests/tiny_configs.py)", raw)
