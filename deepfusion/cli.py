"""``deepfusion`` command line: train, demo, config (and the subcommands other modules add).

Error policy (every rank, never a hang):
  * input errors (config, problem/generator options, run directory) are found before the first
    training collective; ranks exchange their status and all exit with code 2 and one message;
  * decisions made on all-reduced values (non-finite loss, diverged parameters, stop signal)
    end all ranks together with their own exit code;
  * anything else raised on one rank prints that rank's message and calls MPI Abort, which
    ends every rank of the job promptly.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import traceback

EXIT_INPUT, EXIT_NONFINITE, EXIT_ABORT = 2, 3, 1


class InputError(Exception):
    """A user-input problem found on some rank before training; exit 2 everywhere."""


def _collective_check(comm, fn, *args):
    """Run ``fn`` on every rank; if any rank fails, every rank raises InputError with the first
    failing rank's message. Every rank reaches the exchange, so nobody waits forever."""
    try:
        out, err = fn(*args), None
    except (ValueError, KeyError, TypeError, OSError) as e:
        out, err = None, f"{e}"
    errors = comm.allgather_obj(err)
    bad = [(r, m) for r, m in enumerate(errors) if m is not None]
    if bad:
        r, msg = bad[0]
        raise InputError(msg if comm.size == 1 else f"(rank {r}) {msg}")
    return out


def _load(args):
    from .config import load_config

    return load_config(args.config, args.set or [])


def _build(cfg, rank: int):
    """Problem and generator from the config, via diffnet's registries (no PDE named here)."""
    import torch
    from diffnet.generators import build_generator
    from diffnet.problems import get_problem

    task = get_problem(cfg.problem.name, grid=tuple(cfg.problem.grid), **cfg.problem.options)
    torch.manual_seed(cfg.train.init_seed)
    model_kwargs = {"in_channels": len(task.input_channels), **cfg.model.options}
    model = build_generator(cfg.model.name, **model_kwargs)
    dtype = torch.float64 if cfg.train.dtype == "float64" else torch.float32
    model = model.to(dtype)
    if cfg.model.init_from:
        _init_from(model, cfg.model.name, cfg.model.init_from)
    if cfg.model.channels_last:
        model = model.to(memory_format=torch.channels_last)
    specs = {"model": {"name": cfg.model.name, "kwargs": model.config() if hasattr(model, "config")
                       else model_kwargs},
             "problem": {"name": task.name, "kwargs": task.config()}}
    return task, model, specs


def _init_from(model, name: str, path: str) -> None:
    """Copy the generator weights of checkpoint ``path`` into ``model`` (model.init_from)."""
    from .checkpoint import load_checkpoint

    state = load_checkpoint(path)
    spec = state["meta"].get("model") or {}
    ours = model.config() if hasattr(model, "config") else None
    theirs = spec.get("kwargs")

    def arch(kwargs):  # checkpoint_levels changes memory, not the weights
        return {k: v for k, v in kwargs.items() if k != "checkpoint_levels"}

    if spec.get("name") != name or (ours is not None and theirs is not None
                                    and arch(theirs) != arch(ours)):
        raise ValueError(f"model.init_from = {path!r} holds generator {spec.get('name')!r} "
                         f"{theirs}, but this run builds {name!r} {ours}; set [model] name and "
                         f"options to match it, or start from scratch with model.init_from = \"\"")
    dtype = next(model.parameters()).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state["model_state"].items()})


def _prepare_run_dir(cfg, resume: bool, overwrite: bool, rank: int):
    d = cfg.run.dir
    if rank != 0:
        return
    exists = os.path.exists(os.path.join(d, "metrics.jsonl")) or os.path.isdir(os.path.join(d, "checkpoints"))
    if exists and not resume and not overwrite:
        raise ValueError(f"run directory {d!r} already holds a run. Continue it with --resume {d}, "
                         f"start over with --overwrite, or choose another with --set run.dir=PATH")
    if resume and not exists:
        raise ValueError(f"--resume {d}: no run there (no metrics.jsonl or checkpoints/)")
    if overwrite and exists and not resume:
        shutil.rmtree(d)
    os.makedirs(os.path.join(d, "checkpoints"), exist_ok=True)
    from .config import dump_toml

    with open(os.path.join(d, "config.toml"), "w") as f:
        f.write(dump_toml(cfg))


