"""The cases of :mod:`lab.tools.fault_probe` on the commands that read a run and write files,
and on signals (issue #69, items 6-8, 10-12, 14, 15, 17, 18, 20, 21: --out paths, input fields,
check/render, SIGINT/TERM/USR1/HUP, --time, the Python API, hints, ONNX, plugins, unsealed
checkpoints), one function ``sN`` per item, each on copies of the probe's tiny runs A, B and C.
Run through the probe: ``python -m lab.tools.fault_probe --out FILE.json``."""
from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import time

from lab.tools.fault_probe_cases import RES, SITE, ck, damage, no_file, sets, write

NO_OUT = "--out "


# -- 6: --out onto a run's files or the command's inputs -------------------------------------------
def s6(p):
    x, cfg, user = p.copy("x6"), p.path("cfg6.toml"), p.path("user6")
    shutil.copy(p.path("tiny.toml"), cfg)
    link, f, g = (os.path.join(user, n) for n in ("ck.h5", "f.h5", "g.h5"))
    write(os.path.join(user, "params.txt"), "0.01\n0.02\n")
    os.symlink(ck(x, 8), link)
    shutil.copy(p.path("fields.h5"), f)
    os.link(f, g)
    w = [x, user, cfg]
    infer = lambda out: ["infer", x, "--samples", "2", "--out", out]  # noqa: E731
    j = lambda n: os.path.join(x, n)  # noqa: E731
    for name, out in (("config.toml", j("config.toml")), ("lock.json (absent)", j("lock.json")),
                      ("run_id", j("run_id")), ("eval.json", j("eval.json")),
                      ("an older checkpoint", ck(x, 4)),
                      ("checkpoints/../metrics.jsonl", j("checkpoints/../metrics.jsonl")),
                      ("a link to the checkpoint", link), ("the run directory", x)):
        p.case(f"infer --out {name}", infer(out), watch=w, says=NO_OUT)
    p.case("infer CKPT (relative) --out CKPT", ["infer", os.path.relpath(ck(x, 8), p.w),
           "--samples", "2", "--out", ck(x, 8)], watch=w)
    p.case("infer --inputs F --out F's hard link", ["infer", x, "--inputs", f, "--out", g],
           watch=w)
    for name, args in (("evaluate --out metrics.jsonl", ["evaluate", x, "--samples", "2",
                                                         "--out", j("metrics.jsonl")]),
                       ("evaluate --out lock.json", ["evaluate", x, "--samples", "2", "--out",
                                                     j("lock.json")]),
                       ("export --out a link to the checkpoint", ["export", x, "--format",
                                                                  "torchscript", "--out", link]),
                       ("jobs render --config C --out C", ["jobs", "render", *SITE, "--config",
                                                           cfg, "--out", cfg]),
                       ("jobs render --out metrics.jsonl", ["jobs", "render", *SITE, "--out",
                                                            j("metrics.jsonl")]),
                       ("solve --out a checkpoint", ["solve", "--problem", "burgers", "--params",
                                                     os.path.join(user, "params.txt"), "--out",
                                                     ck(x, 8)])):
        p.case(name, args, watch=w)


# -- 7: inconsistent or degenerate input fields (infer --inputs) -----------------------------------
def s7(p):
    import h5py
    import numpy as np

    A = p.path("A")

    def replace(h, a):
        attrs = dict(h["inputs"].attrs)
        del h["inputs"]
        h["inputs"] = a
        h["inputs"].attrs.update(attrs)

    def ramp(a):
        a = a.copy()
        a[:, 0] += 0.1 * np.arange(a.shape[-2])[:, None]
        return a
    edits = (("t scaled by 1.1", lambda a: a * np.array([1.0, 1.1])[None, :, None, None]),
             ("u0 changes along t", ramp), ("NaN in u0", lambda a: np.where(
                 np.arange(a.shape[1])[None, :, None, None] == 0, np.nan, a)),
             ("a third channel", lambda a: np.concatenate([a, a[:, :1]], 1)),
             ("no channel axis", lambda a: a[:, 0]), ("no samples", lambda a: a[:0]))
    for i, (name, edit) in enumerate(edits):
        f, out = p.path(f"in7_{i}.h5"), p.path(f"o7_{i}.h5")
        shutil.copy(p.path("fields.h5"), f)
        with h5py.File(f, "r+") as h:
            replace(h, edit(h["inputs"][()]))
        p.case(name, ["infer", A, "--inputs", f, "--out", out], watch=[A, f], check=no_file(out))
    text, out = p.path("in7_text.h5"), p.path("o7_t.h5")
    write(text, "not HDF5\n")
    for name, f in (("a text file", text), ("a missing file", p.path("nope.h5"))):
        p.case(name, ["infer", A, "--inputs", f, "--out", out], watch=[A], check=no_file(out))


