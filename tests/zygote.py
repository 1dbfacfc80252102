"""A fork server for the processes the integration tests start: each one a real OS process running
``python -m cli.main ARGS`` — its own pid, argv, environment, working directory, log file and
signals — forked from a server that has already imported the third-party libraries (torch, gRPC,
web3, ...) instead of importing them again.

Why: an integration test starts a coordinator and two or three workers, and the suite starts about
two hundred of them. Each fresh interpreter spends about 1.5 s of CPU importing those libraries
before it runs a line of ours, which on a 2-core machine is minutes of the suite's wall time. The
server imports no module of this repository, so each child imports ours afresh, after its own
environment is in place, exactly as a fresh ``python -m cli.main`` would. The commands a user
types by hand (the by-hand script, ``dilocox demo``, the user-error cases, ``audit``) still start
cold through :mod:`subprocess`, so a fresh interpreter's start is tested too.

Protocol, on a Unix SOCK_SEQPACKET socket (each send one message), one connection per child: the
client sends one JSON message ``{"argv",
"env", "cwd"}`` with its stdin/stdout/stderr descriptors (SCM_RIGHTS); the server forks, answers
``pid\\n`` and, when the child ends, ``returncode\\n`` (negative: the signal that ended it, as
:class:`subprocess.Popen` reports it), then closes the connection. The server exits when the pytest
process that started it closes its stdin.
"""

from __future__ import annotations

import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO, TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:  # the server imports nothing of this repository; the client, cli.cluster when it launches
    from cli.cluster import Process

# What a coordinator, a worker and the CLI's other commands import from outside this repository
# (each name with the submodules it imports). A name missing here is only imported by the child.
PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.pipelining", "safetensors.torch",
           "grpc", "grpc_health.v1.health", "google.protobuf", "cryptography.x509", "web3", "eth_account",
           "dcap_qvl", "rich.console", "rich.logging", "requests", "multiprocessing.forkserver")
REPO = Path(__file__).resolve().parents[1]
_MAX_REQUEST = 1 << 20


# --- the server ---------------------------------------------------------------------------------

def _preload() -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass


def _run_child(request: dict, fds: Sequence[int], keep_closed: Sequence[int]) -> None:
    """In the forked child: become ``python -m cli.main ARGV`` in the caller's environment, then
    exit as the interpreter would (non-daemon threads joined, atexit handlers run)."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        for fd in keep_closed:
            os.close(fd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # Unbuffered, as the launcher's PYTHONUNBUFFERED=1 makes a fresh interpreter: a test reads
        # the log while the process runs.
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                      errors="backslashreplace")
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.path[:0] = [request["cwd"]]
        sys.argv = ["cli.main", *request["argv"]]
        try:
            runpy.run_module("cli.main", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:  # the traceback a fresh interpreter would print, and its status
            traceback.print_exc()
            code = 1
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        import atexit
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _tell(conn: socket.socket, number: int) -> None:
    """One message to a client; one that has gone (its process object dropped) costs nothing here."""
    try:
        conn.sendall(f"{number}\n".encode())
    except OSError:
        pass


def serve(path: str) -> None:
    _preload()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, wake_r, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1024):
            return  # the pytest process is gone
        if wake_r in readable:
            os.read(wake_r, 4096)
            while children:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    break
                conn = children.pop(pid, None)
                if conn is not None:
                    _tell(conn, os.waitstatus_to_exitcode(status))
                    conn.close()
        if listener in readable:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, _MAX_REQUEST, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                others = [listener.fileno(), wake_r, wake_w, conn.fileno(), sys.stdin.fileno(),
                          *(c.fileno() for c in children.values())]
                _run_child(request, fds, others)
            for fd in fds:
                os.close(fd)
            _tell(conn, pid)
            children[pid] = conn


# --- the client ---------------------------------------------------------------------------------

def _read_at_start(env: Mapping[str, str]) -> dict[str, str]:
    """The variables an interpreter reads only as it starts (PYTHONPATH, PYTHONHASHSEED, ...): a child
    whose environment differs from the server's in one of them cannot be forked from it."""
    return {k: v for k, v in env.items() if k.startswith("PYTHON") and k != "PYTHONUNBUFFERED"}


class ForkedProcess:
    """The part of :class:`subprocess.Popen` that :class:`cli.cluster.LocalCluster` uses, for a
    child of the fork server."""

    def __init__(self, args: Sequence[str], conn: socket.socket, pid: int) -> None:
        self.args = list(args)
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self._buffer = b""

    def _read_status(self, timeout: float | None) -> int | None:
        if self.returncode is not None:
            return self.returncode
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return None
        while not self._buffer.endswith(b"\n"):
            chunk = self._conn.recv(64)
            if not chunk:
                raise RuntimeError(f"the fork server went away before pid {self.pid} ended")
            self._buffer += chunk
        self.returncode = int(self._buffer)
        self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._read_status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """A fork server for this pytest process, started on first use (:meth:`launch`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._server: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="zygote-")
        self.path = os.path.join(self._dir, "s")
        self._env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self._read_at_start = _read_at_start(os.environ)

    def _ensure_running(self) -> None:
        if self._server is not None and self._server.poll() is None:
            return
        self._server = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.path], cwd=REPO, env=self._env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self._server.stdout is not None
        if self._server.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the fork server did not start (exit {self._server.wait()})")

    def launch(self, args: Sequence[str], *, stdout: IO[bytes], env: Mapping[str, str],
               cwd: str | Path | None = None) -> Process:
        """Start ``python -m cli.main ARGS`` with stdin from /dev/null and stdout and stderr into
        ``stdout``, as :meth:`cli.cluster.LocalCluster.spawn` does with :class:`subprocess.Popen`."""
        if _read_at_start(env) != self._read_at_start:
            # A PYTHONPATH with a test's patched sitecustomize, say: only a fresh interpreter reads it.
            from cli.cluster import start_process
            return start_process(args, stdout=stdout, env=env)
        request = json.dumps({"argv": list(args), "env": dict(env), "cwd": str(cwd or os.getcwd())}).encode()
        with self._lock:
            self._ensure_running()
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(self.path)
        with open(os.devnull, "rb") as devnull:
            socket.send_fds(conn, [request], [devnull.fileno(), stdout.fileno(), stdout.fileno()])
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = conn.recv(64)
            if not chunk:
                raise RuntimeError("the fork server closed the connection before it forked")
            answer += chunk
        return ForkedProcess(["cli.main", *args], conn, int(answer))

    def close(self) -> None:
        if self._server is not None:
            assert self._server.stdin is not None
            self._server.stdin.close()
            self._server.wait(timeout=30)
            self._server = None
        try:
            os.unlink(self.path)
            os.rmdir(self._dir)
        except OSError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1])
