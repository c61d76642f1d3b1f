"""One live job per run directory (deepfusion.engine.run.lock): a second start of any kind is
refused naming the live job, a lock left by a dead job is taken over, and racing starters never
both win. The lock's rules in-process; then racing processes, and real training jobs started,
refused, killed with -9 and resumed (the starts a live job refuses and the resumes after it run
in the test process: another process than the job's, as a user's is). Timeouts are hang
guards only."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from deepfusion.engine.run import files as runlock_files
from deepfusion.engine.run import lock as runlock
from deepfusion.engine.run.lock import LOCK_NAME, Holder, RunDirInUse, acquire
from tests.faults.steps import fault_env
from tests.in_process import deepfusion_here
from tests.mpi_util import HANG_GUARD, ROOT, mpiexec
from tests.tiny_configs import TINY


def fake_lock(run_dir, **changes) -> Holder:
    """Write a lock as another job would have: this machine and a live PID unless changed."""
    h = Holder.here(ranks=2, command="deepfusion train x.toml")
    for k, v in changes.items():
        setattr(h, k, v)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, LOCK_NAME), "wb") as f:
        f.write(h.encode())
    return h


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_held_lock_refuses_a_second_start_and_its_release_leaves_nothing(tmp_path):
    d = tmp_path / "new" / "run"
    lock = acquire(str(d), ranks=2, command="deepfusion train c.toml")
    rec = json.loads((d / LOCK_NAME).read_text())
    assert (rec["pid"], rec["host"], rec["ranks"]) == (os.getpid(), socket.gethostname(), 2)
    with pytest.raises(RunDirInUse) as e:
        acquire(str(d), ranks=1, command="deepfusion train --resume")
    msg = str(e.value)
    for part in (f"is in use by a live job: PID {os.getpid()} on host {socket.gethostname()}",
                 "(2 rank(s)), started ", "--set run.dir=PATH"):
        assert part in msg, (part, msg)
    assert re.search(r"last heartbeat \d+ s ago", msg), msg
    lock.release()
    assert not (tmp_path / "new").exists()  # the directories this start made, still empty
    lock.release()  # idempotent


def test_a_lock_of_a_process_that_ended_is_taken_over(tmp_path):
    pid = dead_pid()
    fake_lock(tmp_path, pid=pid, pid_start="1")
    lock = acquire(str(tmp_path), ranks=1, command="c")
    assert f"took over the stale lock of PID {pid}" in lock.note and "has ended" in lock.note
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.holder.token
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists() and tmp_path.exists()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    """The holder's PID now belongs to another process (started later): the lock is stale."""
    fake_lock(tmp_path, pid=os.getppid(), pid_start="1")
    lock = acquire(str(tmp_path), ranks=1, command="c")
    assert "has ended" in lock.note
    lock.release()


@pytest.mark.parametrize("age,taken", [(runlock.STALE_S + 60, True), (5, False)])
def test_another_host_goes_stale_by_its_heartbeat(tmp_path, age, taken):
    h = fake_lock(tmp_path, host="node7", machine="node7||", pid=4242, slurm_job="987",
                  heartbeat=time.time() - age)
    if taken:
        lock = acquire(str(tmp_path), ranks=1, command="c")
        assert "no heartbeat for" in lock.note and "node7" in lock.note
        lock.release()
        return
    with pytest.raises(RunDirInUse) as e:
        acquire(str(tmp_path), ranks=1, command="c")
    msg = str(e.value)
    assert "PID 4242 on host node7, Slurm job 987 (2 rank(s))" in msg and "scancel 987" in msg
    assert re.search(r"last heartbeat [5-9] s ago", msg) and "by a requeue of Slurm job 987" in msg
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == h.token  # untouched


def test_a_requeued_slurm_job_takes_its_predecessors_lock(tmp_path, monkeypatch):
    """Killed with -9 on another node, requeued by Slurm (same job id, next restart count): the
    lock is stale at once, not after the heartbeat limit."""
    fake_lock(tmp_path, host="node7", machine="node7||", slurm_job="987", slurm_restart=0)
    monkeypatch.setenv("SLURM_JOB_ID", "987")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    lock = acquire(str(tmp_path), ranks=1, command="c")
    assert "Slurm job 987 was requeued" in lock.note
    lock.release()
    fake_lock(tmp_path, host="node7", machine="node7||", slurm_job="987", slurm_restart=1)
    with pytest.raises(RunDirInUse):  # the same run of the job, elsewhere: alive
        acquire(str(tmp_path), ranks=1, command="c")


def test_an_unreadable_lock_is_refused_while_fresh_and_taken_over_when_old(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"")  # a lock being written
    with pytest.raises(RunDirInUse, match="being claimed by another job"):
        acquire(str(tmp_path), ranks=1, command="c")
    old = time.time() - runlock.DAMAGED_S - 5
    os.utime(tmp_path / LOCK_NAME, (old, old))
    lock = acquire(str(tmp_path), ranks=1, command="c")
    assert "a damaged lock file" in lock.note
    lock.release()


