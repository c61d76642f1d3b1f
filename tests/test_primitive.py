"""diffnet.primitive: the primitive of nodal samples, float64 against analytic integrals."""
import numpy as np
import pytest
import torch

from diffnet.primitive import node_primitive, primitive_at, primitive_with_slope


def _sample(n, k=5.0):
    x = torch.linspace(0, 1, n, dtype=torch.float64)
    return x, torch.sin(k * x)[None], (1 - torch.cos(k * x))[None] / k   # f, F = int_0^x f


def test_node_primitive_fourth_order():
    errs = []
    for n in (17, 33, 65):
        x, f, big_f = _sample(n)
        errs.append(float((node_primitive(f, 1 / (n - 1)) - big_f).abs().max()))
    orders = np.log2(np.array(errs[:-1]) / np.array(errs[1:]))
    assert errs[-1] < 5e-7 and np.all(orders > 3.6), (errs, orders)


def test_node_primitive_exact_for_cubics():
    x = torch.linspace(0, 1, 9, dtype=torch.float64)
    f = (1 + x - 2 * x**2 + 3 * x**3)[None]
    want = x + x**2 / 2 - 2 * x**3 / 3 + 3 * x**4 / 4
    torch.testing.assert_close(node_primitive(f, 1 / 8)[0], want, rtol=0, atol=1e-14)


def test_primitive_at_between_nodes_and_outside():
    n, k = 65, 5.0
    x, f, _ = _sample(n, k)
    big = node_primitive(f, 1 / (n - 1))
    y = torch.linspace(-0.3, 1.2, 1001, dtype=torch.float64)[None].requires_grad_()
    val = primitive_at(big, f, 1 / (n - 1), y, left=0.25)
    inside = (y >= 0) & (y <= 1)
    exact = (1 - torch.cos(k * y)) / k
    assert float((val - exact).detach()[inside].abs().max()) < 5e-7
    # outside: slope `left` before 0, slope f(1) after 1
    yd = y.detach()
    torch.testing.assert_close(val[yd < 0], 0.25 * yd[yd < 0])
    f1 = float(f[0, -1])
    torch.testing.assert_close(val[yd > 1], big[0, -1] + f1 * (yd[yd > 1] - 1))
    # C1: the derivative is the interpolated f (O(h^3)), continuous across nodes
    (g,) = torch.autograd.grad(val.sum(), y)
    assert float((g - torch.sin(k * yd))[inside].abs().max()) < 1e-4


def test_primitive_batched_shapes():
    f = torch.rand(3, 10, dtype=torch.float64)
    big = node_primitive(f, 0.1)
    y = torch.rand(3, 2, 4, 5, dtype=torch.float64) * 0.9
    out = primitive_at(big, f, 0.1, y)
    assert out.shape == y.shape
    for b in range(3):
        torch.testing.assert_close(out[b], primitive_at(big[b:b + 1], f[b:b + 1], 0.1, y[b:b + 1])[0])
    with pytest.raises(ValueError, match="at least 4 nodes"):
        node_primitive(f[:, :3], 0.1)


def test_primitive_with_slope_is_autograds_everywhere():
    """The closed-form slope (and the value beside it) equal autograd's through primitive_at,
    before x_0 (slope ``left``), inside, and after the last node (slope f[W-1])."""
    n = 33
    _, f, _ = _sample(n)
    big = node_primitive(f, 1 / (n - 1))
    y = torch.linspace(-0.3, 1.2, 1001, dtype=torch.float64)[None].requires_grad_()
    val = primitive_at(big, f, 1 / (n - 1), y, left=0.25)
    (grad,) = torch.autograd.grad(val.sum(), y)
    value, slope = primitive_with_slope(big, f, 1 / (n - 1), y.detach(), left=0.25)
    torch.testing.assert_close(value, val.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(slope, grad, rtol=0, atol=1e-12)
    yd = y.detach()
    assert torch.all(slope[yd < 0] == 0.25) and torch.allclose(slope[yd > 1], f[0, -1])


def test_a_nan_point_gives_nan_not_an_index_error():
    """A diverged network's answer reaches the Lax-Oleinik loss as NaN points: the primitive
    and its slope must come out NaN there (the engine's non-finite-loss handling takes over),
    and finite points keep their values. (An infinite point is the straight continuation's
    limit: no index is taken from it.)"""
    x = torch.linspace(0.0, 1.0, 33, dtype=torch.float64)[None]
    F, f = node_primitive(torch.sin(3 * x), 1 / 32), torch.sin(3 * x)
    y = torch.tensor([[0.25, float("nan"), 0.75]], dtype=torch.float64)
    for value in (primitive_at(F, f, 1 / 32, y), *primitive_with_slope(F, f, 1 / 32, y)):
        assert torch.isnan(value[0, 1]) and torch.isfinite(value[0, ::2]).all()
    ok = primitive_at(F, f, 1 / 32, y[:, ::2])
    assert torch.equal(primitive_at(F, f, 1 / 32, y)[:, ::2], ok)
