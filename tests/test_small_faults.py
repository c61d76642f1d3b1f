"""The smaller faults of a launch, each refused with a message naming the fix: compare given a
swapped or same-kind pair, degenerate --inputs / --params files, ranks started with another
command or config (real ``mpiexec -n 2`` MPMD launches), the oversubscription warning's advice,
and DEEPFUSION_FAULT's step numbers (the step the log prints) and its malformed values."""
import os

import h5py
import numpy as np
import pytest

from deepfusion.app.agreement import check_same_config, launch_disagreement
from deepfusion.app.fields_file import write_input_fields
from deepfusion.config import load_config
from deepfusion.engine.errors import InputError
from tests.faults.steps import ENV as FAULT
from tests.faults.steps import Faults, InjectedFailure, fault_env, parse
from deepfusion.engine.parallel.layout import RankLayout, report
from tests.mpi_util import run_mpi
from tests.test_inference import ckpt  # noqa: F401 (a fixture: an untrained Poisson checkpoint)
from tests.tiny_configs import TINY, variant


# ---------------------------------------------------------------------------------------------
# compare: which file is which
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def pair(ckpt, tmp_path, cli):  # noqa: F811 (the imported fixture)
    """A prediction and a reference of the same two draws."""
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    assert cli(["infer", ckpt, "--samples", "2", "--seed", "7", "--out", p])[0] == 0
    assert cli(["solve", "--problem", "poisson", "--grid", "16x16", "--samples", "2",
                "--seed", "7", "--method", "direct", "--out", r])[0] == 0
    return p, r


def test_compare_refuses_swapped_files_naming_the_right_order(pair, cli):
    p, r = pair
    rc, out, err = cli(["compare", r, p])
    assert rc == 2 and out == "" and "Traceback" not in err
    assert "the files are swapped" in err and f"deepfusion compare {p} {r}" in err
    assert cli(["compare", p, r])[0] == 0


def test_compare_refuses_two_of_a_kind_naming_the_file_to_make(pair, ckpt, tmp_path,  # noqa: F811
                                                               cli):
    p, r = pair
    rc, _, err = cli(["compare", p, p])
    assert rc == 2 and "are both predictions" in err
    assert "'deepfusion solve' on the same inputs (--samples 2 --seed 7)" in err
    rc, _, err = cli(["compare", r, r])
    assert rc == 2 and "are both references" in err and "'deepfusion infer'" in err
    copy = str(tmp_path / "p2.h5")
    assert cli(["infer", ckpt, "--samples", "2", "--seed", "7", "--out", copy])[0] == 0
    rc, _, err = cli(["compare", p, copy])
    assert rc == 2 and "are both predictions" in err
    assert not os.path.exists(tmp_path / "compare.json")


def test_compare_refuses_a_file_without_a_kind(pair, cli):
    p, r = pair
    with h5py.File(r, "a") as f:
        del f.attrs["kind"]
    rc, _, err = cli(["compare", p, r])
    assert rc == 2 and f"{r} records no kind" in err


def test_compare_refuses_different_given_fields(ckpt, tmp_path, cli):  # noqa: F811
    """--inputs runs have no parameter vectors: the input fields themselves must agree."""
    paths = []
    for j, scale in enumerate((1.0, 2.0)):
        src = str(tmp_path / f"nu{j}.h5")
        write_input_fields(src, scale * np.ones((2, 1, 16, 16)), ["nu"], problem="poisson")
        paths.append(src)
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    assert cli(["infer", ckpt, "--inputs", paths[0], "--out", p])[0] == 0
    assert cli(["solve", "--problem", "poisson", "--inputs", paths[1], "--out", r])[0] == 0
    rc, _, err = cli(["compare", p, r])
    assert rc == 2 and "first input channels differ" in err


# ---------------------------------------------------------------------------------------------
# degenerate --inputs / --params files
# ---------------------------------------------------------------------------------------------

def _inputs(path, data, channels=("nu", "log_nu")):
    with h5py.File(path, "w") as f:
        d = f.create_dataset("inputs", data=data)
        if channels is not None:
            d.attrs["channels"] = list(channels)


def _params_h5(path, data):
    with h5py.File(path, "w") as f:
        f.create_dataset("params", data=data)


