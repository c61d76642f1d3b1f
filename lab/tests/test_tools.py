"""The study tools of lab/tools at tiny sizes: each writes its JSON and the relations it exists to
measure hold on a constructed case."""
import json

import pytest



def test_ablation_bench_records_eval_of_each_variant(tmp_path):
    from lab.tools import ablation_bench

    out = tmp_path / "abl.json"
    assert ablation_bench.main(["--out", str(out), "--only", "poisson_residual_central",
                                "--poisson-steps", "2", "--threads", "1", "--seeds", "0,1",
                                "--runs", str(tmp_path / "runs")]) == 0
    rec, rec1 = json.loads(out.read_text())["results"]
    assert rec["name"] == "poisson_residual_central" and rec["steps"] == 2
    assert 'problem.options.stencil="central"' in rec["overrides"]
    assert rec["n"] == 64 and rec["seed"] == 271828  # the test draw (data.test_seed)
    assert 0 < rec["rel_l2_mean"] <= rec["rel_l2_max"]
    assert rec["validation"]["n"] == 16 and rec["validation"]["seed"] == 12345
    # --seeds: the same variant from another initialisation, in its own run directory
    assert (rec["init_seed"], rec1["init_seed"]) == (0, 1)
    assert rec1["rel_l2_mean"] != rec["rel_l2_mean"]
    assert (tmp_path / "runs" / "poisson_residual_central_seed1" / "test.json").exists()
    for bad in (["--only", "nope"], ["--seeds", "0,x"], ["--seeds", "-1"]):
        with pytest.raises(SystemExit):
            ablation_bench.main(bad + ["--out", str(out)])


def test_error_split_puts_a_moved_front_near_fronts_and_a_bias_away(tmp_path):
    """A step front moved by one node is error near fronts only; a constant offset is mostly
    away from them; the two parts' squares add up to the total's."""
    import h5py
    import numpy as np

    from lab.tools import error_split

    x = np.arange(64)
    ref = np.where(x[None, :] < 32, 1.0, 0.0) * np.ones((16, 1))
    pred = np.stack([np.where(x[None, :] < 33, 1.0, 0.0) * np.ones((16, 1)), ref + 0.01])
    for name, u in (("p.h5", pred), ("r.h5", np.stack([ref, ref]))):
        with h5py.File(tmp_path / name, "w") as f:
            f["u"] = u
    out = tmp_path / "s.json"
    assert error_split.main([str(tmp_path / "p.h5"), str(tmp_path / "r.h5"), "--out", str(out)]) == 0
    moved, biased = json.loads(out.read_text())["samples"]
    assert moved["away"] == 0 and moved["total"] > 0
    assert moved["near_fronts"] == pytest.approx(moved["total"])
    assert biased["away"] > biased["near_fronts"] > 0
    for s in (moved, biased):
        assert s["near_fronts"] ** 2 + s["away"] ** 2 == pytest.approx(s["total"] ** 2)
    # the moved front: one of the two nodes beside the jump is on the wrong side in every row,
    # and it is all the error; the offset puts none there
    assert moved["wrong_side_fraction"] == 0.5 and moved["wrong_side_share"] == 1
    assert moved["without_wrong_side"] == 0
    assert biased["wrong_side_fraction"] == 0
    assert biased["without_wrong_side"] == pytest.approx(biased["total"])


def test_amplitude_error_finds_a_wrong_amplitude_and_a_smooth_error(tmp_path):
    """Half the reference: best scale 2, no error left after it, all of it in the low modes;
    a checkerboard error: nothing gained by scaling, none of it in the low modes."""
    import h5py
    import numpy as np

    from lab.tools import amplitude_error

    y, x = np.meshgrid(np.linspace(0, 1, 32), np.linspace(0, 1, 32), indexing="ij")
    ref = np.sin(np.pi * x) * np.sin(np.pi * y)
    checker = 0.01 * (-1.0) ** (np.arange(32)[:, None] + np.arange(32)[None, :])
    for name, u in (("p.h5", np.stack([0.5 * ref, ref + checker])), ("r.h5", np.stack([ref, ref]))):
        with h5py.File(tmp_path / name, "w") as f:
            f["u"] = u
    out = tmp_path / "a.json"
    assert amplitude_error.main([str(tmp_path / "p.h5"), str(tmp_path / "r.h5"),
                                 "--out", str(out)]) == 0
    half, rough = json.loads(out.read_text())["samples"]
    assert half["best_scale"] == pytest.approx(2.0) and half["rel_l2"] == pytest.approx(0.5)
    assert half["rel_l2_best_scale"] < 1e-12 and half["low_mode_share"] > 0.9
    assert rough["rel_l2_best_scale"] == pytest.approx(rough["rel_l2"], rel=1e-3)
    assert rough["low_mode_share"] < 1e-12


