"""The cases of :mod:`lab.tools.fault_probe` on a run directory (issue #69, items 1-5, 9, 13,
16, 19: another run's checkpoint, a refused resume, metrics damage, --overwrite, read-only
directories, lock.json, options on resume), one function ``sN`` per item, each on copies of the
probe's tiny runs A, B and C; and the helpers the other cases share. Run through the probe:
``python -m lab.tools.fault_probe --out FILE.json``."""
from __future__ import annotations

import json
import os
import shutil
import time

SITE = ["--cluster", "generic-slurm", "--partition", "cpu", "--account", "", "--no-check"]
RES = ["--set", "train.max_steps=10"]


def sets(*kv) -> list[str]:
    return [a for s in kv for a in ("--set", s)]


def ck(run: str, step: int) -> str:
    return os.path.join(run, "checkpoints", f"step_{step:08d}.h5")


def write(path: str, data) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data.encode() if isinstance(data, str) else data)


def damage(path: str, how: str) -> None:
    with open(path, "r+b") as fh:
        if how == "flip":                      # one bit in the middle of the file
            at = fh.seek(0, 2) // 2
            fh.seek(at)
            byte = fh.read(1)[0]
            fh.seek(at)
            fh.write(bytes([byte ^ 0x10]))
        else:
            fh.truncate(0 if how == "empty" else 1000)


def no_file(path: str):
    return lambda r: f"{os.path.basename(path)} was written" if os.path.exists(path) else None


def says_any(*texts):
    return lambda r: None if any(t in r["out"] + r["err"] for t in texts) else \
        f"none of {texts} in its output"


# -- 1: another run's checkpoint -------------------------------------------------------------------
def s1(p):
    B, cfg, other = p.path("B"), p.path("tiny.toml"), "was written by another run"
    plants = (("B's step 12 newer, 2 ranks", 2, lambda x: shutil.copy(ck(B, 8), ck(x, 12))),
              ("B's file as step 8, 2 ranks", 2, lambda x: shutil.copy(ck(B, 8), ck(x, 8))),
              ("32x32 run C's file newer", 0, lambda x: shutil.copy(ck(p.path("C"), 2), ck(x, 12))),
              ("only B's checkpoints", 0, lambda x: [shutil.copy(ck(B, s), ck(x, s))
                                                     for s in (4, 6, 8)]),
              ("no run_id file, B's newer", 0, lambda x: (os.remove(os.path.join(x, "run_id")),
                                                          shutil.copy(ck(B, 8), ck(x, 12)))))
    for i, (name, ranks, plant) in enumerate(plants):
        x = p.copy(f"x1_{i}")
        plant(x)
        p.case(name, ["train", "--resume", x, *RES], ranks=ranks, watch=[x], says=other)
    x, job = p.path("x1_0"), p.path("j1.sh")
    p.case("train CONFIG --resume, B's newer", ["train", cfg, "--resume", x, *RES], watch=[x],
           says=other)
    p.case("check --resume, B's newer", ["check", "--resume", x, "--ranks", "1", "--no-probe"],
           watch=[x], says=other)
    p.case("jobs render --run-dir, B's newer", ["jobs", "render", "--cluster", "local",
           "--ranks-per-node", "1", "--config", cfg, "--run-dir", x, "--out", job],
           watch=[x], check=no_file(job))
    p.case("model.init_from=B's on purpose", ["train", cfg, *sets(
        f"run.dir={p.path('n1')}", f"model.init_from={ck(B, 8)}", "train.max_steps=2")],
        expect=(0,), keep=[B])