# -- 8: check and jobs render on a run without a loadable checkpoint -------------------------------
def s8(p):
    cfg = p.path("tiny.toml")
    chk = lambda x, n="1": ["check", "--resume", x, "--ranks", n, "--no-probe"]  # noqa: E731

    def render(x, j):
        return ["jobs", "render", "--cluster", "local", "--ranks-per-node", "1", "--config",
                cfg, "--run-dir", x, "--out", j]
    x = p.copy("x8")
    for s in (4, 6, 8):
        damage(ck(x, s), "flip")
    y = p.copy("x8b")
    shutil.rmtree(os.path.join(y, "checkpoints"))
    z = p.copy("x8c")
    for s in (4, 6, 8):
        os.remove(ck(z, s))
    for name, run in (("every checkpoint bit-flipped", x), ("no checkpoints/", y),
                      ("an empty checkpoints/", z)):
        p.case(f"check: {name}", chk(run), watch=[run])
        if run is not z:
            job = p.path(f"j8_{len(name)}.sh")
            p.case(f"jobs render --run-dir: {name}", render(run, job), watch=[run],
                   check=no_file(job))
    p.case("check --resume of the intact run A", chk(p.path("A"), "2"), expect=(0,),
           watch=[p.path("A")])


# -- 10: signals to mpiexec or a rank --------------------------------------------------------------
def s10(p):
    for name, sig, target, kw in (("INT to mpiexec", signal.SIGINT, "mpiexec", {}),
                                  ("INT to rank 1", signal.SIGINT, "rank1", {}),
                                  ("INT to rank 0", signal.SIGINT, "rank0", {}),
                                  ("TERM to mpiexec", signal.SIGTERM, "mpiexec", {}),
                                  ("TERM to rank 1", signal.SIGTERM, "rank1", {}),
                                  ("USR1 to mpiexec", signal.SIGUSR1, "mpiexec", {}),
                                  ("INT twice to mpiexec", signal.SIGINT, "mpiexec",
                                   {"again": True}),
                                  ("INT to mpiexec before step 1", signal.SIGINT, "mpiexec",
                                   {"early": True})):
        p.signal_case(name, sig, target, **kw)


# -- 11: bad output paths --------------------------------------------------------------------------
def s11(p):
    x = p.copy("x11")
    os.makedirs(p.path("adir"))
    write(p.path("afile"), "mine")
    w = [x, p.path("adir"), p.path("afile")]
    nodir = no_file(p.path("nodir"))
    render = ["jobs", "render", *SITE, "--out"]
    for name, args in (("render --out nodir/j.sh", [*render, "nodir/j.sh"]),
                       ("render --out a directory", [*render, "adir"]),
                       ("render --out under a file", [*render, "afile/j.sh"]),
                       ("evaluate --out nodir/e.json", ["evaluate", x, "--samples", "2", "--out",
                                                        "nodir/e.json"]),
                       ("evaluate --out a directory", ["evaluate", x, "--samples", "2", "--out",
                                                       "adir"]),
                       ("infer --out nodir/p.h5", ["infer", x, "--samples", "2", "--out",
                                                   "nodir/p.h5"]),
                       ("infer --out ''", ["infer", x, "--samples", "2", "--out", ""]),
                       ("export --out nodir/m.pt", ["export", x, "--format", "torchscript",
                                                    "--out", "nodir/m.pt"])):
        p.case(name, args, watch=w, check=nodir)


# -- 12: jobs render --time ------------------------------------------------------------------------
def s12(p):
    job = p.path("j12.sh")
    for t in ("99:99", "0:60:00", "2-25:00:00", "", "2h"):
        p.case(f"--time {t!r}", ["jobs", "render", *SITE, "--time", t, "--out", job],
               check=no_file(job))
    for t in ("00:30", "7-00:00:00"):
        p.case(f"--time {t!r} (valid)", ["jobs", "render", *SITE, "--time", t, "--out", job],
               expect=(0,), check=lambda r, t=t: None if os.path.exists(job) and
               f"#SBATCH -t {t}" in open(job).read() else "no script with that time")


