"""A local development chain: the pinned ``anvil`` binary run as a managed child process.

The demo, the tests and the gas benchmark need a real EVM chain on this machine, and nothing else
may be reached from it. ``Anvil`` starts the binary that ``make setup`` installs under
``contracts/node_modules/.bin`` on 127.0.0.1 only, waits until it answers JSON-RPC, and stops it
cleanly. With a ``state_file`` the chain survives restarts: anvil loads the file on start, dumps it
every second while running (so a SIGKILL loses at most about a second of blocks) and once more when
stopped with SIGTERM.

A ``detached`` anvil (``dilocox chain up``) runs in its own session with its log in ``log_file``,
and is left running when this process exits: ``detach()`` hands its pid over, and whoever keeps the
pid stops it (``dilocox chain down``).

While an anvil runs, SIGTERM and SIGHUP to this process are an orderly exit (:class:`Terminated`,
status 128 + the signal's number, one line on stderr saying why): the ``with`` blocks unwind as on
any exception, so the anvil is stopped and temporary directories are removed, as at a normal exit
(SIGINT already unwinds them, as KeyboardInterrupt). The handlers are installed by the first
``start`` in the main thread over the default ones only (a process with its own, such as the
coordinator, keeps them) and put back when the last anvil stops. Every command that starts anvil
(``dilocox audit``, ``settle``, ``demo``, ``bench gas``) gets this one behaviour.

    with Anvil(state_file=run / "chain" / "state.json") as anvil:
        chain = Chain(anvil.rpc_url, DEV_ACCOUNTS[0])
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from pathlib import Path
from types import TracebackType
from typing import Self

from storage_client import DilocoxError

__all__ = ["DEV_ACCOUNTS", "Anvil", "AnvilError", "Terminated", "anvil_binary"]

#: The private keys of anvil's first four default accounts (each funded with 10,000 ETH).
#: They are PUBLIC TEST KEYS, printed by every anvil and hardhat node and derived from the well-known
#: mnemonic "test test ... junk"; anything sent to their addresses on a real network is taken at
#: once. Use them on local development chains only.
DEV_ACCOUNTS: tuple[str, ...] = (
    "0xac0974bec39a17e36ba4a6b4d238ff944bacb478cbed5efcae784d7bf4f2ff80",
    "0x59c6995e998f97a5a0044966f0945389dc9e86dae88c7a8412f4603b6b78690d",
    "0x5de4111afa1a4b94908f83103eb1f1706367c2e68ca870fc3fb9a804cdab365a",
    "0x7c852118294e51e653712a81e05800f419141751be58f605c371e15141b007a6",
)

_HOST = "127.0.0.1"
_LOG_TAIL_BYTES = 4000

# Anvils still running when the interpreter exits are stopped (their state dumped), never orphaned.
_running: weakref.WeakSet[Anvil] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for anvil in list(_running):
        anvil.stop()


class AnvilError(DilocoxError, RuntimeError):
    """The anvil binary is missing, or the chain did not start."""


class Terminated(SystemExit):
    """SIGTERM or SIGHUP while an anvil runs: leave as on an error, cleaning up on the way out
    (a SystemExit, so no ``except Exception`` swallows it; exit status 128 + the signal's number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signum = signum


_TERMINATING = (signal.SIGTERM, signal.SIGHUP)
_installed: dict[int, object] = {}  # signal -> the handler it had before, while ours is installed
_terminating = False


def _orderly_exit(signum: int, frame: object) -> None:
    global _terminating
    _terminating = True
    for sig in _TERMINATING:  # a second signal must not cut the clean-up short
        signal.signal(sig, signal.SIG_IGN)
    name = signal.Signals(signum).name
    os.write(2, f"dilocox: {name}: stopping the local chain and removing temporary files, then exiting\n".encode())
    raise Terminated(signum)


def _install_exit_handlers() -> None:
    """Our handler for SIGTERM and SIGHUP, where the process has the default one (main thread only)."""
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    for sig in _TERMINATING:
        if signal.getsignal(sig) == signal.SIG_DFL:
            _installed[sig] = signal.signal(sig, _orderly_exit)


def _restore_exit_handlers() -> None:
    """The handlers from before, once no anvil runs (left as they are while exiting on a signal)."""
    if _running or _terminating or threading.current_thread() is not threading.main_thread():
        return
    while _installed:
        sig, previous = _installed.popitem()
        signal.signal(sig, previous)  # type: ignore[arg-type]


def anvil_binary() -> Path:
    """The pinned anvil binary, ``contracts/node_modules/.bin/anvil`` in this repository.

    @return its path
    @raise AnvilError when it is not installed (``make setup`` installs it)
    """
    path = Path(__file__).resolve().parent.parent / "contracts" / "node_modules" / ".bin" / "anvil"
    if not path.is_file() or not os.access(path, os.X_OK):
        raise AnvilError(f"anvil is not installed at {path}; run `make setup` (it runs npm ci in contracts/)")
    return path


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((_HOST, 0))
        return int(s.getsockname()[1])


def _port_taken(port: int) -> bool:
    """Whether something listens on 127.0.0.1:port (SO_REUSEADDR: TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((_HOST, port))
        except OSError:
            return True
        return False


def _rpc_chain_id(url: str, timeout_s: float) -> int | None:
    """eth_chainId, or None while nothing answers."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "eth_chainId", "params": []}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return int(json.loads(response.read())["result"], 16)
    except (OSError, urllib.error.URLError, ValueError, KeyError):
        return None


class Anvil:
    """One local anvil chain on 127.0.0.1, as a context manager.

    @param state_file where the chain state is loaded from and dumped to (None: in memory only)
    @param port the RPC port; 0 picks a free one at start
    @param chain_id the chain id anvil reports (and EIP-712 domains use)
    @param log_file where anvil's output goes (None: a temporary file, removed when it stops)
    @param detached start it in its own session (a terminal's Ctrl-C does not reach it) so that
        ``detach()`` can leave it running after this process
    """

    def __init__(self, state_file: Path | None = None, port: int = 0, chain_id: int = 31337,
                 *, startup_timeout_s: float = 30.0, stop_grace_s: float = 10.0, log_file: Path | None = None,
                 detached: bool = False) -> None:
        self.state_file = Path(state_file) if state_file is not None else None
        self.port = port
        self.chain_id = chain_id
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self._requested_port = port
        self.log_file = Path(log_file) if log_file is not None else None
        self.detached = detached
        self._process: subprocess.Popen[bytes] | None = None
        self._log_dir: tempfile.TemporaryDirectory[str] | None = None

    def __repr__(self) -> str:
        where = self.rpc_url if self.running else "stopped"
        return f"Anvil({where}, chain_id={self.chain_id}, state_file={self.state_file})"

    @property
    def rpc_url(self) -> str:
        """The JSON-RPC endpoint, ``http://127.0.0.1:PORT`` (after a stop: where it was)."""
        if not self.port:
            raise AnvilError("anvil has not been started (no port yet)")
        return f"http://{_HOST}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int:
        if self._process is None:
            raise AnvilError("anvil is not running")
        return self._process.pid

    def _log_path(self) -> Path | None:
        if self.log_file is not None:
            return self.log_file
        return None if self._log_dir is None else Path(self._log_dir.name) / "anvil.log"

    def log_tail(self) -> str:
        """The last few KB of anvil's stdout and stderr."""
        path = self._log_path()
        if path is None:
            return ""
        try:
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - _LOG_TAIL_BYTES))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def start(self) -> Self:
        """Start anvil and wait until it answers ``eth_chainId``.

        @return self
        @raise AnvilError when the binary is missing, anvil exits, or it does not answer in time
        """
        if self._process is not None:
            raise AnvilError(f"anvil is already started at {self.rpc_url}")
        binary = anvil_binary()
        if self.state_file is not None:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
        # A port picked here can be taken by someone else before anvil binds it: try a few.
        attempts = 3 if self._requested_port == 0 else 1
        for attempt in range(attempts):
            try:
                _install_exit_handlers()  # before the child exists: no window in which a signal orphans it
                self._launch(binary)
                self._wait_ready()
                _running.add(self)
                return self
            except AnvilError:
                exited = self._process is not None and self._process.poll() is not None
                self._terminate()
                if not exited or attempt == attempts - 1:
                    _restore_exit_handlers()
                    raise
            except BaseException:  # a signal or Ctrl-C while starting: no anvil is left behind
                self._terminate()
                _restore_exit_handlers()
                raise
        raise AssertionError("unreachable")

    def _launch(self, binary: Path) -> None:
        if self._requested_port and _port_taken(self._requested_port):
            # Checked first: another node there would answer the readiness probe in anvil's stead.
            raise AnvilError(f"cannot start anvil on {_HOST}:{self._requested_port}: the port is already in use")
        self.port = self._requested_port or _free_port()
        args = [str(binary), "--host", _HOST, "--port", str(self.port), "--chain-id", str(self.chain_id),
                "--silent"]
        if self.state_file is not None:
            args += ["--state", str(self.state_file), "--state-interval", "1"]
        if self.log_file is None:
            self._log_dir = tempfile.TemporaryDirectory(prefix="dilocox-anvil-")
        log_path = self._log_path()
        assert log_path is not None
        with open(log_path, "wb") as log:
            self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=self.detached)

    def _wait_ready(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                raise AnvilError(f"anvil exited with code {code} before answering on {self.rpc_url}; "
                                 f"its log ends:\n{self.log_tail() or '(empty)'}")
            answered = _rpc_chain_id(self.rpc_url, timeout_s=1.0)
            if answered is not None:
                if answered != self.chain_id:
                    raise AnvilError(f"anvil on {self.rpc_url} reports chain id {answered}, "
                                     f"expected {self.chain_id}")
                return
            if time.monotonic() > deadline:
                raise AnvilError(f"anvil did not answer eth_chainId on {self.rpc_url} within "
                                 f"{self.startup_timeout_s:.0f}s; its log ends:\n{self.log_tail() or '(empty)'}")
            time.sleep(0.05)

    def detach(self) -> int:
        """Leave a ``detached`` anvil running after this process exits; returns its pid (whoever keeps
        it stops the chain, with SIGTERM so that the state is dumped)."""
        if not self.detached:
            raise AnvilError("only an anvil started with detached=True can be left running")
        pid = self.pid
        _running.discard(self)
        self._process = None
        return pid

    def stop(self) -> None:
        """SIGTERM (anvil dumps its state file), wait, SIGKILL after the grace period. Idempotent."""
        _running.discard(self)
        self._terminate()
        _restore_exit_handlers()

    def _terminate(self) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log_dir is not None:
            self._log_dir.cleanup()
            self._log_dir = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
