"""A local cluster: a coordinator and workers as separate OS processes on 127.0.0.1, and its chain.

Used by ``dilocox demo`` and by the integration tests, so both exercise exactly the processes a
user would start by hand (``dilocox coordinator`` / ``dilocox worker``). Each process writes its
log to ``<run>/logs/<name>.log``; the coordinator announces its port in ``<run>/coordinator.addr``.
Every channel is TLS: the coordinator makes its self-signed certificate in ``<run>/tls/``, and the
workers and this harness pin its fingerprint (``--tls-fingerprint``), as a user would. A cluster made
with ``insecure=True`` runs both sides with ``--insecure`` instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable, ClassVar, Mapping, Protocol, Sequence

import grpc

from attestation import DevRoot
from proto import CHANNEL_OPTIONS, pb, pb_grpc
from settlement import DEV_ACCOUNTS, Chain
from settlement.provision import allow_run, deploy_to, write_dev_keys
from trainer.config import RunConfig
from trainer.net.tls import CERT_FILE, ClientTls, fingerprint, open_channel
from trainer.runstore.run_dir import RunDir
from trainer.worker.retention import RETAINED_DIR

LOCAL_CHALLENGE_WINDOW = 4  # blocks: a local cluster's run pays a round this long after it is recorded


class ClusterError(RuntimeError):
    pass


class Process(Protocol):
    """What the cluster needs of a process it started: the part of :class:`subprocess.Popen` it uses."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    """Starts ``python -m cli.main ARGS`` with stdin from /dev/null and stdout and stderr into ``stdout``."""

    def __call__(self, args: Sequence[str], *, stdout: IO[bytes], env: Mapping[str, str]) -> Process: ...


def start_process(args: Sequence[str], *, stdout: IO[bytes], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """A fresh interpreter for each process: what a user's shell does."""
    return subprocess.Popen([sys.executable, "-m", "cli.main", *args], stdin=subprocess.DEVNULL,
                            stdout=stdout, stderr=subprocess.STDOUT, env=env)