def cmd_train(args, comm) -> int:
    from .layout import report, setup_threads

    if args.resume:
        if args.config is None:  # requeued jobs: the run directory holds its resolved config
            args.config = os.path.join(args.resume, "config.toml")
        args.set = list(args.set or []) + [f"run.dir={args.resume}"]
    cfg = _collective_check(comm, _load, args)
    _compile_cache_env(cfg)  # before torch is imported
    layout, _node = setup_threads(comm, cfg.parallel.threads_per_rank)  # before any torch op
    layouts = comm.gather_obj(layout)
    if layouts is not None:  # rank 0 prints the layout
        text, warns = report(layouts, comm.library_version())
        print(text, flush=True)
        for w in warns:
            print(f"warning: {w}", file=sys.stderr, flush=True)
    task, model, specs = _collective_check(comm, _build, cfg, comm.rank)
    _collective_check(comm, _prepare_run_dir, cfg, bool(args.resume), args.overwrite, comm.rank)
    _collective_check(comm, _check_batch, cfg, comm.size)
    _collective_check(comm, _check_precision, cfg.train.precision)

    from .evaluate import evaluate, write_report
    from .trainer import Trainer

    trainer = Trainer(cfg, comm, task, model, specs=specs)
    trainer.fit(resume=bool(args.resume))
    if cfg.data.eval_samples > 0:
        summary = evaluate(model, task, comm, n=cfg.data.eval_samples, seed=cfg.data.eval_seed,
                           dtype=trainer.dtype, channels_last=cfg.model.channels_last)
        if summary is not None:
            axes = tuple(a.name for a in task.axes)
            extent = (task.axes[1].lo, task.axes[1].hi, task.axes[0].lo, task.axes[0].hi)
            write_report(summary, cfg.run.dir, axes=axes, extent=extent)
            print(f"held-out relative L2 over {summary['n']} samples: mean {summary['rel_l2_mean']:.4f} "
                  f"median {summary['rel_l2_median']:.4f} worst {summary['rel_l2_max']:.4f} "
                  f"-> {os.path.join(cfg.run.dir, 'eval.json')}", flush=True)
    return 0


def _compile_cache_env(cfg):
    """TorchInductor's kernel cache: train.compile_cache if set, else a TORCHINDUCTOR_CACHE_DIR
    the user exported, else RUN_DIR/compile_cache (so a requeued job does not compile again).
    Before torch is imported: inductor reads the variable once."""
    if not cfg.train.compile:
        return
    if cfg.train.compile_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cfg.train.compile_cache)
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR",
                              os.path.abspath(os.path.join(cfg.run.dir, "compile_cache")))


def _check_batch(cfg, size):
    from .data import check_divisible

    check_divisible(cfg.data.global_batch, size)


def _check_precision(precision: str):
    """bf16 only where the CPU has the instructions (refused with the reason otherwise)."""
    if precision != "fp32":
        from .layout import check_precision

        check_precision(precision)


def cmd_demo(args) -> int:
    """Burgers 64x64 on mpiexec -n NP, one thread per rank, then held-out evaluation."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = os.path.join(root, "configs", "demo.toml")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "-n", str(args.np), sys.executable, "-m", "deepfusion.cli", "train", config,
           "--set", "parallel.threads_per_rank=1", "--set", f"run.dir={args.run_dir}", "--overwrite"]
    cmd += sum((["--set", s] for s in (args.set or [])), [])
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def cmd_config(args) -> int:
    from .config import describe, dump_toml, load_config

    if args.config:
        print(dump_toml(load_config(args.config, args.set or [])))
    else:
        print(describe())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deepfusion", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a DiffNet generator (any number of MPI ranks)")
    t.add_argument("config", nargs="?", default=None, help="TOML config (defaults if omitted)")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config key")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in run.dir")
    d = sub.add_parser("demo", help="the demo: Burgers 64x64 on mpiexec -n 2")
    d.add_argument("--np", type=int, default=2)
    d.add_argument("--run-dir", default="runs/demo")
    d.add_argument("--set", action="append", metavar="KEY=VALUE")
    c = sub.add_parser("config", help="list config keys, or print a resolved config")
    c.add_argument("config", nargs="?")
    c.add_argument("--set", action="append", metavar="KEY=VALUE")
    for register in _extensions():
        register(sub)
    return p


def _extensions():
    """Subcommands living in their own modules (infer/solve/compare, jobs)."""
    out = []
    for mod in ("deepfusion.inference_cli", "jobs.cli"):
        try:
            out.append(__import__(mod, fromlist=["register"]).register)
        except ImportError:
            pass
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "demo":
        return cmd_demo(args)
    if args.cmd == "config":
        return _run_local(cmd_config, args)
    if hasattr(args, "run"):
        return args.run(args)
    from .comm import world

    comm = world()
    return run_guarded(cmd_train, args, comm)


def _run_local(fn, args) -> int:
    try:
        return fn(args)
    except (ValueError, OSError) as e:
        print(f"deepfusion: error: {e}", file=sys.stderr)
        return EXIT_INPUT


def run_guarded(fn, args, comm) -> int:
    """Run a distributed command with the error policy in the module docstring."""
    from .trainer import NonFiniteLoss, ParametersDiverged, Preempted, PREEMPTED_EXIT

    try:
        return fn(args, comm)
    except InputError as e:
        if comm.rank == 0:
            print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return EXIT_INPUT
    except Preempted as e:
        if comm.rank == 0:
            print(f"deepfusion: {e}", file=sys.stderr, flush=True)
        return PREEMPTED_EXIT
    except (NonFiniteLoss, ParametersDiverged) as e:
        if comm.rank == 0:
            print(f"deepfusion: error: {e}", file=sys.stderr, flush=True)
        return EXIT_NONFINITE
    except BaseException as e:  # noqa: BLE001 - any other failure must end every rank
        if isinstance(e, SystemExit) and not e.code:
            raise
        print(f"deepfusion: error on rank {comm.rank}: {type(e).__name__}: {e}", file=sys.stderr)
        traceback.print_exc()
        if comm.size > 1:
            comm.abort(EXIT_ABORT)
        return EXIT_ABORT


if __name__ == "__main__":
    sys.exit(main())
