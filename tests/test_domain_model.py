"""deepfusion/jobs/domain_model.py: the domain-parallel scaling model (one sample split over the ranks)."""
from __future__ import annotations

import json
from argparse import Namespace

import pytest

from deepfusion.jobs import domain_model as D
from deepfusion.jobs.costs import NODES
from deepfusion.jobs.render import get_profile, load_profiles

PROFILES = load_profiles()
TINY = D.Net(dims=2, depth=1, base_width=2, max_width=4, in_channels=1)


def test_halo_bytes_of_a_tiny_network_equal_a_hand_count():
    # widths [2, 4]; layers (level, channels): inc (0,1) (0,2); down (0,2) (1,2) (1,4); up (1,4) (0,6) (0,2)
    assert D.halo_layers(TINY) == [(0, 1), (0, 2), (0, 2), (1, 2), (1, 4), (1, 4), (0, 6), (0, 2)]
    # block 8x8: faces level 0 = 8 (axis 0) + 10 (axis 1, with axis 0's ghosts), level 1 = 4 + 6;
    # channels level 0: 1+2+2+6+2 = 13, level 1: 2+4+4 = 10 -> 13*18 + 10*10 = 334 node-channels
    one = D.halo_traffic(TINY, (8, 8), (2, 2))          # one neighbour per axis
    assert one == dict(halo_bytes=2 * 4 * 334, halo_messages=2 * 8 * 2, halo_layers=8)
    two = D.halo_traffic(TINY, (8, 8), (4, 4))          # interior block: two per axis
    assert two["halo_bytes"] == 2 * 2 * 4 * 334 and two["halo_messages"] == 2 * 8 * 4
    assert D.halo_traffic(TINY, (8, 8), (1, 1))["halo_bytes"] == 0
    a, b = 1e-6, 1e9                                    # fwd+bwd x layers x axes x 2 shifts
    t = D.halo_time(TINY, (8, 8), (2, 2), [(a, b), (a, b)])
    assert t == pytest.approx(2 * (2 * 8 * 2 * a + 2 * 4 * 334 / b))
    assert D.halo_time(TINY, (8, 8), (1, 1), [(a, b), (a, b)]) == 0.0


