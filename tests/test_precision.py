"""train.precision: bf16 autocast through the generator (custom NHWC instance norm included),
refused with a reason on CPUs without bf16 instructions."""
import os

import pytest
import torch

from deepfusion.config import ParallelConfig
from deepfusion.engine.parallel.comm import SerialComm
from deepfusion.engine.parallel.layout import (avoid_amx_under_a_split, bf16_flags, bf16_supported,
                                              check_precision, precision_line)
from deepfusion.engine.parallel.parallelize import parallelize
from deepfusion.engine.train.step import LossAndGrad
from diffnet.generators import build_generator
from diffnet.problems import get_problem


def test_bf16_refused_without_cpu_support(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("flags\t\t: fpu sse avx2\n")
    with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16") as e:
        check_precision("bf16", str(fake))
    assert 'Use train.precision = "fp32"' in str(e.value)
    check_precision("fp32", str(fake))
    with pytest.raises(ValueError) as e:                      # deepfusion infer's wording
        check_precision("bf16", str(fake), setting="--precision {}")
    assert str(e.value).startswith("--precision bf16 needs") and "Use --precision fp32." in str(e.value)


@pytest.mark.parametrize("flags, capped", [("fpu avx2", False), ("avx512f avx512_bf16", False),
                                           ("avx512_bf16 amx_tile amx_bf16", True)])
def test_a_split_bf16_model_runs_onednn_without_amx_unless_the_user_chose(tmp_path, monkeypatch,
                                                                         flags, capped):
    fake = tmp_path / "cpuinfo"
    fake.write_text(f"flags\t\t: {flags}\n")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    note = avoid_amx_under_a_split(str(fake))
    assert bool(note) == capped
    assert (os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX512_CORE_BF16") == capped
    if capped:
        assert "without AMX" in note and "set ONEDNN_MAX_CPU_ISA yourself" in note
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")       # the user's choice stands
    assert avoid_amx_under_a_split(str(fake)) == ""
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_AMX"


@pytest.mark.parametrize("flags, found", [
    ("fpu sse avx2", []),
    ("fpu avx512f avx512_bf16", ["avx512_bf16"]),
    ("avx512_bf16 amx_tile amx_bf16", ["avx512_bf16", "amx_bf16"])])
def test_start_up_line_names_the_precision_and_the_cpus_bf16_flags(tmp_path, flags, found):
    """Both CPU paths (Skylake-like, AVX512-BF16 only, AMX) through a fake /proc/cpuinfo."""
    fake = tmp_path / "cpuinfo"
    fake.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert bf16_flags(str(fake)) == found
    line = precision_line("fp32", str(fake))
    assert line.startswith("precision: fp32")
    if found:
        assert all(f in line for f in found) and 'train.precision = "bf16"' in line
        assert precision_line("bf16", str(fake)).startswith("precision: bf16")
    else:
        assert "no bf16 path" in line
    assert bf16_flags(str(tmp_path / "missing")) == []


@pytest.mark.skipif(not bf16_supported(), reason="this CPU has no avx512_bf16/amx_bf16")
def test_bf16_step_runs_and_matches_fp32_loosely():
    task = get_problem("poisson", grid=(16, 16))
    torch.manual_seed(0)
    model = build_generator("unet", in_channels=2, depth=2, base_width=4).to(memory_format=torch.channels_last)
    x = task.build_input(task.sample_params(0, range(2)))
    res = {}
    for prec in ("fp32", "bf16"):
        pm = parallelize(model, SerialComm(), ParallelConfig())
        res[prec] = LossAndGrad(pm, task, global_batch=2, term_names=task.loss_term_names,
                                precision=prec)(x)
    assert res["bf16"].finite
    assert res["bf16"].loss == pytest.approx(res["fp32"].loss, rel=0.05)


class _Ranks:
    """A communicator stand-in whose ranks report the given bf16 support."""

    def __init__(self, *support):
        self.support = list(support)

    def allgather_obj(self, _mine):
        return self.support


def test_auto_is_bf16_only_if_every_rank_has_it(tmp_path):
    """train.precision = "auto": bf16 where every rank's CPU has native bf16, fp32 if one
    rank's has not (a mixed partition), and said at start-up; fp32 and bf16 pass unchanged."""
    from deepfusion.engine.parallel.layout import agreed_precision

    amx = tmp_path / "cpuinfo"
    amx.write_text("flags\t\t: avx512_bf16 amx_bf16\n")
    assert agreed_precision("auto", _Ranks(True, True), str(amx)) == "bf16"
    assert agreed_precision("auto", _Ranks(True, False), str(amx)) == "fp32"
    assert agreed_precision("fp32", _Ranks(True, True), str(amx)) == "fp32"
    assert agreed_precision("bf16", _Ranks(False), str(amx)) == "bf16"  # refused in preflight
    line = precision_line("bf16", str(amx), requested="auto")
    assert line.startswith("precision: auto -> bf16") and "amx_bf16" in line
    assert "not every rank" in precision_line("fp32", str(amx), requested="auto")
    check_precision("auto", str(tmp_path / "no-such-cpuinfo"))  # never refused


def test_auto_needs_float32():
    from deepfusion.config import ConfigError, load_config

    load_config(None, ['train.precision="auto"'])
    with pytest.raises(ConfigError, match='train.precision "auto" needs train.dtype = "float32"'):
        load_config(None, ['train.precision="auto"', 'train.dtype="float64"'])


def test_auto_run_keeps_auto_in_its_config_and_records_what_ran(tmp_path, cli):
    """The run directory's config.toml keeps "auto" (a requeue on other nodes chooses again);
    the checkpoint's config holds the precision the steps ran in."""
    from deepfusion.engine.checkpoint.store import load_checkpoint
    from tests.tiny_configs import TINY, variant

    cfg = tmp_path / "auto.toml"
    cfg.write_text(variant(TINY, 'train.precision="auto"', 'train.dtype="float32"',
                           "train.max_steps=2", "data.eval_samples=0"))
    run = tmp_path / "run"
    rc, out, err = cli(["train", str(cfg), "--set", f"run.dir={run}"])
    assert rc == 0, err
    ran = "bf16" if bf16_supported() else "fp32"
    assert f"precision: auto -> {ran}" in out
    assert 'precision = "auto"' in (run / "config.toml").read_text()
    (ckpt,) = (run / "checkpoints").glob("step_*.h5")
    assert load_checkpoint(str(ckpt))["meta"]["config"]["train"]["precision"] == ran