# -- 2: a refused resume changes nothing -----------------------------------------------------------
def s2(p):
    cfg = p.path("tiny.toml")
    x = p.copy("x2")
    for s in (4, 6, 8):
        damage(ck(x, s), "empty")
    p.case("no loadable ckpt, --set lr, 2 ranks", ["train", "--resume", x, *sets(
        "optim.lr=0.5", "train.max_steps=99")], ranks=2, watch=[x])
    cfg2 = p.path("lr.toml")
    write(cfg2, open(cfg).read().replace("lr = 3e-3", "lr = 0.5"))
    p.case("no loadable ckpt, another CONFIG", ["train", cfg2, "--resume", x], watch=[x, cfg2])
    x = p.copy("x2b")
    shutil.rmtree(os.path.join(x, "checkpoints"))
    p.case("no checkpoints/ at all, --set lr", ["train", "--resume", x, *sets("optim.lr=0.5")],
           watch=[x])
    x = p.copy("x2c")
    for name, s, ranks in (("batch 3 on 2 ranks", "data.global_batch=3", 2),
                           ("a misspelt key", "optim.lrr=1", 0),
                           ("another problem", 'problem.name="poisson"', 0)):
        p.case(name, ["train", "--resume", x, *RES, "--set", s], ranks=ranks, watch=[x])
    p.case("grid 32x32 on resume", ["train", "--resume", x, *sets(
        "problem.grid=[32,32]", "train.max_steps=10")], expect=(0, 2))


# -- 3: a changed network on resume ----------------------------------------------------------------
def s3(p):
    x = p.copy("x3")
    for name, s, says in (("depth 3", "model.options={depth=3,base_width=4}",
                           "a resume continues the same network"),
                          ("an unknown option", "model.options={depth=2,base_width=4,bogus=1}",
                           None),
                          ("an unknown generator", 'model.name="nope"', None)):
        p.case(name, ["train", "--resume", x, *RES, "--set", s], watch=[x], says=says)
    y = p.copy("x3b")
    p.case("float32 on resume", ["train", "--resume", y, *RES, "--set", 'train.dtype="float32"'],
           expect=(0, 2))
    p.case("plain resume after the refusals", ["train", "--resume", x, *RES], expect=(0,),
           says="resumed from")


# -- 4: damaged metrics.jsonl ----------------------------------------------------------------------
def parsed(run: str) -> list[dict]:
    """The records of ``run``'s metrics.jsonl that parse as JSON objects (damaged lines
    skipped; none if the file cannot be read)."""
    try:
        lines = open(os.path.join(run, "metrics.jsonl"), errors="replace").read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def records(run: str) -> list[str]:
    return [json.dumps(rec, sort_keys=True) for rec in parsed(run)]


def kept(x: str, good: list, warn: bool):
    def check(r):
        have = set(records(x))
        lost = [g for g in good if g not in have]
        if lost:
            return f"{len(lost)} of {len(good)} good records gone from metrics.jsonl"
        if warn and "no record" not in r["err"]:
            return "no warning about the damaged line"
    return check


def s4(p):
    own = set(records(p.path("A")))
    b_line = open(os.path.join(p.path("B"), "metrics.jsonl"), "rb").readline()
    ins = lambda L, line, at=3: L[:at] + [line] + L[at:]  # noqa: E731
    variants = (("garbage first line", lambda L: [b"not JSON\n"] + L, True),
                ("garbage last line", lambda L: L + [b"not JSON\n"], True),
                ("a blank line", lambda L: ins(L, b"\n"), False),
                ("a line of NUL bytes", lambda L: ins(L, b"\0" * 40 + b"\n"), True),
                ("a JSON array line", lambda L: ins(L, b"[1, 2]\n"), True),
                ("non-UTF-8 bytes", lambda L: ins(L, b"\xff\xfe garbage\n"), True),
                ("B's record inserted", lambda L: ins(L, b_line), False),
                ("NUL-filled tail, no newline", lambda L: L[:-2] + [b"\0" * 200], True))
    for i, (name, edit, warn) in enumerate(variants):
        x = p.copy(f"x4_{i}")
        path = os.path.join(x, "metrics.jsonl")
        write(path, b"".join(edit(open(path, "rb").read().splitlines(True))))
        good = [g for g in records(x) if g in own]
        if i == 3:
            p.case("status on a NUL line", ["status", x], expect=(0,), watch=[x])
        p.case(name, ["train", "--resume", x, *RES], expect=(0,), check=kept(x, good, warn))
    x = p.copy("x4_dir")
    os.remove(os.path.join(x, "metrics.jsonl"))
    os.makedirs(os.path.join(x, "metrics.jsonl"))
    p.case("metrics.jsonl is a directory", ["train", "--resume", x, *RES], watch=[x])
    x = p.copy("x4_gone")
    os.remove(os.path.join(x, "metrics.jsonl"))
    p.case("metrics.jsonl missing", ["train", "--resume", x, *RES], expect=(0, 2))