def test_the_layer_list_is_what_the_split_unet_exchanges():
    torch = pytest.importorskip("torch")
    from diffnet.domain import Block
    from diffnet.generators import build_generator, count_parameters
    from diffnet.split_layers import split_generator

    class Recording(Block):
        halos, sums = [], []

        def halo(self, x, width=1, fill="zeros"):
            self.halos.append(((8 // self.shape[0]).bit_length() - 1, x.shape[1], width))  # level
            return super().halo(x, width, fill)

        def sum(self, t):
            self.sums.append(t.shape[1])
            return t

    for name, dims in (("unet", 2), ("unet3d", 3)):
        Recording.halos, Recording.sums = [], []
        kw = dict(depth=2, base_width=2, max_width=4, in_channels=3)
        model = build_generator(name, **kw)
        net = D.Net(dims=dims, **kw)
        assert D.param_count(net) == count_parameters(model)
        split_generator(model, Recording((16,) * dims, (0,) * dims, (8,) * dims))  # block = grid / 2
        model(torch.zeros((1, 3) + (8,) * dims)).sum().backward()
        assert sorted(Recording.halos) == sorted((lv, c, 1) for lv, c in D.halo_layers(net))
        assert sorted(Recording.sums) == sorted(c for c in D.norm_channels(net) for _ in range(2))
    assert D.param_count(D.Net()) == 1_422_097 and D.param_count(D.Net(dims=3)) == 4_260_913


def test_split_choice_and_node_crossings():
    assert D.choose_split((4096, 4096), 8, 4) == (4, 2)
    assert D.choose_split((4096, 4096), 16, 4) == (4, 4)
    assert D.choose_split((512, 512, 512), 1024, 4) == (16, 8, 8)
    assert D.choose_split((4096, 1024), 4, 4) == (4, 1)        # the most nearly square block
    assert D.choose_split((64, 64), 64, 4) is None              # blocks < 2**depth
    assert D.node_crossings((4, 4), 4) == [4, 0]                # a node holds one row of blocks
    assert D.node_crossings((4, 4), 2) == [2, 1]
    assert D.node_crossings((4, 4), 16) == [0, 0]


@pytest.mark.parametrize("grid, ref", [((4096, 4096), (2048, 2048)), ((512, 512, 512), (128, 128, 128))])
def test_efficiency_is_one_at_one_node_then_decreases(grid, ref):
    for name in ("stampede2", "aws-c5n", "generic-slurm"):
        rows = D.predict_domain(get_profile(name, PROFILES), grid, 24.0, ref)
        assert [r["nodes"] for r in rows] == NODES
        assert rows[0]["efficiency"] == 1.0 and rows[0]["links"] == ["shm"] * len(grid)
        effs = [r["efficiency"] for r in rows]
        assert effs == sorted(effs, reverse=True) and 0 < effs[-1] < 1
        comp = [r["t_compute"] for r in rows]
        assert comp == sorted(comp, reverse=True)               # more nodes: never more compute
        assert all(r["t_compute"] == pytest.approx(r["t_sample_rank"] / r["ranks"]) for r in rows)
        assert all(r["t_step"] == pytest.approx(r["t_compute"] + r["t_halo"] + r["t_norm"] + r["t_grad"])
                   for r in rows)
    s2 = get_profile("stampede2", PROFILES)
    small = D.predict_domain(s2, grid, 24.0, ref)[0]["t_sample_rank"]
    assert D.predict_domain(s2, grid, 24.0, tuple(2 * g for g in ref))[0]["t_sample_rank"] == \
        pytest.approx(small / 2 ** len(grid))                   # compute proportional to nodes


def test_cli_writes_json_and_table(tmp_path, capsys):
    from deepfusion.jobs.model import main
    args = ["--t-sample", "24", "--t-sample-grid", "2048x2048", "--clusters", "stampede2,aws-c5n"]
    assert main(["--domain-grid", "4096x4096", *args, "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "domain.json").read_text())
    assert doc["inputs"]["params"] == 1_422_097 and doc["inputs"]["halo_layers"] == 26
    row = doc["predictions"]["stampede2"][-1]
    assert {"nodes", "ranks", "split", "block", "links", "t_step", "t_compute", "t_halo", "t_norm",
            "t_grad", "halo_bytes", "halo_messages", "efficiency", "speedup"} <= set(row)
    assert row["split"] == [32, 32] and row["block"] == [128, 128]
    assert (tmp_path / "domain.png").stat().st_size > 1000
    assert "| stampede2 | 128 | 1024 | 32x32 | 128x128 |" in capsys.readouterr().out
    # a given split: its node count only, efficiency against the 1-node most-square split
    assert main(["--domain-grid", "4096x4096", *args, "--domain-split", "32x32", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "domain.json").read_text())["predictions"]["stampede2"]
    assert [r["nodes"] for r in rows] == [128] and rows[0]["efficiency"] == pytest.approx(row["efficiency"])
    for bad in (["--t-sample-grid", "2048x2048"],                       # needs --domain-grid
                ["--domain-grid", "4096x4096"],                         # needs --t-sample-grid
                ["--domain-grid", "512x512x512", "--t-sample-grid", "2048x2048"],   # 3-D vs 2-D
                ["--domain-grid", "4096x4096", "--t-sample-grid", "2048x2048", "--domain-split", "3x3"]):
        assert main(["--t-sample", "24", *bad, "--out", str(tmp_path)]) == 2


def test_3d_through_deepfusion_jobs_model(tmp_path):
    from deepfusion.jobs.cli import run
    rest = ["--domain-grid", "512x512x512", "--t-sample", "36", "--t-sample-grid", "128x128x128",
            "--clusters", "azure-hc44", "--ranks-per-node", "8", "--threads-per-rank", "4", "--out", str(tmp_path)]
    assert run(Namespace(tool="model", rest=rest)) == 0
    doc = json.loads((tmp_path / "domain.json").read_text())
    rows = doc["predictions"]["azure-hc44"]
    assert doc["inputs"]["params"] == 4_260_913 and doc["inputs"]["grid"] == [512, 512, 512]
    assert rows[0]["split"] == [2, 2, 2] and rows[0]["ranks_per_node"] == 8 and rows[0]["threads_per_rank"] == 4
    assert rows[-1]["split"] == [16, 8, 8] and rows[-1]["block"] == [32, 64, 64]
