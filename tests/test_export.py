"""deepfusion export: TorchScript and ONNX files that run without deepfusion or diffnet (a fresh
Python process) and equal ``deepfusion infer`` on the same inputs, for a 2-D and a 3-D problem;
the refusals (bad format, grid, --out, a missing ONNX package, an answer head a format cannot
hold, a file that differs from the eager answer)."""
import importlib.util
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch

from deepfusion.app.fields_file import write_input_fields
from deepfusion.cli import main
from deepfusion.engine.checkpoint.store import save_checkpoint
from diffnet.generators import build_generator
from diffnet.problems import Poisson, get_problem
from tests.in_process import deepfusion_here

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--set", "train.max_steps=2", "--set", "data.eval_samples=0", "--set", "run.plots=false",
        "--set", "model.options={depth=2,base_width=4}", "--set", "parallel.threads_per_rank=1"]
RUNS = {"poisson": ("configs/poisson.toml", "[16,16]"),
        "poisson3d": ("configs/poisson3d.toml", "[8,8,8]")}

# Runs in a fresh interpreter, outside the repository, with torch, onnxruntime and h5py only:
# each (format, file, inputs, output) of argv answers a batch of 1 then of 3 (the export
# followed a batch of 2).
FRESH = """
import json, sys
import h5py, numpy as np
args = sys.argv[1:]
for fmt, model, inputs, out in zip(args[::4], args[1::4], args[2::4], args[3::4]):
    with h5py.File(inputs) as f:
        x = f["inputs"][()]
    if fmt == "torchscript":
        import torch
        extra = {"deepfusion.json": ""}
        m = torch.jit.load(model, _extra_files=extra)
        meta = json.loads(extra["deepfusion.json"])
        run = lambda a: m(torch.from_numpy(a)).numpy()
    else:
        import onnxruntime
        s = onnxruntime.InferenceSession(model)
        meta = {k: json.loads(v) for k, v in s.get_modelmeta().custom_metadata_map.items()}
        run = lambda a: s.run(None, {meta["input_name"]: a})[0]
    x = x.astype(meta["dtype"])
    np.save(out, np.concatenate([run(x[:1]), run(x[1:])]))
    json.dump(meta, open(out + ".json", "w"))
assert "diffnet" not in sys.modules and "deepfusion" not in sys.modules, "package imported"
"""
FORMATS = ["torchscript", "onnx"] if all(
    importlib.util.find_spec(m) for m in ("onnx", "onnxruntime", "onnxscript")) else ["torchscript"]