def _nan_fields():
    x = np.ones((2, 2, 16, 16), np.float32)
    x[1, 0, 3, 3] = np.nan
    return x


INPUTS = {  # name: (writer, what the message must say)
    "zero_samples.h5": (lambda p: _inputs(p, np.zeros((0, 2, 16, 16), np.float32)),
                        "/inputs holds no samples (N = 0)"),
    "zero_channels.h5": (lambda p: _inputs(p, np.zeros((2, 0, 16, 16), np.float32), ()),
                         "/inputs holds no channels (C = 0)"),
    "nan.h5": (lambda p: _inputs(p, _nan_fields()), "must be finite everywhere"),
    "rank3.h5": (lambda p: _inputs(p, np.ones((2, 16, 16), np.float32), None),
                 "/inputs must have shape (N, C, H, W)"),
    "rank6.h5": (lambda p: _inputs(p, np.ones((1, 2, 2, 4, 4, 4), np.float32)),
                 "/inputs must have shape (N, C, H, W)"),
    "tiny_grid.h5": (lambda p: _inputs(p, np.ones((2, 2, 3, 3), np.float32)),
                     "/inputs holds fields on a 3x3 grid"),
    "strings.h5": (lambda p: _inputs(p, np.array([[[[b"a"]]]]), ["nu"]), "not numbers"),
}
PARAMS = {
    "empty.csv": (lambda p: open(p, "w").close(), "holds no parameter vectors"),
    "header_only.csv": (lambda p: open(p, "w").write("omega_1,omega_2,omega_3,omega_4\n"),
                        "holds no parameter vectors"),
    "nan.csv": (lambda p: open(p, "w").write("0,0,nan,0\n"), "holds non-finite values"),
    "binary.csv": (lambda p: open(p, "wb").write(b"\x89HDF\xff\xfe\x00"), "is not a text file"),
    "zero_rows.h5": (lambda p: _params_h5(p, np.zeros((0, 4))), "/params holds no parameter"),
    "rank3.h5": (lambda p: _params_h5(p, np.zeros((2, 2, 4))), "each vector needs 4 values"),
    "strings.h5": (lambda p: _params_h5(p, np.array([b"x"])), "not numbers"),
}


@pytest.mark.parametrize("flag, name", [("--inputs", n) for n in INPUTS] +
                         [("--params", n) for n in PARAMS])
def test_degenerate_inputs_exit_2_naming_the_file(ckpt, tmp_path, cli, flag, name):  # noqa: F811
    write, needle = (INPUTS if flag == "--inputs" else PARAMS)[name]
    src = str(tmp_path / name)
    write(src)
    out = str(tmp_path / "p.h5")
    for cmd in (["infer", ckpt], ["solve", "--problem", "poisson"]):
        rc, _, err = cli(cmd + [flag, src, "--out", out])
        assert rc == 2 and "Traceback" not in err, err
        assert f"{flag} {src}" in err and needle in err, err
        assert not os.path.exists(out)


def test_nan_made_by_a_problem_that_does_not_check_is_refused(tmp_path):
    """A plugin problem whose inputs_from_fields passes NaN through: refused all the same."""
    from deepfusion.app.samples import resolve_samples

    class Lax:
        name, grid, input_channels = "lax", (16, 16), ("a",)

        def inputs_from_fields(self, fields):
            return np.stack([fields["a"]], axis=1)

    src = str(tmp_path / "a.h5")
    x = np.ones((2, 1, 16, 16))
    x[0, 0, 0, 0] = np.inf
    write_input_fields(src, x, ["a"])
    with pytest.raises(ValueError, match=r"hold 1 non-finite value\(s\)"):
        resolve_samples(Lax(), inputs=src)
    write_input_fields(src, np.ones((2, 1, 16, 16)), ["a"])
    assert resolve_samples(Lax(), inputs=src)[1].n == 2


# ---------------------------------------------------------------------------------------------
# ranks that disagree: real MPMD launches, and the checks on a stand-in communicator
# ---------------------------------------------------------------------------------------------

def _mpmd(first: list[str], second: list[str]):
    """``mpiexec -n 1 deepfusion FIRST : -n 1 deepfusion SECOND`` (python -m deepfusion)."""
    import sys

    rest = [":", "-n", "1", sys.executable, "-m", "deepfusion"] + second
    return run_mpi(1, ["-m", "deepfusion"] + first + rest)


