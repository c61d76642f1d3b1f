"""Fault probe of issue #69's 21 surfaces ("Reliability, fourth round"), in variants the tests
(tests/test_run_identity.py, test_output_paths.py, test_metrics_damage.py, test_runlock.py, ...)
do not reproduce.

    .venv/bin/python -m lab.tools.fault_probe --out FILE.json [--only 1,5,13] [--keep]

It owns one question, the issue's "done when": does a probe of the same surfaces find a silent
resume of another run, a file of the user or of the run lost or overwritten by any command, or
a traceback where a message is due? In a temporary directory it trains three tiny runs of
tests/tiny_configs.py (16x16 Burgers: A on ``mpiexec -n 2``, init_seed 1, 8 steps, checkpoints
at steps 4, 6 and 8; B the same on one process with another seed; C on 32x32), then runs each
case on a copy of them, every command under a 120 s hang guard (``--only`` picks surfaces by
the issue's item numbers). A case records the command ($W is the temporary directory), the exit
code, whether it hung, whether "Traceback" appeared on stderr, which files of the directories it
watches changed, disappeared or appeared (sha256 of every file, before and after), and a
verdict: ok, or FAIL with the reasons. Prints a table and writes the JSON. Exit 1 if a case
failed. The cases are in fault_probe_cases.py (a run directory: items 1-5, 9, 13, 16, 19) and
fault_probe_commands.py (commands, signals, the API: the others). The product never imports
lab/.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque

from lab.tools import fault_probe_cases, fault_probe_commands

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PY = sys.executable
MPIEXEC = os.path.join(os.path.dirname(PY), "mpiexec")
GUARD = 120.0
SURFACES = {1: "another run's checkpoint", 2: "a refused resume changes nothing",
            3: "a changed network on resume", 4: "damaged metrics.jsonl",
            5: "--overwrite and the user's files", 6: "--out onto a run's files or inputs",
            7: "inconsistent input fields", 8: "check/render without a loadable checkpoint",
            9: "a read-only run directory", 10: "SIGINT/SIGTERM/SIGUSR1 to mpiexec or a rank",
            11: "bad output paths", 12: "jobs render --time", 13: "a damaged lock.json",
            14: "predict/load API edge cases", 15: "hints naming a checkpoint",
            16: "a refused start leaves no lock", 17: "the ONNX refusal",
            18: "a plugin's channels changed", 19: "options ignored on resume",
            20: "SIGHUP; TorchScript against predict", 21: "an unsealed checkpoint's check"}


def digest(path: str) -> str:
    if os.path.islink(path):
        return "link:" + os.readlink(path)
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except OSError as e:
        return f"unreadable:{e.errno}"


def tree(*paths) -> dict:
    """Every file and symlink under ``paths`` (files or directories, symlinks not followed) ->
    its sha256 (a link: its target)."""
    out = {}
    for top in paths:
        if os.path.islink(top) or os.path.isfile(top):
            out[top] = digest(top)
            continue
        for d, dirs, files in os.walk(top):
            for n in files + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                out[os.path.join(d, n)] = digest(os.path.join(d, n))
    return out


def default_signals() -> None:
    """In a command's process before exec: SIGHUP and SIGINT as a login shell has them (the
    probe may run under nohup or in the background, where they are ignored and stay so)."""
    for sig in (signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)


def descendants(root: int) -> dict:
    """MPI rank -> PID of the processes under ``root`` (breadth first: a rank before its
    children, which inherit its PMI_RANK)."""
    kids = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d))
    ranks, todo = {}, deque([root])
    while todo:
        for c in kids.get(todo.popleft(), []):
            todo.append(c)
            try:
                env = open(f"/proc/{c}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            for e in env:
                if e.startswith(b"PMI_RANK="):
                    ranks.setdefault(int(e[9:]), c)
    return ranks


def steps(run: str) -> list[int]:
    """The step numbers of metrics.jsonl's step records (damaged lines skipped)."""
    return [rec.get("step") for rec in fault_probe_cases.parsed(run) if rec.get("kind") == "step"]


