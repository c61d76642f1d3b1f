"""``--set problem.options.family=...`` on a Darcy checkpoint: the checkpoint stores the preset's
values (tau, alpha, a_hi, a_lo) explicitly, yet a family given on the command line gives that
family's values, unless its values are given too; a checkpoint of explicit non-preset values
still reloads exactly; a problem without presets replaces options one by one."""
import json

import h5py
import pytest
import torch

from deepfusion.engine.predict.loader import load_model
from deepfusion.engine.checkpoint.store import save_checkpoint
from diffnet.generators import build_generator
from diffnet.problems import get_problem, replace_options

FINE = {"tau": 10.0, "alpha": 2.0, "a_hi": 100.0, "a_lo": 1.0}    # the fine-scale preset
FAMILY = 'problem.options.family="fine-scale"'


def darcy_checkpoint(path, **options) -> str:
    """An untrained 16x16 Darcy checkpoint as 'deepfusion train' writes it (the problem's
    config(): every option, the preset's values included)."""
    torch.manual_seed(0)
    problem = get_problem("darcy", grid=[16, 16], modes=4, **options)
    model = build_generator("unet", in_channels=2, depth=2, base_width=4)
    meta = {"step": 0, "config": {"data": {"seed": 0}, "model": {"channels_last": False}},
            "model": {"name": "unet", "kwargs": model.config()},
            "problem": {"name": "darcy", "kwargs": problem.config()}}
    save_checkpoint(path, model_state=model.state_dict(), optim_state={}, rng_state={}, meta=meta)
    return str(path)


def values(problem) -> dict:
    return {k: getattr(problem, k) for k in FINE}


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory):
    return darcy_checkpoint(tmp_path_factory.mktemp("darcy") / "step_00000000.h5")


def test_a_family_given_replaces_the_stored_preset_values(benchmark):
    _, problem, _, meta = load_model(benchmark, options={"family": "fine-scale"})
    assert meta["problem"]["kwargs"]["tau"] == 3.0  # stored explicitly
    assert problem.family == "fine-scale" and values(problem) == FINE
    _, problem, _, _ = load_model(benchmark, options={"family": "fine-scale", "a_hi": 50.0})
    assert values(problem) == {**FINE, "a_hi": 50.0}  # a value given with it wins


def test_explicit_non_preset_values_reload_exactly(tmp_path):
    own = {"tau": 5.0, "a_hi": 20.0, "a_lo": 2.0}
    path = darcy_checkpoint(tmp_path / "step_00000000.h5", **own)
    _, problem, _, meta = load_model(path)
    assert problem.config() == meta["problem"]["kwargs"]
    assert values(problem) == {**own, "alpha": 2.0}
    _, problem, _, _ = load_model(path, options={"ritz_partition": 0})  # another option: kept
    assert values(problem) == {**own, "alpha": 2.0}


def test_replace_options_resets_only_what_a_given_preset_sets():
    stored = get_problem("darcy", grid=[16, 16], tau=5.0).config()
    assert replace_options("darcy", stored, {"source": 2.0}) == {**stored, "source": 2.0}
    fine = replace_options("darcy", stored, {"family": "fine-scale"})
    assert not set(FINE) & set(fine) and fine["modes"] == stored["modes"]
    burgers = get_problem("burgers", grid=[16, 16]).config()  # no presets: key by key
    assert replace_options("burgers", burgers, {"viscosity": 0.1}) == {**burgers, "viscosity": 0.1}


def test_infer_and_solve_with_a_family_on_the_command_line(benchmark, cli, tmp_path):
    p, r = str(tmp_path / "p.h5"), str(tmp_path / "r.h5")
    rc, _, err = cli(["infer", benchmark, "--samples", "1", "--set", FAMILY, "--out", p])
    assert rc == 0, err
    rc, _, err = cli(["solve", "--problem", "darcy", "--grid", "16x16", "--samples", "1",
                      "--set", "problem.options.modes=4", "--set", FAMILY, "--out", r])
    assert rc == 0, err
    for path in (p, r):
        with h5py.File(path) as f:
            kwargs = json.loads(f.attrs["problem_kwargs"])
        assert kwargs["family"] == "fine-scale" and {k: kwargs[k] for k in FINE} == FINE, path