# -- 5: --overwrite and the user's files -----------------------------------------------------------
def s5(p):
    cfg, user = p.path("tiny.toml"), p.path("user5")
    write(os.path.join(user, "thesis.txt"), "months of work")
    write(os.path.join(user, "dir", "data.csv"), "1,2,3\n")

    def over(x):
        return ["train", cfg, "--overwrite", *sets(f"run.dir={x}", "train.max_steps=2")]
    plants = (("sub/deep/notes.md", lambda x: write(os.path.join(x, "sub/deep/notes.md"), "n")),
              ("a symlink to a user file", lambda x: os.symlink(
                  os.path.join(user, "thesis.txt"), os.path.join(x, "thesis.txt"))),
              ("a symlink to a user dir", lambda x: os.symlink(
                  os.path.join(user, "dir"), os.path.join(x, "data"))),
              ("checkpoints/notes.txt", lambda x: write(os.path.join(x, "checkpoints/notes.txt"),
                                                        "n")),
              ("checkpoints/step_8.h5.bak", lambda x: shutil.copy(ck(x, 8), ck(x, 8) + ".bak")),
              ("a hidden .notes", lambda x: write(os.path.join(x, ".notes"), "n")),
              ("config.toml.orig", lambda x: write(os.path.join(x, "config.toml.orig"), "n")))
    for i, (name, plant) in enumerate(plants):
        x = p.copy(f"x5_{i}")
        plant(x)
        p.case(f"--overwrite, {name}", over(x), watch=[x, user], says="files no run writes")
    for name, extra in (("--overwrite, only user files", ["--overwrite"]),
                        ("a start, only user files", [])):
        d = p.path(f"d5_{len(extra)}")
        write(os.path.join(d, "thesis.txt"), "months of work")
        p.case(name, ["train", cfg, *extra, *sets(f"run.dir={d}", "train.max_steps=2")],
               expect=(0, 2), keep=[d])
    x = p.copy("x5_t")
    write(ck(x, 10) + ".tmp.4242", "partial")
    write(os.path.join(x, "metrics.rejected.jsonl"), '{"line": 4, "text": "x"}\n')
    p.case("--overwrite, a .tmp and metrics.rejected", over(x), expect=(0,))


# -- 9: a read-only run directory (root: chattr +i) ------------------------------------------------
def s9(p):
    import subprocess

    for i, (name, rel, expect) in enumerate((("checkpoints/ immutable", "checkpoints", (2,)),
                                             ("the run dir immutable", "", (2,)),
                                             ("metrics.jsonl immutable", "metrics.jsonl", (2,)),
                                             ("config.toml immutable", "config.toml", (0, 2)))):
        x = p.copy(f"x9_{i}")
        target = os.path.join(x, rel) if rel else x
        if subprocess.run(["chattr", "+i", target], capture_output=True).returncode:
            print(f"    skipped {name}: chattr +i failed")
            continue
        try:
            p.case(name, ["train", "--resume", x, *RES], expect=expect,
                   watch=[x] if expect == (2,) else [])
        finally:
            subprocess.run(["chattr", "-i", target], capture_output=True)


