"""lab.tools.interp_floor: a coarse field file interpolated to a fine one's grid, against it."""
import json

import pytest

from lab.tools import interp_floor
from deepfusion.cli import main


@pytest.fixture(autouse=True)
def _serial(monkeypatch):
    monkeypatch.setenv("DEEPFUSION_NO_MPI", "1")  # in-process solves: the serial communicator


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    """Poisson references of the same 3 draws on 9x9, 17x17 and 33x33 nodes (nested grids)."""
    d = tmp_path_factory.mktemp("refs")
    mp = pytest.MonkeyPatch()
    mp.setenv("DEEPFUSION_NO_MPI", "1")
    paths = {}
    for n in (9, 17, 33):
        paths[n] = str(d / f"r{n}.h5")
        assert main(["solve", "--problem", "poisson", "--grid", f"{n}x{n}", "--samples", "3",
                     "--seed", "7", "--out", paths[n]]) == 0
    mp.undo()
    paths["other"] = str(d / "other.h5")
    assert main(["solve", "--problem", "poisson", "--grid", "9x9", "--samples", "3", "--seed", "8",
                 "--out", paths["other"]]) == 0
    return paths


def test_a_file_against_itself_is_zero(refs):
    res = interp_floor.floor(refs[17], refs[17])
    assert res["n"] == 3 and res["rel_l2_worst"] < 1e-12


def test_a_finer_coarse_grid_is_closer(refs):
    """Smooth solutions: bilinear interpolation error falls as the coarse grid is refined."""
    far, near = (interp_floor.floor(refs[n], refs[33]) for n in (9, 17))
    assert far["coarse_grid"] == [9, 9] and far["fine_grid"] == [33, 33]
    assert 0 < near["rel_l2_mean"] < far["rel_l2_mean"] < 0.2
    assert near["rel_l2_worst"] == max(near["rel_l2"])


def test_cli_writes_json_and_refuses_other_samples(refs, tmp_path, capsys):
    out = tmp_path / "f.json"
    assert interp_floor.main([refs[9], refs[33], "--out", str(out)]) == 0
    assert "poisson 9x9 interpolated to 33x33, 3 samples" in capsys.readouterr().out
    assert json.loads(out.read_text())["command"].startswith("python -m lab.tools.interp_floor")
    assert interp_floor.main([refs["other"], refs[33], "--out", str(out)]) == 2
    assert "same problem and samples" in capsys.readouterr().err
