"""``deepfusion evaluate``: a checkpoint's error on the test draw (data.test_seed), never the
training pool or the validation draw unless asked, and then with a warning."""
import json
import os

import pytest

from bench import infer_bench
from deepfusion.engine.checkpoint.store import latest_checkpoint
from tests.mpi_util import REAL_MPI, commands, deepfusion
from tests.test_engine_mpi import train
from tests.tiny_configs import TINY, variant


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("ev")
    cfg = d / "tiny.toml"
    cfg.write_text(TINY)
    run_dir = str(d / "run")
    p = train(None, str(cfg), run_dir, "train.max_steps=4", "data.test_samples=6")
    assert p.returncode == 0, p.stderr
    return run_dir


@pytest.mark.mpi
def test_the_test_draw_by_default_on_any_number_of_ranks(run):
    outs = {}
    for n in (0, 2):
        out = os.path.join(run, f"test_p{n}.json")
        p = deepfusion(n, ["evaluate", run, "--out", out])
        assert p.returncode == 0, p.stderr
        assert "test relative L2 over 6 draws (seed 271828)" in p.stdout and "WARNING" not in p.stderr
        outs[n] = json.load(open(out))
    s = outs[0]
    assert s["n"] == 6 and s["seed"] == 271828 and len(s["rel_l2"]) == 6 and s["step"] == 4
    assert s["rel_l2_max"] >= s["rel_l2_median"] >= min(s["rel_l2"]) > 0
    assert outs[2]["rel_l2"] == pytest.approx(s["rel_l2"], rel=1e-9)  # same draws on 2 ranks


def test_the_validation_or_training_seed_is_flagged(run, cli):
    rc, out, err = cli(["evaluate", run, "--seed", "12345", "--samples", "2"])
    assert rc == 0, err
    assert "validation draw (data.eval_seed)" in err and "NOT a test draw" in out
    assert os.path.exists(os.path.join(run, "eval_seed12345.json"))
    rc, out, err = cli(["evaluate", run, "--seed", "0", "--samples", "2"])
    assert rc == 0 and "training seed" in err, err


def test_a_directory_without_checkpoints_is_bad_input(tmp_path, cli):
    (tmp_path / "checkpoints").mkdir()
    rc, _, err = cli(["evaluate", str(tmp_path)])
    assert rc == 2 and "no complete checkpoint" in err and "Traceback" not in err


RITZ = variant(TINY, 'problem.name="darcy"', 'problem.options={family = "fine-scale", '
               'output_scale = 0.01, ritz = true, ritz_fields = 2}')


@pytest.mark.mpi
@pytest.mark.full
def test_an_answer_option_replaces_the_checkpoints(tmp_path, cli):
    """--set problem.options.KEY=VALUE changes how the answer is formed (here the Ritz coefficients become fields on
    a 2 x 2 partition) on evaluate and infer, is recorded, and is refused when it names no
    option, sets the grid, or changes the channels the network was built for."""
    assert RITZ != TINY
    cfg = tmp_path / "ritz.toml"
    cfg.write_text(RITZ)
    run = str(tmp_path / "run")
    assert train(None, str(cfg), run, "train.max_steps=4", "data.test_samples=3").returncode == 0
    errs, opts = {}, ([], ["--set", "problem.options.ritz_partition=2"])
    outs = [str(tmp_path / f"e{len(opt)}.json") for opt in opts]   # both in one 2-rank launch
    done = commands(2, [["evaluate", run, "--out", out, *opt] for opt, out in zip(opts, outs)],
                    env=REAL_MPI)
    for opt, out, (code, said, err) in zip(opts, outs, done):
        assert code == 0, err
        s = json.load(open(out))
        assert s["options"] == ({"ritz_partition": 2} if opt else {})
        assert ("with --set problem.options.ritz_partition=2" in said) == bool(opt)
        errs[len(opt)] = s["rel_l2"]
    assert errs[0] != errs[2]
    # One-process commands and the benches run in this process (main takes argv), not as
    # more ~3 s launches; the refusal on 2 ranks below is a real launch.
    assert cli(["infer", run, "--samples", "2", "--out", str(tmp_path / "p.h5"),
                "--set", "problem.options.ritz_partition=2"])[0] == 0
    ckpt = latest_checkpoint(run)
    bench = {}
    for opt in ([], ["--set", "problem.options.ritz_partition=2"]):
        out = str(tmp_path / f"ib{len(opt)}.json")
        assert infer_bench.main(["--checkpoint", ckpt, "--sizes", "16", "--batches", "1",
                                 "--samples", "2", "--solver-samples", "2", "--solvers", "direct",
                                 "--threads", "1", *opt, "--out", out]) == 0
        bench[len(opt)] = json.load(open(out))
    assert bench[2]["options"] == {"ritz_partition": 2} and bench[0]["options"] == {}
    assert (bench[2]["results"][0]["rel_l2_vs_reference"]["mean"]
            != bench[0]["results"][0]["rel_l2_vs_reference"]["mean"])   # the option answered
    for bad, says in (("problem.options.bogus=1", "unknown option(s) ['bogus']"),
                      ("problem.options.grid=[8,8]", "give the grid with --grid"),
                      ("train.lr=1", "evaluate takes only problem options")):
        rc, _, err = cli(["evaluate", run, "--set", bad])
        assert rc == 2 and says in err and "Traceback" not in err, err
    p = deepfusion(2, ["evaluate", run, "--set", "problem.options.ritz_fields=3"], env=REAL_MPI)  # all exit
    says = "changes the problem's output channels (2 -> 3)"
    assert p.returncode == 2 and says in p.stderr and "Traceback" not in p.stderr, p.stderr
