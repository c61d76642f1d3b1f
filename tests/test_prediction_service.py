"""One prediction service (``deepfusion/engine/predict/``: ``loader``, ``pipeline``, ``service``):

* no other module of deepfusion/ or bench/ builds a pipeline or an answer module, nor loads a
  checkpoint for prediction by itself (read from the source);
* in-training validation, ``evaluate``, ``infer``, ``deepfusion.load(...).predict`` and
  ``export`` reach it: every pipeline is built by the service's ``pipeline``, every batch is
  computed inside the service's loop ``run`` (watched on a tiny trained run).
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib

import pytest

import deepfusion
from deepfusion.engine.predict import service
from deepfusion.engine.predict.pipeline import AnswerOnGrid, Pipeline
from tests.tiny_configs import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]
SERVICE = {f"deepfusion/engine/predict/{m}.py" for m in ("loader", "pipeline", "service")}
# what only the service does: build the pipeline or the answer, load a checkpoint to predict
BUILDERS = {"Pipeline", "Answer", "AnswerOnGrid", "load_model", "checkpoint_file"}


def calls(path: pathlib.Path):
    """The names of the functions and classes called in a file (``f(...)``, ``m.f(...)``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            yield f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)


def test_only_the_service_builds_pipelines_answers_and_loads_checkpoints():
    bad = sorted((str(p.relative_to(ROOT)), name)
                 for pkg in ("deepfusion", "bench") for p in (ROOT / pkg).rglob("*.py")
                 if str(p.relative_to(ROOT)) not in SERVICE and "out" not in p.parts
                 for name in calls(p) if name in BUILDERS)
    assert not bad, f"go through deepfusion.engine.predict.service / .loader: {bad}"


def test_the_service_does_not_import_the_app():
    for name in SERVICE:
        tree = ast.parse((ROOT / name).read_text())
        mods = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [m for m in mods if m and m.startswith("deepfusion.app")], name


def _inside(function: str) -> bool:
    """Whether the service's ``function`` is on the call stack."""
    here = os.path.abspath(service.__file__)
    return any(os.path.abspath(f.filename) == here and f.function == function
               for f in inspect.stack(0))


@pytest.fixture
def watch(monkeypatch):
    """Records, per kind, whether each pipeline was built by ``service.pipeline``, each batch
    computed inside ``service.run``, and each answer module call."""
    seen = {"built": [], "batch": [], "module": []}
    init, batch, forward = Pipeline.__init__, Pipeline.answer_batch, AnswerOnGrid.forward

    def spy_init(self, *a, **k):
        seen["built"].append(_inside("pipeline"))
        init(self, *a, **k)

    def spy_batch(self, *a, **k):
        seen["batch"].append(_inside("run"))
        return batch(self, *a, **k)

    def spy_forward(self, x):
        seen["module"].append(True)
        return forward(self, x)

    monkeypatch.setattr(Pipeline, "__init__", spy_init)
    monkeypatch.setattr(Pipeline, "answer_batch", spy_batch)
    monkeypatch.setattr(AnswerOnGrid, "forward", spy_forward)

    def through_service(*kinds) -> bool:
        ok = all(seen[k] and all(seen[k]) for k in kinds)
        for v in seen.values():
            v.clear()
        return ok
    return through_service


def test_every_door_predicts_through_the_service(tmp_path, cli, watch):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY)
    run = str(tmp_path / "run")
    rc, _, err = cli(["train", str(cfg), "--set", f"run.dir={run}", "--set", "train.max_steps=2"])
    assert rc == 0, err
    assert json.load(open(os.path.join(run, "eval.json")))["n"] == 2
    assert watch("built", "batch"), "validation"
    rc, _, err = cli(["evaluate", run, "--samples", "2"])
    assert rc == 0, err
    assert watch("built", "batch"), "evaluate"
    rc, _, err = cli(["infer", run, "--samples", "3", "--batch", "2",
                      "--out", str(tmp_path / "p.h5")])
    assert rc == 0, err
    assert watch("built", "batch"), "infer"
    s = deepfusion.load(run, threads=1)
    s.predict(params=s.sample(2, seed=1))
    assert watch("built", "batch"), "Solver.predict"
    rc, _, err = cli(["export", run, "--format", "torchscript", "--out", str(tmp_path / "m.pt")])
    assert rc == 0, err
    assert watch("built", "module"), "export"
