"""Given input fields checked against the channels a family derives from the others
(:meth:`~diffnet.problems.Family.derived_channels`): a log of a coefficient, a coordinate, a
field repeated along an axis. A network trained on consistent channels answers inconsistent
ones without a sign of trouble (a ``log_nu`` that is not the log of ``nu`` moves a Poisson
answer by tens of percent), so every prediction from given fields is refused when a derived
channel differs from its recomputation by more than rounding.

The tolerance is sized for float32 inputs (a fields file stores float32; float32 rounds at
6e-8 of a value, a log of a rounded value moves by 6e-8): a sample passes when the largest
difference is at most ``RTOL`` times the recomputed channel's largest magnitude in that
sample plus ``ATOL``. Both are far below what changes an answer and far above rounding.
"""
from __future__ import annotations

import numpy as np

RTOL = 1e-4
ATOL = 1e-6
# values compared per slice of samples: bounds the temporaries of a large input
SLICE_VALUES = 1 << 22


def mismatches(problem, inputs) -> dict[str, dict]:
    """{channel: its mismatch} for every derived channel of ``problem`` whose given values in
    ``inputs`` (N, C, *grid) differ from the recomputed ones beyond the tolerance. A mismatch
    holds ``samples`` (the indices of the samples that fail), ``worst`` (that of the largest
    difference), ``diff`` (the largest absolute difference) and ``scale`` (the recomputed
    channel's largest magnitude in that sample). Empty when the family derives nothing."""
    derive = getattr(problem, "derived_channels", None)   # an object outside the contract: none
    if derive is None:
        return {}
    x = np.asarray(inputs)
    n = len(x)
    per = max(1, SLICE_VALUES // max(1, int(np.prod(x.shape[1:]))))
    names = list(problem.input_channels)
    diff: dict[str, np.ndarray] = {}
    scale: dict[str, np.ndarray] = {}
    for lo in range(0, n, per):
        part = np.asarray(x[lo:lo + per], dtype=np.float64)
        for name, rec in derive(part).items():
            if name not in names:
                raise ValueError(f"problem {problem.name!r}: derived_channels returned channel "
                                 f"{name!r}, which is not one of its input_channels {names}")
            rec = np.asarray(rec, dtype=np.float64)
            given = part[:, names.index(name)]
            if rec.shape != given.shape:
                raise ValueError(f"problem {problem.name!r}: derived_channels returned channel "
                                 f"{name!r} of shape {rec.shape}, not {given.shape}")
            flat = len(part), -1
            d = np.abs(given - rec).reshape(flat).max(axis=1, initial=0.0)
            s = np.abs(rec).reshape(flat).max(axis=1, initial=0.0)
            diff.setdefault(name, np.empty(n))[lo:lo + len(part)] = d
            scale.setdefault(name, np.empty(n))[lo:lo + len(part)] = s
    out = {}
    for name in diff:
        bad = ~(diff[name] <= RTOL * scale[name] + ATOL)   # NaN counts as a mismatch
        if bad.any():
            worst = int(np.nanargmax(np.where(bad, diff[name], -np.inf)))
            out[name] = {"samples": np.flatnonzero(bad), "worst": worst,
                         "diff": float(diff[name][worst]), "scale": float(scale[name][worst])}
    return out


def check_derived_channels(problem, inputs, where: str) -> None:
    """ValueError naming ``where`` (the flag and file, or the argument), the first channel of
    ``inputs`` (N, C, *grid) that is not what ``problem`` derives from the others, how far off
    it is, in how many samples, and the fix; nothing when every derived channel agrees."""
    bad = mismatches(problem, inputs)
    if not bad:
        return
    name, m = next(iter(bad.items()))
    how = problem.derivations.get(name, "from the other channels")
    rel = f" ({m['diff'] / m['scale']:.3g} of its largest value)" if m["scale"] > 0 else ""
    rest = [k for k in bad if k != name]
    others = f"; channel(s) {rest} differ too" if rest else ""
    raise ValueError(
        f"{where}: channel {name!r} is not {how}, as problem {problem.name!r} derives it "
        f"from the other channels: it differs by up to {m['diff']:.3g}{rel} in "
        f"{len(m['samples'])} of {len(inputs)} samples (the most in sample {m['worst']}), "
        f"beyond float32 rounding ({RTOL:g} of its size), so the network would answer them "
        f"silently wrong{others}; give {name!r} = {how}{problem.fields_hint}")