class Probe:
    """The temporary directory, the command runner and the record of cases."""

    logged = staticmethod(steps)

    def __init__(self, work: str, only: set):
        self.w, self.only, self.cases, self.t0 = work, only, [], time.monotonic()
        self.surface = 0

    def path(self, *parts) -> str:
        return os.path.join(self.w, *parts)

    def short(self, text: str) -> str:
        return text.replace(self.w, "$W")

    def env(self, ranks: int, extra=None) -> dict:
        e = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, self.path("plug")]),
             "PATH": os.pathsep.join([os.path.dirname(PY), os.environ.get("PATH", "")]),
             "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
             "DEEPFUSION_NO_MPI": "0" if ranks else "1"}
        return {**e, **(extra or {})}

    def argv(self, args, ranks: int, py: bool = False) -> list[str]:
        head = [MPIEXEC, "-n", str(ranks)] if ranks else []
        return head + [PY] + (list(args) if py else ["-m", "deepfusion", *args])

    def show(self, args, ranks: int, py: bool = False, env=None) -> str:
        pre = " ".join(f"{k}={v}" for k, v in (env or {}).items())
        cmd = (f"mpiexec -n {ranks} " if ranks else "") + ("python " if py else "deepfusion ")
        return self.short(" ".join(filter(None, [pre, cmd + shlex.join(args)])))

    def popen(self, args, ranks=0, env=None, py=False, out=subprocess.PIPE):
        return subprocess.Popen(self.argv(args, ranks, py), cwd=self.w, env=self.env(ranks, env),
                                stdout=out, stderr=out, text=True, start_new_session=True,
                                preexec_fn=default_signals)

    def run(self, args, ranks=0, env=None, timeout=GUARD, py=False) -> dict:
        t = time.monotonic()
        p = self.popen(args, ranks, env, py)
        try:
            out, err = p.communicate(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            hung = True
        return {"rc": p.returncode, "hung": hung, "out": out, "err": err,
                "seconds": round(time.monotonic() - t, 1)}

    def changes(self, before: dict, after: dict, strict: bool) -> list[str]:
        found = (("lost", [p for p in before if p not in after]),
                 ("changed", [p for p in before if p in after and after[p] != before[p]]),
                 ("appeared", [p for p in after if p not in before] if strict else []))
        return [f"{what}: " + ", ".join(self.short(p) for p in ps[:4]) +
                (f" (+{len(ps) - 4})" if len(ps) > 4 else "") for what, ps in found if ps]

    def case(self, name, args, *, ranks=0, expect=(2,), watch=(), keep=(), says=None,
             check=None, env=None, timeout=GUARD, py=False):
        """Run one command; ``watch``: directories or files that must not change at all
        (nothing lost, changed or added); ``keep``: whose files must stay as they were (added
        files allowed); ``says``: a text the output must hold; ``check(result)``: a reason to
        fail, or None."""
        before_w, before_k = tree(*watch), tree(*keep)
        r = self.run(args, ranks, env, timeout, py)
        why = self.changes(before_w, tree(*watch), True) + \
            self.changes(before_k, tree(*keep), False)
        if says and says not in r["out"] + r["err"] and not r["hung"]:
            why.append(f"no {says!r} in its output")
        if check and not r["hung"]:
            why += [m for m in [check(r)] if m]
        return self.record(name, self.show(args, ranks, py, env), r, why, expect)

    def record(self, name, command, r, why, expect=None):
        if r["hung"]:
            why.insert(0, "hung (killed by the hang guard)")
        elif expect and r["rc"] not in expect:
            why.insert(0, f"exit {r['rc']}, expected {' or '.join(map(str, expect))}")
        if "Traceback" in r["err"]:
            why.insert(0, "traceback on stderr")
        err = [x for x in r["err"].strip().splitlines() if x.strip()]
        rec = {"surface": self.surface, "case": name, "command": command, "exit": r["rc"],
               "hung": r["hung"], "traceback": "Traceback" in r["err"],
               "seconds": r["seconds"], "verdict": "FAIL" if why else "ok", "why": why,
               "stderr_last": self.short(err[-1])[:400] if err else ""}
        self.cases.append(rec)
        mark = "FAIL " + "; ".join(why) if why else "ok"
        print(f"[{time.monotonic() - self.t0:6.0f}s] {self.surface:2d} {name:34s} "
              f"exit {r['rc']!s:>4} {r['seconds']:5.1f}s  {mark}"[:300], flush=True)
        return r

    def copy(self, name: str, src: str = "A") -> str:
        dst = self.path(name)
        shutil.copytree(self.path(src), dst, symlinks=True)
        return dst

    def signal_case(self, name, sig, target, *, launcher=False, again=False, early=False,
                    after=None, every=1000):
        """Start a long 2-rank run, send ``sig`` to ``target`` ("mpiexec", "launch", "rank0",
        "rank1") once it has logged 3 steps (``early``: once it holds the run's lock, before its
        first step), expect exit 99
        with a checkpoint of the last logged step and no lock left; ``after(run, r)``: reasons
        to fail of a follow-up (``every``: train.checkpoint_every)."""
        run = self.path("sig_" + re.sub(r"\W+", "_", name))
        args = ["train", self.path("tiny.toml"), "--set", f"run.dir={run}", "--set",
                "train.epochs=100000", "--set", f"train.checkpoint_every={every}"]
        argv = ["launch", "-n", "2", "--", *args] if launcher else args
        log = open(run + ".log", "w+")
        t = time.monotonic()
        p = self.popen(argv, 0 if launcher else 2, out=log,
                       env={"DEEPFUSION_NO_MPI": "0"} if launcher else None)
        pid, why = None, []
        while time.monotonic() - t < 90 and p.poll() is None:
            ranks = descendants(p.pid)
            built = os.path.exists(os.path.join(run, "lock.json"))  # the run is being built
            if (early and built and len(ranks) == 2) or len(steps(run)) >= 3:
                pid = p.pid if target in ("mpiexec", "launch") else ranks.get(int(target[-1]))
                break
            time.sleep(0.2 if early else 0.5)
        if pid is None:
            why.append("the job did not get going within 90 s")
            os.killpg(p.pid, signal.SIGKILL)
        else:
            os.kill(pid, sig)
            if again:
                time.sleep(0.3)
                os.kill(pid, sig)
        try:
            p.wait(timeout=GUARD)
            hung = False
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            hung = True
        log.seek(0)
        text = log.read()
        r = {"rc": p.returncode, "hung": hung, "out": "", "err": text,
             "seconds": round(time.monotonic() - t, 1)}
        why += after(run, r) if after else self.stopped_well(run, text)
        sent = f"{signal.Signals(sig).name} to {target}" + (" twice" if again else "")
        cmd = self.show(argv, 0 if launcher else 2) + f"   # then {sent}"
        return self.record(name, cmd, r, why, expect=None if after else (99,))

    def stopped_well(self, run: str, text: str) -> list[str]:
        why, done = [], steps(run)
        last = os.path.join(run, "checkpoints", f"step_{max(done or [0]):08d}.h5")
        if "checkpoint written at step" not in text:
            why.append("no 'checkpoint written at step' message")
        if not os.path.exists(last):
            why.append(f"no checkpoint of the last logged step ({max(done or [0])})")
        if os.path.exists(os.path.join(run, "lock.json")):
            why.append("lock.json left behind")
        return why


def setup(p: Probe) -> None:
    """The config, runs A, B, C and an inputs file of 3 draws of A (infer's own output)."""
    from tests.tiny_configs import TINY

    with open(p.path("tiny.toml"), "w") as fh:
        fh.write(TINY)
    os.makedirs(p.path("plug"))
    common = ["train.checkpoint_every=2", "train.keep_checkpoints=3"]
    for name, ranks, sets in (("A", 2, ["train.max_steps=8", "train.init_seed=1"]),
                              ("B", 0, ["train.max_steps=8"]),
                              ("C", 0, ["train.max_steps=2", "problem.grid=[32,32]"])):
        args = ["train", p.path("tiny.toml"), "--set", f"run.dir={p.path(name)}"]
        r = p.run(args + [a for s in common + sets for a in ("--set", s)], ranks, timeout=600)
        if r["rc"] != 0:
            raise SystemExit(f"training run {name} failed:\n{r['err'][-3000:]}")
    r = p.run(["infer", p.path("A"), "--samples", "3", "--out", p.path("fields.h5")])
    if r["rc"] != 0:
        raise SystemExit(f"infer of run A failed:\n{r['err'][-3000:]}")


def summary(cases: list) -> dict:
    table = {}
    for c in cases:
        row = table.setdefault(c["surface"], {"surface": SURFACES[c["surface"]], "cases": 0,
                                              "failed": 0})
        row["cases"] += 1
        row["failed"] += c["verdict"] == "FAIL"
    return table


def unlock(work: str) -> None:
    """Clear the immutable flag a read-only case set (chattr +i), so the directory can go."""
    subprocess.run(["chattr", "-R", "-i", work], capture_output=True)


def surface(p: Probe, n: int) -> None:
    """Run the cases of item ``n``; an exception of the probe itself is recorded as such."""
    p.surface = n
    module = fault_probe_cases if hasattr(fault_probe_cases, f"s{n}") else fault_probe_commands
    try:
        getattr(module, f"s{n}")(p)
    except Exception as e:  # a bug of the probe, not a verdict on the product
        import traceback

        p.cases.append({"surface": n, "case": "probe error", "command": "", "exit": None,
                        "hung": False, "traceback": False, "seconds": 0,
                        "verdict": "probe error", "why": [f"{type(e).__name__}: {e}"],
                        "stderr_last": p.short(traceback.format_exc()[-600:])})
        print(f"    probe error in surface {n}: {type(e).__name__}: {e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lab.tools.fault_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON report")
    ap.add_argument("--only", help="comma-separated surfaces (the issue's item numbers)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args(argv)
    only = {int(x) for x in args.only.split(",")} if args.only else set(SURFACES)
    work = tempfile.mkdtemp(prefix="fault-probe-")
    p = Probe(work, only)
    t0 = time.monotonic()
    try:
        setup(p)
        for n in sorted(only):
            surface(p, n)
    finally:
        unlock(work)
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    table = summary(p.cases)
    report = {"command": "python -m lab.tools.fault_probe " + shlex.join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "seconds": round(time.monotonic() - t0), "cases": len(p.cases),
              "failed": sum(c["verdict"] == "FAIL" for c in p.cases),
              "probe_errors": sum(c["verdict"] == "probe error" for c in p.cases),
              "by_surface": table,
              "results": p.cases}
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
        fh.write("\n")
    print(f"\n{'#':>2} {'surface':44s} {'cases':>5} {'failed':>6}")
    for n, row in sorted(table.items()):
        print(f"{n:2d} {row['surface']:44s} {row['cases']:5d} {row['failed']:6d}")
    print(f"   {'total':44s} {report['cases']:5d} {report['failed']:6d}   "
          f"({report['seconds']} s; {report['probe_errors']} probe errors)")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
