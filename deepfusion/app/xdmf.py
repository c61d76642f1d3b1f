"""XDMF sidecars of fields files: ParaView (or VisIt) opens ``preds.xmf`` to show ``preds.h5``.

The sidecar is light XML (XDMF 2) that points into the HDF5 file, which holds all the data:

* a temporal collection with one uniform grid per sample (ParaView's time slider steps through
  the samples; "time" is the sample index);
* the grid is the node grid of the problem: ``3DCoRectMesh`` with ``ORIGIN_DXDYDZ`` geometry,
  node counts, origin and spacing listed slowest axis first, as the arrays are stored ((z, y,
  x) for a (D, H, W) field), so ParaView's x, y, z are the last, middle and first array axes.
  A 2-D (H, W) grid is written as a (1, H, W) one: ParaView shows it in the x-y plane with x
  the column axis (``axes[1]``) and y the row axis (``axes[0]``, e.g. t);
* node-centred scalar attributes: ``u`` (a hyperslab of ``/u``) and one per input channel (a
  hyperslab of ``/inputs``), named after the channel.

The HDF5 file is named by its base name (the pair moves together). Written atomically after
the HDF5 file is published (:func:`deepfusion.engine.checkpoint.atomic.atomic_path`).
"""
from __future__ import annotations

import os
import xml.etree.ElementTree as ET

import numpy as np

from deepfusion.engine.checkpoint.atomic import atomic_path


def sidecar_path(h5_path) -> str:
    """``preds.h5`` -> ``preds.xmf`` (next to it)."""
    return os.path.splitext(os.fspath(h5_path))[0] + ".xmf"


def _dims(shape) -> str:
    return " ".join(str(int(v)) for v in shape)


def _slab(parent, *, h5_name: str, dataset: str, full_shape, start, mesh) -> None:
    """A DataItem selecting one field (the trailing grid axes) of ``dataset`` at ``start``,
    shaped as the ``mesh`` node counts (the field's, with a leading 1 for a 2-D grid)."""
    rank = len(full_shape)
    lead = len(start)  # leading axes fixed by ``start`` (sample, channel)
    field = tuple(full_shape[lead:])
    slab = ET.SubElement(parent, "DataItem", ItemType="HyperSlab", Type="HyperSlab",
                         Dimensions=_dims(mesh))
    sel = [list(start) + [0] * len(field), [1] * rank, [1] * lead + list(field)]
    ET.SubElement(slab, "DataItem", Dimensions=f"3 {rank}", Format="XML").text = \
        " ".join(_dims(row) for row in sel)
    ET.SubElement(slab, "DataItem", Dimensions=_dims(full_shape), NumberType="Float",
                  Precision="4", Format="HDF").text = f"{h5_name}:/{dataset}"


def xdmf_text(h5_name: str, *, n: int, grid, channels, coords: dict, axes) -> str:
    """The sidecar's XML for a fields file ``h5_name`` with ``n`` samples on ``grid``."""
    grid, axes = [int(v) for v in grid], list(axes)
    if len(grid) not in (2, 3) or len(axes) != len(grid):
        raise ValueError(f"an XDMF sidecar needs 2 or 3 grid axes, got grid {grid}, axes {axes}")
    origin = [float(np.asarray(coords[a])[0]) for a in axes]
    spacing = [float(np.asarray(coords[a])[-1] - np.asarray(coords[a])[0]) / max(1, g - 1)
               for a, g in zip(axes, grid)]
    mesh = [1] * (3 - len(grid)) + grid  # a 2-D grid as one layer of a 3-D one
    origin, spacing = [0.0] * (3 - len(grid)) + origin, [1.0] * (3 - len(grid)) + spacing
    root = ET.Element("Xdmf", Version="2.0")
    domain = ET.SubElement(root, "Domain")
    series = ET.SubElement(domain, "Grid", Name="samples", GridType="Collection",
                           CollectionType="Temporal")
    for j in range(n):
        g = ET.SubElement(series, "Grid", Name=f"sample_{j}", GridType="Uniform")
        ET.SubElement(g, "Time", Value=str(j))
        ET.SubElement(g, "Topology", TopologyType="3DCoRectMesh", Dimensions=_dims(mesh))
        geo = ET.SubElement(g, "Geometry", GeometryType="ORIGIN_DXDYDZ")
        for values in (origin, spacing):
            ET.SubElement(geo, "DataItem", Dimensions="3", NumberType="Float", Precision="8",
                          Format="XML").text = " ".join(repr(v) for v in values)
        u = ET.SubElement(g, "Attribute", Name="u", AttributeType="Scalar", Center="Node")
        _slab(u, h5_name=h5_name, dataset="u", full_shape=(n, *grid), start=(j,),
              mesh=mesh)
        for c, name in enumerate(channels):
            a = ET.SubElement(g, "Attribute", Name=str(name), AttributeType="Scalar",
                              Center="Node")
            _slab(a, h5_name=h5_name, dataset="inputs", full_shape=(n, len(channels), *grid),
                  start=(j, c), mesh=mesh)
    ET.indent(root)
    return '<?xml version="1.0" ?>\n<!DOCTYPE Xdmf SYSTEM "Xdmf.dtd" []>\n' + \
        ET.tostring(root, encoding="unicode") + "\n"


def write_sidecar(h5_path, **layout) -> str:
    """Write ``<h5_path without .h5>.xmf`` for the fields file ``h5_path`` (atomically);
    ``layout``: :func:`xdmf_text`'s keywords. Returns the sidecar's path."""
    path = sidecar_path(h5_path)
    text = xdmf_text(os.path.basename(os.fspath(h5_path)), **layout)
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
    return path