def test_mpmd_launch_with_another_learning_rate_is_refused_before_any_work(tmp_path):
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(TINY)
    b.write_text(variant(TINY, "optim.lr=1e-3"))
    d = str(tmp_path / "run")
    p = _mpmd(["train", str(a), "--set", f"run.dir={d}"],
              ["train", str(b), "--set", f"run.dir={d}"])
    assert p.returncode == 2, p.stderr
    assert p.stderr.count("deepfusion: error:") == 1 and "Traceback" not in p.stderr
    assert "resolved different configs" in p.stderr
    assert "rank 1 differs in 1 key(s) (rank 0 -> rank 1): optim.lr: 0.003 -> 0.001" in p.stderr
    assert not os.path.exists(d)  # refused before the run directory was made


def test_mpmd_launch_of_two_commands_is_refused(tmp_path):
    a = tmp_path / "a.toml"
    a.write_text(TINY)
    d = str(tmp_path / "run")
    p = _mpmd(["train", str(a), "--set", f"run.dir={d}"], ["evaluate", d])
    assert p.returncode == 2, p.stderr
    assert "command 'train' on rank 0, 'evaluate' on rank 1" in p.stderr
    assert not os.path.exists(d)


def test_mpmd_launch_differing_only_in_threads_runs(tmp_path):
    """Thread counts change a rank's speed, not the numbers exchanged: hosts of different sizes
    may set their own."""
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(variant(TINY, "train.max_steps=2", "data.eval_samples=0"))
    b.write_text(variant(TINY, "train.max_steps=2", "data.eval_samples=0",
                         "parallel.threads_per_rank=2"))
    d = str(tmp_path / "run")
    p = _mpmd(["train", str(a), "--set", f"run.dir={d}"],
              ["train", str(b), "--set", f"run.dir={d}"])
    assert p.returncode == 0, p.stderr[-3000:]


class _Gathered:
    """A stand-in communicator whose collectives return what ``others`` (the ranks after this
    one) would send; this process is rank 0."""

    rank, size = 0, 2

    def __init__(self, others):
        self.others = list(others)

    def allgather_obj(self, obj):
        return [obj] + [self.others.pop(0)]

    def bcast_obj(self, obj, root=0):
        return obj if root == 0 else self.others.pop(0)


def test_launch_check_names_another_version_or_option():
    from argparse import Namespace

    from deepfusion.app.agreement import launch

    args = Namespace(cmd="infer", checkpoint="run", samples=2, threads=0, run=print)
    other = launch(args)
    assert launch_disagreement(_Gathered([dict(other)]), args) is None
    assert launch(Namespace(**{**vars(args), "threads": 8})) == other  # threads: exempt
    msg = launch_disagreement(_Gathered([{**other, "version": "0.0.1"}]), args)
    assert "version" in msg and "'0.0.1' on rank 1" in msg
    msg = launch_disagreement(_Gathered([{**other, "options": {**other["options"],
                                                               "samples": 3}}]), args)
    assert "option samples: 2 on rank 0, 3 on rank 1" in msg


def test_config_check_names_every_differing_key():
    from deepfusion.app.agreement import config_digest

    mine = load_config(None, ["problem.name=\"burgers\"", "optim.lr=1e-3"])
    theirs = load_config(None, ["problem.name=\"burgers\"", "optim.lr=2e-3", "data.seed=5",
                                "parallel.threads_per_rank=3"])
    check_same_config(_Gathered([config_digest(mine)[0]]), mine)  # agrees: no exception
    same_but_threads = load_config(None, ["problem.name=\"burgers\"", "optim.lr=1e-3",
                                          "parallel.threads_per_rank=3"])
    check_same_config(_Gathered([config_digest(same_but_threads)[0]]), mine)
    digest, d = config_digest(theirs)
    with pytest.raises(InputError) as e:
        check_same_config(_Gathered([digest, d]), mine)
    assert "in 2 key(s)" in str(e.value)
    assert "data.seed: 0 -> 5" in str(e.value) and "optim.lr: 0.001 -> 0.002" in str(e.value)


# ---------------------------------------------------------------------------------------------
# the oversubscription warning names the fix that applies
# ---------------------------------------------------------------------------------------------

