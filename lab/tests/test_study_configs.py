"""The study configs of lab/configs stay valid, and the studies built on a recipe stay in step
with it."""
import os

import pytest

from tests.mpi_util import ROOT

STUDIES = os.path.join(ROOT, "lab", "configs")
RECIPES = os.path.join(ROOT, "configs", "recipes")


def _training_configs() -> list[str]:
    """The training configs of lab/configs/ (a study's plan, such as batch_study.toml, names
    its base configs and has no [problem] of its own)."""
    import tomllib

    out = []
    for name in sorted(os.listdir(STUDIES)):
        with open(os.path.join(STUDIES, name), "rb") as f:
            if "problem" in tomllib.load(f):
                out.append(name)
    return out


@pytest.mark.parametrize("config", _training_configs())
def test_study_configs_load(config):
    """The configs of the comparison runs (lab/configs/) stay valid."""
    from deepfusion.config import load_config
    from deepfusion.engine.train.plan import plan

    assert plan(load_config(os.path.join(STUDIES, config)))


def _beside_the_fine_darcy_recipe(study_file: str):
    """(recipe config, study config, recipe visits, study visits) of darcy_fine.toml and a
    study of lab/configs/ built on it, whose model, data, optimiser and problem options
    must be the recipe's."""
    from deepfusion.config import load_config
    from deepfusion.engine.train.plan import plan, signature

    rc = load_config(os.path.join(RECIPES, "darcy_fine.toml"))
    sc = load_config(os.path.join(STUDIES, study_file))
    assert (sc.model, sc.data, sc.optim) == (rc.model, rc.data, rc.optim)
    assert sc.problem.options == rc.problem.options
    return (rc, sc) + tuple(signature(plan(c, cut=False)) for c in (rc, sc))


def test_the_128_study_starts_as_the_fine_darcy_recipe():
    """lab/configs/darcy_fine_128.toml trains the recipe's 64x64 level (the same visit, so
    the same network at its end), then a 128x128 level with the recipe's second level's batch,
    rate and length in place of its 256x256 grid: the coarse route is the recipe's, one grid
    coarser."""
    rc, sc, recipe, study = _beside_the_fine_darcy_recipe("darcy_fine_128.toml")
    assert len(study) == 2 and study[0] == recipe[0] and study[1] != recipe[1]
    assert sc.train.levels[0] == rc.train.levels[0]
    second = {k: v for k, v in rc.train.levels[1].items() if k != "grid"}
    assert {k: v for k, v in sc.train.levels[1].items() if k != "grid"} == second
    assert list(sc.train.levels[1]["grid"]) == [128, 128] == list(sc.problem.grid)


def test_the_1024_study_starts_as_the_fine_darcy_recipe():
    """lab/configs/darcy_fine_1024.toml trains the recipe's 64x64 and 256x256 levels, the
    same visits (so its 256x256 network is the recipe's), then a 1024x1024 level in place of
    the recipe's 512x512 one: kept in step when the recipe changes."""
    rc, sc, recipe, study = _beside_the_fine_darcy_recipe("darcy_fine_1024.toml")
    assert len(study) == len(recipe) and study[:2] == recipe[:2] and study[2] != recipe[2]
    assert sc.train.levels[:2] == rc.train.levels[:2]
    assert "1024" in str(study[2]) and "512" in str(recipe[2])
