"""A warm ``deepfusion`` for the documentation's examples: one server process imports torch,
the package and its libraries once; every plain ``deepfusion ARGS`` of a shell block (and every
Python block) then runs in a fork of it instead of a fresh interpreter importing them again.

    with WarmServer(tmp_dir, env) as warm:      # warm.env(env): its shims first on PATH
        subprocess.run(["bash", "-c", "deepfusion problems"], env=warm.env(env))
        subprocess.run(warm.python_argv(code), env=warm.env(env))    # `python -c CODE`, warm

A fork starts with the argv, environment, working directory and standard streams of the
command that asked for it, and ends as a fresh interpreter would (its threads joined, atexit
run, streams flushed); its exit status is the command's. Nothing of the imported modules has
run in the server (no torch op, no MPI), so each fork picks its threads and initialises MPI
itself. Under a launcher (mpiexec's ranks) the shim runs the real command, and so does a shim
that finds no server: a rank starts as it does for a user.
"""
from __future__ import annotations

import array
import json
import os
import socket
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOCKET_VAR = "DEEPFUSION_TEST_WARM"
# variables a launcher sets in each rank: there the real command starts, MPI with it
LAUNCHED = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
PRELOAD = ("numpy", "scipy.sparse.linalg", "h5py", "torch", "matplotlib.pyplot", "deepfusion.cli",
           "deepfusion.app.train", "deepfusion.app.infer", "deepfusion.engine.predict.service",
           "deepfusion.app.solver",
           "deepfusion.app.export", "deepfusion.jobs.sweep", "diffnet.problems")
SHIM = """#!{python} -S
import sys
sys.path.insert(0, {root!r})
from tests.warm_cli import client
client({mode!r})
"""


# -- the client: the shim's side ------------------------------------------------------------------

def client(mode: str) -> None:
    """Run ``deepfusion ARGS`` (mode "deepfusion") or ``python -c CODE`` (mode "python") of
    this process's argv in a fork of the server; exit with its status."""
    argv, path = sys.argv[1:], os.environ.get(SOCKET_VAR, "")
    if mode == "deepfusion" and (any(v in os.environ for v in LAUNCHED) or not path):
        os.execv(sys.executable, [sys.executable, "-m", "deepfusion", *argv])
    request = json.dumps({"mode": mode, "argv": argv, "cwd": os.getcwd(),
                          "env": dict(os.environ)}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        fds = array.array("i", [0, 1, 2])
        s.sendmsg([struct.pack("!I", len(request)), request],
                  [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        status = _recv_exactly(s, 4)
    sys.exit(struct.unpack("!i", status)[0] if len(status) == 4 else 1)


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


# -- the server ---------------------------------------------------------------------------------

def serve(path: str):
    """Listen on ``path``; for each request fork a child that reports the status of a fork of
    its own, which returns here with the job to run (the server itself never returns)."""
    import signal

    for name in PRELOAD:
        __import__(name)
    own = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    base = [p for p in sys.path[1:] if p not in own]  # a job's PYTHONPATH and script go first
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    signal.signal(signal.SIGTERM, _stop)
    print("ready", flush=True)
    while True:
        _reap(os.WNOHANG)
        conn, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a job's signals are a fresh one's
            return _report(conn, base)
        conn.close()


def _reap(flags: int) -> None:
    """Wait for ended reporters (their CPU time then counts in the server's, and so in the
    test process's, as a fresh process's would)."""
    try:
        while os.waitpid(-1, flags)[0]:
            pass
    except ChildProcessError:
        pass


def _stop(*_):
    _reap(0)
    os._exit(0)


def _report(conn: socket.socket, base: list[str]):
    """In the reporter: read the request, fork the job (which returns its runner) and send the
    job's exit status back."""
    msg, fds, size = b"", [], None
    while size is None or len(msg) < 4 + size:  # the descriptors come with the first bytes
        data, anc, _, _ = conn.recvmsg(1 << 16, socket.CMSG_SPACE(3 * 4))
        if not data:
            os._exit(1)
        msg += data
        for level, kind, raw in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", raw[:len(raw) - len(raw) % 4]).tolist()
        if size is None and len(msg) >= 4:
            size = struct.unpack("!I", msg[:4])[0]
    req = json.loads(msg[4:])
    if len(fds) != 3:  # never let a job write on the server's streams
        os._exit(1)
    pid = os.fork()
    if pid == 0:
        conn.close()
        return _job(req, fds, base)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    conn.sendall(struct.pack("!i", code if code >= 0 else 128 - code))
    os._exit(0)


def _job(req: dict, fds: list[int], base: list[str]):
    """Become the command's process (streams, directory, environment, sys.path, argv) and
    return what runs it."""
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if req["mode"] == "python":
        sys.path[:] = [""] + extra + base
        sys.argv = ["-c"] + req["argv"][1:]
        return lambda: _python(req["argv"][0])
    sys.path[:] = [os.path.dirname(sys.executable)] + extra + base
    sys.argv = [os.path.join(os.path.dirname(sys.executable), "deepfusion")] + req["argv"]
    return _deepfusion


def _deepfusion():
    from deepfusion.cli import main

    sys.exit(main())


def _python(code: str):
    import types

    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    exec(compile(code, "<string>", "exec"), main.__dict__)


def finish(job) -> None:
    """Run the job and end the process as the interpreter ends one: the exit status of its
    SystemExit or uncaught exception, non-daemon threads joined, atexit run, streams flushed,
    then C's exit (the libraries' own exit handlers). Only the teardown of the modules, which
    writes nothing and is most of the time a process with torch loaded takes to end, is left
    to the operating system."""
    import atexit
    import ctypes
    import threading

    code = 0
    try:
        job()
    except SystemExit as e:
        code = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught one
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # noqa: SLF001 - the interpreter's own wait for non-daemon threads
    atexit._run_exitfuncs()  # noqa: SLF001
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            code = code or 120  # what the interpreter exits with when the flush fails
    ctypes.CDLL(None).exit(int(code))


def _exit_status(code) -> int:
    """The status of ``sys.exit(code)``: None is 0, an int itself, anything else is printed
    and 1."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


# -- the fixture's side -------------------------------------------------------------------------

class WarmServer:
    """Start the server in ``directory`` (its socket and the shims' ``bin``); stop it on exit."""

    def __init__(self, directory, env: dict):
        import subprocess

        self.dir = str(directory)
        self.bin = os.path.join(self.dir, "bin")
        os.makedirs(self.bin, exist_ok=True)
        self.socket = os.path.join(self.dir, "warm.sock")
        for name, mode in (("deepfusion", "deepfusion"), ("warm-python", "python")):
            shim = os.path.join(self.bin, name)
            with open(shim, "w") as f:
                f.write(SHIM.format(python=sys.executable, root=ROOT, mode=mode))
            os.chmod(shim, 0o755)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_cli", self.socket],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline().strip()
        assert ready == "ready", f"the warm deepfusion server did not start: {ready!r}"

    def env(self, env: dict) -> dict:
        """``env`` with the shims first on PATH and the server's socket named."""
        return dict(env, PATH=self.bin + os.pathsep + env["PATH"], **{SOCKET_VAR: self.socket})

    def python_argv(self, code: str) -> list[str]:
        return [os.path.join(self.bin, "warm-python"), code]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        import subprocess

        self.proc.terminate()  # the server waits for its jobs, then ends
        try:
            self.proc.wait(timeout=60)  # a hang guard: a job left over from a failed test
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


if __name__ == "__main__":
    finish(serve(sys.argv[1]))  # returns in a forked job only
