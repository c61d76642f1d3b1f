"""The final checkpoint is written once, after the final validation (``Trainer.fit``'s
``closing``): with what that validation adds to its metadata, and with the state from before it
(RNG, step), so training on from it is the trajectory of a run that never stopped. A final
validation that fails still leaves the final checkpoint."""
from __future__ import annotations

import os

import pytest
import torch

from deepfusion.engine.checkpoint import store
from tests.test_progress_hook import tiny_trainer


def test_the_final_checkpoint_is_written_once_after_the_validation_with_the_state_before_it(
        tmp_path, monkeypatch):
    saved, real = [], store.save_checkpoint

    def counting(path, **kw):
        saved.append(os.path.basename(path))
        return real(path, **kw)

    monkeypatch.setattr(store, "save_checkpoint", counting)
    before = {}

    def closing(t):
        before["rng"] = torch.get_rng_state().clone()
        torch.rand(100)            # a validation that draws: not in the checkpoint's RNG state
        return {"answer_check": {"threshold": 0.5}}

    t = tiny_trainer(tmp_path)
    t.fit(closing=closing)
    final = store.checkpoint_path(t.run_dir, 6)
    assert saved == [os.path.basename(final)]                       # 3 epochs x 2 steps
    state = store.load_checkpoint(final)
    assert state["meta"]["answer_check"] == {"threshold": 0.5} and state["meta"]["step"] == 6
    assert torch.equal(state["rng_state"]["torch"], before["rng"])
    assert store.seal_status(final) == "sealed"


def test_a_final_validation_that_fails_still_leaves_the_final_checkpoint(tmp_path):
    def closing(t):
        raise RuntimeError("the reference solver failed")

    t = tiny_trainer(tmp_path)
    with pytest.raises(RuntimeError, match="reference solver failed"):
        t.fit(closing=closing)
    state = store.load_checkpoint(store.checkpoint_path(t.run_dir, 6))
    assert state["meta"]["step"] == 6 and "answer_check" not in state["meta"]