def _host(ranks: int, threads: int, cores: int = 2, affinity=None):
    aff = list(range(cores)) if affinity is None else affinity
    return [RankLayout(r, r, ranks, "vm", cores, aff, threads) for r in range(ranks)]


def test_oversubscription_warning_names_the_fix_that_applies():
    assert report(_host(2, 1), "MPI")[1] == []
    (w,) = report(_host(2, 2), "MPI")[1]
    assert "4 threads on 2 cores" in w and "set parallel.threads_per_rank = 1" in w
    (w,) = report(_host(4, 1), "MPI")[1]  # already one thread each: fewer ranks is the fix
    assert "start at most 2 ranks on this host" in w and "threads_per_rank" not in w
    (w,) = report(_host(4, 2), "MPI")[1]
    assert "start at most 2 ranks" in w and "with parallel.threads_per_rank = 1" in w
    # bound to one CPU each, 4 threads each: one line for all such ranks
    (w,) = report(_host(12, 4, cores=64, affinity=[5]), "MPI")[1]
    assert w.startswith("rank 0, 1, 2, 3, 4, 5, 6, 7 and 4 more: 4 threads on the 1 CPU(s)")
    assert "parallel.threads_per_rank = 1" in w and "bind each rank to 4 cores" in w


def test_a_host_busy_before_the_job_warns_where_ranks_run_several_threads():
    busy = _host(1, 2)
    busy[0].load = 3.2
    (w,) = report(busy, "MPI")[1]
    assert "load average 3.2 on 2 cores" in w and "OMP_WAIT_POLICY=PASSIVE" in w
    assert "parallel.threads_per_rank = 1" in w
    one = _host(2, 1)
    one[0].load = 9.0
    assert report(one, "MPI")[1] == []          # one thread each: nothing to wait for
    quiet = _host(1, 2)
    quiet[0].load = 1.9
    assert report(quiet, "MPI")[1] == []


# ---------------------------------------------------------------------------------------------
# DEEPFUSION_FAULT: the step the log prints
# ---------------------------------------------------------------------------------------------

def test_fault_steps_are_the_logged_steps():
    assert parse("raise@13:1, nan@5") == [("raise", 13, 1), ("nan", 5, 0)]
    f = Faults(0, parse("nan@3"))
    assert [f.fire(taken) for taken in range(5)] == [False, False, True, False, False]
    with pytest.raises(InjectedFailure, match="injected failure at step 2 on rank 1"):
        Faults(1, parse("raise@2:1")).fire(1)


@pytest.fixture
def tiny_run(tmp_path):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(variant(TINY, "train.max_steps=4", "data.eval_samples=0", "train.log_every=1"))
    return str(cfg), str(tmp_path / "run")


def inject(monkeypatch, faults: str) -> None:
    """This process's ``deepfusion train`` with ``faults`` (the in-process ``cli``)."""
    for key, value in fault_env(faults).items():
        monkeypatch.setenv(key, value)


def test_nan_fault_stops_at_the_step_it_names(tiny_run, cli, monkeypatch):
    cfg, d = tiny_run
    inject(monkeypatch, "nan@3")
    rc, _, err = cli(["train", cfg, "--set", f"run.dir={d}"])
    assert rc == 3 and "non-finite loss at step 3:" in err, err


def test_raise_fault_lets_the_steps_before_it_be_logged(tiny_run, cli, monkeypatch):
    import json

    cfg, d = tiny_run
    inject(monkeypatch, "raise@3")
    rc, _, err = cli(["train", cfg, "--set", f"run.dir={d}"])
    assert rc == 1 and "injected failure at step 3 on rank 0" in err
    with open(os.path.join(d, "metrics.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if r["kind"] == "step"] == [1, 2]


@pytest.mark.parametrize("value", ["nan", "nan@x", "boom@3", "nan@0", "raise@2:r"])
def test_malformed_fault_exits_2_before_anything_is_made(tiny_run, cli, monkeypatch, value):
    cfg, d = tiny_run
    inject(monkeypatch, value)
    rc, _, err = cli(["train", cfg, "--set", f"run.dir={d}"])
    assert rc == 2 and "Traceback" not in err, err
    assert f"{FAULT}={value!r}: cannot read" in err and "KIND@STEP[:RANK]" in err
    assert not os.path.exists(d)
