"""The Problem contract beyond training: inputs from given fields, reference solutions from
them, and the choice of reference method -- for every registered problem, so the application
never needs to know which PDE it runs."""
from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

from diffnet.problems import (PROBLEMS, Problem, get_problem, has_reference, problem_spec, resolve,
                              solves_from_inputs)
from diffnet.reference.elliptic import METHODS

# Parametrised over whatever is registered (never a fixed list of names): a problem added to the
# registry is checked too, and breaks nothing here.
GRID = (16, 16)
NAMES = sorted(n for n in PROBLEMS if PROBLEMS[n].dims == 2)  # 3-D: tests/test_poisson3d.py
# the diffusion families: solved from their diffusivity field nu (log nu derived from it)
DIFFUSION = [n for n in NAMES if solves_from_inputs(PROBLEMS[n])
             and "nu" in PROBLEMS[n].input_channels]
PARAMS_ONLY = [n for n in NAMES
               if has_reference(PROBLEMS[n]) and not solves_from_inputs(PROBLEMS[n])]


def make(name, **kw):
    return get_problem(name, grid=GRID, **kw)


def inputs64(p, n=3, seed=1):
    return p.build_input(p.sample_params(seed, range(n)), dtype=torch.float64).numpy()


@pytest.mark.parametrize("name", sorted(PROBLEMS))
def test_every_registered_name_is_found_again_by_its_spec(name):
    cls = resolve(name)
    assert cls is PROBLEMS[name] and resolve(problem_spec(cls)) is cls
    assert get_problem(problem_spec(cls), grid=(16,) * cls.dims).name == cls.name


@pytest.mark.parametrize("name", NAMES)
def test_every_problem_states_the_whole_contract(name):
    cls = PROBLEMS[name]
    assert issubclass(cls, Problem)
    assert not has_reference(cls) or cls.reference_methods[0] == "auto"
    for method in ("reference_solution", "solve_from_inputs"):
        sig = inspect.signature(getattr(cls, method))
        assert sig.parameters["method"].default == "auto", (name, method)
    assert callable(cls.inputs_from_fields)


# -- inputs_from_fields ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_inputs_from_build_inputs_own_channels_round_trip(name):
    p = make(name)
    x = inputs64(p)
    fields = {c: x[:, i] for i, c in enumerate(p.input_channels)}
    got = p.inputs_from_fields(fields)
    assert got.dtype == np.float64 and got.shape == x.shape
    np.testing.assert_array_equal(got, x)
    # any order of the dict, float32 or torch fields: the problem's channel order, float64
    shuffled = {c: torch.from_numpy(fields[c]).float() for c in reversed(p.input_channels)}
    got = p.inputs_from_fields(shuffled)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", DIFFUSION)
