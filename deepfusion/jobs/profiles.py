"""Cluster profiles: the fields of a profile (``deepfusion/jobs/clusters.toml`` and a user's ``--profiles
FILE`` merged over it), their checks, and "auto" fields read from this machine.

Public API (the tools of deepfusion.jobs read profiles here; deepfusion.jobs.render re-exports the
first two):
    load_profiles(extra=None) -> {name: profile}
    get_profile(name, profiles=None) -> profile
    validate_profile(name, prof, source="") -> profile with defaults filled in
    profile_names() -> the names in deepfusion/jobs/clusters.toml
    node_layouts(profile) -> [(ranks per node, threads per rank)] that fill a node's cores
"""
from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PROFILES = HERE / "clusters.toml"
LAUNCHERS = ("ibrun", "srun", "mpirun", "mpiexec")
MPI_IMPLS = ("intel", "openmpi", "mpich", "any")

_INT = (int,)
_NUM = (int, float)
# field -> (allowed python types, may be "auto", description)
REQUIRED_FIELDS: dict[str, tuple[tuple[type, ...], bool, str]] = {
    "launcher": ((str,), False, f"one of {', '.join(LAUNCHERS)}"),
    "cores_per_node": (_INT, True, "physical cores per node (integer > 0 or \"auto\")"),
    "sockets": (_INT, True, "sockets per node (integer > 0 or \"auto\")"),
    "numa_domains": (_INT, True, "NUMA domains per node (integer > 0 or \"auto\")"),
    "memory_gb": (_NUM, True, "memory per node in GB (number > 0 or \"auto\")"),
    "link_bandwidth_GBps": (_NUM, False, "inter-node link bandwidth in GB/s (number > 0)"),
    "link_latency_us": (_NUM, False, "inter-node MPI latency in microseconds (number > 0)"),
    "ranks_per_node": (_INT, True, "default MPI ranks per node (integer > 0, or \"auto\": "
                                   "cores_per_node / threads_per_rank)"),
    "threads_per_rank": (_INT, True, "default threads per rank (integer > 0 or \"auto\")"),
    "partition": ((str,), False, "SLURM partition (string, may be empty)"),
    "account": ((str,), False, "SLURM account (string, may be empty)"),
    "modules": ((list,), False, "list of shell lines such as \"module load ...\""),
}
OPTIONAL_FIELDS: dict[str, tuple[tuple[type, ...], object]] = {
    "description": ((str,), ""),
    "mpi_impl": ((str,), "any"),
    "hw_threads_per_core": (_INT, 1),
    "shm_bandwidth_GBps": (_NUM, 10.0),
    "shm_latency_us": (_NUM, 0.5),
    "max_nodes": (_INT, 0),  # 0 = no limit
    # srun --mpi=VALUE (pmi2, pmix, ...); "" = the cluster's MpiDefault. Measured on the local Slurm
    # 22.05 cluster (docs/clusters.md): the pip mpich wheel needs "pmi2"; with "none" every rank
    # starts its own 1-rank world, and "pmix" is refused by that MPICH build.
    "srun_mpi": ((str,), ""),
    # shell lines that make `deepfusion` runnable in the job, after `modules` (e.g. "source
    # /path/to/.venv/bin/activate"); unset = the environment `jobs render` runs from
    # (deepfusion.jobs.precheck.default_setup); [] = none
    "setup": ((list,), None),
}
_POSITIVE = {"cores_per_node", "sockets", "numa_domains", "memory_gb", "link_bandwidth_GBps",
             "link_latency_us", "ranks_per_node", "threads_per_rank", "hw_threads_per_core",
             "shm_bandwidth_GBps", "shm_latency_us"}


class ProfileError(ValueError):
    """A cluster profile is missing a field or has a field of the wrong type/value."""


