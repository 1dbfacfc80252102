"""Availability attacks on a running coordinator, and what honest training keeps meanwhile.

Each attack is a client written from proto/dilocox.proto (generic gRPC calls, as an outsider or an
insider with the published worker code would write them), run by ``calls`` threads that re-open
their call ``REOPEN_PAUSE_S`` after it ends or is refused, until ``stop()`` cancels every call still
in flight:

    UnfinishedUnary   over ONE TLS connection, unary calls (health Check, Status, Challenge, Join,
                      Heartbeat) whose request message never arrives: the request iterator blocks
    Hoarding          K joined ids, each with 8 long-poll FetchGlobal (min_round far ahead, 30 s
                      wait) and 8 PushUpdate streams that never send a byte
    Dripping          joined ids whose PushUpdate sends a plausible header (the open round, its
                      base, the model's layout, signed when the id holds a key) and then one byte
                      every ``drip_s`` seconds, for ever
    Flood             any other call, ``calls`` at once (the bench's older floods)

How a call was answered is counted by status code; a call still held when the attack stopped counts
as "held". ``observe`` measures a window of the honest run: rounds closed (read from the run
directory's rounds.jsonl, so a coordinator that answers nothing still has a rate: zero), health
Check latency (each probe has a 1 s deadline; one that misses it counts as its time taken), and the
coordinator's RSS and open files from /proc. The honest rate of a window is

    rounds per minute = 60 · k / (t_k − t_0)

where t_0 is the first round close seen in the window (so the window starts on a round boundary)
and t_k the k-th close after it; a window that ends before its k rounds counts the rounds it saw
over its whole length after t_0 (no close at all: zero).

Every attacker channel has its own connection (``grpc.use_local_subchannel_pool``): gRPC would
otherwise share one HTTP/2 connection between the attacker and the harness's own probes.
Used by benchmarks/flood.py and tests/integration/test_availability.py.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from attestation import DevProvider, WorkerKey, attest, code_measurement
from attestation.signing import update_digest
from benchmarks.hostile import Mallory
from cli.cluster import LocalCluster
from proto import CHANNEL_OPTIONS, PROTOCOL_VERSION, SERVICE_NAME, pb, pb_grpc, session_metadata
from trainer.codec.wire import encode_params, sha256_hex
from trainer.config import RunConfig
from trainer.net.tls import open_channel

# A connection of its own for each attacker channel (module docstring).
ATTACKER_OPTIONS = (*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1))
HEALTH_DEADLINE_S = 1.0     # the bound on a health answer
# Between a call's end and its re-opening. The attacker shares the machine (2 cores in the tests) with
# the run it attacks: a busy loop would measure the attacker's CPU, not what the coordinator allows.
REOPEN_PAUSE_S = 0.5
HOLD_S = 300.0              # the deadline an attacker's held call carries (stop() cancels it sooner)
FAR_ROUND = 1_000_000       # a long-poll for a round that will not come
UNARY_METHODS = ("/grpc.health.v1.Health/Check", f"/{SERVICE_NAME}/Status", f"/{SERVICE_NAME}/Challenge",
                 f"/{SERVICE_NAME}/Join", f"/{SERVICE_NAME}/Heartbeat")


def attacker_channel(cluster: LocalCluster) -> grpc.Channel:
    """A channel to the cluster's coordinator on a TLS connection of its own."""
    assert cluster.address is not None and cluster.client_tls is not None, "start the coordinator first"
    return open_channel(cluster.address, cluster.client_tls, ATTACKER_OPTIONS)


def _raw(message: bytes) -> bytes:
    return message