NO_ONNX = "the onnx extra is not installed here (pip install -e '.[onnx]')"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (run dir, inputs file of 4 draws, infer's answers (4, *grid) on them)."""
    out = {}
    for name, (config, grid) in RUNS.items():
        tmp = tmp_path_factory.mktemp(name)
        run = str(tmp / "run")
        p = deepfusion_here(["train", os.path.join(ROOT, config), "--set", f"run.dir={run}",
                             "--set", f"problem.grid={grid}", *TINY])
        assert p.returncode == 0, p.stderr
        problem = get_problem(name, grid=json.loads(grid))
        x = problem.build_input(problem.sample_params(5, range(4)))
        inputs, preds = str(tmp / "inputs.h5"), str(tmp / "preds.h5")
        write_input_fields(inputs, x.numpy(), problem.input_channels, name)
        p = deepfusion_here(["infer", run, "--inputs", inputs, "--out", preds])
        assert p.returncode == 0, p.stderr
        with h5py.File(preds) as f:
            out[name] = (run, inputs, f["u"][()])
    return out


@pytest.fixture(scope="module")
def fresh(runs, tmp_path_factory):
    """(name, format) -> (the file's answers (4, 1, *grid), its metadata, export's stdout),
    every file exported here and run in one fresh process."""
    tmp, argv, done = tmp_path_factory.mktemp("exported"), [], {}
    for name, (run, inputs, _) in runs.items():
        for fmt in FORMATS:
            path, got = str(tmp / f"{name}.{fmt}"), str(tmp / f"{name}-{fmt}.npy")
            p = deepfusion_here(["export", run, "--format", fmt, "--out", path])
            assert p.returncode == 0, p.stderr
            argv += [fmt, path, inputs, got]
            done[name, fmt] = (got, p.stdout)
    p = subprocess.run([sys.executable, "-c", FRESH, *argv], cwd=tmp, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return {k: (np.load(got), json.load(open(got + ".json")), out)
            for k, (got, out) in done.items()}


@pytest.mark.parametrize("fmt", ["torchscript", "onnx"])
@pytest.mark.parametrize("name", list(RUNS))
def test_the_file_runs_without_the_package_and_equals_infer(runs, fresh, name, fmt):
    if fmt not in FORMATS:
        pytest.skip(NO_ONNX)
    u, meta, out = fresh[name, fmt]
    u_infer = runs[name][2]
    grid = list(u_infer.shape[1:])
    assert "export:" in out and "max relative difference" in out
    assert u.shape == (4, 1, *grid)
    rel = np.linalg.norm((u[:, 0] - u_infer).reshape(4, -1), axis=1) / \
        np.linalg.norm(u_infer.reshape(4, -1), axis=1)
    assert rel.max() <= 1e-5, rel
    assert meta["problem"] == name and meta["grid"] == grid and meta["dtype"] == "float32"
    assert meta["input_channels"] == ["nu", "log_nu"]
    assert meta["input_shape"] == ["N", 2, *grid] and meta["output_shape"] == ["N", 1, *grid]
    assert meta["export_format"] == fmt and meta["deepfusion_version"]
    assert meta["problem_kwargs"]["grid"] == grid and meta["step"] == 2


def scaled_differences(got, ref) -> tuple[float, float]:
    """(worst relative L2, worst largest difference over the sample's largest |ref|) of
    answers (N, *grid)."""
    d = (np.asarray(got, np.float64) - ref).reshape(len(ref), -1)
    r = np.asarray(ref, np.float64).reshape(len(ref), -1)
    l2 = np.linalg.norm(d, axis=1) / np.linalg.norm(r, axis=1)
    return float(l2.max()), float((np.abs(d).max(1) / np.abs(r).max(1)).max())


@pytest.mark.full
def test_a_trained_channels_last_network_agrees_with_its_file_within_the_stated_bound(tmp_path):
    """docs/export.md: the file computes in NCHW; predict on a network trained channels-last
    runs the NHWC instance norm, whose float32 sums (GEMMs of a ones row) run in another
    order, and the network amplifies that rounding as it trains: the two agree within 1e-4 of
    the answer's scale (measured about 1e-5 here, 2e-5 for the default U-Net at 64x64), and
    the file is the closer to the float64 answer. Run NCHW, predict and the file agree to
    float32 rounding (2e-6)."""
    run = str(tmp_path / "run")
    p = deepfusion_here(["train", os.path.join(ROOT, "configs/poisson.toml"), "--set",
                         f"run.dir={run}", "--set", "problem.grid=[32,32]", *TINY,
                         "--set", "model.options={depth=3,base_width=8}",
                         "--set", "train.max_steps=40", "--set", "data.n_samples=64",
                         "--set", "data.global_batch=8"])
    assert p.returncode == 0, p.stderr
    path = str(tmp_path / "m.pt")
    assert deepfusion_here(["export", run, "--format", "torchscript", "--out", path]).returncode == 0
    import copy

    import deepfusion
    from deepfusion.engine.predict.service import answer_module

    solver = deepfusion.load(run)
    assert solver.channels_last          # trained channels-last, as configs/poisson.toml does
    x = solver.inputs(solver.sample(8, seed=3)).astype(np.float32)
    with torch.no_grad():
        u_file = torch.jit.load(path)(torch.from_numpy(x))[:, 0].numpy()
        u64 = answer_module(copy.deepcopy(solver.model).double(), solver.problem)(
            torch.from_numpy(x).double())[:, 0].numpy()
    u_predict = solver.predict(x)
    l2, sup = scaled_differences(u_file, u_predict)
    assert l2 <= 1e-4 and sup <= 1e-4, (l2, sup)
    assert scaled_differences(u_file, u64)[1] < scaled_differences(u_predict, u64)[1]
    solver.channels_last = False         # predict in the file's layout: the same operations
    l2, sup = scaled_differences(u_file, solver.predict(x))
    assert l2 <= 2e-6 and sup <= 2e-6, (l2, sup)


def test_on_another_grid_the_file_resamples_as_infer_does(runs, tmp_path, cli):
    """--grid 20x20 on a 16x16 network: the file resamples the inputs to the training grid and
    the answer back (--work-grid trained, the default), as infer does with the same fields."""
    run = runs["poisson"][0]
    problem = get_problem("poisson", grid=[20, 20])
    x = problem.build_input(problem.sample_params(9, range(3)))
    inputs, preds, path = (str(tmp_path / n) for n in ("in.h5", "preds.h5", "m.pt"))
    write_input_fields(inputs, x.numpy(), problem.input_channels, "poisson")
    assert cli(["infer", run, "--inputs", inputs, "--out", preds])[0] == 0
    rc, out, err = cli(["export", run, "--format", "torchscript", "--grid", "20x20",
                        "--out", path])
    assert rc == 0 and "16x16" in err, err      # the note: where the network runs
    with h5py.File(preds) as f:
        u_infer, x = f["u"][()], torch.from_numpy(f["inputs"][()])
    with torch.no_grad():
        u = torch.jit.load(path)(x)[:, 0].numpy()
    rel = np.linalg.norm((u - u_infer).reshape(3, -1), axis=1) / \
        np.linalg.norm(u_infer.reshape(3, -1), axis=1)
    assert u.shape == (3, 20, 20) and rel.max() <= 1e-5, rel


def test_refusals_write_nothing(runs, tmp_path, cli, monkeypatch):
    run = runs["poisson"][0]
    out = str(tmp_path / "m.pt")

    def refused(*args, says):
        rc, _, err = cli(["export", run, *args])
        assert rc == 2 and says in err, err
        assert not os.listdir(tmp_path), os.listdir(tmp_path)

    refused("--format", "torchscript", "--out", out, "--grid", "18x18", "--work-grid", "as-is",
            says="not divisible by 2**depth")
    refused("--format", "torchscript", "--out", out, "--grid", "16x16x16", says="has 3 axes")
    refused("--format", "torchscript", "--out", str(tmp_path / "no" / "m.pt"),
            says="does not exist")
    refused("--format", "torchscript", "--out", str(tmp_path), says="is a directory")
    refused("--format", "torchscript", "--out", out, "--set", "problem.options.grid=[8,8]",
            says="--grid")
    monkeypatch.setitem(sys.modules, "onnxruntime", None)   # as if it were not installed
    refused("--format", "onnx", "--out", out, says="pip install")
    with pytest.raises(SystemExit):
        cli(["export", run, "--format", "savedmodel", "--out", out])


class BatchBranch(Poisson):
    """Poisson whose answer doubles when the batch holds two samples: a Python branch on a
    traced size, which the trace fixes to the example's outcome."""

    def impose(self, u, inputs):
        u = super().impose(u, inputs)
        return 2 * u if u.shape[0] == 2 else u


def checkpoint(tmp_path, name: str, **options) -> str:
    """An untrained checkpoint of problem ``name`` with ``options``, as training writes it."""
    torch.manual_seed(0)
    problem = get_problem(name, grid=[16, 16], **options)
    model = build_generator("unet", in_channels=2, out_channels=problem.output_channels,
                            depth=2, base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": name, "kwargs": problem.config()}}
    path = str(tmp_path / "step_00000000.h5")
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={}, meta=meta)
    return path


def test_an_answer_the_trace_gets_wrong_is_refused(tmp_path, cli):
    ckpt = checkpoint(tmp_path, f"{__name__}:BatchBranch")
    rc, _, err = cli(["export", ckpt, "--format", "torchscript", "--out", str(tmp_path / "m.pt")])
    assert rc == 2 and "differs from the eager one" in err and "not written" in err, err
    assert "tests/test_export.py" in err     # the branch the trace fixed, by file and line
    assert not os.path.exists(tmp_path / "m.pt")


def export_fd(capfd, monkeypatch, args) -> tuple[int, str, str]:
    """``deepfusion export ARGS`` here, with what reaches the file descriptors 1 and 2 (torch
    writes its dumps through handlers and C++ that Python's redirection does not see)."""
    monkeypatch.setenv("DEEPFUSION_NO_MPI", "1")
    capfd.readouterr()
    rc = main(["export", *args])
    got = capfd.readouterr()
    return rc, got.out, got.err


@pytest.mark.skipif("onnx" not in FORMATS, reason=NO_ONNX)
def test_an_answer_head_onnx_cannot_hold_is_refused_with_the_reason(tmp_path, capfd,
                                                                     monkeypatch):
    """Darcy's Ritz head on a partition solves per-sample Gram systems by Cholesky, with a
    branch on its success: the head says so, and the refusal comes before any tracing (which
    took most of a minute only to stop there, dumping the graph), one line naming the head, the
    line of code and TorchScript, which holds it."""
    ckpt = checkpoint(tmp_path, "darcy", ritz=True, ritz_partition=2)

    def traced(*a, **k):
        raise AssertionError("the exporter ran")
    with monkeypatch.context() as mp:
        mp.setattr(torch.onnx, "export", traced)
        rc, out, err = export_fd(capfd, monkeypatch, [ckpt, "--format", "onnx", "--out",
                                                       str(tmp_path / "m.onnx")])
    assert rc == 2 and err.count("\n") == 1 and not out, err
    assert "cannot be exported to ONNX: the answer head Ritz(fields=1, partition=2)" in err
    assert "solve_gram" in err and "--format torchscript" in err
    assert not os.path.exists(tmp_path / "m.onnx")
    rc, out, err = export_fd(capfd, monkeypatch, [ckpt, "--format", "torchscript", "--out",
                                                   str(tmp_path / "m.pt")])
    assert rc == 0, err


class ValueBranch(Poisson):
    """Poisson that branches on a computed value and does not say so: the exporter itself
    stops at the branch."""

    def impose(self, u, inputs):
        u = super().impose(u, inputs)
        return u if bool(u.mean() < 1e9) else -u


@pytest.mark.full
@pytest.mark.skipif("onnx" not in FORMATS, reason=NO_ONNX)
def test_the_exporter_refusal_is_one_line_without_its_graph_dump(tmp_path, capfd, monkeypatch):
    """A branch the head does not declare: torch.export stops there and logs the whole graph
    (hundreds of lines) through its own handlers; the user sees one line naming the problem,
    the head, the line of code and TorchScript."""
    ckpt = checkpoint(tmp_path, f"{__name__}:ValueBranch")
    rc, out, err = export_fd(capfd, monkeypatch, [ckpt, "--format", "onnx", "--out",
                                                   str(tmp_path / "m.onnx")])
    assert rc == 2 and err.count("\n") == 1 and not out, err
    assert "answer head Plain()) cannot be exported to ONNX: a Python branch on a computed " \
           "value" in err and "tests/test_export.py" in err and "in impose" in err, err
    assert "--format torchscript" in err and not os.path.exists(tmp_path / "m.onnx")
