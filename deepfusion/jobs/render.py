"""Render batch/job scripts for DiffNet training on CPU clusters.

    deepfusion jobs render --cluster stampede2 --nodes 4 [--ranks-per-node 8] [--threads-per-rank 6]
                           [--layout-from runs/sweep/sweep.json]     # the fastest measured layout
                           [--time 02:00:00] [--config configs/demo.toml] [--out job.sh]
                           [--profiles my_clusters.toml] [--allow-smt]

Cluster profiles live in deepfusion/jobs/clusters.toml (see the comments there; their fields and checks:
deepfusion/jobs/profiles.py); ``--profiles FILE`` merges a user file over them. One template per launcher
is in deepfusion/jobs/templates/<launcher>.sh.in (string.Template with the delimiter ``@@`` so bash's own
``$VAR`` needs no escaping). ``main`` checks the job before it writes it (deepfusion/jobs/precheck.py:
placeholders left in the profile, and the start-up of ``deepfusion train`` on the job's ranks);
``render`` itself only writes the text.

Public API (also used by deepfusion.jobs.sweep and deepfusion.jobs.sweep_sbatch):
    load_profiles(extra=None) -> {name: profile}
    get_profile(name, profiles=None) -> profile
    check_layout(profile, nodes, ranks_per_node, threads_per_rank, allow_smt=False)
    launch_argv(profile, nodes, ranks_per_node, threads_per_rank, allow_smt=False) -> [str]
    render(cluster, nodes, ranks_per_node=None, threads_per_rank=None, ...) -> str
    main(argv=None) -> int
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import string
import sys
from pathlib import Path

from deepfusion.app.checks import check_output
from deepfusion.jobs.precheck import absolute, check_job, default_setup, refuse_placeholders, with_site
from deepfusion.jobs.profiles import get_profile, load_profiles, profile_names

__all__ = ["check_layout", "get_profile", "launch_argv", "load_profiles", "main", "render"]

HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
DEFAULT_CONFIG = "configs/demo.toml"  # what `deepfusion demo` trains

# ------------------------------------------------------------------------------------ layout
def check_layout(prof: dict, nodes: int, ranks_per_node: int, threads_per_rank: int,
                 allow_smt: bool = False) -> None:
    """Raise ValueError when the layout does not fit the node."""
    name = prof.get("name", "?")
    for what, v in (("nodes", nodes), ("ranks per node", ranks_per_node), ("threads per rank", threads_per_rank)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{what} must be a positive integer, got {v!r}")
    if prof.get("max_nodes") and nodes > prof["max_nodes"]:
        raise ValueError(f"cluster '{name}' has at most {prof['max_nodes']} node(s), asked for {nodes}")
    used = ranks_per_node * threads_per_rank
    cores = prof["cores_per_node"]
    hw = prof.get("hw_threads_per_core", 1)
    if used > cores:
        if allow_smt and hw > 1 and used <= cores * hw:
            return
        hint = (f"; with --allow-smt up to {cores * hw} hardware threads may be used" if hw > 1 and not allow_smt
                else "")
        raise ValueError(
            f"oversubscribed: {ranks_per_node} ranks/node x {threads_per_rank} threads/rank = {used} "
            f"threads > {cores if not allow_smt else cores * hw} "
            f"{'cores' if not allow_smt else 'hardware threads'} per node on cluster '{name}'{hint}")


def _smt(prof: dict, ranks_per_node: int, threads_per_rank: int, allow_smt: bool) -> bool:
    """True when the layout needs more than one thread per physical core."""
    return bool(allow_smt and ranks_per_node * threads_per_rank > prof["cores_per_node"])


def _cpus_per_task(prof: dict, threads: int, smt: bool) -> int:
    # Slurm counts hardware threads as CPUs: reserve whole cores unless SMT is used on purpose.
    return threads if smt else threads * prof.get("hw_threads_per_core", 1)


def launch_argv(prof: dict, nodes: int, ranks_per_node: int, threads_per_rank: int,
                allow_smt: bool = False) -> list[str]:
    """The launcher prefix (before ``deepfusion train ...``) with rank/thread binding."""
    smt = _smt(prof, ranks_per_node, threads_per_rank, allow_smt)
    np_ = nodes * ranks_per_node
    t = threads_per_rank
    launcher = prof["launcher"]
    if launcher == "srun":
        return ["srun", f"--nodes={nodes}", f"--ntasks={np_}", f"--ntasks-per-node={ranks_per_node}",
                f"--cpus-per-task={_cpus_per_task(prof, t, smt)}",
                f"--cpu-bind={'threads' if smt else 'cores'}", "--kill-on-bad-exit=1"] + \
            ([f"--mpi={prof['srun_mpi']}"] if prof.get("srun_mpi") else [])
    if launcher == "mpirun":
        rpp, unit = _ranks_per_package(prof, ranks_per_node)
        argv = ["mpirun", "-np", str(np_), "--map-by", f"ppr:{rpp}:{unit}:PE={t}",
                "--bind-to", "hwthread" if smt else "core", "--report-bindings"]
        if smt:
            argv.append("--use-hwthread-cpus")
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES"):
            argv += ["-x", var]
        return argv
    if launcher == "mpiexec":
        argv = ["mpiexec", "-n", str(np_), "-ppn", str(ranks_per_node)]
        if prof.get("mpi_impl") != "intel":  # MPICH Hydra; Intel MPI pins via I_MPI_PIN_DOMAIN=omp
            argv += ["-bind-to", f"{'hwthread' if smt else 'core'}:{t}"]
        return argv
    if launcher == "ibrun":
        return ["ibrun"]
    raise ValueError(f"unknown launcher {launcher!r}")


def _ranks_per_package(prof: dict, ranks_per_node: int) -> tuple[int, str]:
    sockets = prof["sockets"]
    if ranks_per_node % sockets == 0:
        return ranks_per_node // sockets, "package"
    return ranks_per_node, "node"


# ------------------------------------------------------------------------------------ render
class _Tpl(string.Template):
    delimiter = "@@"


def _template(name: str) -> _Tpl:
    return _Tpl((TEMPLATES / name).read_text())


# Slurm's time limits (sbatch --time): MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
_TIME_RE = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d{1,2})(?::(?P<dm>\d{2})(?::(?P<ds>\d{2}))?)?"
                      r"|(?P<a>\d+)(?::(?P<b>\d{2})(?::(?P<c>\d{2}))?)?)$")
TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 02:00:00, 1-12:00:00, 90)"


def check_time(time: str) -> None:
    """ValueError unless ``time`` is a time limit Slurm accepts, naming the forms: minutes and
    seconds after another field below 60, hours below 24 after days (Slurm would otherwise
    refuse the script at submission, or read a limit other than the one meant)."""
    m = _TIME_RE.match(str(time))
    if m:
        g = {k: int(v) for k, v in m.groupdict().items() if v is not None}
        if "d" in g:
            below = [(g["dh"], 24)] + [(g[k], 60) for k in ("dm", "ds") if k in g]
        else:  # the last two fields of a:b:c or a:b are minutes/seconds below 60
            below = [(g[k], 60) for k in (("b", "c") if "c" in g else ("b",)) if k in g]
        if all(v < limit for v, limit in below):
            return
    raise ValueError(f"--time {time!r} is not a Slurm time limit: use {TIME_FORMS}, with "
                     f"minutes and seconds below 60 and hours below 24 after days")


def render(cluster: str, nodes: int, ranks_per_node: int | None = None, threads_per_rank: int | None = None,
           time: str = "02:00:00", config: str = DEFAULT_CONFIG, run_dir: str | None = None,
           job_name: str = "deepfusion", profiles: str | os.PathLike | dict | None = None,
           allow_smt: bool = False, deepfusion: str = "deepfusion", extra_sets: tuple[str, ...] = ()) -> str:
    """Return the job script text for ``cluster``. Raises ValueError for a bad cluster/layout/profile."""
    profs = profiles if isinstance(profiles, dict) else load_profiles(profiles)
    prof = get_profile(cluster, profs)
    r = prof["ranks_per_node"] if ranks_per_node is None else ranks_per_node
    t = prof["threads_per_rank"] if threads_per_rank is None else threads_per_rank
    check_layout(prof, nodes, r, t, allow_smt)
    check_time(time)
    smt = _smt(prof, r, t, allow_smt)
    launcher = prof["launcher"]
    run_dir = absolute(run_dir or default_run_dir(job_name))
    setup = default_setup() if prof.get("setup") is None else prof["setup"]
    for kv in extra_sets:
        if "=" not in kv:
            raise ValueError(f"--set expects key=value, got {kv!r}")

    if launcher == "ibrun":
        # ibrun is a shell wrapper that may not forward signals: signal the job steps through Slurm
        forward = ('{ [ -n "${SLURM_JOB_ID:-}" ] && scancel --signal="$1" "$SLURM_JOB_ID" 2>/dev/null; } || '
                   'kill -s "$1" "$STEP_PID" 2>/dev/null || true')
    else:
        forward = 'kill -s "$1" "$STEP_PID" 2>/dev/null || true'
    rpp, unit = _ranks_per_package(prof, r)
    values = dict(
        cluster=cluster, description=prof.get("description", ""), job_name=job_name, nodes=nodes,
        ranks_per_node=r, threads_per_rank=t, total_ranks=nodes * r, used_cores=r * t,
        cores_per_node=prof["cores_per_node"], cpus_per_task=_cpus_per_task(prof, t, smt),
        smt_note=" (SMT: several threads per physical core)" if smt else "",
        time=time, omp_places="threads" if smt else "cores",
        ntasks_line=f"#SBATCH -n {nodes * r}\n" if launcher == "ibrun" else "",
        partition_line=f"#SBATCH -p {prof['partition']}\n" if prof["partition"] else "",
        account_line=f"#SBATCH -A {prof['account']}\n" if prof["account"] else "",
        module_lines="".join(line + "\n" for line in prof["modules"] + setup),
        mpi_impl=prof.get("mpi_impl", "any"), ranks_per_package=rpp, ppr_unit=unit,
        pin_cell="unit" if smt else "core",
    )
    values["header"] = _template("_header.sh.in").substitute(values)
    if launcher == "mpiexec":
        if prof.get("mpi_impl") == "intel":
            values["mpiexec_env"] = ("# Intel MPI: one pinning domain of OMP_NUM_THREADS cores per rank.\n"
                                     "export I_MPI_PIN=1\nexport I_MPI_PIN_DOMAIN=omp\n"
                                     f"export I_MPI_PIN_CELL={values['pin_cell']}\n")
        else:
            values["mpiexec_env"] = (f"# MPICH Hydra: -bind-to core:{t} binds each rank to {t} cores, "
                                     "-ppn places ranks per node.\n")
    values["train_block"] = _template("_train_requeue.sh.in").substitute(
        values, config=absolute(config), run_dir=run_dir, forward_cmd=forward, deepfusion=deepfusion,
        launch=" ".join(shlex.quote(a) for a in launch_argv(prof, nodes, r, t, allow_smt)),
        extra_sets="".join(f" --set {shlex.quote(kv)}" for kv in extra_sets))
    return _template(f"{launcher}.sh.in").substitute(values)


def cluster_help(what: str) -> str:
    """Help text of a --cluster flag: ``what`` it does, then the profiles to choose from."""
    return (f"{what}: a profile of deepfusion/jobs/clusters.toml ({', '.join(profile_names())}) or of "
            f"the --profiles file; an unknown name lists the valid ones")


def build_parser(prog: str = "deepfusion jobs render") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", required=True, help=cluster_help("the cluster to render for"))
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="MPI ranks per node (default: the profile's ranks_per_node)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="threads per rank (default: the profile's threads_per_rank)")
    p.add_argument("--layout-from", metavar="SWEEP_JSON", default=None,
                   help="ranks and threads per node from the fastest one-node layout of a "
                        "strong-scaling sweep (deepfusion jobs sweep) measured on such a node")
    p.add_argument("--time", default="02:00:00", help="time limit as Slurm takes it: HH:MM:SS, D-HH:MM:SS or MM (also MM:SS, "
                        "D-HH, D-HH:MM); default 02:00:00")
    p.add_argument("--config", default=DEFAULT_CONFIG,
                   help=f"training config passed to deepfusion train (default {DEFAULT_CONFIG}, "
                        f"the one 'deepfusion demo' trains)")
    p.add_argument("--run-dir", default=None, help="default runs/JOBNAME-$SLURM_JOB_ID (stable across requeues)")
    p.add_argument("--job-name", default="deepfusion",
                   help="the batch job's name (default deepfusion)")
    p.add_argument("--set", dest="extra_sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra --set passed to deepfusion train (repeatable)")
    p.add_argument("--deepfusion", default="deepfusion", help="training command (default: deepfusion)")
    p.add_argument("--allow-smt", action="store_true",
                   help="allow ranks x threads up to cores x hw_threads_per_core (hyper-threads)")
    p.add_argument("--out", default=None, help="write the script here (default: stdout)")
    p.add_argument("--profiles", default=None, help="extra TOML profile file merged over deepfusion/jobs/clusters.toml")
    p.add_argument("--partition", default=None, metavar="NAME",
                   help="the Slurm partition (#SBATCH -p), over the profile's; \"\" leaves it out")
    p.add_argument("--account", default=None, metavar="NAME",
                   help="the Slurm account (#SBATCH -A), over the profile's; \"\" leaves it out")
    p.add_argument("--no-check", action="store_true",
                   help="write the script without checking the config against the job's ranks "
                        "(a config only the compute nodes can read)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_time(args.time)
        if args.out:  # before the config is checked (it may run a probe)
            check_output(args.out, flag="--out",
                         inputs=(args.config, args.profiles, args.layout_from))
        profs = load_profiles(args.profiles)
        prof = get_profile(args.cluster, profs)
        profs[args.cluster] = prof = with_site(prof, args.partition, args.account)
        refuse_placeholders(prof)
        if args.layout_from:
            args.ranks_per_node, args.threads_per_rank = _measured_layout(args)
        r = prof["ranks_per_node"] if args.ranks_per_node is None else args.ranks_per_node
        t = prof["threads_per_rank"] if args.threads_per_rank is None else args.threads_per_rank
        run_dir = absolute(args.run_dir or default_run_dir(args.job_name))
        text = render(args.cluster, args.nodes, r, t, time=args.time, config=args.config,
                      run_dir=run_dir, job_name=args.job_name, profiles=profs,
                      allow_smt=args.allow_smt, deepfusion=args.deepfusion,
                      extra_sets=tuple(args.extra_sets))
        warns = [] if args.no_check else check_job(
            args.config, args.extra_sets, args.nodes, r, t, run_dir)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for w in warns:
        print(f"warning: {w}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        os.chmod(args.out, 0o755)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def default_run_dir(job_name: str) -> str:
    """RUN_DIR unless --run-dir: one per job, the same across its requeues."""
    return f"runs/{job_name}-${{SLURM_JOB_ID:-local}}"


def _measured_layout(args) -> tuple[int, int]:
    """--layout-from: the sweep's fastest layout, said on stderr (with a warning if the sweep
    ran on another kind of host than the profile's nodes)."""
    from deepfusion.jobs.pick import fastest_layout, host_note, load_sweep

    if args.ranks_per_node is not None or args.threads_per_rank is not None:
        raise ValueError("--layout-from takes ranks and threads from the sweep: drop "
                         "--ranks-per-node / --threads-per-rank, or drop --layout-from")
    doc = load_sweep(args.layout_from)
    r, t, line = fastest_layout(doc, args.layout_from)
    print(line, file=sys.stderr)
    cores = get_profile(args.cluster, load_profiles(args.profiles))["cores_per_node"]
    note = host_note(doc, args.layout_from, cores)
    if note:
        print(f"warning: {note}", file=sys.stderr)
    return r, t


if __name__ == "__main__":
    sys.exit(main())
