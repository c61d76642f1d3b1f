"""Figures of fields on 2-D and 3-D node grids: input, prediction, reference and error.

A 2-D field (H, W) is shown whole; a 3-D field (D, H, W) as its three orthogonal mid-slices
(the planes through the middle node of each axis), one figure row per slice. Callers keep only
:func:`views` of a field (the 2-D arrays shown), so a 3-D sample costs three planes, not its
volume, when it is gathered to rank 0. Axes carry the problem's axis names and physical
coordinates (nodes include the boundary: node k of ``n`` on [lo, hi] is at
lo + k (hi - lo) / (n - 1)).
"""
from __future__ import annotations

import numpy as np


def views(field) -> list[np.ndarray]:
    """The 2-D arrays that show ``field``: itself (2-D) or its mid-slices across each axis
    (3-D: the plane at the middle node of axis 0, then of axis 1, then of axis 2)."""
    f = np.asarray(field)
    if f.ndim == 2:
        return [f]
    if f.ndim == 3:
        return [np.take(f, f.shape[a] // 2, axis=a) for a in range(3)]
    raise ValueError(f"a field to plot must be 2-D (H, W) or 3-D (D, H, W), got shape {f.shape}")


def view_geometry(names, bounds, grid) -> list[dict]:
    """Per view of a field on ``grid``: extent (col lo, col hi, row lo, row hi), axis labels
    and, for a slice, where it cuts (e.g. "z = 0.467")."""
    names, grid = list(names), [int(n) for n in grid]
    bounds = [(float(lo), float(hi)) for lo, hi in bounds]
    if not len(names) == len(bounds) == len(grid) or len(grid) not in (2, 3):
        raise ValueError(f"axes {names}, bounds {bounds} and grid {grid} must describe the same "
                         f"2 or 3 grid axes")
    if len(grid) == 2:
        return [_geometry(names, bounds, 0, 1, "")]
    out = []
    for a in range(3):
        r, c = (i for i in range(3) if i != a)
        lo, hi = bounds[a]
        k = grid[a] // 2
        at = lo + k * (hi - lo) / max(1, grid[a] - 1)
        out.append(_geometry(names, bounds, r, c, f"{names[a]} = {at:.3g}"))
    return out


def _geometry(names, bounds, r: int, c: int, cut: str) -> dict:
    return {"extent": (*bounds[c], *bounds[r]), "xlabel": names[c], "ylabel": names[r],
            "cut": cut}


def error_style(err) -> dict:
    """imshow keywords for an error field: a diverging map centred on 0 (symmetric limits), so
    white means "no error" in every row; matplotlib's own limits would put white at the middle
    of [min, max], and a field that is nearly all ~0 with one large negative line shows red."""
    lim = float(np.abs(np.asarray(err)).max()) or 1.0
    return {"cmap": "RdBu_r", "vmin": -lim, "vmax": lim}


def fields_figure(path: str, rows: list[dict], *, names, bounds, grid,
                  titles=("input", "prediction", "reference"), dpi: int = 90) -> str:
    """One figure row per sample and view: input, prediction, reference, error.

    ``rows``: dicts with ``input``, ``pred``, ``ref`` (each a list of :func:`views`) and
    ``error_title``. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geo = view_geometry(names, bounds, grid)
    n_rows = len(rows) * len(geo)
    fig, axs = plt.subplots(n_rows, 4, figsize=(13, 3 * n_rows), squeeze=False)
    k = 0
    for row in rows:
        for v, g in enumerate(geo):
            pred, ref = np.asarray(row["pred"][v]), np.asarray(row["ref"][v])
            imgs = (np.asarray(row["input"][v]), pred, ref, pred - ref)
            heads = (*titles, row["error_title"])
            for col, (ax, img, title) in enumerate(zip(axs[k], imgs, heads)):
                style = error_style(img) if col == 3 else {"cmap": "viridis"}
                im = ax.imshow(img, origin="lower", aspect="auto", extent=g["extent"], **style)
                ax.set_title(f"{title}, {g['cut']}" if g["cut"] else title, fontsize=8)
                ax.set_xlabel(g["xlabel"])
                ax.set_ylabel(g["ylabel"])
                fig.colorbar(im, ax=ax, fraction=0.046)
            k += 1
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
