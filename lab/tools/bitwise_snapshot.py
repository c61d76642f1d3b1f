"""A snapshot of what tiny runs compute, to compare a refactoring before and after bit for bit.

    python -m lab.tools.bitwise_snapshot OUT.json            # on the tree as it is
    python -m lab.tools.bitwise_snapshot OUT2.json --compare OUT.json

Each case trains a tiny float64 run through the ``deepfusion`` command (1 process and
``mpiexec -n 2``; every built-in family; a domain split; a multigrid plan with a grown
network; L-BFGS), then predicts through every door: ``evaluate``, ``infer`` (with and
without the answer check, split), ``deepfusion.load(...).predict`` and a TorchScript
export. It records every loss of ``metrics.jsonl`` as ``float.hex`` and a sha256 of every
prediction array, so any moved bit shows. Threads are fixed at 1 per rank: the bits do not
depend on the machine's load, only on its CPU (compare on one host).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

TINY = """
[run]
plots = false
[problem]
name = "{name}"
grid = {grid}
{options}
[model]
name = "{model}"
options = {{depth = 2, base_width = 4}}
channels_last = {cl}
[data]
n_samples = 16
global_batch = 4
eval_samples = 3
[optim]
name = "{optim}"
lr = 3e-3
schedule = "constant"
[train]
epochs = 3
dtype = "float64"
log_every = 1
checksum_every = 4
[parallel]
threads_per_rank = 1
"""

CASES = {
    "burgers": dict(name="burgers", grid="[16, 16]", ranks=2),
    "burgers_serial": dict(name="burgers", grid="[16, 16]", ranks=0, cl="true"),
    "darcy": dict(name="darcy", grid="[16, 16]", ranks=2),
    "poisson": dict(name="poisson", grid="[16, 16]", ranks=0),
    "poisson3d": dict(name="poisson3d", grid="[8, 8, 8]", ranks=2, model="unet3d"),
    "reaction_diffusion": dict(name="reaction_diffusion", grid="[16, 16]", ranks=0,
                               options="options = {ritz = true}"),
    "poisson_split": dict(name="poisson", grid="[16, 16]", ranks=2,
                          extra=["parallel.domain=[1, 2]"], domain="1x2"),
    "lbfgs": dict(name="poisson", grid="[16, 16]", ranks=2, optim="lbfgs"),
    "multigrid": dict(name="poisson", grid="[16, 16]", ranks=0,
                      extra=["train.levels=[{grid = [8, 8], steps = 4}, "
                             "{grid = [16, 16], steps = 4, prolong = true}]"]),
}


def digest(a) -> str:
    a = np.ascontiguousarray(np.asarray(a))
    if a.dtype.kind in "OSU":   # strings: their values (an object array's bytes are pointers)
        data = json.dumps([v.decode() if isinstance(v, bytes) else str(v)
                           for v in a.ravel().tolist()]).encode()
        return f"str{list(a.shape)}:" + hashlib.sha256(data).hexdigest()[:20]
    return f"{a.dtype}{list(a.shape)}:" + hashlib.sha256(a.tobytes()).hexdigest()[:20]


def deepfusion(ranks: int, args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DEEPFUSION_NO_MPI"}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "deepfusion", *args]
    if ranks:
        cmd = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", str(ranks), *cmd]
    else:
        env["DEEPFUSION_NO_MPI"] = "1"
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(args)} exited {p.returncode}:\n{p.stderr[-3000:]}")


def h5_digests(path: str) -> dict:
    import h5py
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset) and not name.startswith("timing"):
                out[name] = digest(obj[()])
        f.visititems(visit)
    return out


def case(tmp: str, key: str, c: dict) -> dict:
    run = os.path.join(tmp, key)
    cfg = os.path.join(tmp, f"{key}.toml")
    with open(cfg, "w") as f:
        f.write(TINY.format(name=c["name"], grid=c["grid"], options=c.get("options", ""),
                            cl=c.get("cl", "false"), model=c.get("model", "unet"), optim=c.get("optim", "adam")))
    sets = sum((["--set", s] for s in [f"run.dir={run!r}".replace("'", '"'),
                                        *c.get("extra", [])]), [])
    deepfusion(c["ranks"], ["train", cfg, *sets])
    rec = {"losses": [], "evals": []}
    with open(os.path.join(run, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if "loss" in r and isinstance(r["loss"], float):
                rec["losses"].append(float.hex(r["loss"]))
            if r.get("kind", r.get("type")) == "eval" or "rel_l2_mean" in r:
                rec["evals"].append({k: v for k, v in r.items() if "rel_l2" in k or "loss_" in k})
    rec["validation"] = eval_digest(run)
    deepfusion(c["ranks"], ["evaluate", run])
    rec["evaluate"] = eval_digest(run)
    preds = os.path.join(tmp, f"{key}_preds.h5")
    deepfusion(c["ranks"], ["infer", run, "--samples", "5", "--out", preds, "--threads", "1",
                            "--batch", "2"])
    rec["infer"] = h5_digests(preds)
    if "domain" in c:
        split = os.path.join(tmp, f"{key}_split.h5")
        deepfusion(2, ["infer", run, "--samples", "3", "--out", split, "--threads", "1",
                       "--domain", c["domain"]])
        rec["infer_split"] = h5_digests(split)
    ts = os.path.join(tmp, f"{key}.pt")
    deepfusion(0, ["export", run, "--format", "torchscript", "--out", ts])
    rec["api"] = api(run, ts)
    return rec


def eval_digest(run: str) -> list:
    """The per-draw errors (or losses) of the run's eval.json, as float.hex."""
    with open(os.path.join(run, "eval.json")) as f:
        ev = json.load(f)
    return [float.hex(v) for v in ev.get("rel_l2", ev.get("loss", []))]


def api(run: str, exported: str) -> dict:
    os.environ["DEEPFUSION_NO_MPI"] = "1"
    import torch
    torch.set_num_threads(1)
    import deepfusion as df
    s = df.load(run, threads=1)
    params = s.sample(4, seed=7)
    out = {"params": digest(s.predict(params=params))}
    x = s.inputs(params)
    out["inputs"] = digest(x)
    out["fields"] = digest(s.predict(x))
    module = torch.jit.load(exported)
    with torch.no_grad():
        out["torchscript"] = digest(module(torch.as_tensor(x, dtype=s.dtype)).numpy())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--compare", help="an earlier snapshot: list every difference")
    ap.add_argument("--only", nargs="*", help="these cases only")
    a = ap.parse_args(argv)
    snap = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, c in CASES.items():
            if a.only and key not in a.only:
                continue
            snap[key] = case(tmp, key, c)
            print(f"{key}: {len(snap[key]['losses'])} losses", flush=True)
    with open(a.out, "w") as f:
        json.dump(snap, f, indent=1, sort_keys=True)
    if not a.compare:
        return 0
    with open(a.compare) as f:
        old = json.load(f)
    bad = [k for k in snap if snap[k] != old.get(k)]
    for k in bad:
        for part in snap[k]:
            if snap[k][part] != old[k].get(part):
                print(f"DIFFERS: {k}.{part}")
    print("identical" if not bad else f"{len(bad)} case(s) differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
