"""diffnet.resample: node-aligned bilinear resampling between grids of the same domain."""
import numpy as np
import torch

from diffnet.resample import resample_nodes


def _bilinear(n, m):
    y = torch.linspace(0, 1, n, dtype=torch.float64)[:, None]
    x = torch.linspace(0, 1, m, dtype=torch.float64)[None, :]
    return (1 + 2 * x - 3 * y + 5 * x * y)[None, None]


def test_exact_on_bilinear_fields_both_ways():
    for src, dst in (((9, 17), (33, 65)), ((33, 65), (9, 17)), ((16, 16), (48, 48))):
        out = resample_nodes(_bilinear(*src), dst)
        np.testing.assert_allclose(out.numpy(), _bilinear(*dst).numpy(), rtol=0, atol=1e-13)


def test_same_grid_is_identity_and_corners_are_kept():
    a = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    assert resample_nodes(a, (16, 16)) is a
    b = resample_nodes(a, (61, 47))
    for i, j in ((0, 0), (0, -1), (-1, 0), (-1, -1)):
        torch.testing.assert_close(b[..., i, j], a[..., i, j], rtol=0, atol=1e-12)


def test_second_order_on_smooth_fields():
    def field(n):
        t = torch.linspace(0, 1, n, dtype=torch.float64)
        return torch.sin(3 * t)[:, None] * torch.cos(2 * t)[None, :]

    errs = [float((resample_nodes(field(n)[None, None], (257, 257))[0, 0] - field(257)).abs().max())
            for n in (17, 33, 65)]
    orders = [np.log2(errs[k] / errs[k + 1]) for k in range(2)]
    assert min(orders) > 1.8, (errs, orders)
