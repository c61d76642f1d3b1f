"""The sweep's loading side: a worker process loads flipped copies of a checkpoint one after
another and prints one JSON line per flip (``python -m tests.faults.loader``, a job on stdin);
:func:`run_flips` feeds it and, when a flip crashes or hangs it, records that flip and goes on
in a new worker from the next one."""
from __future__ import annotations

import contextlib
import io
import json
import os
import queue
import subprocess
import sys
import threading

from tests.faults.commands import STEP, env
from tests.mpi_util import ROOT


def fingerprint(obj, h=None) -> str:
    """A digest of a loaded state: types, keys, dtypes, shapes and bytes, in order."""
    import hashlib

    import numpy as np
    import torch

    top = h is None
    h = h or hashlib.sha256()
    h.update(type(obj).__name__.encode())
    if isinstance(obj, torch.Tensor):
        t = obj.detach().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}{t.stride()}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(obj, (np.ndarray, np.generic)):
        a = np.ascontiguousarray(obj)
        h.update(f"{a.dtype.str}{a.shape}".encode() + a.tobytes())
    elif isinstance(obj, dict):
        for k, v in obj.items():
            h.update(repr(k).encode())
            fingerprint(v, h)
    elif isinstance(obj, (list, tuple)):
        h.update(str(len(obj)).encode())
        for v in obj:
            fingerprint(v, h)
    else:
        h.update(repr(obj).encode())
    return h.hexdigest() if top else ""


def worker() -> int:
    """Read a job (JSON on stdin), print one JSON line per flip."""
    import h5py

    from deepfusion.engine.checkpoint import contained
    from deepfusion.engine.checkpoint import store as ckpt
    job = json.load(sys.stdin)
    original = open(job["checkpoint"], "rb").read()
    # the undamaged file's own check keeps the product's guard: a short --check-seconds is for
    # the flipped copies, and a child slow to start on a busy machine is no finding
    baseline = fingerprint(ckpt.load_checkpoint(job["checkpoint"]))
    contained.SECONDS = job["check_seconds"]
    seen = {"parsed": False, "contained": False}
    h5_file, run_child = h5py.File, ckpt.run_contained

    def counting_file(*a, **k):
        seen["parsed"] = True
        return h5_file(*a, **k)

    def counting_contained(*a, **k):
        seen["contained"] = True
        return run_child(*a, **k)

    def in_process(args, timeout):  # --uncontained: the check without its child process
        seen["contained"] = True
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            contained.main(args[2:])
        return out.getvalue().strip()

    h5py.File = counting_file
    ckpt.run_contained = in_process if job["uncontained"] else counting_contained
    target = os.path.join(job["workdir"], "checkpoints", STEP)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    print(json.dumps({"ready": True}), flush=True)
    for bit in job["bits"]:
        data = bytearray(original)
        data[bit // 8] ^= 1 << (bit % 8)
        with open(target, "wb") as fh:
            fh.write(data)
        seen.update(parsed=False, contained=False)
        rec = {"bit": bit}
        try:
            state = ckpt.load_checkpoint(target)
            rec["outcome"] = "harmless" if fingerprint(state) == baseline else "silent"
        except ckpt.CheckpointError as exc:
            rec.update(outcome="refused", why=str(exc))
        except Exception as exc:  # noqa: BLE001 - what the loader must never raise
            rec.update(outcome="unclear", why=f"{type(exc).__name__}: {exc}")
        rec.update(seen)
        print(json.dumps(rec), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the parent: batches in workers, a crash or hang ends only the flip it happened on
# ---------------------------------------------------------------------------------------------

def _lines(stream, q):
    for line in stream:
        q.put(line)
    q.put(None)


def run_flips(checkpoint: str, bits: list[int], workdir: str, *, hang_guard: float,
              check_seconds: float, uncontained: bool = False, startup: float = 300.0) -> dict:
    """bit -> record, for every bit; a worker that dies or hangs is replaced."""
    results, pending, restarts = {}, list(bits), 0
    while pending:
        proc = subprocess.Popen([sys.executable, "-m", "tests.faults.loader"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, env=env(), cwd=ROOT)
        proc.stdin.write(json.dumps({"checkpoint": checkpoint, "bits": pending,
                                     "workdir": os.path.join(workdir, f"w{restarts}"),
                                     "check_seconds": check_seconds,
                                     "uncontained": uncontained}))
        proc.stdin.close()
        q = queue.Queue()
        threading.Thread(target=_lines, args=(proc.stdout, q), daemon=True).start()
        try:
            first = q.get(timeout=startup)
        except queue.Empty:
            first = None
        if first is None or "ready" not in first:
            proc.kill()
            raise SystemExit("the sweep's worker did not start (it loads the undamaged file)")
        for bit in pending:
            try:
                line = q.get(timeout=hang_guard)
            except queue.Empty:
                proc.kill()
                results[bit] = {"bit": bit, "outcome": "hang"}
                break
            if line is None:
                results[bit] = {"bit": bit, "outcome": "crash", "why": f"exit {proc.wait()}"}
                break
            results[bit] = json.loads(line)
        proc.wait()
        restarts += 1
        pending = [b for b in pending if b not in results]
    return results


if __name__ == "__main__":
    sys.exit(worker())
