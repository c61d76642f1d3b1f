"""diffnet.validation: the one set of argument checks (values returned, messages raised)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffnet import validation as v


# -- check_number ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2, 2.5, np.float32(2.5), np.float64(2.5), np.int64(2), "2.5"])
def test_number_returns_a_python_float(value):
    out = v.check_number("x", value)
    assert type(out) is float and out == float(value)


def test_number_keeps_float64_precision():
    x = np.float64(1.0) + np.finfo(np.float64).eps
    assert v.check_number("x", x) == x != 1.0


@pytest.mark.parametrize("value, kw, text", [
    (True, {}, "x must be a finite number, got True"),
    (np.bool_(False), {}, "x must be a finite number"),
    ("abc", {}, "x must be a finite number, got 'abc'"),
    (None, {}, "got None"),
    (math.nan, {}, "got nan"),
    (math.inf, {}, "got inf"),
    (-1.0, {"lo": 0.0}, "x must be a finite number >= 0.0, got -1.0"),
    (0.0, {"lo": 0.0, "lo_open": True}, "x must be a finite number > 0.0, got 0.0"),
    (2.0, {"lo": 0.0, "hi": 1.0}, "x must be a finite number >= 0.0 and <= 1.0"),
    (1.0, {"hi": 1.0, "hi_open": True}, "x must be a finite number < 1.0"),
    (5.0, {"hi": 1.0, "what": "a rate in [0, 1]"}, "x must be a rate in [0, 1], got 5.0"),
])
def test_number_refusals_name_the_argument_and_the_allowed_values(value, kw, text):
    with pytest.raises(ValueError) as e:
        v.check_number("x", value, **kw)
    assert text in str(e.value)


def test_number_bounds_are_inclusive_unless_open():
    assert v.check_number("x", 0.0, lo=0.0, hi=1.0) == 0.0
    assert v.check_number("x", 1.0, lo=0.0, hi=1.0) == 1.0
    assert v.check_number("x", 1.0, lo=0.0, lo_open=True) == 1.0


# -- check_int ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [3, np.int32(3), np.int64(3)])
def test_int_returns_a_python_int(value):
    out = v.check_int("n", value, 1)
    assert type(out) is int and out == 3


@pytest.mark.parametrize("value, lo, hi, text", [
    (True, 0, None, "n must be an integer >= 0, got True"),
    (3.0, 0, None, "n must be an integer >= 0, got 3.0"),
    ("3", 0, None, "got '3'"),
    (0, 1, None, "n must be an integer >= 1, got 0"),
    (11, 0, 10, "n must be an integer in [0, 10], got 11"),
])
def test_int_refusals(value, lo, hi, text):
    with pytest.raises(ValueError) as e:
        v.check_int("n", value, lo, hi)
    assert text in str(e.value)


def test_int_custom_description():
    with pytest.raises(ValueError, match=r"n_terms must be an integer >= 4 \(KL terms\), got 2"):
        v.check_int("n_terms", 2, 4, what="an integer >= 4 (KL terms)")


# -- check_choice / check_bool ---------------------------------------------------------------------
def test_choice():
    assert v.check_choice("kind", "b", ("a", "b")) == "b"
    assert v.check_choice("act", "relu", {"relu": 1, "gelu": 2}) == "relu"   # a dict's keys
    with pytest.raises(ValueError, match=r"kind must be one of \('a', 'b'\), got 'c'"):
        v.check_choice("kind", "c", ("a", "b"))
    for bad in (None, ["a"], 1):   # not a string, unhashable included: ValueError, not TypeError
        with pytest.raises(ValueError, match="kind must be one of"):
            v.check_choice("kind", bad, ("a", "b"))


def test_bool():
    assert v.check_bool("flag", True) is True
    out = v.check_bool("flag", np.bool_(False))
    assert out is False and type(out) is bool
    for bad in (1, 0, "yes", None):
        with pytest.raises(ValueError, match="flag must be True or False"):
            v.check_bool("flag", bad)


# -- pairs, ranges, grids -------------------------------------------------------------------------
def test_range():
    assert v.check_range("r", [1, 2]) == (1.0, 2.0)
    assert v.check_range("r", (2, 2), allow_equal=True) == (2.0, 2.0)
    with pytest.raises(ValueError, match=r"r must be a pair \(lo, hi\) of numbers"):
        v.check_range("r", "ab")
    with pytest.raises(ValueError, match="r must be finite"):
        v.check_range("r", (0, math.inf))
    with pytest.raises(ValueError, match="lo < hi"):
        v.check_range("r", (2, 1))
    with pytest.raises(ValueError, match="lo < hi"):
        v.check_range("r", (2, 2))


def test_positive_pair():
    out = v.check_positive_pair("spacing", (np.float32(0.5), 1), "(h_row, h_col)")
    assert out == (0.5, 1.0) and all(type(h) is float for h in out)
    for bad in [(0.1,), "ab", None, (0.1, 0.2, 0.3)]:
        with pytest.raises(ValueError, match=r"spacing must be a pair \(h_row, h_col\)"):
            v.check_positive_pair("spacing", bad, "(h_row, h_col)")
    for bad in [(0.1, 0.0), (-1, 1), (1, math.nan)]:
        with pytest.raises(ValueError, match="spacing must be two finite numbers > 0"):
            v.check_positive_pair("spacing", bad, "(h_row, h_col)")


def test_grid():
    assert v.check_grid([64, 32]) == (64, 32)
    assert v.check_grid((np.int64(8), 8.0)) == (8, 8)
    assert all(type(n) is int for n in v.check_grid(torch.Size([8, 8])))
    for bad in ["ab", (16,), None, (16.5, 16), (True, 16), ("16", 16), (math.inf, 16)]:
        with pytest.raises(ValueError, match=r"grid must be a pair \(H, W\) of integers"):
            v.check_grid(bad)
    with pytest.raises(ValueError, match="grid must have at least 4 nodes per axis"):
        v.check_grid((3, 16))
    with pytest.raises(ValueError, match="work must have at least 2 nodes"):
        v.check_grid((1, 16), name="work", minimum=2)


# -- check_array ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [np.ones((2, 3), np.float32), np.ones((2, 3), np.int64),
                                   torch.ones(2, 3), [[1.0] * 3] * 2])
def test_array_is_a_float64_copy(value):
    a = v.check_array("f", value, ndim=2)
    assert a.dtype == np.float64 and a.shape == (2, 3)
    a[0, 0] = 5.0
    assert float(np.asarray(value, dtype=np.float64)[0, 0]) == 1.0   # the input is untouched


def test_array_keeps_float64_values_exactly():
    x = np.random.default_rng(0).standard_normal((4, 5))
    np.testing.assert_array_equal(v.check_array("x", x), x)


def test_array_refusals():
    with pytest.raises(ValueError, match=r"f must be a real array \(H, W\), got str"):
        v.check_array("f", "abc", form="(H, W)")
    with pytest.raises(ValueError, match=r"f must be a 3-D array \(N, H, W\), got shape \(2, 3\)"):
        v.check_array("f", np.ones((2, 3)), ndim=3, form="(N, H, W)")
    x = np.ones((2, 3))
    x[0, 1], x[1, 2] = np.nan, -np.inf
    with pytest.raises(ValueError, match="f must be finite everywhere, got 2 non-finite"):
        v.check_array("f", x)
    with pytest.raises(ValueError, match=r"nu must be > 0 everywhere, got min -2"):
        v.check_array("nu", np.array([1.0, -2.0]), positive=True)
    assert v.check_array("nu", np.array([1e-300]), positive=True)[0] == 1e-300