class Attack:
    """``calls`` threads, each making ``one_call(i)`` again whenever it ends, until ``stop()``."""

    name = "attack"

    def __init__(self, calls: int) -> None:
        self.calls = calls
        self.stopping = threading.Event()
        self.answers: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._in_flight: dict[int, grpc.Call] = {}
        self._threads: list[threading.Thread] = []

    def one_call(self, i: int) -> tuple[grpc.Call, bool]:
        """Start thread ``i``'s next call; returns it, and whether its answer is a stream to drain."""
        raise NotImplementedError

    def held(self) -> Iterator[object]:
        """A request iterator that sends nothing until the attack stops."""
        self.stopping.wait()
        return
        yield  # a generator that yields nothing

    def start(self) -> Attack:
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"{self.name}-{i}", daemon=True)
                         for i in range(self.calls)]
        for thread in self._threads:
            thread.start()
        return self

    def _loop(self, i: int) -> None:
        # The lowest CPU priority for this thread (Linux schedules threads apart): in a test the attacker
        # shares the machine's cores with the honest processes, which one attacking from elsewhere does
        # not; what its calls cost the coordinator is what is measured.
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self.stopping.is_set():
            answer = self._answer(i)
            with self._lock:
                self.answers[answer] += 1
            self.stopping.wait(REOPEN_PAUSE_S)

    def _answer(self, i: int) -> str:
        try:
            call, stream = self.one_call(i)
        except grpc.RpcError as exc:  # a call the attack needed first (a fetch of the open round) failed
            return exc.code().name
        with self._lock:
            self._in_flight[i] = call
        if self.stopping.is_set():  # stop() took its list of calls to cancel before this one began
            call.cancel()
        try:
            if stream:
                for _ in call:  # type: ignore[attr-defined]
                    pass
            else:
                call.result()  # type: ignore[attr-defined]
            return "OK"
        except grpc.RpcError as exc:
            return "held" if self.stopping.is_set() else exc.code().name
        except grpc.FutureCancelledError:
            return "held"
        finally:
            with self._lock:
                self._in_flight.pop(i, None)

    def stop(self) -> dict[str, int]:
        """Cancel every call in flight, wait for the threads; returns how the calls were answered."""
        self.stopping.set()
        with self._lock:
            in_flight = list(self._in_flight.values())
        for call in in_flight:
            call.cancel()
        for thread in self._threads:
            thread.join(timeout=30)
        return dict(self.answers)


class UnfinishedUnary(Attack):
    """Unary calls whose request message never arrives, all over ONE connection."""

    name = "unfinished unary calls"

    def __init__(self, cluster: LocalCluster, calls: int = 64) -> None:
        super().__init__(calls)
        self.channel = attacker_channel(cluster)
        self.methods = [self.channel.stream_unary(m, request_serializer=_raw, response_deserializer=_raw)
                        for m in UNARY_METHODS]

    def one_call(self, i: int) -> tuple[grpc.Call, bool]:
        return self.methods[i % len(self.methods)].future(self.held(), timeout=HOLD_S), False

    def stop(self) -> dict[str, int]:
        answers = super().stop()
        self.channel.close()
        return answers


@dataclass
class Insider:
    """An id the attacker joined: its own connection and session (and key, in a run with a ledger)."""

    worker_id: str
    channel: grpc.Channel
    session: tuple
    config: RunConfig
    run_digest: bytes
    key: WorkerKey | None = None
    _mallory: Mallory | None = field(default=None, repr=False)

    @property
    def stub(self) -> pb_grpc.CoordinatorStub:
        return pb_grpc.CoordinatorStub(self.channel)

    @property
    def mallory(self) -> Mallory:
        """The header builder of an honest-looking push (benchmarks.hostile.Mallory)."""
        if self._mallory is None:
            self._mallory = Mallory(self.stub, self.worker_id, self.config, self.session)
        return self._mallory

    def close(self) -> None:
        self.channel.close()


