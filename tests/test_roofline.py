"""The roofline of the training step (bench/roofline.py, bench/host_probe.py): FLOPs and bytes
of single ops against their formulas, the bound from given ceilings, the table's fields, and
the bench's roofline section and goal lines. Never a timing assertion."""
import json

import pytest
import torch

from bench import host_probe, opmeter, roofline, run

CEIL = {"compute_gflops": 100.0, "compute_source": "given", "dram_gbs": 10.0,
        "bandwidth": [{"footprint_mib": 1, "gbs": 100.0}, {"footprint_mib": 64, "gbs": 10.0}]}


def _rows_by_op(meter):
    out = {}
    for r in meter.rows.values():
        out.setdefault(r["op"], []).append(r)
    return out


@pytest.mark.parametrize("input_grad", [False, True])
def test_conv_flops_forward_and_backward_equal_the_formula(input_grad):
    n, c_in, c_out, h, w = 2, 3, 8, 12, 10
    conv = torch.nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
    x = torch.randn(n, c_in, h, w, requires_grad=input_grad)
    with opmeter.OpMeter(network="Conv2d") as m:
        conv(x).sum().backward()
    macs = n * c_out * h * w * c_in * 9
    ops = _rows_by_op(m)
    (fwd,) = ops["convolution"]
    (bwd,) = ops["convolution_backward"]
    assert (fwd["phase"], bwd["phase"]) == ("forward", "backward")
    assert fwd["flops"] == 2 * macs
    # grad of the weight always; of the input only when it needs one
    assert bwd["flops"] == 2 * macs * (2 if input_grad else 1)
    assert host_probe.conv_flops([n, c_in, h, w], [c_out, c_in, 3, 3], [1, 1], [1, 1]) == 2 * macs
    # forward: input, weight read, output written (fp32)
    assert fwd["bytes"] == 4 * (n * c_in * h * w + c_out * c_in * 9 + n * c_out * h * w)


def test_bytes_count_each_distinct_tensor_once_and_views_nothing():
    a, b = torch.ones(1000), torch.ones(1000)
    row = torch.ones(1, 1000)
    with opmeter.OpMeter() as m:
        a + b                      # read 2, write 1
        a.view(10, 100)            # a view: nothing moves
        a.mul_(2.0)                # read a, write a
        torch.ones(50, 1000) + row.expand(50, 1000)  # the broadcast row read once
    ops = _rows_by_op(m)
    assert ops["add"][0]["bytes"] == 4 * (3000 + 2 * 50 * 1000 + 1000)
    assert ops["view"][0]["bytes"] == 0
    assert ops["mul_"][0]["bytes"] == 4 * 2000
    assert all(r["phase"] == "loss" for r in m.rows.values())  # outside any module


