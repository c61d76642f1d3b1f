"""One live job per run directory: the lock file ``RUN_DIR/lock.json``, held by rank 0.

Two jobs writing one run directory interleave ``metrics.jsonl`` and the checkpoints, so every
``deepfusion train`` (a plain start, ``--resume`` and ``--overwrite`` alike) takes the lock before
it looks at the directory, and is refused (exit 2, the live job named) while another job holds it.

Which file-system operations this relies on, and why: cluster run directories live on NFS,
Lustre or GPFS, where ``fcntl``/``flock`` locks may be unsupported, local to one client, or lost
when a client dies, so none is used. The lock is a file created with ``O_CREAT | O_EXCL``
(atomic on local file systems, NFSv3 and later, Lustre and GPFS: exactly one creator wins) and
rewritten with ``rename`` (atomic on all of them). On a file system where exclusive create is
not atomic (NFSv2), two starts in the same instant could both win; the heartbeat below then
finds the other job's record in the lock within one beat and ends the job that lost.

The file records the holder (host, PID, Slurm job and restart count, start time, a random token)
and a heartbeat: a thread of rank 0 rewrites it every ``HEARTBEAT_S`` seconds, touching nothing
the training reads, and checks that the lock is still its own. A job killed with SIGKILL leaves
its lock behind; the next start takes it over once it is stale:

* on the holder's own machine (same host name, boot and PID namespace): at once when its process
  has ended (or its PID now belongs to a newer process);
* a requeue of the same Slurm job (a higher ``SLURM_RESTART_COUNT``): at once, since Slurm starts
  a job again only after its previous run ended;
* anywhere else: ``STALE_S`` seconds after the last heartbeat (the hosts' clocks must agree to
  well within that, as NTP keeps them on a cluster).

A lock file that holds no lock record (garbage, empty, a list, fields of the wrong type: a
damaged file, since every write of a record is a ``rename``) cannot name its holder. A live
holder repairs it at its next heartbeat, so one unchanged for ``DAMAGED_S`` seconds has no live
holder and is taken over; before that a start is refused at once, naming the file and the wait.
Only a file younger than ``WRITING_S`` is taken for a lock being created (``O_EXCL`` then write).

A takeover is atomic: the starter first creates ``lock.json.takeover`` with ``O_EXCL`` (one
starter at a time), checks that the lock still holds the very bytes it judged stale (a heartbeat
or another takeover since would change them), then renames its own record over it.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields

from deepfusion.engine.checkpoint.atomic import atomic_path, pid_alive
from deepfusion.engine.errors import InputError, NonFiniteLoss, ParametersDiverged, Preempted

LOCK_NAME = "lock.json"
HEARTBEAT_S = 15.0    # rank 0 rewrites the lock this often (DEEPFUSION_LOCK_HEARTBEAT overrides)
STALE_S = 120.0       # a lock whose heartbeat is older than this was left by a dead job
CLAIM_STALE_S = 30.0  # a takeover claim this old was left by a starter that died taking over
DAMAGED_S = 2 * HEARTBEAT_S  # a damaged lock this old has no live holder (it would repair it)
WRITING_S = 1.0       # an unreadable lock younger than this may be one being created
ATTEMPTS = 5          # rounds of create / judge / take over before giving up on a busy lock
# Decisions every rank takes together: rank 0 releases the lock itself on its way out
AGREED = (InputError, Preempted, NonFiniteLoss, ParametersDiverged)
_HELD: set[str] = set()  # tokens of the locks this process holds


class RunDirInUse(ValueError):
    """A live job holds the run directory (an input error: exit 2)."""


@dataclass(kw_only=True)
class Holder:
    """What the lock file records about the job that holds it."""

    host: str
    machine: str     # host name, boot id and PID namespace: where a PID names the same process
    pid: int
    pid_start: str   # the process's start time in clock ticks (Linux), "" if unknown
    slurm_job: str
    slurm_restart: int
    ranks: int
    command: str
    started: float   # time.time() of the start
    heartbeat: float  # time.time() of the last heartbeat
    token: str

    @classmethod
    def here(cls, *, ranks: int, command: str) -> "Holder":
        now = time.time()
        return cls(host=socket.gethostname(), machine=machine_id(), pid=os.getpid(),
                   pid_start=process_start(os.getpid()),
                   slurm_job=os.environ.get("SLURM_JOB_ID", ""),
                   slurm_restart=_int(os.environ.get("SLURM_RESTART_COUNT", "0")), ranks=ranks,
                   command=command[:500], started=now, heartbeat=now, token=os.urandom(16).hex())

    @classmethod
    def parse(cls, raw: bytes) -> "Holder | None":
        """The record in ``raw``, or None if it is not one (a lock being written, a damaged
        file: not JSON, not an object, a field missing or of another type)."""
        try:
            rec = json.loads(raw.decode())
            values = {f.name: rec[f.name] for f in fields(cls)}
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        kinds = {"str": (str,), "int": (int,), "float": (int, float)}
        for f in fields(cls):
            v = values[f.name]
            if isinstance(v, bool) or not isinstance(v, kinds[f.type]):
                return None
        return cls(**values)

    def encode(self) -> bytes:
        return (json.dumps(asdict(self), indent=1, sort_keys=True) + "\n").encode()

    def describe(self, now: float) -> str:
        job = f", Slurm job {self.slurm_job}" if self.slurm_job else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return (f"PID {self.pid} on host {self.host}{job} ({self.ranks} rank(s)), started "
                f"{started}, last heartbeat {max(0.0, now - self.heartbeat):.0f} s ago")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        return 0


def machine_id() -> str:
    """Host name, boot id and PID namespace: two processes with equal ids see the same PIDs."""
    parts = [socket.gethostname()]
    for path, read in (("/proc/sys/kernel/random/boot_id", _read_text),
                       ("/proc/self/ns/pid", os.readlink)):
        try:
            parts.append(read(path).strip())
        except OSError:
            parts.append("")
    return "|".join(parts)


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read()


def process_start(pid: int) -> str:
    """Start time of process ``pid`` (clock ticks since boot; /proc), "" if unknown or gone."""
    try:
        stat = _read_text(f"/proc/{pid}/stat")
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22; the name before ")" may hold spaces


def process_gone(holder: Holder) -> bool:
    """Whether ``holder``'s process has ended (call only on the holder's own machine)."""
    if not pid_alive(holder.pid):
        return True
    now = process_start(holder.pid)
    return bool(holder.pid_start and now and now != holder.pid_start)  # the PID was reused


def stale_reason(holder: Holder | None, mtime: float, me: Holder, now: float) -> str:
    """Why the lock of ``holder`` (None: unreadable, last changed at ``mtime``) was left by a
    job that is gone; "" while it may be alive."""
    if holder is None:
        age = now - mtime
        return (f"a damaged lock file (no lock record), unchanged for {age:.0f} s: a live job "
                f"repairs its lock within {DAMAGED_S:.0f} s") if age > DAMAGED_S else ""
    if holder.machine == me.machine:
        if holder.pid == me.pid and holder.token not in _HELD:
            return "left by an earlier run in this process"
        return f"its process (PID {holder.pid} on {holder.host}) has ended" \
            if process_gone(holder) else ""
    if holder.slurm_job and holder.slurm_job == me.slurm_job \
            and holder.slurm_restart < me.slurm_restart:
        return (f"Slurm job {me.slurm_job} was requeued: this is its restart "
                f"{me.slurm_restart}, the lock is from restart {holder.slurm_restart}")
    age = now - holder.heartbeat
    if age > STALE_S:
        return f"no heartbeat for {age:.0f} s (the limit is {STALE_S:.0f} s)"
    return ""


def read_lock(path: str) -> tuple[bytes | None, float]:
    """The lock file's bytes (None if there is none) and its modification time."""
    try:
        with open(path, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_mtime
    except FileNotFoundError:
        return None, 0.0


def create_exclusive(path: str, data: bytes) -> bool:
    """Create ``path`` holding ``data`` if it does not exist (O_EXCL); False if it does."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def replace(path: str, data: bytes) -> None:
    """Put ``data`` at ``path`` at once (a temp file renamed over it: :func:`atomic_path`;
    one writer per process: the takeover before the heartbeat starts, then the heartbeat)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(data)


def refusal(run_dir: str, holder: Holder, now: float) -> str:
    path = os.path.join(run_dir, LOCK_NAME)
    stop = (f"scancel {holder.slurm_job}" if holder.slurm_job
            else f"kill {holder.pid} on {holder.host}")
    gone = [f"at once on {holder.host} once PID {holder.pid} has ended"]
    if holder.slurm_job:
        gone.append(f"by a requeue of Slurm job {holder.slurm_job}")
    gone.append(f"{STALE_S:.0f} s after its last heartbeat from anywhere else")
    return (f"run directory {run_dir!r} is in use by a live job: {holder.describe(now)} "
            f"({path}). Two jobs on one run directory would interleave its metrics and "
            f"checkpoints. Wait for that job to end or stop it ({stop}), or use another "
            f"directory with --set run.dir=PATH. If that job is gone, the next start takes its "
            f"lock over: {', '.join(gone)}")


def damaged(path: str, age: float) -> str:
    return (f"{path} is damaged: it holds no lock record, so it cannot say which job holds "
            f"the run directory. A live job rewrites its lock at its next heartbeat; this one "
            f"is taken over by the first start once unchanged for {DAMAGED_S:.0f} s (in "
            f"{max(1.0, DAMAGED_S - age):.0f} s). Start again then, or delete the file if no "
            f"job uses this directory")


def make_dirs(run_dir: str) -> list[str]:
    """Create ``run_dir`` and its missing parents; the ones created, deepest first."""
    made, d = [], os.path.abspath(run_dir)
    while not os.path.isdir(d):
        made.append(d)
        d = os.path.dirname(d)
    os.makedirs(run_dir, exist_ok=True)
    return made


def acquire(run_dir: str, *, ranks: int, command: str) -> "RunLock":
    """Take the lock of ``run_dir`` (created if missing): RunDirInUse while a live job holds it;
    a stale lock is taken over (``RunLock.note`` says whose and why)."""
    made = make_dirs(run_dir)
    me = Holder.here(ranks=ranks, command=command)
    try:
        for attempt in range(ATTEMPTS):
            lock = attempt_once(run_dir, me, made)
            if lock is not None:
                return lock
            time.sleep(0.05 * (attempt + 1))  # a lock being written or taken over: look again
        raise RunDirInUse(f"run directory {run_dir!r} is being claimed by another job right now "
                          f"(its {LOCK_NAME} is being written or taken over). Wait for that job "
                          f"to end, or use another directory with --set run.dir=PATH")
    except BaseException:
        remove_dirs(made)
        raise


def attempt_once(run_dir: str, me: Holder, made: list[str]) -> "RunLock | None":
    """One round: create the lock, or judge the one there and take it over if stale. The lock,
    None to look again, RunDirInUse if a live job holds it."""
    path = os.path.join(run_dir, LOCK_NAME)
    try:
        if create_exclusive(path, me.encode()):
            return RunLock(path, me, made)
    except FileNotFoundError:  # a refused start that had made the directory removed it just now
        made += make_dirs(run_dir)
        return None
    raw, mtime = read_lock(path)
    if raw is None:
        return None  # released in the meantime
    holder, now = Holder.parse(raw), time.time()
    why = stale_reason(holder, mtime, me, now)
    if not why:
        if holder is None:
            if now - mtime < WRITING_S:
                return None  # being created: its record follows at once
            raise RunDirInUse(damaged(path, now - mtime))
        raise RunDirInUse(refusal(run_dir, holder, now))
    if not take_over(path, raw, me):
        return None
    whose = holder.describe(now) if holder else "an unreadable lock"
    return RunLock(path, me, made, note=f"took over the stale lock of {whose}: {why}")


def take_over(path: str, judged: bytes, me: Holder) -> bool:
    """Replace the stale lock whose bytes were ``judged`` by ``me``'s record; False if another
    start is taking it over, or the lock changed since it was judged."""
    claim = path + ".takeover"
    if not create_exclusive(claim, me.encode()):
        raw, mtime = read_lock(claim)  # (the claim may still be empty: it is being written)
        if raw is not None and time.time() - mtime > CLAIM_STALE_S:
            _unlink(claim)  # its starter died mid-takeover
        return False
    try:
        if read_lock(path)[0] != judged:
            return False
        replace(path, me.encode())
        return read_lock(path)[0] == me.encode()
    finally:
        _unlink(claim)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_dirs(made: list[str]) -> None:
    """Remove the directories a refused or failed start created, if they are still empty."""
    for d in made:
        try:
            os.rmdir(d)
        except OSError:
            return


def release_if_holder(path: str, token: str) -> None:
    """Remove the lock at ``path`` if ``token`` still holds it (best effort)."""
    try:
        raw, _ = read_lock(path)
        holder = Holder.parse(raw) if raw is not None else None
        if holder is not None and holder.token == token:
            os.unlink(path)
    except OSError:
        pass


class RunLock:
    """The lock this process holds: its heartbeat, and its release."""

    def __init__(self, path: str, holder: Holder, made: list[str], note: str = ""):
        self.path, self.holder, self.made, self.note = path, holder, made, note
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        _HELD.add(holder.token)

    def beat(self) -> str:
        """Check the lock is still ours and renew its heartbeat; why it is lost, else ""."""
        try:
            raw, _ = read_lock(self.path)
            if raw is None:  # removed by hand: ours again, unless another job took it
                if create_exclusive(self.path, self.holder.encode()):
                    return ""
                raw, _ = read_lock(self.path)
            holder = Holder.parse(raw or b"")
            if holder is None and self.still_unreadable():
                replace(self.path, self.holder.encode())  # damaged from outside: ours again
                return ""
            if holder is None or holder.token != self.holder.token:
                who = holder.describe(time.time()) if holder else "an unreadable record"
                return f"{self.path} now names another job: {who}"
            self.holder.heartbeat = time.time()
            replace(self.path, self.holder.encode())
        except OSError:
            pass  # a file-system hiccup: the next beat tries again
        return ""

    def still_unreadable(self) -> bool:
        """Whether the lock still holds no record a moment later (damaged, not a record being
        created by a start that found it removed)."""
        time.sleep(WRITING_S)
        raw, _ = read_lock(self.path)
        return raw is not None and Holder.parse(raw) is None

    def start_heartbeat(self, on_lost, every: float = HEARTBEAT_S) -> None:
        """Beat every ``every`` seconds from a daemon thread; ``on_lost(reason)`` if lost."""
        def run():
            while not self._stop.wait(every):
                why = self.beat()
                if why:
                    on_lost(why)
                    return
        self._thread = threading.Thread(target=run, name="run-dir-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and remove the lock (if still ours) and the directories this
        start created that are still empty. Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)  # a beat stuck in file-system I/O is left behind
        if self.holder.token in _HELD:
            release_if_holder(self.path, self.holder.token)
            _HELD.discard(self.holder.token)
            remove_dirs(self.made)


def heartbeat_seconds() -> float:
    """The heartbeat period: ``DEEPFUSION_LOCK_HEARTBEAT`` seconds if set (a test, or a file
    system slow to write), else ``HEARTBEAT_S``; it must stay well under ``STALE_S``."""
    text = os.environ.get("DEEPFUSION_LOCK_HEARTBEAT", "")
    try:
        value = float(text) if text else HEARTBEAT_S
    except ValueError:
        value = -1.0
    if not 0 < value <= STALE_S / 4:
        raise InputError(f"DEEPFUSION_LOCK_HEARTBEAT={text!r}: give seconds in (0, {STALE_S / 4:g}]")
    return value


@contextmanager
def held(lock: RunLock | None, comm, on_lost):
    """Hold rank 0's ``lock`` (None elsewhere) while the block runs: heartbeat, and release on
    the way out however the block ends; ``on_lost(reason)`` (from the heartbeat thread) if
    another job took the lock. A rank that fails alone is about to call MPI_Abort, which kills
    rank 0 with SIGKILL (no cleanup there), so that rank removes the lock first."""
    ref = None
    try:
        every = heartbeat_seconds()  # on every rank, so a bad value ends them all alike
        ref = comm.bcast_obj((lock.path, lock.holder.token) if lock is not None else None)
        if lock is not None:
            lock.start_heartbeat(on_lost, every)
        yield
    except AGREED:
        raise
    except BaseException:
        if ref is not None:
            release_if_holder(*ref)
        raise
    finally:
        if lock is not None:
            lock.release()
