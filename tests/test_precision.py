"""train.precision: bf16 autocast through the generator (custom NHWC instance norm included),
refused with a reason on CPUs without bf16 instructions."""
import pytest
import torch

from deepfusion.config import ParallelConfig
from deepfusion.engine.comm import SerialComm
from deepfusion.engine.layout import bf16_flags, bf16_supported, check_precision, precision_line
from deepfusion.engine.parallel import parallelize
from deepfusion.engine.step import LossAndGrad
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