def test_scheme_floor_marches_the_losses_zero_and_it_converges(tmp_path):
    """The marched field is the residual loss's zero (its "pde" term vanishes); MUSCL's floor is
    below first-order upwind's, and both fall from 32x32 to 64x64; the exact cell averages are
    closer than either."""
    import torch

    from lab.tools import scheme_floor
    from diffnet.problems import get_problem

    p = get_problem("burgers", grid=(32, 32), hard_bc=True, scheme="muscl", horizon=8)
    params = p.sample_params(7, range(3))
    u = torch.from_numpy(scheme_floor.march(p, params))[:, None]
    inputs = p.build_input(params, dtype=torch.float64)
    assert float(p.loss_terms(u, inputs)["pde"].max()) < 1e-20
    assert float(p.loss_terms(u + 0.01 * torch.rand_like(u), inputs)["pde"].min()) > 1e-6

    out = tmp_path / "f.json"
    assert scheme_floor.main(["--grids", "32,64", "--schemes", "upwind,muscl:mc,cells",
                              "--draws", "4", "--out", str(out)]) == 0
    f = {(r["grid"][0], r["scheme"]): r["rel_l2_mean"]
         for r in json.loads(out.read_text())["rows"]}
    assert f[64, "muscl:mc"] < f[64, "upwind"] and f[32, "muscl:mc"] < f[32, "upwind"]
    assert f[64, "muscl:mc"] < f[32, "muscl:mc"] and f[64, "upwind"] < f[32, "upwind"]
    # the exact cell averages: below every scheme's march, and falling with the grid
    assert f[32, "cells"] < f[32, "muscl:mc"] and f[64, "cells"] < f[64, "muscl:mc"]
    assert 0 < f[64, "cells"] < f[32, "cells"]
    with pytest.raises(SystemExit):
        scheme_floor.main(["--schemes", "stencil"])


def test_ritz_bench_times_the_partition_answer_for_each_m(tmp_path):
    from lab.tools import ritz_bench

    out = tmp_path / "ritz.json"
    assert ritz_bench.main(["--grid", "32", "--fields", "2", "--partitions", "2,4",
                            "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["partition"] for r in rows] == [2, 4]
    assert all(r["impose_s"] > 0 and r["impose_energy_backward_s"] > 0 for r in rows)


def test_correction_cost_times_the_grown_network_per_correction(tmp_path):
    """The tiny 16 -> 32 -> 64 prolonged schedule: one row per --correction, each the final
    network with that correction (its parameter count shrinks with the width), the config's
    own when none is given."""
    from lab.tools import correction_cost
    from tests.test_prolong import MGP

    cfg, out = tmp_path / "mgp.toml", tmp_path / "cost.json"
    cfg.write_text(MGP)
    assert correction_cost.main([str(cfg), "--correction", "{base_width = 4}", "--correction",
                                 "{base_width = 2, max_width = 4}", "--repeats", "1",
                                 "--threads", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["correction"] for r in rows] == [
        {"depth": 2, "base_width": 4, "max_width": 64},
        {"depth": 2, "base_width": 2, "max_width": 4}]
    assert rows[0]["correction_parameters"] > rows[1]["correction_parameters"]
    assert all(r["grid"] == [64, 64] and r["inner_grid"] == [32, 32] and r["forward_s"] > 0
               for r in rows)
    assert correction_cost.main([str(cfg), "--repeats", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["correction"]["base_width"] == 4


def test_checkpoint_average_means_the_float_tensors_and_keeps_the_others(tmp_path):
    """Two checkpoints: the floating weights averaged (in float64, stored in their dtype), an
    integer buffer taken from the last one; K outside the kept checkpoints is refused."""
    import torch

    from lab.tools import checkpoint_average
    from deepfusion.engine.checkpoint.store import save_checkpoint

    paths = []
    for step, (w, n) in enumerate([(1.0, 3), (2.0, 5)], start=1):
        paths.append(str(tmp_path / "checkpoints" / f"step_{step:08d}.h5"))
        save_checkpoint(paths[-1], model_state={"w": torch.full((2,), w, dtype=torch.float32),
                                                "n": torch.tensor(n)},
                        optim_state={}, rng_state={}, meta={"step": step})
    avg = checkpoint_average.averaged_state(checkpoint_average.model_states(paths))
    assert avg["w"].dtype == torch.float32 and avg["w"].tolist() == [1.5, 1.5]
    assert avg["n"].item() == 5
    with pytest.raises(SystemExit):
        checkpoint_average.main([str(tmp_path), "--last", "3"])




def test_residual_flags_records_each_draw_and_the_shares(tmp_path):
    """An untrained Darcy network on 2 draws of its family and of the 30/1 contrast: every
    draw is recorded with its signals, the 30/1 coefficient is outside the trained range, and
    the shares are those of the rows."""
    import numpy as np

    from lab.tools import residual_flags
    from tests.test_answer_check import checkpoint

    ck, out = checkpoint(tmp_path, "darcy", (16, 16), 2), tmp_path / "flags.json"
    assert residual_flags.main([ck, "--family", "trained", "--family", "c30", "a_hi=30",
                                "a_lo=1", "--samples", "2", "--calibrate", "2", "--bad", "0.5",
                                "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["threshold"] == 0.4 and res["calibration"]["n"] == 2
    trained, c30 = res["families"]["trained"], res["families"]["c30"]
    assert c30["options"] == {"a_hi": 30, "a_lo": 1} and trained["n"] == c30["n"] == 2
    assert not any(r["fields_out_of_range"] for r in trained["rows"])
    assert all(r["fields_out_of_range"] for r in c30["rows"])
    bad = np.array([r["error"] > 0.5 for r in c30["rows"]])
    flagged = np.array([r["residual"] > 0.4 for r in c30["rows"]])
    if bad.any():
        assert c30["flags"]["residual"]["bad_flagged"] == flagged[bad].mean()
    assert res["pooled"]["n"] == 4
    assert all(r["nodal_residual"] > 0 for r in trained["rows"])