# -- 14 (and 7, 20): the Python API ----------------------------------------------------------------
API = r'''
import json, sys, warnings
import numpy as np, torch
import deepfusion
from deepfusion.engine.checkpoint.store import CheckpointError
run, other, broken, pt = sys.argv[1:5]
s = deepfusion.load(run)
x = s.inputs(s.sample(3))
bounds = np.asarray(s.param_bounds, dtype=float).reshape(-1, 2)
mid = bounds.mean(1)
far = mid.copy(); far[0] = bounds[0, 1] + 1000 * (bounds[0, 1] - bounds[0, 0])
class Mismatch(Exception): pass
def edit(f):
    y = x.copy(); f(y); return s.predict(y)
def t_up(y): y[:, 1] *= 1.1
def ramp(y): y[:, 0] += 0.1 * np.arange(y.shape[-2])[:, None]
def c(a): return np.ascontiguousarray(a)
def ts():
    extra = {"deepfusion.json": ""}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # torch.jit.load's own deprecation warning
        m = torch.jit.load(pt, _extra_files=extra)
    dt = json.loads(extra["deepfusion.json"]).get("dtype", "float64")
    y = m(torch.from_numpy(x.astype(dt))).detach().numpy().reshape(len(x), -1)
    u = s.predict(x).reshape(len(x), -1)
    d = np.abs(y - u).max() / max(np.abs(u).max(), 1e-30)
    if d > 1e-5:
        raise Mismatch(f"differs from predict by {d:.2e} of the answer's scale (docs: 1e-5)")
    return u
A, R, W = "answer", "refused", "warned"
CASES = [
 (14, "s.predict(x[:0])", {A}, lambda: s.predict(x[:0])),
 (14, "s.predict(x[:, 0])  # no channel axis", {R}, lambda: s.predict(x[:, 0])),
 (14, "s.predict(x[None])  # 5-D", {R}, lambda: s.predict(x[None])),
 (14, "s.predict(x.tolist())", {A, R}, lambda: s.predict(x.tolist())),
 (14, "s.predict(x.astype(np.int64))", {A, R, W}, lambda: s.predict(x.astype(np.int64))),
 (14, "s.predict(x.astype(np.float32))", {A}, lambda: s.predict(x.astype(np.float32))),
 (14, "s.predict(x[..., :8])  # 16x8", {A, R, W}, lambda: s.predict(c(x[..., :8]))),
 (14, "s.predict(x[:, ::-1])  # channels swapped", {R}, lambda: s.predict(c(x[:, ::-1]))),
 (7, "s.predict(x with t * 1.1)", {R}, lambda: edit(t_up)),
 (7, "s.predict(x with u0 + ramp along t)", {R}, lambda: edit(ramp)),
 (14, "s.predict(x with NaN in u0)", {R, W}, lambda: edit(lambda y: y.__setitem__((1, 0), np.nan))),
 (14, "s.predict(x with inf in u0)", {R, W}, lambda: edit(lambda y: y.__setitem__((1, 0), np.inf))),
 (14, "s.predict(params=[[nan, ...]])", {R}, lambda: s.predict(params=[mid * np.nan])),
 (14, "s.predict(params=np.zeros((0, P)))", {A, R},
  lambda: s.predict(params=np.zeros((0, len(mid))))),
 (14, "s.predict(params=[mid + 2 extra])", {R}, lambda: s.predict(params=[list(mid) + [0.0, 0.0]])),
 (14, "s.predict(params=[1000 ranges outside])", {R}, lambda: s.predict(params=[far])),
 (14, "s.predict()", {R}, lambda: s.predict()),
 (14, "s.predict(x, params=[mid])", {R}, lambda: s.predict(x, params=[mid])),
 (14, "s.predict(x, batch=np.int64(2))", {A, R}, lambda: s.predict(x, batch=np.int64(2))),
 (14, "s.predict(x, batch='2')", {R}, lambda: s.predict(x, batch="2")),
 (14, "s.predict(x, batch=10**9)", {A}, lambda: s.predict(x, batch=10 ** 9)),
 (14, "deepfusion.load(a missing path)", {R}, lambda: deepfusion.load(run + "_nope")),
 (14, "deepfusion.load(B's checkpoint file).predict(x)", {A},
  lambda: deepfusion.load(other).predict(x)),
 (14, "deepfusion.load(a run with no loadable checkpoint)", {R}, lambda: deepfusion.load(broken)),
 (20, "TorchScript file(x) against s.predict(x)", {A}, ts),
]
def classify(fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            out = fn()
        except Mismatch as e:
            return "mismatch", str(e)
        except (ValueError, TypeError, FileNotFoundError, CheckpointError) as e:
            return R, f"{type(e).__name__}: {e}"
        except Exception as e:
            return "unclear", f"{type(e).__name__}: {e}"
    a = np.asarray(out.detach() if torch.is_tensor(out) else out)
    note = "; ".join(str(m.message) for m in w)
    if a.size and not np.isfinite(a).all():
        return (W if w else "silent non-finite answer"), note
    return (W if w else A), note
for surface, name, want, fn in CASES:
    t = __import__("time").perf_counter()
    kind, detail = classify(fn)
    print("CASE " + json.dumps({"surface": surface, "name": name, "kind": kind,
          "want": sorted(want), "detail": detail[:400],
          "seconds": round(__import__("time").perf_counter() - t, 2)}), flush=True)
'''


