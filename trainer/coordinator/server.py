"""The coordinator process: one run directory, one gRPC server, the round loop, exit codes.

``serve`` locks the run directory (one coordinator a run), opens the run, starts the service
(trainer.coordinator.service) on a grpc.aio server of its own event loop (``RpcServer``, with the
HTTP/2 limits of ``SERVER_OPTIONS``), the run's store as a trustless gateway on a second port with
the same certificate (storage_client.gateway, its bounds per client) and, when the run has a ledger,
the settlement thread of its trust layer; then closes and publishes rounds until the last, lets
live workers fetch the final checkpoint, and waits for the ledger to confirm every round. It exits 1
with one line when a round cannot be published, when it cannot close because every live worker's
push of it was refused (Coordinator.stalled; the workers are told, and stop too), when a port cannot
be listened on, or when the ledger cannot be caught up; everything finished stays in the run
directory, and a restart resumes from HEAD.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import signal
import ssl
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2

from proto import CHANNEL_OPTIONS, SERVICE_NAME
from storage_client.gateway import GatewayServer, start_gateway
from trainer.config import RunConfig
from trainer.coordinator.machine import Coordinator
from trainer.coordinator.run import Run, open_run
from trainer.coordinator.service import (
    MAX_RPCS,
    MAX_STREAMS_PER_CONNECTION,
    CoordinatorService,
    Health,
    handler,
    health_handler,
)
from trainer.coordinator.trust import RunTrust
from trainer.net.limits import clip
from trainer.runstore.run_dir import RunDir
from trainer.runstore.spool import empty_scratch

log = logging.getLogger("dilocox.service")


class RunDirBusy(OSError):
    """Another coordinator holds this run directory."""


def lock_run_dir(run_dir: RunDir) -> int:
    """An exclusive lock on <run>/coordinator.lock for this process's life: one coordinator a run."""
    fd = os.open(run_dir.path / "coordinator.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirBusy(f"another coordinator is serving {run_dir.path} (it holds coordinator.lock)") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


# HTTP/2 and connection limits (module docstring of trainer.coordinator.calls for the rest).
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *CHANNEL_OPTIONS,
    ("grpc.so_reuseport", 0),                      # a port another process holds is refused, not shared
    ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
    ("grpc.max_metadata_size", 16 << 10),          # headers: a worker sends its id and token
    ("grpc.server_handshake_timeout_ms", 10_000),  # a TLS handshake that does not finish
    ("grpc.max_connection_idle_ms", 30_000),       # no call for 30 s: closed (a worker's channel reconnects)
    ("grpc.keepalive_time_ms", 60_000),            # the server pings a quiet peer to find dead ones
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # ping floods: GOAWAY after max strikes
    ("grpc.http2.max_ping_strikes", 2),
)