# ------------------------------------------------------------------------------------ profiles
def _read_toml(path: str | os.PathLike) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ProfileError(f"profile file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"profile file {path} is not valid TOML: {exc}") from None


def _type_name(types: tuple[type, ...]) -> str:
    return "/".join("number" if t is float else t.__name__ for t in types)


def _check_value(label: str, field: str, val, types, desc: str | None = None) -> None:
    """Type and positivity of one profile field (``label`` names the profile and its file)."""
    if isinstance(val, bool) or not isinstance(val, types):
        what = f"{_type_name(types)} ({desc})" if desc else _type_name(types)
        raise ProfileError(f"{label}: field '{field}' must be {what}, got {type(val).__name__} {val!r}")
    if field in _POSITIVE and val <= 0:
        raise ProfileError(f"{label}: field '{field}' must be > 0, got {val!r}")


def validate_profile(name: str, prof: dict, source: str = "") -> dict:
    """Check every field; return a copy with optional defaults filled in. Raises ProfileError."""
    where = f" in {source}" if source else ""
    if not isinstance(prof, dict):
        raise ProfileError(f"cluster profile '{name}'{where} must be a TOML table [{name}]")
    out = dict(prof)
    for field, (types, auto_ok, desc) in REQUIRED_FIELDS.items():
        if field not in prof:
            raise ProfileError(f"cluster profile '{name}'{where} is missing field '{field}' ({desc})")
        if not (auto_ok and prof[field] == "auto"):
            _check_value(f"cluster profile '{name}'{where}", field, prof[field], types, desc)
    if prof["launcher"] not in LAUNCHERS:
        raise ProfileError(f"cluster profile '{name}'{where}: field 'launcher' must be one of "
                           f"{', '.join(LAUNCHERS)}, got {prof['launcher']!r}")
    for field, (types, default) in OPTIONAL_FIELDS.items():
        if field not in prof:
            out[field] = default
            continue
        _check_value(f"cluster profile '{name}'{where}", field, prof[field], types)
    for field in ("modules", "setup"):
        if not all(isinstance(m, str) for m in prof.get(field) or []):
            raise ProfileError(f"cluster profile '{name}'{where}: field '{field}' must be a list of strings")
    if not re.fullmatch(r"[a-z0-9_]*", out["srun_mpi"]):
        raise ProfileError(f"cluster profile '{name}'{where}: field 'srun_mpi' must be an srun --mpi "
                           f"type such as pmi2 or pmix (or \"\" for the cluster default), got {out['srun_mpi']!r}")
    if out["mpi_impl"] not in MPI_IMPLS:
        raise ProfileError(f"cluster profile '{name}'{where}: field 'mpi_impl' must be one of "
                           f"{', '.join(MPI_IMPLS)}, got {out['mpi_impl']!r}")
    unknown = set(prof) - set(REQUIRED_FIELDS) - set(OPTIONAL_FIELDS)
    if unknown:
        raise ProfileError(f"cluster profile '{name}'{where} has unknown field(s) "
                           f"{', '.join(sorted(unknown))} (typo?)")
    return out


def _numa_nodes() -> int:
    try:
        return max(1, len([d for d in os.listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", d)]))
    except OSError:
        return 1


def _memory_gb() -> float:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024**2, 1)
    except OSError:
        pass
    return 1.0


def _resolve_auto(prof: dict) -> dict:
    p = dict(prof)
    cpus = os.cpu_count() or 1
    if p["cores_per_node"] == "auto":
        p["cores_per_node"] = max(1, cpus // p.get("hw_threads_per_core", 1))
    if p["numa_domains"] == "auto":
        p["numa_domains"] = _numa_nodes()
    if p["sockets"] == "auto":
        p["sockets"] = min(p["numa_domains"], p["cores_per_node"])
    if p["memory_gb"] == "auto":
        p["memory_gb"] = _memory_gb()
    if p["ranks_per_node"] == "auto":  # one rank per core unless threads_per_rank says otherwise
        t = 1 if p["threads_per_rank"] == "auto" else p["threads_per_rank"]
        p["ranks_per_node"] = max(1, p["cores_per_node"] // t)
    if p["threads_per_rank"] == "auto":
        p["threads_per_rank"] = max(1, p["cores_per_node"] // p["ranks_per_node"])
    return p


def load_profiles(extra: str | os.PathLike | None = None, base: str | os.PathLike | None = None) -> dict:
    """All profiles: deepfusion/jobs/clusters.toml, then ``extra`` merged over it (field by field per profile).

    Every profile is validated; "auto" fields are resolved for this machine.
    """
    base = base or DEFAULT_PROFILES
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in _read_toml(base).items()}
    sources = {k: str(base) for k in raw}
    if extra:
        for name, prof in _read_toml(extra).items():
            if isinstance(prof, dict) and isinstance(raw.get(name), dict):
                raw[name].update(prof)
            else:
                raw[name] = prof
            sources[name] = str(extra)
    return {name: _resolve_auto(validate_profile(name, prof, sources[name])) for name, prof in raw.items()}


def get_profile(name: str, profiles: dict | None = None) -> dict:
    profiles = load_profiles() if profiles is None else profiles
    if name not in profiles:
        raise ValueError(f"unknown cluster '{name}'; valid clusters: {', '.join(sorted(profiles))}")
    return dict(profiles[name], name=name)


def profile_names() -> list[str]:
    """The names of the profiles in deepfusion/jobs/clusters.toml (for help texts; not validated)."""
    try:
        return sorted(_read_toml(DEFAULT_PROFILES))
    except (OSError, ValueError):
        return []


def node_layouts(prof: dict) -> list[tuple[int, int]]:
    """(ranks per node, threads per rank) that fill the node's cores."""
    cores = int(prof["cores_per_node"])
    return [(r, cores // r) for r in range(1, cores + 1) if cores % r == 0]