def test_diffusion_problems_derive_log_nu_from_nu(name):
    p = make(name)
    x = inputs64(p)
    got = p.inputs_from_fields({"nu": x[:, 0]})
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got[:, 0], x[:, 0])
    np.testing.assert_allclose(got[:, 1], np.log(x[:, 0]), rtol=0, atol=1e-15)
    np.testing.assert_allclose(got[:, 1], x[:, 1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", DIFFUSION)
@pytest.mark.parametrize("value", [0.0, -1.0])
def test_diffusion_problems_refuse_a_nu_not_positive_everywhere(name, value):
    p = make(name)
    nu = inputs64(p)[:, 0]
    nu[1, 3, 4] = value
    with pytest.raises(ValueError, match=r"'nu'.*> 0 everywhere"):
        p.inputs_from_fields({"nu": nu})
    with pytest.raises(ValueError, match=r"'nu'.*> 0 everywhere"):
        p.inputs_from_fields({"nu": nu, "log_nu": np.zeros_like(nu)})


@pytest.mark.parametrize("name", NAMES)
def test_missing_or_unknown_channels_are_named(name):
    p = make(name)
    with pytest.raises(ValueError) as e:
        p.inputs_from_fields({"wrong": np.ones((2, *GRID))})
    msg = str(e.value)
    assert "'wrong'" in msg and str(list(p.input_channels)) in msg and "missing" in msg
    x = inputs64(p, n=2)
    fields = {c: x[:, i] for i, c in enumerate(p.input_channels)}
    with pytest.raises(ValueError, match=r"unknown \['extra'\]"):
        p.inputs_from_fields({**fields, "extra": x[:, 0]})


@pytest.mark.parametrize("name", NAMES)
def test_bad_fields_are_refused_with_the_reason(name):
    p = make(name)
    x = inputs64(p, n=2)
    fields = {c: x[:, i] for i, c in enumerate(p.input_channels)}
    first = p.input_channels[0]
    bad = dict(fields)
    bad[first] = x[:, 0].copy()
    bad[first][0, 0, 0] = np.nan
    with pytest.raises(ValueError, match=rf"field '{first}' must be finite everywhere"):
        p.inputs_from_fields(bad)
    with pytest.raises(ValueError, match="16x16"):           # another grid
        p.inputs_from_fields({c: np.ones((2, 8, 16)) for c in p.input_channels})
    with pytest.raises(ValueError, match="same number of samples"):
        p.inputs_from_fields({**fields, first: x[:1, 0]})
    with pytest.raises(ValueError, match=r"3-D array \(N, H, W\)"):
        p.inputs_from_fields({**fields, first: x[0, 0]})
    for not_a_dict in ({}, None, x):
        with pytest.raises(ValueError, match="dict of channel name"):
            p.inputs_from_fields(not_a_dict)


# -- reference solutions ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", DIFFUSION)
def test_solve_from_inputs_equals_the_reference_of_the_parameters(name):
    p = make(name)
    params = p.sample_params(3, range(2))
    x = p.build_input(params, dtype=torch.float64)
    for j in range(2):
        ref = p.reference_solution(params[j])
        assert ref.dtype == np.float64 and ref.shape == GRID
        np.testing.assert_allclose(p.solve_from_inputs(x[j]), ref, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(p.solve_from_inputs(x[j].numpy(), method="direct"), ref,
                                   rtol=1e-12, atol=1e-12)
    amg = p.reference_solution(params[0], method="amg")
    np.testing.assert_allclose(amg, p.reference_solution(params[0]), rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", DIFFUSION)
def test_solve_from_inputs_reads_only_nu(name):
    """log_nu is the network's view of nu; the solver takes nu, however log_nu was made."""
    p = make(name)
    x = inputs64(p, n=1)[0]
    y = x.copy()
    y[1] = 0.0
    np.testing.assert_array_equal(p.solve_from_inputs(y), p.solve_from_inputs(x))


@pytest.mark.parametrize("name", DIFFUSION)
def test_solve_from_inputs_checks_the_sample(name):
    p = make(name)
    x = inputs64(p, n=1)[0]
    with pytest.raises(ValueError, match=r"\(C, H, W\) = \(2, 16, 16\)"):
        p.solve_from_inputs(x[:1])
    with pytest.raises(ValueError, match=r"3-D array"):
        p.solve_from_inputs(x[None])
    x[0, 2, 2] = np.inf
    with pytest.raises(ValueError, match="finite"):
        p.solve_from_inputs(x)


def test_diffusion_methods_are_those_of_the_solver():
    for name in DIFFUSION:
        if PROBLEMS[name].__module__.startswith("diffnet."):  # the built-ins' shared solver
            assert PROBLEMS[name].reference_methods == METHODS


@pytest.mark.parametrize("name", PARAMS_ONLY)
def test_solve_from_inputs_unavailable_says_so_and_what_to_give(name):
    p = make(name)
    x = inputs64(p, n=1)[0]
    with pytest.raises(ValueError) as e:
        p.solve_from_inputs(x)
    msg = str(e.value)
    assert f"not available for problem {name!r}" in msg and "parameter vectors" in msg
    with pytest.raises(ValueError, match="not available"):
        p.check_method("auto", from_inputs=True)
    assert p.check_method("auto") == "auto"


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("method", ["cg", "", None, "AUTO"])
def test_bad_methods_are_refused_listing_the_valid_ones(name, method):
    p = make(name)
    params = p.sample_params(0, [0])[0]
    with pytest.raises(ValueError) as e:
        p.reference_solution(params, method=method)
    assert str(p.reference_methods) in str(e.value) and "reference method" in str(e.value)
    if solves_from_inputs(p):
        with pytest.raises(ValueError, match="reference method"):
            p.solve_from_inputs(inputs64(p, n=1)[0], method=method)


def test_burgers_has_no_linear_solver_to_choose():
    p = make("burgers")
    with pytest.raises(ValueError, match=r"one of \('auto',\), got 'direct'"):
        p.reference_solution(np.array([3.0]), method="direct")
    np.testing.assert_array_equal(p.reference_solution(np.array([3.0]), method="auto"),
                                  p.reference_solution(np.array([3.0])))