def s14(p):
    broken, pt = p.copy("x14"), p.path("m.pt")
    for s in (4, 6, 8):
        damage(ck(broken, s), "empty")
    p.case("export --format torchscript (for item 20)", ["export", p.path("A"), "--format",
           "torchscript", "--out", pt], expect=(0,), keep=[p.path("A")])
    r = p.run(["-c", API, p.path("A"), ck(p.path("B"), 8), broken, pt], py=True, timeout=300)
    head = f"python: s = deepfusion.load('{p.short(p.path('A'))}'); x = s.inputs(s.sample(3)); "
    seen = 0
    for line in r["out"].splitlines():
        if not line.startswith("CASE "):
            continue
        c, seen = json.loads(line[5:]), seen + 1
        why = [] if c["kind"] in c["want"] else [f"{c['kind']} (wanted {'/'.join(c['want'])}): "
                                                  f"{c['detail']}"]
        p.surface, keep_surface = c["surface"], p.surface
        p.record(c["name"].split("  #")[0], head + c["name"], {
            "rc": 0, "hung": False, "out": "", "err": c["detail"] if why else "",
            "seconds": c["seconds"]}, why)
        p.surface = keep_surface
    if r["rc"] != 0 or r["hung"] or seen == 0:
        p.record("the API script itself", "python -c API ...", r, ["the script failed"])


# -- 15: hints naming a checkpoint -----------------------------------------------------------------
def s15(p):
    out, B = p.path("o15.h5"), p.path("B")
    infer = lambda c: ["infer", c, "--samples", "2", "--out", out]  # noqa: E731
    x = p.copy("x15a")
    damage(ck(x, 8), "flip")
    damage(ck(x, 6), "trunc")
    p.case("infer step 8 flipped, 6 cut", infer(ck(x, 8)), watch=[x],
           says=f"use an earlier one: {ck(x, 4)}")
    y = p.copy("x15b")
    damage(ck(y, 8), "flip")
    p.case("infer step 8 flipped", infer(ck(y, 8)), watch=[y],
           says=f"use an earlier one: {ck(y, 6)}")
    z = p.copy("x15c")
    for s in (4, 6, 8):
        damage(ck(z, s), "flip")
    p.case("infer step 8, all flipped", infer(ck(z, 8)), watch=[z],
           says="no other checkpoint in")
    p.case("evaluate RUN, newest flipped", ["evaluate", y, "--samples", "2", "--out",
           p.path("e15.json")], expect=(0,), says="skipped")
    v = p.copy("x15d")
    damage(ck(v, 8), "flip")
    shutil.copy(ck(B, 6), ck(v, 6))
    theirs = lambda r: ("used another run's step 6 without saying it is another run's"  # noqa: E731
                        if "step_00000006" in r["out"] + r["err"] and "another run"
                        not in r["err"] else None)
    p.case("infer RUN: 8 flipped, 6 is B's", infer(v), expect=(0, 2), check=theirs)
    p.case("resume: 8 flipped, 6 is B's, 4 own", ["train", "--resume", v, *RES], expect=(0, 2),
           check=lambda r: "resumed from B's step 6" if f"resumed from {ck(v, 6)}"
           in r["out"] + r["err"] else None)


# -- 17: the ONNX refusal --------------------------------------------------------------------------
def s17(p):
    out = p.path("m.onnx")

    def quick(r):
        n = len(r["err"].strip().splitlines())
        return ("the file was written" if os.path.exists(out) else None) or \
            (f"{n} lines on stderr" if n > 3 else None) or \
            (f"took {r['seconds']} s" if r["seconds"] > 30 else None)
    p.case("export --format onnx", ["export", p.path("A"), "--format", "onnx", "--out", out],
           expect=(0, 2), watch=[p.path("A")], check=quick)


