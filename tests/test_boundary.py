"""Boundary data and coarsening in the contract (``diffnet.problems``: ``dirichlet``,
``transfinite_lift``, ``bubble``, ``mesh``, ``neumann``, ``robin``, ``normal_derivative``,
``cell_means``): what each computes on the whole grid, checked against the formula; split
[1, 2], [2, 2] and 3-D [2, 2, 2] (blocks in threads of this process, as a real split's ranks):
the imposed field bit for bit and every term's value and gradient equal to the undivided ones
in float64 (and on a real ``mpiexec -n 2`` split); bad arguments refused with the fix."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffnet.domain import Block
from diffnet.problems import (Axis, Problem, block_cells, bubble, cell_means, dirichlet, mesh,
                              neumann, normal_derivative, robin, transfinite_lift, wall_names)
from diffnet.problems.check.split import ThreadSplit, close, run_blocks, terms_and_grads
from tests.mpi_util import run_script_cases

RTOL = 1e-12


class Box(Problem):
    """Only the geometry the helpers read: axes of different lengths and offsets."""

    name = "box"
    param_names = ("a",)
    input_channels = ("f", "g")

    @property
    def axes(self):
        return (Axis("z", 0.0, 0.5), Axis("y", 0.0, 3.0), Axis("x", -1.0, 1.0))[-self.dims:]

    def param_bounds(self):
        return np.array([[0.0, 1.0]])

    def build_input(self, params, dtype=torch.float32):
        raise NotImplementedError

    def impose(self, u, inputs):
        return u

    def loss_terms(self, u, inputs):
        return {}


class Box3(Box):
    dims = 3


def box(grid):
    return (Box3 if len(grid) == 3 else Box)(grid=grid)


def g_of(*c):
    """Dirichlet data of the coordinates, non-zero and not bilinear."""
    return np.sin(2 * c[-1]) + c[-2] ** 2 + 0.5 * c[0] * c[-1]


# -- on the whole grid: the formulas ----------------------------------------------------------------
def test_mesh_and_bubble_follow_the_axes():
    p = box((7, 9))
    y, x = mesh(p)
    assert y.shape == x.shape == (7, 9) and y[-1, 0] == 3.0 and x[0, 0] == -1.0
    b = bubble(p)
    assert b[3, 4] == 1.0 and (b[[0, -1]] == 0).all() and (b[:, [0, -1]] == 0).all()
    t = (x + 1) / 2
    assert np.allclose(b, 4 * (y / 3) * (1 - y / 3) * 4 * t * (1 - t), rtol=0, atol=1e-15)
    one = bubble(p, walls=["x_lo", (0, "lo"), "y_hi"])     # names and (axis, side) pairs
    assert (one[:, 0] == 0).all() and (one[0] == 0).all() and (one[-1] == 0).all()
    assert np.allclose(one[3, -1], 1.0) and (one[1:-1, -1] > 0).all()   # the free wall x = hi
    assert wall_names(p) == ["y_lo", "y_hi", "x_lo", "x_hi"]


@pytest.mark.parametrize("grid", [(9, 11), (5, 6, 7)], ids=str)
def test_transfinite_lift_is_g_on_the_walls_and_reproduces_blended_fields(grid):
    p = box(grid)
    c = mesh(p)
    lift = transfinite_lift(p, g_of)
    g = g_of(*c)
    for a in range(len(grid)):
        for k in (0, -1):
            assert np.array_equal(np.take(lift, k, axis=a), np.take(g, k, axis=a))
    # a sum of one-axis functions and a multilinear part is reproduced inside too
    blended = lambda *c: sum(np.cos(v) for v in c) + np.prod(c, axis=0)      # noqa: E731
    assert np.allclose(transfinite_lift(p, blended), blended(*c), rtol=0, atol=1e-13)
    # n draws at once, and an array given on the whole grid: its wall values are read
    many = transfinite_lift(p, lambda *c: np.stack([g_of(*c), 2 * g_of(*c)]))
    assert many.shape == (2, *grid) and np.allclose(many[1], 2 * lift)
    assert np.allclose(transfinite_lift(p, g + 5 * p.block.nodes() * (lift != g)), lift)


def test_a_lift_on_some_walls_only_holds_g_there():
    p = box((9, 11))
    walls = ("y_lo", "y_hi", "x_lo")
    g_of = lambda y, x: np.sin(x * y)                           # noqa: E731 -- not blended
    lift = transfinite_lift(p, g_of, walls=walls)
    g = g_of(*mesh(p))
    assert np.array_equal(lift[0], g[0]) and np.array_equal(lift[-1], g[-1])
    assert np.array_equal(lift[:, 0], g[:, 0])
    assert not np.allclose(lift[1:-1, -1], g[1:-1, -1])      # x = hi is not a Dirichlet wall
    # along x only the wall x = lo: the constant extension from it
    only = transfinite_lift(p, g_of, walls="x_lo")
    assert np.array_equal(only, np.broadcast_to(g[:, :1], g.shape))


def test_dirichlet_holds_g_exactly_whatever_the_network_says():
    p = box((9, 11))
    g = g_of(*mesh(p))
    for data in (g_of, torch.tensor(transfinite_lift(p, g_of))[None, None]):
        u = dirichlet(p, torch.randn(3, 1, 9, 11, dtype=torch.float64), data, scale=0.3)
        assert u.shape == (3, 1, 9, 11)
        for k in (0, -1):
            assert torch.equal(u[:, 0, k], torch.tensor(g[k]).expand(3, -1))
            assert torch.equal(u[:, 0, :, k], torch.tensor(g[:, k]).expand(3, -1))
    n = torch.randn(2, 1, 9, 11, dtype=torch.float64)
    u = dirichlet(p, n, 1.5, scale=0.3)
    assert torch.equal(u, 1.5 + torch.tensor(0.3 * bubble(p)) * n)


def test_normal_derivative_is_second_order_exact_on_quadratics():
    p = box((9, 11))
    y, x = (torch.tensor(v)[None, None] for v in mesh(p))
    u = 2 * x.square() - x * y + 3 * y.square() + y             # quadratic in each axis
    for axis, side, dudn in [(1, "hi", 4 * x - y), (1, "lo", -(4 * x - y)),
                             (0, "lo", -(-x + 6 * y + 1)), (0, "hi", -x + 6 * y + 1)]:
        got = normal_derivative(p, u, axis, side)
        want = dudn.narrow(2 + axis, 0 if side == "lo" else dudn.shape[2 + axis] - 1, 1)
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-11)


def test_neumann_and_robin_are_the_measure_weighted_wall_means():
    p = box((9, 11))                  # walls y = lo, hi of length 2; x = lo, hi of length 3
    u = torch.randn(2, 1, 9, 11, dtype=torch.float64)
    q = torch.randn(2, 1, 9, 11, dtype=torch.float64)
    per = {}
    for axis, side in [(0, "lo"), (0, "hi"), (1, "lo"), (1, "hi")]:
        dim = 2 + axis
        k = 0 if side == "lo" else u.shape[dim] - 1
        r = normal_derivative(p, u, axis, side) - q.narrow(dim, k, 1)
        per[axis, side] = r.square().mean(dim=(1, 2, 3))
    want = (2 * (per[0, "lo"] + per[0, "hi"]) + 3 * (per[1, "lo"] + per[1, "hi"])) / 10
    assert torch.allclose(neumann(p, u, q), want, rtol=1e-14, atol=0)
    assert torch.allclose(neumann(p, u, q, walls="x_hi"), per[1, "hi"], rtol=1e-14, atol=0)
    # robin: a u + b du/dn = c; data as numbers, fields and functions of the coordinates
    dn = normal_derivative(p, u, 1, "hi")
    c = lambda y, x: y * x                                        # noqa: E731
    r = 2.0 * u[..., -1:] + q[..., -1:] * dn - torch.tensor(c(*mesh(p)))[..., -1:]
    got = robin(p, u, 2.0, q, c, walls=[(1, "hi")])
    assert torch.allclose(got, r.square().mean(dim=(1, 2, 3)), rtol=1e-14, atol=0)
    # rim=False leaves out the wall's two end nodes, which lie on the walls y = lo, hi
    got = robin(p, u, 2.0, q, c, walls="x_hi", rim=False)
    assert torch.allclose(got, r[..., 1:-1, :].square().mean(dim=(1, 2, 3)), rtol=1e-14, atol=0)


def test_neumann_data_of_an_exact_solution_leave_a_second_order_term():
    """du/dn - q on the wall x = hi of u = sin(x) e^y shrinks like h^2 (the term like h^4)."""
    terms = []
    for n in (17, 33, 65):
        p = box((n, n))
        y, x = mesh(p)
        u = torch.tensor(np.sin(x) * np.exp(y / 3))[None, None]
        terms.append(neumann(p, u, lambda y, x: np.cos(x) * np.exp(y / 3), walls="x_hi").item())
    assert 12 < terms[0] / terms[1] < 20 and 12 < terms[1] / terms[2] < 20, terms


def test_cell_means_are_the_means_over_the_cells_ragged_last_cells_included():
    p = box((9, 10))
    t = torch.randn(2, 3, 9, 10, dtype=torch.float64)
    m = cell_means(p, t, (4, 3))
    assert m.shape == (2, 3, 3, 4)                              # ceil(9/4), ceil(10/3)
    assert torch.allclose(m[..., 0, 0], t[..., :4, :3].mean(dim=(-1, -2)))
    assert torch.allclose(m[..., 2, 3], t[..., 8:, 9:].mean(dim=(-1, -2)))   # a 1 x 1 cell
    assert torch.allclose(m[..., 1, 3], t[..., 4:8, 9:].mean(dim=(-1, -2)))
    assert torch.equal(cell_means(p, t, 1), t)
    assert [list(r) for r in block_cells(p, 4)] == [[0, 1, 2], [0, 1, 2]]


# -- split against undivided -------------------------------------------------------------------------
CASES = [((12, 16), (1, 2)), ((12, 16), (2, 2)), ((8, 8, 12), (2, 2, 2))]


def helper_terms(p, raw, x) -> dict:
    """The helpers' fields and terms on p's block: raw (B, 1, *shape), x (B, 2, *shape)."""
    d = p.dims
    dims = tuple(range(1, raw.dim()))
    walls = [f"{p.axes[0].name}_lo", f"{p.axes[-1].name}_hi"]
    u = dirichlet(p, raw, x[:, 1:2], scale=0.3)
    v = dirichlet(p, raw, g_of, scale=0.2, walls=walls)
    terms = {"imposed": u, "imposed_fn": v,
             "neumann_number": neumann(p, u, 0.7),
             "neumann_field": neumann(p, v, x[:, :1], walls=walls[::-1], rim=False),
             "robin": robin(p, u, lambda *c: 1 + c[-1] ** 2, x[:, 1:2], g_of),
             "robin_some": robin(p, v, 2.0, 0.5, x[:, :1], walls=walls[1:])}
    for m in (2, 3, 4, (3,) * (d - 1) + (5,)):
        w = torch.arange(1.0, 1.0 + p.block.nodes(), dtype=raw.dtype).reshape(p.grid).cos()
        cut = w[tuple(slice(r.start, r.stop) for r in block_cells(p, m))]
        c = cell_means(p, u, m)
        terms[f"cells {m}"] = (cut * c.square()).sum(dims)
        terms[f"cell field {m}"] = c
    return terms


@pytest.mark.parametrize("grid,split", CASES, ids=str)
def test_split_fields_values_and_gradients_are_the_undivided_ones(grid, split):
    g = torch.Generator().manual_seed(sum(grid))
    raw = torch.randn((2, 1, *grid), generator=g, dtype=torch.float64, requires_grad=True)
    x = torch.randn((2, 2, *grid), generator=g, dtype=torch.float64)
    whole = helper_terms(box(grid), raw, x)
    ts = ThreadSplit(grid, split)
    blocks, parts = run_blocks(ts, lambda b: helper_terms(box(grid).on_block(b), b.local(raw),
                                                          b.local(x)))
    fields = [k for k in whole if k.startswith(("imposed", "cell field"))]
    for k in fields:        # the blocks' fields (their own cells) put together: the whole field
        got = ts.assemble({b.coord: part[k] for b, part in zip(blocks, parts)}, 2)
        if k.startswith("imposed"):
            assert torch.equal(got, whole[k]), k
        else:
            assert close(got, whole[k], rtol=RTOL), k
    ref = terms_and_grads({k: v for k, v in whole.items() if k not in fields}, raw)
    got = terms_and_grads({k: sum(p[k] for p in parts) for k in ref}, raw)
    for k in ref:
        assert close(got[k][0], ref[k][0], rtol=RTOL), (k, got[k][0], ref[k][0])
        assert close(got[k][1], ref[k][1], rtol=RTOL), k
        assert ref[k][1].abs().max() > 0 and ref[k][0].abs().max() > 0, k     # not vacuous


# -- refusals --------------------------------------------------------------------------------------
def test_bad_arguments_say_what_is_wrong_and_how_to_fix_it():
    p = box((8, 8))
    u = torch.zeros(1, 1, 8, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"unknown wall 'left': the walls of problem 'box' are "
                                         r"\['y_lo', 'y_hi', 'x_lo', 'x_hi'\]"):
        neumann(p, u, walls="left")
    with pytest.raises(ValueError, match="no walls given"):
        bubble(p, walls=())
    with pytest.raises(ValueError, match=r"g\(\*coords\) must return values on the nodes"):
        transfinite_lift(p, lambda y, x: np.ones(3))
    with pytest.raises(ValueError, match=r"g must be a number, a function of the coordinates "
                                         r"or a field"):
        dirichlet(p, u, torch.zeros(1, 1, 5, 5))
    with pytest.raises(ValueError, match="scale must be a number > 0"):
        dirichlet(p, u, 0.0, scale=0.0)
    with pytest.raises(ValueError, match=r"cells must have an integer side >= 1"):
        cell_means(p, u, 0)
    thin = box((8, 8)).on_block(ThreadSplit((8, 8), (1, 4)).blocks()[3])   # blocks 2 nodes wide
    with pytest.raises(ValueError, match="needs 3 nodes along it .* split axis 1 into fewer "
                                         "blocks"):
        neumann(thin, u[..., :2], walls="x_hi")
    with pytest.raises(ValueError, match="does not hold the wall"):
        normal_derivative(box((8, 8)).on_block(Block((8, 8), (0, 0), (8, 4))), u[..., :4], 1,
                          "hi")


@pytest.mark.mpi
@pytest.mark.full      # the threads' split above is the everyday check; this one with real ranks
def test_real_mpi_two_ranks():
    run_script_cases(2, "tests/mpi_scripts/boundary_check.py", ["12x16:1x2", "12x16:2x1",
                                                                "8x8x12:1x1x2"])
