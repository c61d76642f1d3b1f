"""Check a fields file's XDMF sidecar with VTK's XDMF reader (the one ParaView uses).

    python3 -m venv /tmp/vtkenv && /tmp/vtkenv/bin/pip install vtk h5py
    /tmp/vtkenv/bin/python -m lab.tools.xdmf_vtk_check preds.xmf preds.h5    # from the repository root

(``python -m lab.tools.NAME`` with a Python that has VTK: it needs only vtk, h5py and numpy, not
the project's environment.)

Prints, per sample (time step): the image's dimensions, origin, spacing and bounds, whether
every point array equals the HDF5 data (VTK's point order: x fastest = C order of (z, y, x)),
and the location of one node next to the value stored for it.
"""
import sys

import h5py
import numpy as np
import vtk
from vtk.util.numpy_support import vtk_to_numpy

xmf, h5 = sys.argv[1], sys.argv[2]
r = vtk.vtkXdmfReader()
r.SetFileName(xmf)
r.UpdateInformation()
steps = r.GetOutputInformation(0).Get(vtk.vtkStreamingDemandDrivenPipeline.TIME_STEPS())
print("time steps", steps)
with h5py.File(h5, "r") as f:
    channels = [c.decode() if isinstance(c, bytes) else c for c in f["inputs"].attrs["channels"]]
    for j, t in enumerate(steps):
        r.UpdateTimeStep(t)
        out = r.GetOutputDataObject(0)
        print(type(out).__name__, out.GetDimensions(), "origin", out.GetOrigin(), "spacing",
              out.GetSpacing(), "bounds", out.GetBounds())
        pd = out.GetPointData()
        same = {"u": np.array_equal(vtk_to_numpy(pd.GetArray("u")), f["u"][j].ravel())}
        for c, name in enumerate(channels):
            same[name] = np.array_equal(vtk_to_numpy(pd.GetArray(name)), f["inputs"][j, c].ravel())
        print("  arrays equal to the HDF5 data:", same)
        node = (1, 2, 3)[: f["u"].ndim - 1]           # (k, j, i) or (j, i): index into /u[j]
        ijk = list(reversed(node)) + [0] * (3 - len(node))  # VTK's (i, j, k): x first
        pid = out.ComputePointId(ijk)
        print(f"  node {node} of /u at {out.GetPoint(pid)}: VTK {vtk_to_numpy(pd.GetArray('u'))[pid]}"
              f", HDF5 {f['u'][j][node]}")
