"""A damaged line in metrics.jsonl is set aside with a warning on resume, never a reason to drop
the good records after it (deepfusion.engine.run.log)."""
import json

from deepfusion.engine.run.log import REJECTED, read_metrics
from tests.tiny_configs import TINY, variant


def steps(run):
    return [r["step"] for r in read_metrics(str(run / "metrics.jsonl")) if r["kind"] == "step"]


def test_a_damaged_line_is_set_aside_and_the_records_after_it_are_kept(tmp_path, cli):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(variant(TINY, "train.max_steps=8", "train.checkpoint_every=8"))
    run = tmp_path / "run"
    assert cli(["train", str(cfg), "--set", f"run.dir={run}"])[0] == 0
    assert steps(run) == list(range(1, 9))
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines.insert(3, "this is no JSON\n")
    lines.append('{"kind": "step", "step": 9')       # a record cut by a kill, past the checkpoint
    (run / "metrics.jsonl").write_text("".join(lines))
    rc, _, err = cli(["train", "--resume", str(run), "--set", "train.max_steps=12"])
    assert rc == 0, err
    assert "2 line(s) that are no record" in err and REJECTED in err
    assert steps(run) == list(range(1, 13))            # nothing before the damage was dropped
    rejected = [json.loads(x) for x in (run / REJECTED).read_text().splitlines()]
    assert [r["line"] for r in rejected] == [4, len(lines)]
    assert rejected[0]["text"] == "this is no JSON"