DAMAGED = [b"garbage\x00\xff", b"", b"[1, 2, 3]", b'{"host": "h"}', b"null",
           json.dumps({**json.loads(Holder.here(ranks=1, command="c").encode()), "pid": "12"}).encode(),
           json.dumps({**json.loads(Holder.here(ranks=1, command="c").encode()), "ranks": True}).encode()]


@pytest.mark.parametrize("raw", DAMAGED, ids=["garbage", "empty", "list", "missing", "null",
                                              "pid-as-text", "ranks-as-bool"])
def test_a_damaged_lock_is_a_clear_refusal_then_a_prompt_takeover(tmp_path, raw):
    path = tmp_path / LOCK_NAME
    path.write_bytes(raw)
    past = time.time() - 2 * runlock.WRITING_S   # no longer a lock being created
    os.utime(path, (past, past))
    with pytest.raises(RunDirInUse, match=r"lock.json is damaged: it holds no lock record") as e:
        acquire(str(tmp_path), ranks=1, command="c")
    assert "being claimed" not in str(e.value) and "delete the file" in str(e.value)
    assert path.read_bytes() == raw                 # a refusal changes nothing
    old = time.time() - runlock.DAMAGED_S - 1       # well before STALE_S
    os.utime(path, (old, old))
    lock = acquire(str(tmp_path), ranks=1, command="c")
    assert "a damaged lock file" in lock.note and runlock.DAMAGED_S < runlock.STALE_S
    lock.release()
    assert not path.exists()


def test_a_live_holder_repairs_a_damaged_lock(tmp_path):
    lock = acquire(str(tmp_path), ranks=1, command="c")
    (tmp_path / LOCK_NAME).write_bytes(b"[]")
    assert lock.beat() == ""                        # not lost: repaired
    assert Holder.parse((tmp_path / LOCK_NAME).read_bytes()).token == lock.holder.token
    lock.release()


def test_status_of_a_damaged_lock_says_so_and_not_running(tmp_path):
    from deepfusion.app.status import lock_state, run_state
    (tmp_path / LOCK_NAME).write_bytes(b"{broken")
    past = time.time() - 2 * runlock.WRITING_S
    os.utime(tmp_path / LOCK_NAME, (past, past))
    state = {"lock": lock_state(str(tmp_path)), "step": 0, "total_steps": None,
             "checkpoint": None, "run_dir": str(tmp_path)}
    kind, text = run_state(state)
    assert kind == "damaged lock" and "lock.json is damaged" in text


def test_a_refused_heartbeat_setting_leaves_no_lock(tmp_path, monkeypatch):
    from deepfusion.engine.parallel.comm import SerialComm
    monkeypatch.setenv("DEEPFUSION_LOCK_HEARTBEAT", "0")
    lock = acquire(str(tmp_path / "run"), ranks=1, command="c")
    with pytest.raises(runlock.InputError, match="DEEPFUSION_LOCK_HEARTBEAT"):
        with runlock.held(lock, SerialComm(), lambda why: None):
            pass
    assert not (tmp_path / "run").exists()          # neither the lock nor the directory it made


def test_the_heartbeat_renews_the_lock_and_notices_another_job_in_it(tmp_path):
    lock = acquire(str(tmp_path), ranks=1, command="c")
    first = lock.holder.heartbeat
    assert lock.beat() == "" and json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] > first
    (tmp_path / LOCK_NAME).unlink()  # removed by hand: taken back
    assert lock.beat() == "" and (tmp_path / LOCK_NAME).exists()
    lost = []
    lock.start_heartbeat(lost.append, every=0.01)
    fake_lock(tmp_path, host="node7", machine="node7||", pid=4242)
    deadline = time.monotonic() + 60  # hang guard
    while not lost and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lost and "now names another job: PID 4242 on host node7" in lost[0]
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()  # not ours to remove


def test_overwrite_clears_all_but_the_lock(tmp_path):
    lock = acquire(str(tmp_path), ranks=1, command="c")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "step_00000002.h5").write_bytes(b"x")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    runlock_files.clear_run_dir(str(tmp_path))
    assert os.listdir(tmp_path) == [LOCK_NAME]
    lock.release()