# -- 13: a damaged lock.json -----------------------------------------------------------------------
def s13(p):
    x = p.copy("x13")
    lock, dmg = os.path.join(x, "lock.json"), "lock.json is damaged"
    for name, data in (("garbage", b"garbage{"), ("empty", b""), ("a list", b"[]"),
                       ("a number", b"42"), ("NUL bytes", b"\0" * 64),
                       ("cut JSON", b'{"pid": 12'),
                       ("wrong types", json.dumps({"pid": "x", "host": 1, "started": "y",
                                                   "heartbeat": []}).encode())):
        write(lock, data)
        os.utime(lock, (time.time() - 5,) * 2)   # past WRITING_S (1 s): not a lock being written
        p.case(f"resume, lock {name}", ["train", "--resume", x, *RES], watch=[x], says=dmg)
    p.case("status, lock of wrong types", ["status", x], expect=(0,), watch=[x],
           check=says_any("damaged"))
    os.remove(lock)
    os.makedirs(lock)
    p.case("resume, lock.json a directory", ["train", "--resume", x, *RES], watch=[x])
    p.case("status, lock.json a directory", ["status", x], expect=(0, 2), watch=[x])
    os.rmdir(lock)
    write(lock, b"garbage{")
    os.utime(lock, (time.time() - 60,) * 2)
    p.case("resume, garbage lock 60 s old", ["train", "--resume", x, *RES], expect=(0,),
           says="took over")


# -- 16: a refused start leaves no lock ------------------------------------------------------------
def s16(p):
    cfg = p.path("tiny.toml")

    def start(d, *s):
        return ["train", cfg, *sets(f"run.dir={d}", "train.max_steps=2", *s)]
    for i, v in enumerate(("0", "-5", "abc", "inf")):
        d = p.path(f"n16_{i}")
        p.case(f"DEEPFUSION_LOCK_HEARTBEAT={v}", start(d), env={"DEEPFUSION_LOCK_HEARTBEAT": v},
               watch=[d], says="DEEPFUSION_LOCK_HEARTBEAT")
    d = p.path("n16_b")
    p.case("a new run, batch 3 on 2 ranks", start(d, "data.global_batch=3"), ranks=2, watch=[d])
    d = p.path("n16_s")
    p.case("a new run, max_steps=-1", start(d, "train.max_steps=-1"), watch=[d])
    x = p.copy("x16")
    p.case("a start into a run, no --overwrite", start(x), watch=[x], says="already holds a run")


# -- 19: options ignored on resume -----------------------------------------------------------------
def s19(p):
    x, B = p.copy("x19"), p.path("B")
    other, link, cfgo = p.path("o19"), p.path("l19"), p.path("other19.toml")
    os.symlink(x, link)
    write(cfgo, open(p.path("tiny.toml")).read().replace("[run]\n", f'[run]\ndir = "{other}"\n'))
    p.case("--resume X --overwrite --set run.dir=X", ["train", "--resume", x, "--overwrite",
           *sets(f"run.dir={x}")], watch=[x])
    p.case("check --resume X --overwrite", ["check", "--resume", x, "--overwrite", "--ranks",
           "1", "--no-probe"], watch=[x])
    p.case("--resume X --set model.init_from=B's", ["train", "--resume", x, *RES, "--set",
           f"model.init_from={ck(B, 8)}"], watch=[x])
    p.case("CONFIG with run.dir=OTHER --resume X", ["train", cfgo, "--resume", x, *RES],
           expect=(0, 2), check=lambda r: "OTHER was created" if os.path.exists(other) else (
               None if r["rc"] == 2 or other in r["out"] + r["err"] else
               "the config's run.dir=OTHER ignored without a word"))
    p.case("--resume X --set run.dir=X/", ["train", "--resume", x, *sets(
        f"run.dir={x}/", "train.max_steps=12")], expect=(0,))
    p.case("--resume X --set run.dir=LINK-to-X", ["train", "--resume", x, *sets(
        f"run.dir={link}", "train.max_steps=14")], expect=(0, 2))


