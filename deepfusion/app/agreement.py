"""What every rank of one launch must agree on before any work: the command, its options and the
deepfusion version (:func:`launch_disagreement`, the first collective of every distributed
command), and for ``train`` the resolved config (:func:`check_same_config`).

A launcher starts every rank from its own command line, so an MPMD launch (``mpiexec -n 1
deepfusion train A.toml : -n 1 deepfusion train B.toml``), a node with another installation, or
a config file that differs between nodes would run ranks that disagree: different collectives
(a hang or a crash), or the same collectives on different numbers (found, at best, by the
parameter checksum many steps later). Each check is one small allgather; a disagreement is
refused on every rank with one message (exit 2) naming what differs.

Thread counts are exempt (``--threads``, ``parallel.threads_per_rank``): they change the speed of
a rank, not the numbers the ranks exchange, and an MPMD launch over hosts of different sizes may
set them per host.
"""
from __future__ import annotations

import hashlib
import json

from deepfusion.config import config_changes, config_to_dict
from deepfusion.engine.errors import InputError
from deepfusion.version import __version__

# Options compared through what they resolve to (train's config, below), and options exempt.
RESOLVED = {"train": ("config", "set", "resume")}
EXEMPT_OPTIONS = ("threads",)
EXEMPT_KEYS = (("parallel", "threads_per_rank"),)

ONE_LAUNCH = "one 'mpiexec -n P deepfusion ...', not an MPMD launch with ':'"


def launch(args) -> dict:
    """This rank's command, version and options (train's config and --set excluded: their
    resolved config is compared instead)."""
    cmd = getattr(args, "cmd", None)
    skip = set(RESOLVED.get(cmd, ())) | set(EXEMPT_OPTIONS) | {"cmd"}
    options = {k: v for k, v in sorted(vars(args).items()) if k not in skip and not callable(v)}
    if cmd == "train":
        options["resume"] = bool(args.resume)
    return {"command": cmd, "version": __version__, "options": options}


def launch_disagreement(comm, args) -> str | None:
    """Why the ranks of this launch cannot run together (every rank gets the same text), or
    None. Collective: every distributed command calls it first."""
    every = comm.allgather_obj(launch(args))
    others = [r for r, d in enumerate(every) if d != every[0]]
    if not others:
        return None
    a, b, r = every[0], every[others[0]], others[0]
    diffs = [f"{k} {a[k]!r} on rank 0, {b[k]!r} on rank {r}" for k in ("command", "version")
             if a[k] != b[k]]
    if not diffs:
        keys = sorted(set(a["options"]) | set(b["options"]))
        diffs = [f"option {k}: {a['options'].get(k)!r} on rank 0, {b['options'].get(k)!r} on "
                 f"rank {r}" for k in keys if a["options"].get(k) != b["options"].get(k)]
    return (f"the ranks of this launch were started differently (rank(s) {_ranks(others)} "
            f"differ from rank 0): {'; '.join(diffs)}. Nothing was run: start every rank "
            f"with the same command line ({ONE_LAUNCH}) from the same installation")


def config_digest(cfg) -> tuple[str, dict]:
    """(sha256 of the resolved config, the config as a dict), thread counts left out."""
    d = config_to_dict(cfg)
    for section, key in EXEMPT_KEYS:
        d.get(section, {}).pop(key, None)
    text = json.dumps(d, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest(), d


def check_same_config(comm, cfg) -> None:
    """Raise InputError on every rank if some rank resolved another config than rank 0, naming
    the keys in which the first such rank differs. Collective."""
    digest, mine = config_digest(cfg)
    digests = comm.allgather_obj(digest)
    others = [r for r, d in enumerate(digests) if d != digests[0]]
    if not others:
        return
    r = others[0]
    ours = comm.bcast_obj(mine if comm.rank == 0 else None, root=0)
    theirs = comm.bcast_obj(mine if comm.rank == r else None, root=r)
    changes = config_changes(ours, theirs)
    raise InputError(f"the ranks of this launch resolved different configs (rank(s) "
                     f"{_ranks(others)} differ from rank 0); rank {r} differs in "
                     f"{len(changes)} key(s) (rank 0 -> rank {r}): {'; '.join(changes)}. "
                     f"Nothing was run: give every rank the same config file and --set "
                     f"({ONE_LAUNCH}), and check the file is the same on every node")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return shown + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