def test_overwrite_refuses_a_directory_with_files_no_run_writes(tmp_path, cli):
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.replace("epochs = 5", "epochs = 1"))
    run = tmp_path / "run"
    assert cli(["train", str(cfg), "--set", f"run.dir={run}"])[0] == 0
    (run / "thesis.txt").write_text("months of work")
    (run / "sub").mkdir()
    (run / "sub" / "notes.md").write_text("notes")
    before = sorted(os.listdir(run))
    rc, _, err = cli(["train", str(cfg), "--set", f"run.dir={run}", "--overwrite"])
    assert rc == 2 and "files no run writes: sub, thesis.txt" in err, err
    assert sorted(os.listdir(run)) == before and (run / "thesis.txt").read_text() == "months of work"
    (run / "thesis.txt").unlink()
    (run / "sub" / "notes.md").unlink()
    (run / "sub").rmdir()
    # checkpoints/ holds the run's step files; a user's copy or notes there are theirs
    newest = sorted((run / "checkpoints").iterdir())[-1]
    (run / "checkpoints" / "notes.txt").write_text("which step was best")
    (run / "checkpoints" / (newest.name + ".bak")).write_bytes(newest.read_bytes())
    rc, _, err = cli(["train", str(cfg), "--set", f"run.dir={run}", "--overwrite"])
    assert rc == 2 and (f"no run writes: checkpoints/notes.txt, checkpoints/{newest.name}.bak"
                        in err), err
    assert (run / "checkpoints" / "notes.txt").exists() and newest.exists()
    (run / "checkpoints" / "notes.txt").unlink()
    (run / "checkpoints" / (newest.name + ".bak")).unlink()
    rc, _, err = cli(["train", str(cfg), "--set", f"run.dir={run}", "--overwrite"])
    assert rc == 0, err


RACER = """
import os, sys, time
from deepfusion.engine.run.lock import RunDirInUse, acquire
d, go, done, out = sys.argv[1:5]
while not os.path.exists(go):
    time.sleep(0.001)
try:
    lock = acquire(d, ranks=1, command="racer")
    said = f"WON {os.getpid()} {lock.note}"
except RunDirInUse as e:
    lock, said = None, f"REFUSED {e}"
with open(os.path.join(out, str(os.getpid())), "w") as f:
    f.write(said)
while lock is not None and not os.path.exists(done):  # the winner holds it until all tried
    time.sleep(0.01)
if lock is not None:
    lock.release()
"""


@pytest.mark.parametrize("stale", [False, True])
def test_racing_starters_never_both_win(tmp_path, stale):
    """Six processes claim one directory at the same moment, free or holding a stale lock:
    exactly one wins, and every other is refused naming it."""
    d, go, done, out = tmp_path / "run", tmp_path / "go", tmp_path / "done", tmp_path / "out"
    out.mkdir()
    if stale:
        fake_lock(d, pid=dead_pid(), pid_start="1")
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(d), str(go), str(done),
                               str(out)], env=env) for _ in range(6)]
    time.sleep(1.0)  # let them all reach the start line (a slow one only races later)
    go.touch()
    deadline = time.monotonic() + HANG_GUARD
    while len(os.listdir(out)) < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    done.touch()
    for p in procs:
        assert p.wait(timeout=HANG_GUARD) == 0
    said = [(out / name).read_text() for name in os.listdir(out)]
    won = [s for s in said if s.startswith("WON")]
    assert len(won) == 1, said
    winner = won[0].split()[1]
    assert ("took over the stale lock" in won[0]) == stale
    refused = [s for s in said if s.startswith("REFUSED")]
    assert len(refused) == 5 and all(f"PID {winner} on host" in r for r in refused), said
    assert not (d / LOCK_NAME).exists()


# -- real training jobs ----------------------------------------------------------------------

def steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r["step"] for r in map(json.loads, f) if r["kind"] == "step"]