class LocalCluster:
    # How every cluster starts its processes; the test suite puts a fork server here (tests/zygote.py).
    launcher: ClassVar[Launcher] = staticmethod(start_process)

    def __init__(self, run_dir: str | Path, *, threads_per_worker: int = 1, insecure: bool = False) -> None:
        self.run_dir = RunDir(run_dir)
        self.insecure = insecure
        self.client_tls: ClientTls | None = None  # how to reach the coordinator, once it listens
        self.run_dir.logs.mkdir(exist_ok=True)
        self.threads_per_worker = threads_per_worker  # 0: the worker's own budget (its --cores)
        self.processes: dict[str, Process] = {}
        self.address: str | None = None
        self._channel: grpc.Channel | None = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: Sequence[str]) -> Process:
        old = self.processes.get(name)
        if old is not None and old.poll() is None:
            raise ClusterError(f"{name} is already running (pid {old.pid})")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        log = open(self.run_dir.logs / f"{name}.log", "ab")
        try:
            process = self.launcher(args, stdout=log, env=env)
        finally:
            log.close()
        self.processes[name] = process
        return process

    def start_coordinator(self, config: str | Path | None = None, *, port: int = 0,
                          timeout_s: float = 60.0, extra: Sequence[str] = ()) -> Process:
        self.run_dir.address_file.unlink(missing_ok=True)
        args = ["coordinator", "--run-dir", str(self.run_dir.path), "--host", "127.0.0.1", "--port", str(port)]
        if self.insecure:
            args.append("--insecure")
        if config is not None:
            args += ["--config", str(config)]
        process = self._spawn("coordinator", [*args, *extra])
        deadline = time.monotonic() + timeout_s
        while not self.run_dir.address_file.exists():
            if process.poll() is not None:
                raise ClusterError(f"coordinator exited with {process.returncode}:\n{self.log('coordinator')}")
            if time.monotonic() > deadline:
                raise ClusterError(f"coordinator did not listen within {timeout_s}s:\n{self.log('coordinator')}")
            time.sleep(0.05)
        self.address = self.run_dir.address_file.read_text().strip()
        if self.insecure:
            self.client_tls = ClientTls(insecure=True)
        else:
            cert = (self.run_dir.path / "tls" / CERT_FILE).read_bytes()
            self.client_tls = ClientTls(fingerprint=fingerprint(cert))
        self._channel = None
        return process

    def tls_args(self) -> list[str]:
        """The flags that make a worker (or ``dilocox status``) trust this cluster's coordinator."""
        assert self.client_tls is not None, "start the coordinator first"
        if self.client_tls.insecure:
            return ["--insecure"]
        return ["--tls-fingerprint", str(self.client_tls.fingerprint)]

    def channel(self) -> grpc.Channel:
        """A new channel to the coordinator, secured as its workers' are (the caller closes it)."""
        assert self.address is not None and self.client_tls is not None, "start the coordinator first"
        return open_channel(self.address, self.client_tls, CHANNEL_OPTIONS)

    def start_worker(self, worker_id: str, extra: Sequence[str] = ()) -> Process:
        if self.address is None:
            raise ClusterError("start the coordinator first")
        threads = ["--threads", str(self.threads_per_worker)] if self.threads_per_worker else []
        receipts = [] if "--receipts" in extra else ["--receipts", str(self.receipts_dir(worker_id))]
        receipts += [] if "--retain" in extra else ["--retain", str(self.retained_dir(worker_id))]
        return self._spawn(worker_id, ["worker", "--coordinator", self.address, "--worker-id", worker_id,
                                       *threads, *receipts, *self.tls_args(), *extra])

    def retained_dir(self, worker_id: str) -> Path:
        """Where a worker this cluster starts keeps its committed inner states to reveal (trainer.worker.retention)."""
        return self.run_dir.path / RETAINED_DIR / worker_id

    def receipts_dir(self, worker_id: str) -> Path:
        """Where a worker this cluster starts keeps the coordinator's receipts (trainer.worker.receipts)."""
        return self.run_dir.path / "receipts" / worker_id

    def stub(self) -> pb_grpc.CoordinatorStub:
        if self._channel is None:
            self._channel = self.channel()
        return pb_grpc.CoordinatorStub(self._channel)

    def status(self) -> pb.StatusResponse:
        return self.stub().Status(pb.StatusRequest(), timeout=10)

    def wait_for(self, predicate: Callable[[pb.StatusResponse], bool], timeout_s: float,
                 what: str = "condition") -> pb.StatusResponse:
        """Poll Status until ``predicate`` holds; fail early if the coordinator died."""
        deadline = time.monotonic() + timeout_s
        while True:
            coordinator = self.processes.get("coordinator")
            try:
                status = self.status()
                if predicate(status):
                    return status
            except grpc.RpcError as exc:
                if coordinator is not None and coordinator.poll() is not None:
                    raise ClusterError(f"coordinator exited with {coordinator.returncode} while waiting "
                                       f"for {what}:\n{self.log('coordinator')}") from exc
            if time.monotonic() > deadline:
                raise ClusterError(f"timed out after {timeout_s}s waiting for {what}")
            time.sleep(0.2)

    def wait_exit(self, name: str, timeout_s: float) -> int:
        try:
            return self.processes[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise ClusterError(f"{name} still running after {timeout_s}s:\n{self.log(name)}") from exc

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.processes[name]
        process.send_signal(sig)
        process.wait(timeout=30)

    def log(self, name: str, tail: int = 40) -> str:
        try:
            lines = (self.run_dir.logs / f"{name}.log").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-tail:])

    def stop(self) -> None:
        """Terminate whatever still runs: SIGTERM, then SIGKILL after a grace period."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        running = [p for p in self.processes.values() if p.poll() is None]
        for process in running:
            process.terminate()
        deadline = time.monotonic() + 10
        for process in running:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def provision(run_dir: Path, rpc_url: str, config: RunConfig) -> tuple[list[str], list[str]]:
    """A local cluster's chain, as ``dilocox chain deploy`` and ``dilocox run create`` make it
    (settlement.provision), with the dev accounts' keys in <run>/chain: deploy, allowlist the
    measurement, make the coordinator a verifier, create the dev root; returns the extra
    command-line arguments of the coordinator and of each worker."""
    chain_dir = run_dir / "chain"
    keys = write_dev_keys(chain_dir)
    owner, coordinator = Chain(rpc_url, DEV_ACCOUNTS[0]), Chain(rpc_url, DEV_ACCOUNTS[1])
    deployment = deploy_to(owner, chain_dir / "deployment.json")
    allow_run(owner, deployment, str(config.cid), coordinator.address)
    dev_root = DevRoot.load_or_create(run_dir / "dev-root")
    coordinator_args = ["--ledger", str(chain_dir / "deployment.json"), "--chain-rpc", rpc_url,
                        "--chain-key-file", str(keys[1]), "--allow-dev", "--dev-root", dev_root.address,
                        "--challenge-window", str(LOCAL_CHALLENGE_WINDOW)]
    worker_args = ["--attestation", "dev", "--dev-root-dir", str(run_dir / "dev-root")]
    return coordinator_args, worker_args
