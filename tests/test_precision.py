"""train.precision: bf16 autocast through the generator (custom NHWC instance norm included),
refused with a reason on CPUs without bf16 instructions."""
import pytest
import torch

from deepfusion.config import ParallelConfig
from deepfusion.engine.comm import SerialComm
from deepfusion.engine.layout import bf16_supported, check_precision
from deepfusion.engine.parallel import parallelize
from deepfusion.engine.step import LossAndGrad
from diffnet.generators import build_generator
from diffnet.problems import get_problem


def test_bf16_refused_without_cpu_support(tmp_path):
    fake = tmp_path / "cpuinfo"
    fake.write_text("flags\t\t: fpu sse avx2\n")
    with pytest.raises(ValueError, match="avx512_bf16 or amx_bf16"):
        check_precision("bf16", str(fake))
    check_precision("fp32", str(fake))


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
