"""A hostile coordinator, and what a real ``dilocox worker`` does against each of its misbehaviours.

``Hostile`` is a gRPC coordinator whose answers the caller sets (the run configuration, the
heartbeat interval, the FetchGlobal stream): what a compromised coordinator, or anyone the worker
reaches with ``--insecure``, could send. ``served`` runs it on 127.0.0.1, plaintext or over TLS with
a self-signed certificate the worker pins. ``run_worker`` runs ``dilocox worker`` against it to its
end and returns its exit code, output and peak RSS (``os.wait4``: the kernel's own account of the
child).

``dilocox bench flood --side worker`` (``main``) runs one misbehaviour at a time and prints one
table: the worker's exit code, its last line, its peak RSS, and its requests per second to the
hostile coordinator over its life. The misbehaviours:

    oversized global state     a signed header declaring a 2^50-byte payload, then 64 MiB of it
    bad signature              a 1 MiB global state signed by a key that is not the coordinator's
    heartbeat interval 0       Join says interval 0; long-polls are held as an honest coordinator
                               holds them (the worker is stopped after ``HELD_S``: nothing to refuse)
    premature "no new state"   every FetchGlobal answers "not yet" at once, for ever
    nested config JSON         the run configuration is 200,000 nested brackets

Used by tests/unit/test_hostile_coordinator.py and tests/integration/test_hostile_coordinator.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import grpc

from attestation import WorkerKey
from attestation.signing import global_digest
from benchmarks.flood import fast_config, machine_line
from proto import CHANNEL_OPTIONS, Encoding, pb, pb_grpc
from storage_client import CID, Codec
from trainer.config import RunConfig, estimated_parameters
from trainer.net.tls import ensure_self_signed, server_credentials

RUN_DIGEST = bytes(range(32))
PARAMS_CID = str(CID.of(b"params"))
MANIFEST_CID = str(CID.of(b"manifest", Codec.JSON))
NESTED_CONFIG = b"[" * 200_000 + b"]" * 200_000
PAYLOAD_CHUNKS = 64   # MiB a hostile stream offers after its header
WORKER_LIMIT_S = 120  # a worker still running after this is killed
HELD_S = 10.0         # how long the bench lets a worker run against a misbehaviour it cannot refuse


class Hostile(pb_grpc.CoordinatorServicer):
    """A coordinator whose answers the caller sets: ``fetch`` yields a FetchGlobal stream's messages."""

    def __init__(self, key: WorkerKey, config: RunConfig) -> None:
        self.key = key
        self.config = config
        self.config_json = config.canonical()
        self.heartbeat_interval_s = 1.0
        self.heartbeat_times: list[float] = []
        self.third_heartbeat = threading.Event()
        self.fetch: Callable[[], Iterator[pb.GlobalChunk]] = lambda: iter(())
        self.fetches = 0
        self.requests = 0  # every call the worker made, whatever it was

    def Challenge(self, request: pb.ChallengeRequest, context: grpc.ServicerContext) -> pb.ChallengeResponse:
        self.requests += 1
        return pb.ChallengeResponse(config_json=self.config_json,
                                    config_cid=str(CID.of(self.config_json, Codec.JSON)),
                                    coordinator_address=self.key.address, run_digest=RUN_DIGEST, nonce=b"n" * 32)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        self.requests += 1
        return pb.JoinResponse(coordinator_address=self.key.address, session_token=b"t" * 32, shard=0,
                               num_shards=self.config.rounds.expected_workers,
                               heartbeat_interval_s=self.heartbeat_interval_s)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        self.requests += 1
        self.heartbeat_times.append(time.monotonic())
        if len(self.heartbeat_times) >= 3:
            self.third_heartbeat.set()
        return pb.HeartbeatResponse()

    def FetchGlobal(self, request: pb.FetchGlobalRequest, context: grpc.ServicerContext) -> Iterator[pb.GlobalChunk]:
        self.requests += 1
        self.fetches += 1
        yield from self.fetch()

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        self.requests += 1
        context.abort(grpc.StatusCode.UNAVAILABLE, "busy, forever")


