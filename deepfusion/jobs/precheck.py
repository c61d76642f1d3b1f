"""What ``jobs render`` and ``jobs sweep`` check before a job is written or submitted, and the
site settings a rendered script carries.

* :func:`check_job`: the job's ``deepfusion train`` start-up, checked here for its ranks
  (nodes x ranks per node) with ``deepfusion check``'s in-process checks
  (:func:`deepfusion.app.checks.check_launch`, no probe): a missing config, an unknown key,
  a grid the network refuses or a batch the ranks do not divide is refused with the message
  ``train`` would print after the queue wait. What depends on the compute nodes (their CPU)
  is left to the job; a literal run directory is judged as the script will start on it (one
  it would resume needs a checkpoint that loads).
* :func:`refuse_placeholders`: a profile field still holding a ``YOUR_...`` placeholder.
* :func:`default_setup`: the lines that activate the environment ``jobs render`` runs from.
* :func:`absolute`: CONFIG and RUN_DIR as absolute paths (``sbatch`` may run elsewhere).
"""
from __future__ import annotations

import os
import re
import shlex
import sys

from deepfusion.app import checks
from deepfusion.engine.errors import InputError

PLACEHOLDER = re.compile(r"\bYOUR_[A-Z0-9_]+\b")
FIXES = {
    "partition": ("--partition NAME (sinfo -s lists your site's partitions)",
                  '"" leaves the #SBATCH -p line out: the default partition'),
    "account": ("--account NAME (your allocation or project; sacctmgr show assoc user=$USER "
                "lists yours)", '"" leaves the #SBATCH -A line out, where none is needed'),
}


def with_site(prof: dict, partition: str | None = None, account: str | None = None) -> dict:
    """The profile with the ``--partition`` / ``--account`` flags over its fields."""
    out = dict(prof)
    for key, value in (("partition", partition), ("account", account)):
        if value is not None:
            out[key] = value
    return out


def refuse_placeholders(prof: dict) -> None:
    """ValueError naming the first field that still holds a ``YOUR_...`` placeholder, and how
    to set it (a flag, or a ``--profiles`` file)."""
    name = prof.get("name", "?")
    for field in ("partition", "account", "modules", "setup"):
        value = prof.get(field)
        text = " ".join(value) if isinstance(value, list) else str(value or "")
        found = PLACEHOLDER.search(text)
        if not found:
            continue
        flag, empty = FIXES.get(field, ("", ""))
        how = f"give {flag}, or " if flag else ""
        raise ValueError(
            f"cluster profile '{name}': field '{field}' is still the placeholder "
            f"{found.group(0)!r}: {how}set {field} = ... under [{name}] in a file passed with "
            f"--profiles FILE{f' ({field} = {empty})' if empty else ''}")


def default_setup() -> list[str]:
    """The environment this renderer runs from: its virtual environment's activate script, or
    else its Python's bin directory first on the PATH."""
    activate = os.path.join(sys.prefix, "bin", "activate")
    if sys.prefix != sys.base_prefix and os.path.exists(activate):
        return [f"source {shlex.quote(activate)}"]
    return [f'export PATH={shlex.quote(os.path.dirname(sys.executable))}:"$PATH"']


def absolute(path: str) -> str:
    """``path`` from the current directory, unless it is absolute or starts with a shell
    variable or ``~`` (left to the job's shell)."""
    if path.startswith(("/", "$", "~")):
        return path
    joined = os.path.join(os.getcwd(), path)
    return joined if "$" in path else os.path.normpath(joined)


def check_job(config: str, sets, nodes: int, ranks_per_node: int, threads_per_rank: int,
              run_dir: str | None) -> list[str]:
    """ValueError with ``train``'s message if the job's start-up would be refused; else the
    warnings to show (a level at its data-parallel limit, a live job on the run directory).
    ``sets`` are the job's ``--set`` items; ``run_dir`` its RUN_DIR (None: one the caller
    prepares itself, not looked at; one with a shell variable is known only in the job)."""
    size = nodes * ranks_per_node
    literal = run_dir is not None and "$" not in run_dir
    sets = [f"parallel.threads_per_rank={threads_per_rank}",  # in the script's order
            *([f"run.dir={run_dir}"] if literal else []), *sets]
    where = f"deepfusion train on {size} rank(s) ({nodes} node(s) x {ranks_per_node})"
    try:
        done = checks.check_launch(config, sets, size)
        if literal:  # the script adds --resume when RUN_DIR/checkpoints exists
            resumes = os.path.isdir(os.path.join(run_dir, "checkpoints"))
            checks.check_run_dir(run_dir, resumes)
            if resumes:   # a resume that no checkpoint can serve fails at once in the job
                checks.check_resumable(run_dir)
    except (InputError, ValueError) as e:
        raise ValueError(f"{where} would refuse this job: {e}") from None
    warns = list(done.warnings)
    if literal:
        if resumes:
            warns.append(f"run directory {run_dir} holds checkpoints: the job resumes that run")
        try:
            checks.check_lock(run_dir, size)
        except ValueError as e:  # the job may start after that one ended
            warns.append(f"{e} (the job is refused at its start if that job still runs then)")
    return warns