class RpcServer:
    """The grpc.aio server on an event loop of its own thread, so the round loop and the settlement
    thread stay plain threads. ``start`` returns the bound port; ``stop`` ends every call."""

    def __init__(self, service: CoordinatorService, health: Health, where: str,
                 credentials: grpc.ServerCredentials | None) -> None:
        self.service, self.health, self.where, self.credentials = service, health, where, credentials
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rpc-loop", daemon=True)
        self._server: grpc.aio.Server | None = None

    def start(self) -> int:
        self._thread.start()
        return asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=60)

    async def _start(self) -> int:
        self.service.bind(asyncio.get_running_loop())
        server = grpc.aio.server(options=SERVER_OPTIONS, maximum_concurrent_rpcs=MAX_RPCS)
        server.add_generic_rpc_handlers((handler(self.service), health_handler(self.health)))
        try:
            bound = (server.add_secure_port(self.where, self.credentials) if self.credentials
                     else server.add_insecure_port(self.where))
        except RuntimeError:
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {self.where}: the address is in use or not this machine's")
        await server.start()
        self._server = server
        return bound

    def set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.loop.call_soon_threadsafe(self.health.set, name, status)

    def stop(self, grace_s: float) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result(timeout=grace_s + 30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


def _raise_open_file_limit() -> None:
    """Every connection costs a file descriptor: allow as many as the system lets this process have,
    so idle connections of strangers (closed after 30 s) exhaust no soft limit of 1,024 first."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)


def serve(run_dir: RunDir, config: RunConfig | None, host: str = "127.0.0.1", port: int = 0,
          linger_s: float = 10.0, trust: Callable[[Run], RunTrust] | None = None, settle_timeout_s: float = 120.0,
          credentials: grpc.ServerCredentials | None = None, idle_s: float = 30.0,
          store_port: int | None = None, gateway_tls: ssl.SSLContext | None = None) -> int:
    """Run the coordinator until the run's last round is published and, with a ledger, recorded
    (or SIGTERM/SIGINT). Rounds the chain has not confirmed stay in <run>/outbox for next time.
    ``trust`` opens the run's trust layer once the run is known (settlement.ledger_trust);
    ``credentials`` None serves plaintext, which the caller must have asked for (--insecure).
    ``store_port`` (0: a free one; None: none) serves the run's store as a trustless gateway on
    ``host`` with ``gateway_tls`` (the gRPC port's certificate; None: plaintext, with --insecure)."""
    lock = lock_run_dir(run_dir)
    _raise_open_file_limit()
    empty_scratch(run_dir.scratch)  # spools of pushes a previous process never finished
    run = open_run(run_dir, config)
    coordinator = Coordinator(run, trust=trust(run) if trust is not None else None)
    service = CoordinatorService(coordinator, idle_s=idle_s)
    server = RpcServer(service, Health(service.gate), f"{host}:{port}", credentials)
    try:
        bound = server.start()
    except BaseException:
        server.stop(0)
        raise
    try:
        gateway = _start_gateway(run_dir, host, store_port, gateway_tls)
    except BaseException:
        server.stop(0)
        raise
    service.gateway = gateway
    server.set_health(health_pb2.HealthCheckResponse.SERVING)
    address = f"{host}:{bound}"
    run_dir.write_address(address)
    log.info("coordinator of run %s listening on %s (%s), open round %d of %d", coordinator.config.run_id,
             address, "TLS" if credentials else "PLAINTEXT: --insecure", coordinator.round.number,
             coordinator.config.rounds.rounds)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    settling = threading.Event()
    failure: list[str] = []
    settler = None
    if coordinator.trust is not None:
        settler = threading.Thread(target=coordinator.trust.settle, args=(coordinator, settling, stop, failure),
                                   name="settlement", daemon=True)
        settler.start()
    try:
        code = _run_rounds(coordinator, run_dir, stop, linger_s, settle_timeout_s)
        if failure:
            log.error("cannot go on: %s. Rounds stay published in %s; nothing was sent in their place",
                      failure[0], run_dir.path)
            code = 1
    except Exception as exc:  # a round that cannot be published: stop at once, resumable from HEAD
        log.error("cannot go on: round %d was not published: %s: %s. HEAD stays at round %d and the "
                  "accepted updates stay journalled; fix the cause and start the coordinator again",
                  coordinator.round.number, type(exc).__name__, clip(exc, 300), coordinator.global_state.round)
        log.debug("publish failure", exc_info=True)
        code = 1
    finally:
        settling.set()
        if settler is not None:
            settler.join(timeout=30)
        server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        server.stop(grace_s=2.0)
        if gateway is not None:
            gateway.shutdown()
            gateway.server_close()
            log.info("store gateway sent %d bytes", gateway.bytes_out)  # its egress (benchmarks.egress reads it)
        service.close()
        os.close(lock)
    return code


def _start_gateway(run_dir: RunDir, host: str, port: int | None, tls: ssl.SSLContext | None) -> GatewayServer | None:
    """The run's store served as an IPFS trustless gateway (storage_client.gateway) beside the gRPC
    port: workers fetch the global state by CID from it when no mirror has it; announced to them
    in JoinResponse.store_port and to operators in Status."""
    if port is None:
        return None
    try:
        gateway, _ = start_gateway(run_dir.store, host, port, tls)
    except OSError as exc:
        raise OSError(f"cannot serve the store on {host}:{port}: {exc.strerror or exc}") from None
    log.info("store gateway at %s/ipfs/<cid> (%s)", gateway.url, "TLS, the same certificate" if tls else "PLAINTEXT")
    return gateway


def _run_rounds(coordinator: Coordinator, run_dir: RunDir, stop: threading.Event, linger_s: float,
                settle_timeout_s: float) -> int:
    """Close and publish rounds until the run is finished (or ``stop``), then let workers see the
    end and the ledger catch up; returns the exit status: 1 when rounds remain unrecorded."""
    while not stop.is_set() and not coordinator.finished:
        if coordinator.close_due():
            coordinator.close_round()
        elif (why := coordinator.stalled()) is not None:
            return _halt(coordinator, why, stop, linger_s)
        else:
            stop.wait(0.05)
    if not coordinator.finished:
        log.info("stopped at round %d by a signal; the run resumes from %s", coordinator.round.number, run_dir.path)
        return 0
    # Let live workers fetch the final checkpoint and learn the run is over before going away.
    _linger(coordinator, stop, linger_s)
    log.info("run %s finished: %d rounds, head %s", coordinator.config.run_id,
             coordinator.global_state.round, coordinator.global_state.manifest_cid)
    deadline = time.monotonic() + settle_timeout_s
    while not stop.is_set() and not coordinator.settled() and time.monotonic() < deadline:
        stop.wait(0.2)
    if not coordinator.settled():
        log.error("not every round is recorded on the ledger yet; what is left stays queued in %s "
                  "and is sent when the coordinator runs again", run_dir.path / "outbox")
        return 1
    if coordinator.trust is not None:
        log.info("every round is recorded on the ledger %s", coordinator.trust.ledger_address)
    return 0


def _linger(coordinator: Coordinator, stop: threading.Event, linger_s: float) -> None:
    """Serve until every live worker said it is done, ``linger_s`` at most (or ``stop``)."""
    deadline = time.monotonic() + linger_s
    while not stop.is_set() and time.monotonic() < deadline:
        if coordinator.live_workers_done():
            break
        stop.wait(0.1)


def _halt(coordinator: Coordinator, why: str, stop: threading.Event, linger_s: float) -> int:
    """The open round can never close (Coordinator.stalled): say why in one line, tell the workers
    (their wait for the round's checkpoint is refused with ``why``, and they exit), and exit 1.
    The run directory keeps HEAD; a coordinator started again reopens the round."""
    log.error("cannot go on: %s", why)
    coordinator.halt(why)
    _linger(coordinator, stop, linger_s)
    return 1