@contextlib.contextmanager
def served(coordinator: Hostile, tls_dir: Path | None = None, threads: int = 8) -> Iterator[tuple[str, list[str]]]:
    """Serve ``coordinator`` on 127.0.0.1 (over TLS with a self-signed certificate made in ``tls_dir``,
    else plaintext); yields its address and the ``dilocox worker`` flags that reach it."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=CHANNEL_OPTIONS)
    pb_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    if tls_dir is None:
        port = server.add_insecure_port("127.0.0.1:0")
        trust = ["--insecure"]
    else:
        identity = ensure_self_signed(tls_dir, ("127.0.0.1",))
        port = server.add_secure_port("127.0.0.1:0", server_credentials(identity))
        trust = ["--tls-fingerprint", identity.fingerprint]
    server.start()
    try:
        yield f"127.0.0.1:{port}", ["--coordinator", f"127.0.0.1:{port}", *trust]
    finally:
        server.stop(grace=None)


def signed_header(key: WorkerKey, **fields: object) -> pb.GlobalChunk:
    """A round-1 global state header signed by ``key`` (the coordinator's, or a forger's)."""
    digest = global_digest(RUN_DIGEST, 1, CID.parse(PARAMS_CID).digest, CID.parse(MANIFEST_CID).digest)
    return pb.GlobalChunk(header=pb.GlobalHeader(
        available=True, round=1, params_cid=PARAMS_CID, manifest_cid=MANIFEST_CID, encoding=Encoding.DENSE_F32,
        signature=key.sign_digest(digest), **fields))


def run_worker(flags: list[str], log: Path, *, stop_after_s: float | None = None) -> tuple[int, str, int]:
    """Exit code, output and peak RSS in bytes of ``dilocox worker`` run to its end: SIGTERM after
    ``stop_after_s`` if given, killed after WORKER_LIMIT_S in any case."""
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "cli.main", "worker", "--worker-id", "w0", "--threads", "1",
                                    *flags], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    timers = [threading.Timer(WORKER_LIMIT_S, process.kill)]
    if stop_after_s is not None:
        timers.append(threading.Timer(stop_after_s, process.send_signal, args=(signal.SIGTERM,)))
    for timer in timers:
        timer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)  # this child's own peak RSS, from the kernel
    finally:
        for timer in timers:
            timer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, log.read_text(errors="replace"), usage.ru_maxrss * 1024


# ------------------------------------------------------------------------------------ the bench


def _oversized(h: Hostile) -> None:
    def stream() -> Iterator[pb.GlobalChunk]:
        yield signed_header(h.key, payload_size=1 << 50, payload_sha256="0" * 64)
        for _ in range(PAYLOAD_CHUNKS):
            yield pb.GlobalChunk(data=b"\0" * (1 << 20))
    h.fetch = stream


def _bad_signature(h: Hostile) -> None:
    payload = b"\0" * (1 << 20)
    forged = signed_header(WorkerKey.generate(), payload_size=len(payload), payload_sha256=CID.of(payload).digest.hex())
    h.fetch = lambda: iter([forged, pb.GlobalChunk(data=payload)])


def _interval_zero(h: Hostile) -> None:
    h.heartbeat_interval_s = 0.0

    def held() -> Iterator[pb.GlobalChunk]:  # an honest long-poll: held, then "not yet"
        time.sleep(5.0)
        yield pb.GlobalChunk(header=pb.GlobalHeader(available=False, open_round=1))
    h.fetch = held


def _premature_empty(h: Hostile) -> None:
    h.fetch = lambda: iter([pb.GlobalChunk(header=pb.GlobalHeader(available=False, open_round=1))])


def _nested_config(h: Hostile) -> None:
    h.config_json = NESTED_CONFIG


MISBEHAVIOURS: dict[str, tuple[Callable[[Hostile], None], float | None]] = {
    "oversized global state (2^50 bytes declared)": (_oversized, None),
    "bad signature on the global state": (_bad_signature, None),
    "heartbeat interval 0": (_interval_zero, HELD_S),
    'premature "no new state", for ever': (_premature_empty, None),
    "nested config JSON (200,000 deep)": (_nested_config, None),
}


@dataclass
class WorkerOutcome:
    misbehaviour: str
    exit_code: int
    line: str
    peak_rss: int
    requests_per_s: float


def last_line(output: str) -> str:
    """The worker's one line, without its time and logger: its last ERROR, else its last WARNING
    (a bound it applied), else its last line."""
    lines = [line for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if " ERROR " in line]
    warnings = [line for line in lines if " WARNING " in line]
    line = (errors or warnings or lines or ["(no output)"])[-1]
    return line.split(": ", 1)[-1] if " ERROR " in line or " WARNING " in line or " INFO " in line else line


def run(config: RunConfig | None = None) -> list[WorkerOutcome]:
    config = config or fast_config(rounds=2)
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="dilocox-hostile-") as tmp:
        for i, (name, (misbehave, stop_after_s)) in enumerate(MISBEHAVIOURS.items()):
            coordinator = Hostile(WorkerKey.generate(), config)
            misbehave(coordinator)
            with served(coordinator, Path(tmp) / f"tls{i}") as (_, flags):
                started = time.monotonic()
                code, output, peak = run_worker(flags, Path(tmp) / f"w{i}.log", stop_after_s=stop_after_s)
                lived = time.monotonic() - started
            outcomes.append(WorkerOutcome(name, code, last_line(output), peak, coordinator.requests / lived))
    return outcomes


def main() -> None:
    config = fast_config(rounds=2)
    outcomes = run(config)
    bound = 4 * 4 * estimated_parameters(config.model) + (1 << 30)
    print(f"dilocox worker (a real process, TLS to a pinned self-signed certificate) against a hostile coordinator, "
          f"one misbehaviour at a time; a worker that has nothing to refuse is stopped (SIGTERM) after {HELD_S:g} s. "
          f"Requests/s: all its calls over its life, start-up included. Peak RSS from os.wait4; the issue's "
          f"bound is the model's bytes x 4 + 1 GB = {bound / 2**20:.0f} MiB.")
    print(machine_line() + "\n")
    print("| misbehaviour | exit code | worker's line | peak RSS MiB | requests/s |")
    print("| --- | ---: | --- | ---: | ---: |")
    for o in outcomes:
        print(f"| {o.misbehaviour} | {o.exit_code} | {o.line[:200].replace('|', '/')} | {o.peak_rss / 2**20:.0f} | "
              f"{o.requests_per_s:.1f} |")