def start(n, cfg, run_dir, *sets, env=None):
    """A training job in the background: mpiexec -n n (0: one plain process)."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **(env or {}))
    head = [mpiexec(), "-n", str(n)] if n else []
    cmd = head + [sys.executable, "-m", "deepfusion", "train", cfg, "--set", f"run.dir={run_dir}"]
    cmd += [a for s in sets for a in ("--set", s)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=e, cwd=ROOT)


def wait_for_steps(run_dir, proc, n=3):
    metrics = os.path.join(run_dir, "metrics.jsonl")
    deadline = time.monotonic() + HANG_GUARD  # hang guard only
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(metrics) and len(steps(run_dir)) >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"the job did not train: {proc.communicate()[1][-3000:]}")


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return str(path)


@pytest.mark.mpi
def test_a_live_job_refuses_a_start_a_resume_and_an_overwrite(tiny, tmp_path):
    d = str(tmp_path / "live")
    live = start(2, tiny, d, "train.epochs=100000")
    wait_for_steps(d, live)
    holder = json.loads(open(os.path.join(d, LOCK_NAME)).read())
    named = f"is in use by a live job: PID {holder['pid']} on host {holder['host']} (2 rank(s))"
    for args in (["train", tiny, "--set", f"run.dir={d}"], ["train", "--resume", d],
                 ["train", tiny, "--set", f"run.dir={d}", "--overwrite"]):
        p = deepfusion_here(args)  # another process than the live job's, as a user's start is
        assert p.returncode == 2, (args, p.stderr)
        assert named in p.stderr and p.stderr.count("deepfusion: error") == 1, p.stderr
    live.send_signal(signal.SIGUSR1)
    _, err = live.communicate(timeout=HANG_GUARD)
    assert live.returncode == 99, err
    assert not os.path.exists(os.path.join(d, LOCK_NAME))  # released on the way out
    done = steps(d)
    assert done == list(range(1, len(done) + 1))  # one job's records, in order
    p = deepfusion_here(["train", "--resume", d, "--set", f"train.max_steps={len(done) + 2}"])
    assert p.returncode == 0, p.stderr
    assert steps(d) == list(range(1, len(done) + 3))


@pytest.mark.mpi
@pytest.mark.full
def test_two_starts_at_once_one_runs_and_the_other_is_refused(tiny, tmp_path):
    d = str(tmp_path / "both")
    jobs = [start(0, tiny, d, "train.epochs=50") for _ in range(2)]  # 200 steps
    outs = [j.communicate(timeout=HANG_GUARD) for j in jobs]
    codes = sorted(j.returncode for j in jobs)
    assert codes == [0, 2], [e[-2000:] for _, e in outs]
    refused = outs[[j.returncode for j in jobs].index(2)][1]
    # refused by the live job's lock, or (a loaded machine started it after the other ended)
    # because the directory holds a run: never both running
    assert "is in use by a live job" in refused or "already holds a run" in refused, refused
    assert steps(d) == list(range(1, 201))


@pytest.mark.mpi
@pytest.mark.full
def test_a_job_killed_with_9_leaves_a_lock_the_next_start_takes_over(tiny, tmp_path):
    d = str(tmp_path / "killed")
    job = start(0, tiny, d, "train.epochs=100000", "train.checkpoint_every=2")
    wait_for_steps(d, job, n=4)
    job.kill()
    job.communicate(timeout=HANG_GUARD)
    left = json.loads(open(os.path.join(d, LOCK_NAME)).read())
    assert left["pid"] == job.pid
    p = deepfusion_here(["train", "--resume", d, "--set", "train.max_steps=12"])
    assert p.returncode == 0, p.stderr
    assert f"took over the stale lock of PID {job.pid} on host" in p.stderr
    assert "has ended" in p.stderr and not os.path.exists(os.path.join(d, LOCK_NAME))
    assert steps(d) == list(range(1, 13))


@pytest.mark.mpi
def test_an_exception_on_one_rank_leaves_no_lock(tiny, tmp_path):
    """MPI_Abort kills rank 0 with SIGKILL; the failing rank removed the lock before it."""
    d = str(tmp_path / "abort")
    job = start(2, tiny, d, env=fault_env("raise@3:1"))
    _, err = job.communicate(timeout=HANG_GUARD)
    assert job.returncode == 1 and "error on rank 1" in err, err
    assert os.path.isdir(d) and not os.path.exists(os.path.join(d, LOCK_NAME))


@pytest.mark.mpi
@pytest.mark.full
def test_a_job_whose_lock_another_job_took_ends_without_writing_more(tiny, tmp_path):
    """Another job judged this one dead and took the lock: at its next heartbeat this job ends
    every rank (exit 1) and leaves the other's lock alone."""
    d = str(tmp_path / "taken")
    job = start(2, tiny, d, "train.epochs=100000", env={"DEEPFUSION_LOCK_HEARTBEAT": "1"})
    wait_for_steps(d, job)
    other = fake_lock(d, host="node7", machine="node7||", pid=4242)
    _, err = job.communicate(timeout=HANG_GUARD)  # within one heartbeat
    assert job.returncode == 1, err
    assert "lost the lock of the run directory" in err and "PID 4242 on host node7" in err, err
    assert json.loads(open(os.path.join(d, LOCK_NAME)).read())["token"] == other.token


def test_a_resume_without_a_checkpoint_names_the_command_that_starts_over(tiny, tmp_path):
    d = str(tmp_path / "nockpt")
    os.makedirs(os.path.join(d, "checkpoints"))
    open(os.path.join(d, "metrics.jsonl"), "w").close()
    p = deepfusion_here(["train", tiny, "--resume", d])
    assert p.returncode == 2 and "no loadable checkpoint" in p.stderr, p.stderr
    assert "start over in it with --overwrite (without --resume)" in p.stderr
    p = deepfusion_here(["train", tiny, "--set", f"run.dir={d}", "--overwrite",
                         "--set", "train.max_steps=2"])  # the command it names runs
    assert p.returncode == 0, p.stderr
    assert steps(d) == [1, 2] and not os.path.exists(os.path.join(d, LOCK_NAME))
