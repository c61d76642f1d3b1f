"""``deepfusion demo``: train configs/demo.toml on ``mpiexec -n NP``, one thread per rank, then
print its validation error (what ``make demo`` runs)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

from deepfusion.app.policy import run_local


def register(sub) -> None:
    d = sub.add_parser("demo", help="train configs/demo.toml on mpiexec -n NP, one thread per "
                                    "rank, and print its validation error")
    d.add_argument("--np", type=int, default=2, metavar="NP",
                   help="number of MPI ranks to launch (default 2)")
    d.add_argument("--run-dir", default="runs/demo",
                   help="run directory, replaced if it exists (default runs/demo)")
    d.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a key of the demo config, as 'deepfusion train --set' "
                        "(repeatable)")
    d.set_defaults(run=lambda args: run_local(cmd_demo, args))


def cmd_demo(args) -> int:
    """The demo config on mpiexec -n NP, one thread per rank, then the validation error."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = os.path.join(root, "configs", "demo.toml")
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        mpiexec = shutil.which("mpiexec") or "mpiexec"
    cmd = [mpiexec, "-n", str(args.np), sys.executable, "-m", "deepfusion", "train", config,
           "--set", "parallel.threads_per_rank=1", "--set", f"run.dir={args.run_dir}", "--overwrite"]
    cmd += sum((["--set", s] for s in (args.set or [])), [])
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)