def test_bound_is_the_sum_of_per_op_maxima_from_the_given_rates():
    rows = [  # 1 GFLOP over 1 MB: compute-bound at 100 GF/s (10 ms; memory 0.01 ms at 100 GB/s)
        {"phase": "forward", "layer": "net.conv", "op": "convolution", "calls": 1,
         "flops": 1e9, "bytes": 1e6, "call_bytes": {1e6: 1}, "seconds": 0.030},
        # 100 MB in 2 calls, no FLOPs: memory-bound at the >1 MiB rate, 10 GB/s (10 ms)
        {"phase": "optimiser", "layer": "-", "op": "_foreach_add_", "calls": 2,
         "flops": 0.0, "bytes": 1e8, "call_bytes": {5e7: 2}, "seconds": 0.012},
        {"phase": "forward", "layer": "net.act", "op": "gelu", "calls": 1,
         "flops": 0.0, "bytes": 5e5, "call_bytes": {5e5: 1}, "seconds": 0.001}]
    r = roofline.roofline(rows, step_s=0.050, ceil=CEIL)
    assert r["bound_s"] == pytest.approx(0.010 + 0.010 + 5e5 / 100e9)
    assert r["step_over_bound"] == pytest.approx(0.050 / r["bound_s"])
    assert r["compute_floor_s"] == pytest.approx(0.010)
    assert r["outside_ops_s"] == pytest.approx(0.050 - 0.043)
    top = r["top_ops"]
    assert [t["op"] for t in top] == ["convolution", "_foreach_add_", "gelu"]  # by gap
    assert [t["bound_by"] for t in top] == ["compute", "memory", "memory"]
    for t in top:
        assert {"phase", "layer", "op", "calls", "flops", "bytes", "seconds", "bound_s",
                "bound_by", "gap_s", "share_of_step", "gap_share_of_step"} <= set(t)
        assert t["gap_s"] == pytest.approx(t["seconds"] - t["bound_s"])
        assert t["share_of_step"] == pytest.approx(t["seconds"] / 0.050)
    assert set(r["by_phase"]) == {"forward", "optimiser"}
    assert list(r["by_op"]) == ["convolution", "_foreach_add_", "gelu"]  # by gap, over layers
    assert len(roofline.roofline(rows * 5, 0.05, CEIL, top=10)["top_ops"]) == 10
    # each call's bytes at the rate of its own footprint: 1 MB at 100 GB/s + 10 MB at 10
    mixed = {**rows[2], "bytes": 11e6, "call_bytes": {1e6: 1, 1e7: 1}}
    bound = roofline.roofline([mixed], 1.0, CEIL)["bound_s"]
    assert bound == pytest.approx(1e6 / 100e9 + 1e7 / 10e9)


def test_bandwidth_is_the_rate_at_the_smallest_footprint_not_below_the_bytes():
    curve = CEIL["bandwidth"]
    assert roofline.bandwidth_at(1000, curve) == 100.0
    assert roofline.bandwidth_at(1 << 20, curve) == 100.0
    assert roofline.bandwidth_at((1 << 20) + 1, curve) == 10.0
    assert roofline.bandwidth_at(1e12, curve) == 10.0  # beyond the probe: its largest


def test_step_phases_and_the_probes_convolutions_on_a_tiny_unet():
    """One deepfusion step of a tiny U-Net: every phase is seen, the loss's stencils count to
    the loss, the optimiser's foreach kernels move bytes, and the convolutions handed to the
    host probe are the network's forward ones."""
    from bench.common import build, inputs
    from bench.step_bench import make_deepfusion

    torch.set_num_threads(1)
    prob, model = build("burgers", 16, "unet", {"depth": 1, "base_width": 4})
    step = make_deepfusion(prob, model, inputs(prob, 2))
    step()
    rows = opmeter.measure_ops(step, steps=1, network=type(model).__name__)
    phases = {r["phase"] for r in rows}
    assert phases == {"forward", "loss", "backward", "loss_backward", "optimiser"}
    assert all(r["layer"].startswith("UNet") for r in rows if r["phase"] == "forward")
    assert sum(r["bytes"] for r in rows if r["phase"] == "optimiser") > 0
    shapes = roofline.conv_shapes(rows)
    assert shapes and all(s["w"][0] in (4, 8, 1) for s in shapes)
    strides = {tuple(s["stride"]) for s in shapes}
    assert strides == {(1, 1), (2, 2)}  # the conv downsampling is there, with its stride