# -- 18: a plugin whose channels changed after training --------------------------------------------
PLUGIN = 'from examples.heat import Heat\n\n\nclass ProbeHeat(Heat):\n    name = "probe_heat"\n'


def s18(p):
    mod, run = p.path("plug", "probeheat.py"), p.path("heat")
    write(mod, PLUGIN)
    r = p.run(["train", p.path("tiny.toml"), *sets('problem.name="probeheat:ProbeHeat"',
                                                   "train.max_steps=2", f"run.dir={run}")])
    if r["rc"] != 0:
        p.record("training the plugin run", "deepfusion train (plugin)", r, ["it failed"])
        return
    args = ["infer", run, "--samples", "2", "--out", p.path("o18.h5")]
    grid = lambda r: "blames the grid" if "--grid" in r["err"] or "--work-grid" in r["err"] \
        else None  # noqa: E731
    for name, text, says in (("input channels grew to 2", PLUGIN + '    input_channels = '
                              '("f", "g")\n', "its code changed"),
                             ("the plugin class renamed", PLUGIN.replace("ProbeHeat", "Other"),
                              None), ("the plugin module removed", None, None)):
        shutil.rmtree(p.path("plug", "__pycache__"), ignore_errors=True)
        if text is None:
            os.remove(mod)
        else:
            write(mod, text)
        p.case(name, args, watch=[run], says=says, check=grid)


# -- 20: SIGHUP (TorchScript against predict is in s14) --------------------------------------------
def s20(p):
    def resumes(run, r):
        time.sleep(2)                     # the ranks end after mpiexec
        n = max(p.logged(run) or [0])
        q = p.run(["train", "--resume", run, *sets(f"train.max_steps={n + 2}")])
        why = [] if q["rc"] == 0 else [f"the resume after it exited {q['rc']}: "
                                       f"{(q['err'].strip().splitlines() or [''])[-1][:200]}"]
        return why + (["traceback in the resume"] if "Traceback" in q["err"] else [])
    p.signal_case("HUP to mpiexec, then resume", signal.SIGHUP, "mpiexec", after=resumes,
                  every=2)
    p.signal_case("HUP to rank 0", signal.SIGHUP, "rank0")
    p.signal_case("HUP to deepfusion launch", signal.SIGHUP, "launch", launcher=True)
    p.signal_case("INT to deepfusion launch", signal.SIGINT, "launch", launcher=True)


# -- 21: an unsealed checkpoint's contained check --------------------------------------------------
VLEN_STRING = bytes([0x19, 0x01, 0x01, 0x00, 0x10, 0x00, 0x00, 0x00])


def crash_bit(path: str) -> int:
    """Bit 1 of the first variable-length string type's class byte (lab/tests/
    test_hdf5_killer_bits.py: HDF5 segfaults parsing it)."""
    return (open(path, "rb").read().index(VLEN_STRING) + 1) * 8 + 1


def loop_bit(path: str) -> int:
    """The bit adding 2**62 to the first stored list's ``__len__`` (a reader loops)."""
    data = open(path, "rb").read()
    name = data.index(b"__len__\x00")
    _, _, n_name, n_type, n_space = struct.unpack_from("<BBHHH", data, name - 8)
    return (name + sum(-(-n // 8) * 8 for n in (n_name, n_type, n_space))) * 8 + 62


def s21(p):
    from tests.faults.files import flip_bit, make_unsealed

    fast = lambda r: f"took {r['seconds']} s" if r["seconds"] > 60 else None  # noqa: E731
    for name, bit in (("unsealed, intact", None), ("unsealed, a crash bit", crash_bit),
                      ("unsealed, a loop bit", loop_bit)):
        x = p.copy(f"x21_{len(name)}")
        make_unsealed(ck(x, 8), version=2)
        if bit:
            flip_bit(ck(x, 8), bit(ck(x, 8)))
        p.case(f"infer RUN, {name}", ["infer", x, "--samples", "2", "--out",
               p.path(f"o21_{len(name)}.h5")], expect=(0,), check=fast,
               says=None if bit is None else "skipped")
        if bit is loop_bit:
            p.case(f"resume, {name}", ["train", "--resume", x, *RES], expect=(0,),
                   check=fast, says=f"resumed from {ck(x, 6)}")