def join_insiders(cluster: LocalCluster, worker_ids: list[str], provider: DevProvider | None = None) -> list[Insider]:
    """Join each id on a connection of its own: a bare Join (a run without a ledger admits anyone),
    or with ``provider``'s attestation of a fresh key (a dev-attested insider of a ledger run)."""
    insiders = []
    for worker_id in worker_ids:
        channel = attacker_channel(cluster)
        stub = pb_grpc.CoordinatorStub(channel)
        request = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id)
        key = None
        if provider is not None:
            key = WorkerKey.generate()
            challenge = stub.Challenge(pb.ChallengeRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id),
                                       timeout=30)
            evidence = attest(provider, key, challenge.run_digest, challenge.nonce,
                              code_measurement(challenge.config_cid))
            request = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=worker_id, address=key.address,
                                     evidence=evidence.to_bytes(), nonce=challenge.nonce)
        joined = stub.Join(request, timeout=60)
        insiders.append(Insider(worker_id, channel, session_metadata(worker_id, joined.session_token),
                                RunConfig.from_json(json.loads(joined.config_json)), joined.run_digest, key))
    return insiders


class Hoarding(Attack):
    """Every joined id holds ``polls`` long-polls and ``pushes`` stalled pushes, re-opened as they end."""

    name = "slot hoarding"

    def __init__(self, insiders: list[Insider], polls: int = 8, pushes: int = 8) -> None:
        super().__init__(len(insiders) * (polls + pushes))
        self.insiders, self.polls, self.per_id = insiders, polls, polls + pushes

    def one_call(self, i: int) -> tuple[grpc.Call, bool]:
        insider = self.insiders[i // self.per_id]
        if i % self.per_id < self.polls:
            return insider.stub.FetchGlobal(pb.FetchGlobalRequest(worker_id=insider.worker_id, min_round=FAR_ROUND,
                                                                  wait_s=30), timeout=HOLD_S,
                                            metadata=insider.session), True
        return insider.stub.PushUpdate.future(self.held(), timeout=HOLD_S, metadata=insider.session), False


class Dripping(Attack):
    """Every joined id holds ``pushes`` pushes that send a plausible header, then a byte every ``drip_s``."""

    name = "dripping pushes"

    def __init__(self, insiders: list[Insider], pushes: int = 8, drip_s: float = 2.0) -> None:
        super().__init__(len(insiders) * pushes)
        self.insiders, self.per_id, self.drip_s = insiders, pushes, drip_s

    def one_call(self, i: int) -> tuple[grpc.Call, bool]:
        insider = self.insiders[i // self.per_id]
        first = self.plausible_header(insider)
        return insider.stub.PushUpdate.future(self.drip(first), timeout=HOLD_S, metadata=insider.session), False

    @staticmethod
    def plausible_header(insider: Insider) -> pb.UpdateChunk:
        """A header an honest worker could send now: the open round and its base (from the global
        state's header, FetchGlobal), the model's layout and claims, signed by the insider's key."""
        fetch = insider.stub.FetchGlobal(pb.FetchGlobalRequest(worker_id=insider.worker_id, min_round=0, wait_s=0),
                                         timeout=30, metadata=insider.session)
        try:
            global_header = next(iter(fetch)).header
        finally:
            fetch.cancel()  # the header is all it needs, not the payload
        payload = encode_params(insider.mallory.default)
        round_ = global_header.open_round
        signature = b""
        if insider.key is not None:
            signature = insider.key.sign_digest(update_digest(insider.run_digest, round_, 0, 1, sha256_hex(payload)))
        return insider.mallory.header(payload, round=round_, base_params_cid=global_header.params_cid,
                                      signature=signature)

    def drip(self, first: pb.UpdateChunk) -> Iterator[pb.UpdateChunk]:
        yield first
        while not self.stopping.wait(self.drip_s):
            yield pb.UpdateChunk(data=b"\0")


class Flood(Attack):
    """``calls`` threads repeating ``make_call`` (a call object, and whether to drain its stream)."""

    def __init__(self, name: str, calls: int, make_call: Callable[[Attack], tuple[grpc.Call, bool]]) -> None:
        super().__init__(calls)
        self.name, self.make_call = name, make_call

    def one_call(self, i: int) -> tuple[grpc.Call, bool]:
        return self.make_call(self)


# ------------------------------------------------------------------------------------ observing


def rounds_closed(run: Path) -> int:
    """Lines of <run>/rounds.jsonl, read without an RPC: the rounds the coordinator has closed, and
    the run's start (round 0)."""
    try:
        return (run / "rounds.jsonl").read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def process_usage(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of a live process, from /proc."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(list(Path(f"/proc/{pid}/fd").iterdir()))


@dataclass
class Window:
    """What the honest run did during one window (module docstring)."""

    name: str
    rounds: int
    seconds: float
    health_s: list[float]
    health_failures: int
    rss_bytes: int
    open_fds: int
    answers: dict[str, int] = field(default_factory=dict)

    @property
    def rounds_per_min(self) -> float:
        return 60.0 * self.rounds / self.seconds if self.seconds > 0 else 0.0

    @property
    def health_median_ms(self) -> float:
        return 1000 * statistics.median(self.health_s) if self.health_s else float("inf")

    @property
    def health_worst_ms(self) -> float:
        return 1000 * max(self.health_s) if self.health_s else float("inf")

    def line(self) -> str:
        return (f"{self.name}: {self.rounds} rounds in {self.seconds:.1f}s = {self.rounds_per_min:.1f}/min; health "
                f"median {self.health_median_ms:.0f} ms, worst {self.health_worst_ms:.0f} ms, "
                f"{self.health_failures} past {HEALTH_DEADLINE_S:g}s; RSS {self.rss_bytes / 2**20:.0f} MiB, "
                f"{self.open_fds} fds; answers {self.answers}")


class HealthProbe:
    """Health Check every ``every_s`` on a connection of the harness's own, each with a 1 s deadline."""

    def __init__(self, cluster: LocalCluster, every_s: float = 0.05) -> None:
        self.channel = cluster.channel()
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.every_s = every_s
        self.took: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-probe", daemon=True)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.channel.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                reply = self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_DEADLINE_S)
                ok = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                ok = False
            self.took.append(time.monotonic() - started)
            self.failures += not ok
            self._stop.wait(self.every_s)


def observe(cluster: LocalCluster, name: str, *, max_s: float, rounds: int | None = None) -> Window:
    """Watch the run for up to ``max_s`` seconds, or until ``rounds`` rounds closed after the first
    close seen (module docstring); the coordinator's peak RSS and open files meanwhile."""
    coordinator = cluster.processes["coordinator"]
    target = rounds if rounds is not None else 1 << 62
    started = time.monotonic()
    deadline = started + max_s
    first_close: float | None = None
    last_close = started
    base = count = rounds_closed(cluster.run_dir.path)
    rss = fds = 0
    with HealthProbe(cluster) as probe:
        while time.monotonic() < deadline and coordinator.poll() is None:
            seen = rounds_closed(cluster.run_dir.path)
            now = time.monotonic()
            if seen > count:
                if first_close is None:
                    first_close, base = now, seen
                last_close, count = now, seen
                if count - base >= target:
                    break
            try:
                usage = process_usage(coordinator.pid)
                rss, fds = max(rss, usage[0]), max(fds, usage[1])
            except (FileNotFoundError, ProcessLookupError):
                break  # it exited between the poll and the read
            time.sleep(0.1)
    closed = count - base if first_close is not None else 0
    end = last_close if closed >= target else time.monotonic()
    seconds = end - first_close if first_close is not None else end - started
    return Window(name, closed, seconds, probe.took, probe.failures, rss, fds)


def under_attack(cluster: LocalCluster, attack: Attack, *, max_s: float, rounds: int | None = None) -> Window:
    """``observe`` while ``attack`` runs (started just before, stopped after), with its answers."""
    attack.start()
    try:
        window = observe(cluster, attack.name, max_s=max_s, rounds=rounds)
    finally:
        window_answers = attack.stop()
    window.answers = window_answers
    return window