def test_goal_lines_and_table_of_a_roofline_section():
    ceil = {**CEIL, "threads": 1, "gemm_gflops": 90.0, "conv_best_gflops": 100.0}
    rows = [{"phase": "forward", "layer": "net", "op": "convolution", "calls": 1,
             "flops": 1e9, "bytes": 1e6, "call_bytes": {1e6: 1}, "seconds": 0.012}]
    res = {"machine": {"cores": 2, "torch": "x", "cpu_capability": "AVX512", "loadavg": [0] * 3},
           "roofline": {"isa": {"cpu_capability": "AVX512", "avx512_bf16": False,
                                "amx_bf16": False},
                        "ceilings": [ceil], "runs": [
                            {"grid": 64, "batch": 16, "threads": 1,
                             **roofline.roofline(rows, 0.012, ceil)},
                            {"grid": 256, "batch": 2, "threads": 1,
                             **roofline.roofline(rows, 0.020, ceil)}]}}
    res["goals"] = run.goals(res)
    met = res["goals"]["step_within_1.5x_roofline_64_t1"]
    assert met["met"] is True and met["value"] == pytest.approx(1.2) and met["goal"] == 1.5
    assert res["goals"]["step_within_1.5x_roofline_256_t1"]["met"] is False
    text = run.table(res)
    assert "roofline 64^2 b16 t1" in text and "step/bound 1.20" in text
    assert "goal step_within_1.5x_roofline_256_t1: 2 (goal 1.5) not met" in text


def test_roofline_run_tiny_has_ceilings_runs_and_top_ops():
    # reuse_memory off: mallopt's settings would stay for the rest of this test process
    res = roofline.run(grids=((32, 2),), threads=(1,), repeats=1, log=lambda *a: None,
                       footprints_mib=(1, 4), reuse_memory=False)
    assert {"isa", "ceilings", "runs", "loadavg_before", "loadavg_after"} <= set(res)
    assert res["reuse_memory"] is False
    (c,) = res["ceilings"]
    assert c["threads"] == 1 and c["gemm_gflops"] > 0 and c["conv"]
    assert c["compute_gflops"] == max(c["gemm_gflops"], c["conv_best_gflops"])
    assert [b["footprint_mib"] for b in c["bandwidth"]] == [1, 4]
    (r,) = res["runs"]
    assert r["bound_s"] > 0 and r["step_over_bound"] == pytest.approx(r["step_s"] / r["bound_s"])
    assert 0 < len(r["top_ops"]) <= 10
    a = r["alone"]  # the step's convolutions run again alone (bench/alone.py)
    assert a["conv_in_step_s"] > 0 and a["conv_alone_s"] > 0 and a["others_at_bound_s"] > 0
    assert a["best_eager_s"] == pytest.approx(a["conv_alone_s"] + a["others_at_bound_s"])
    assert r["best_eager_over_bound"] == pytest.approx(a["best_eager_s"] / r["bound_s"])
    assert not any("replays" in o for o in r["top_ops"])   # the specs stay out of the JSON
    text = "\n".join(roofline.lines(res))
    assert "roofline 32^2 b2 t1" in text and "ms alone" in text


def test_a_recorded_convolution_replays_alone_with_its_layout_and_arguments():
    import torch
    import torch.nn.functional as F

    from bench import alone

    x = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    w = torch.randn(4, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    calls = []

    def record(args):
        calls.append(alone.spec("convolution", args))
        return torch.ops.aten.convolution.default(*args)
    args = (x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
    assert torch.equal(record(args), F.conv2d(x, w, stride=2, padding=1))
    name, encoded = json.loads(calls[0])
    assert name == "convolution" and encoded[0]["t"] == [[2, 3, 8, 8], list(x.stride()), "float32"]
    assert encoded[2] is None and encoded[3] == [2, 2] and encoded[6] is False
    assert alone.replay_seconds(calls[0], repeats=2) > 0
    rows = [{"phase": "forward", "layer": "L", "op": "convolution", "seconds": 0.5,
             "replays": {calls[0]: 3}},
            {"phase": "forward", "layer": "L", "op": "gelu", "seconds": 0.2}]
    bounds = {"convolution": 0.1, "gelu": 0.05}
    got = alone.conv_alone(rows, lambda r: bounds[r["op"]])
    assert got["conv_in_step_s"] == 0.5 and got["others_at_bound_s"] == 0.05
    assert 0 < got["conv_alone_s"] < 0.5 and got["best_eager_s"] == got["conv_alone_s"] + 0.05
