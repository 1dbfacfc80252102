"""The worker's side of the wire: one channel to the coordinator, retried calls, verified states.

Nothing received is used unchecked: the channel is TLS to the coordinator's pinned certificate or a
CA (trainer.net.tls; plaintext only with --insecure), the run configuration must hash to the CID the
coordinator names, and every global state must carry the coordinator's signature
(attestation.signing.global_digest, by the key named at the first Join, which may not change) and
hash to its CID. Every call made for this worker after Join carries its session token
(proto.session_metadata). Every byte is counted per direction. A worker given store sources asks
for a payload the run's store holds by its CID and fetches it from them, verified, the coordinator's
gateway last, and over gRPC when none has a correct copy (trainer.worker.cid_fetch).

Nor is the coordinator trusted to be well-behaved (bounds in trainer.net.limits): a global state's header
must carry the coordinator's signature and declare at most ``dense_payload_limit`` of the model's
parameter count before a payload byte is read, and the stream is cut at the first byte past what it
declared (the payload is hashed as it arrives, trainer.codec.wire.reassemble); the run configuration is
parsed with bounded size and nesting; the heartbeat interval it dictates is held to
[HEARTBEAT_FLOOR_S, HEARTBEAT_CEILING_S]; every retry waits a growing, jittered ``Backoff``; and
more than ``MAX_EARLY_EMPTY`` answers in a row of "no new global state yet" that did not wait the
long-poll asked for end the worker with one line (WorkerError), as any invalid global state does.

Faults it rides out: a coordinator unreachable (restart, network blip) or busy (RESOURCE_EXHAUSTED)
is retried with backoff for up to ``reconnect_timeout_s``; after reconnecting, or when the
coordinator no longer knows the session (it restarted), the worker joins again and re-sends an
update the coordinator may not have received (a repeat of an update it counted is answered with
that update's receipt again in a run with a ledger, docs/trust.md "Receipts"; another duplicate is
answered ALREADY_EXISTS and counts as sent).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence, TypeVar

import grpc
import torch

from attestation import (
    Domain,
    EvidenceProvider,
    SignatureError,
    SignedReport,
    WorkerKey,
    attest,
    checksum_address,
    code_measurement,
    recover_address,
)
from attestation.signing import global_digest, update_digest
from proto import PROTOCOL_VERSION, Encoding, WorkerPhase, pb, pb_grpc, session_metadata
from storage_client import CID, Codec, DilocoxError, Kernels, canonical_json, loads_bounded
from trainer.codec import CodecHeader, CompressionError
from trainer.codec.downlink import apply_update, decode_update
from trainer.codec.uplink import Slice
from trainer.codec.wire import (
    Params,
    WireError,
    chunked,
    cid_of_chunks,
    decode_params,
    json_object,
    layout_of,
    params_chunks,
    reassemble,
    sha256_hex,
)
from trainer.config import RunConfig, estimated_parameters
from trainer.data.shared_eval import MAX_EVAL_BATCHES
from trainer.net.limits import (
    FETCH_WAIT_CEILING_S,
    FETCH_WAIT_FLOOR_S,
    HEARTBEAT_CEILING_S,
    HEARTBEAT_FLOOR_S,
    Backoff,
    bounded,
    clip,
    dense_payload_limit,
)
from trainer.net.link import Link
from trainer.net.tls import ClientTls
from trainer.rounds.schedule import ScheduleError, WorkerSchedule
from trainer.runtime.state_commit import NO_STATE, StateBytes
from trainer.worker.cid_fetch import CidFetchError, PayloadSources
from trainer.worker.succession import Endpoint, Succession, SuccessionError, Successors

log = logging.getLogger("dilocox.worker")
T = TypeVar("T")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}
# A push answered with one of these is out of the round: the worker undoes or carries it forward.
REFUSED = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
           grpc.StatusCode.UNAUTHENTICATED}
MAX_CONFIG_JSON = 1 << 20  # bytes of the run configuration a coordinator may send (an honest one: a few kB)
# "No new global state yet" answered sooner than half the long-poll asked for, this many times in a
# row, is a coordinator that does not hold the poll: the worker stops rather than poll it forever.
MAX_EARLY_EMPTY = 20
Fetched = tuple[pb.GlobalHeader, bytes | None, int]  # a fetch's header, payload (None: not yet), wire bytes


class WorkerError(DilocoxError, RuntimeError):
    """The worker cannot go on; the message says why."""


@dataclass(frozen=True)
class Checkpoint:
    """A global state as fetched: verified against its CID and the coordinator's signature."""

    round: int
    params_cid: str
    manifest_cid: str
    eval_loss_e6: int
    finished: bool
    params: Params
    eval_losses_e6: tuple[int, ...] = ()  # the coordinator's per-batch claims (trainer.data.shared_eval)


@dataclass(frozen=True)
class PushHeader:
    """What a slice's push says besides its payload (the round's metrics and what it built on)."""

    round: int
    train_loss: float
    tokens: int
    inner_steps: int
    base_params_cid: str
    base_bytes_received: int
    inner_state_sha256: str
    kernels: Kernels | None = None  # what decided the inner loop's floating point (trainer.runtime.kernels)


class PhaseSeconds:
    """Seconds spent by phase name, added from any thread, taken (and reset) by a progress record."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._lock = threading.Lock()

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] = self._seconds.get(phase, 0.0) + seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            taken, self._seconds = self._seconds, {}
        return taken


def slice_name(piece: Slice) -> str:
    return "update" if piece.num_stages == 1 else f"stage {piece.stage} of {piece.num_stages} slice"


def update_header(run_id: str, worker_id: str, piece: Slice, what: PushHeader, payload_sha256: str,
                  state_size: int) -> pb.UpdateHeader:
    """The header of one slice's PushUpdate stream (unsigned: ``slice_signature`` signs it)."""
    return pb.UpdateHeader(
        protocol_version=PROTOCOL_VERSION, run_id=run_id, round=what.round, worker_id=worker_id,
        encoding=piece.encoding, compression_header=piece.codec_header_bytes or b"",
        tensors=[pb.TensorSpec(name=n, dtype=d, shape=s) for n, (d, s) in layout_of(piece.transmitted).items()],
        payload_size=len(piece.payload), payload_sha256=payload_sha256, train_loss=what.train_loss,
        tokens=what.tokens, inner_steps=what.inner_steps, base_params_cid=what.base_params_cid,
        base_bytes_received=what.base_bytes_received, stage=piece.stage, num_stages=piece.num_stages,
        inner_state_sha256=what.inner_state_sha256, inner_state_size=state_size,
        cpu_capability=what.kernels.capability if what.kernels else "",
        intra_op_threads=what.kernels.threads if what.kernels else 0,
        data_parallel=what.kernels.data_parallel if what.kernels and what.kernels.data_parallel > 1 else 0,
    )


def update_messages(header: pb.UpdateHeader, payload: bytes, state: StateBytes = NO_STATE) -> Iterator[pb.UpdateChunk]:
    """A PushUpdate stream's messages, made one at a time (never the whole payload a second time in
    messages, nor the inner state's bytes whole): the header, the payload's chunks, then the state's."""
    yield pb.UpdateChunk(header=header)
    yield from (pb.UpdateChunk(data=p) for p in chunked(payload))
    yield from (pb.UpdateChunk(state=p) for piece in state.chunks() for p in chunked(piece))


def slice_signature(key: WorkerKey | None, run_digest: bytes, round_: int, piece: Slice) -> bytes:
    """A worker's signature over a slice's push (attestation.signing.update_digest), empty without a
    key. Deterministic (RFC 6979), so the record the report restates, which keeps it
    (trainer.runstore.update_record), is the one the coordinator stores."""
    if key is None:
        return b""
    return key.sign_digest(update_digest(run_digest, round_, piece.stage, piece.num_stages, sha256_hex(piece.payload)))


class CoordinatorClient:
    def __init__(self, address: str, worker_id: str, *, tls: ClientTls, attestation: EvidenceProvider | None,
                 reconnect_timeout_s: float, fetch_wait_s: float, link: Link, on_first_join: Callable[[RunConfig, int, int], None],
                 sleep: Callable[[float], None] = time.sleep, store_sources: Sequence[str] = (),
                 successors: Successors = Successors(), decode_device: torch.device | None = None) -> None:
        self.worker_id, self.sleep, self.reconnect_timeout_s = worker_id, sleep, reconnect_timeout_s  # sleep: each retry's
        self.fetch_wait_s = bounded(fetch_wait_s, FETCH_WAIT_FLOOR_S, FETCH_WAIT_CEILING_S)
        self.attestation, self.link, self.on_first_join = attestation, link, on_first_join
        self.decode_device = decode_device  # where a compressed global update is rebuilt: the worker's device
        # The coordinator served now, and the ones to move to (trainer.worker.succession).
        self.succession = Succession(Endpoint(address, tls), successors)
        self._moving = threading.Lock()
        self.session: tuple[tuple[str, str | bytes], ...] = ()  # metadata of every call after Join
        self.sources, self.store_port = PayloadSources(store_sources, address, tls, self._received), 0
        self._connect()
        self._joining = threading.Lock()
        self.coordinator_key: str | None = None  # the address that signs global states, from the first Join
        self.config: RunConfig | None = None
        self.key: WorkerKey | None = None
        self.domain: Domain | None = None  # set when the run has a ledger
        self.run_digest, self.heartbeat_interval_s = b"", 1.0
        self.round, self.phase = 0, WorkerPhase.STARTING  # what heartbeats say
        self.bytes_sent = self.bytes_received = 0
        self.held: tuple[str, Params] | None = None  # the newest global parameters, by CID
        self.received_for: dict[str, int] = {}  # wire bytes of the fetch that delivered each CID
        self.schedule: WorkerSchedule | None = None  # H_r of the rounds ahead; set at the first Join
        # Seconds streaming global states in ("fetch": header to last byte, not the wait) and rebuilding θ ("decode").
        self.phase_seconds = PhaseSeconds()

    # ----------------------------------------------------------------------------- calls

    def _move_on(self, serving: int) -> bool:
        """Serve the coordinator after the one at ``serving``, joined afresh; False when there is none."""
        with self._moving:
            if self.succession.connected != serving:
                return True
            if self.succession.advance(serving) is None:
                return False
            log.warning("coordinator at %s unreachable; moving to %s", self.address, self.succession.current.address)
            self.channel.close()
            self._connect()
            return True

    def _connect(self) -> None:
        """A channel to the coordinator served now, without a session yet."""
        self.channel = self.succession.connect(self.reconnect_timeout_s, self.sleep)
        self.address, self.session = self.succession.current.address, ()
        self.sources.follow(self.succession.current.address, self.succession.current.tls)  # its gateway too
        self.stub = pb_grpc.CoordinatorStub(self.channel)

    def call(self, what: str, fn: Callable[[], T], halted: str = "") -> T:
        """Run ``fn``; retry with backoff while the coordinator is unreachable or busy, then rejoin; rejoin
        at once when it no longer knows this session; a fetch refused as not fitting the run (``halted``:
        what for; FAILED_PRECONDITION, e.g. the run stopped) ends in a WorkerError with the reason."""
        deadline, backoff = time.monotonic() + self.reconnect_timeout_s, Backoff(sleep=self.sleep)
        lost, rejoins, serving = False, 0, self.succession.connected
        while True:
            try:
                if lost:
                    self.join()
                    log.info("reconnected to %s", self.address)
                    lost = False
                return fn()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED and self.session and rejoins < 2:
                    log.warning("%s: the coordinator does not know this session (%s); joining again", what,
                                clip(exc.details(), 200))
                    lost, rejoins = True, rejoins + 1
                    continue
                if halted and exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    raise WorkerError(f"{halted}: {clip(exc.details(), 600)}") from None  # the run stopped
                if exc.code() not in _RETRYABLE:
                    raise
                if time.monotonic() >= deadline and self._move_on(serving):
                    deadline, serving = time.monotonic() + self.reconnect_timeout_s, self.succession.connected
                    lost = True
                    continue
                if time.monotonic() >= deadline:
                    raise WorkerError(f"coordinator at {self.address} unreachable for {self.reconnect_timeout_s:.0f}s "
                                      f"({what}: {clip(exc.details(), 200)})") from exc
                if not lost:
                    log.warning("%s: coordinator unreachable (%s); retrying", what, clip(exc.details(), 200))
                lost = True
                backoff.wait()

    def close(self) -> None:
        self.channel.close()

    # ----------------------------------------------------------------------------- joining

    def join(self) -> pb.JoinResponse:
        """Challenge, attest (when the run has a ledger), join; set up on the first join. A worker
        id still held by a live session is retried until that session lapses (a restarted worker).
        One join at a time: the heartbeat thread may join again while the main thread calls."""
        deadline, backoff = time.monotonic() + self.reconnect_timeout_s, Backoff(floor=1.0, sleep=self.sleep)
        while True:
            try:
                with self._joining:
                    return self._join_once()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() >= deadline:
                    raise
                log.warning("join: %s; retrying", clip(exc.details(), 200))
                backoff.wait()

    def _join_once(self) -> pb.JoinResponse:
        challenge = self.stub.Challenge(pb.ChallengeRequest(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id), timeout=30)
        config = checked_config(challenge.config_json, challenge.config_cid, self.config)
        ledger = Domain(challenge.chain_id, challenge.ledger) if challenge.attestation_required else None
        self.check_coordinator_key(challenge.coordinator_address, challenge.run_digest, ledger)
        self.run_digest = challenge.run_digest
        request = pb.JoinRequest(protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id)
        if challenge.attestation_required:
            if self.attestation is None:
                raise WorkerError("this run requires attestation; start the worker with --attestation dev|tdx")
            if self.key is None:
                self.key = WorkerKey.generate()  # born here, never leaves the process
            measurement = code_measurement(challenge.config_cid)
            evidence = attest(self.attestation, self.key, challenge.run_digest, challenge.nonce, measurement)
            request.address, request.evidence, request.nonce = self.key.address, evidence.to_bytes(), challenge.nonce
            self.domain = Domain(challenge.chain_id, challenge.ledger)
        # The session of an earlier Join (if any) proves this is the same worker taking its id back.
        response = self.stub.Join(request, timeout=60, metadata=self.session)
        self.check_coordinator_key(response.coordinator_address)
        if len(response.session_token) != 32:
            raise WorkerError("the coordinator's Join gave no session token; is it an older version?")
        self.session = session_metadata(self.worker_id, response.session_token)
        self.heartbeat_interval_s = heartbeat_interval(response.heartbeat_interval_s)
        self.store_port = response.store_port  # its gateway (trainer.worker.cid_fetch), 0: none
        if self.config is None:  # set-up (pipeline stages start): heartbeats already say STARTING
            self.on_first_join(config, response.shard, response.num_shards)
            self.config, self.schedule = config, WorkerSchedule(config)
        log.info("joined run %s at %s: shard %d of %d, open round %d%s", config.run_id, self.address,
                 response.shard, response.num_shards, response.open_round,
                 f", key {self.key.address}" if self.domain else "")
        return response

    def check_coordinator_key(self, address: str, run: bytes | None = None, domain: Domain | None = None) -> None:
        """Pin the coordinator's signing key at the first Join; another later as trainer.worker.succession says."""
        try:
            address = checksum_address(address)
            key = self.succession.accept(self.coordinator_key, address, self.run_digest,
                                         self.run_digest if run is None else run, self.domain, domain or self.domain)
        except (ValueError, TypeError) as exc:
            raise WorkerError(f"the coordinator names no valid signing key: {exc}") from exc
        except SuccessionError as exc:
            raise WorkerError(str(exc)) from None
        if key != self.coordinator_key:
            log.info("coordinator signing key %s", key)
        self.coordinator_key = key

    # ----------------------------------------------------------------------------- liveness

    def say(self, round_: int, phase: WorkerPhase, timeout: float = 5) -> None:
        self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=round_, phase=phase),
                            timeout=timeout, metadata=self.session)

    def status(self) -> pb.StatusResponse:
        return self.call("status", lambda: self.stub.Status(pb.StatusRequest(), timeout=10))

    # ----------------------------------------------------------------------------- fetching

    def fetch(self, min_round: int) -> Checkpoint:
        """The global parameters of round >= ``min_round`` (waits for them), verified by their CID.

        When this worker holds the round before, the coordinator may send the compressed global
        update instead (trainer.codec.downlink): θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾), which must hash to the
        CID the header names; if it does not, the worker says so and fetches θ⁽ʳ⁾ dense.
        """
        self.phase = WorkerPhase.WAITING
        dense_only, by_cid, backoff = False, self.sources.enabled, Backoff(sleep=self.sleep)
        while True:
            held, asked = None if dense_only else self.held, time.monotonic()
            try:
                header, payload, size = self.call("fetch global state", lambda: self._fetch_once(
                    min_round, held, by_cid), f"waiting for round {min_round}")
            except CidFetchError as exc:  # trainer.worker.cid_fetch: over gRPC, this fetch
                log.error("%s; fetching it from the coordinator over gRPC", exc)
                by_cid = False
                continue
            if payload is None:  # not yet: ask again, no sooner than the backoff allows
                wait_after_empty(backoff, time.monotonic() - asked, self.fetch_wait_s)
                continue
            decoding = time.perf_counter()
            try:
                params = global_params(header, payload, held, self.decode_device)
                self.phase_seconds.add("decode", time.perf_counter() - decoding)
            except (WireError, CompressionError) as exc:
                if header.encoding == Encoding.DENSE_F32:
                    raise
                log.error("round %d: the %s global state does not give the published parameters (%s); fetching "
                          "them dense", header.round, Encoding(header.encoding).name, exc)
                dense_only = True
                continue
            check_pinned_genesis(self.config, header)
            self.held = (header.params_cid, params)
            self.received_for[header.params_cid] = size
            learn_schedule(self.schedule, header, params)
            return Checkpoint(header.round, header.params_cid, header.manifest_cid, header.eval_loss_e6,
                              header.finished, params,
                              # one past the bound, kept so that too many claims are refused by count
                              tuple(header.eval_losses_e6[:MAX_EVAL_BATCHES + 1]))

    def _fetch_once(self, min_round: int, held: tuple[str, Params] | None, by_cid: bool = False) -> Fetched:
        self.link.call()
        stream = self.stub.FetchGlobal(pb.FetchGlobalRequest(
            worker_id=self.worker_id, min_round=min_round, wait_s=self.fetch_wait_s, payload_by_cid=by_cid,
            have_params_cid=held[0] if held else ""), timeout=self.fetch_wait_s + 60, metadata=self.session)
        first = next(stream)
        size = first.ByteSize()
        self._received(size)
        if not first.HasField("header"):
            raise WireError("global state stream did not start with its header")
        header = first.header
        if not header.available:
            return header, None, size
        streaming = time.perf_counter()

        def data() -> Iterator[bytes]:
            nonlocal size
            for message in stream:
                size += message.ByteSize()
                self._received(message.ByteSize())
                yield message.data

        try:  # signature and size before a byte of the payload is read; not a byte past what was declared
            self.checked_signature(header)
            check_size(self.config, header)
            payload = (self.sources.fetch(header, self.store_port, data()) if header.payload_cid else
                       reassemble(data(), header.payload_size, header.payload_sha256,
                                  what=f"global state of round {header.round}"))
        except WireError:
            stream.cancel()  # the rest of the stream is not read
            raise
        self.phase_seconds.add("fetch", time.perf_counter() - streaming)
        return header, payload, size

    def _received(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.link.transfer("down", nbytes)

    def checked_signature(self, header: pb.GlobalHeader) -> None:
        """A global state is used only if the run's coordinator signed it."""
        try:
            digest = global_digest(self.run_digest, header.round, CID.parse(header.params_cid).digest,
                                   CID.parse(header.manifest_cid).digest)
            signer = recover_address(digest, header.signature)
        except (ValueError, SignatureError) as exc:
            raise WireError(f"global state of round {header.round} carries no valid coordinator signature: {exc}") from exc
        if signer != self.coordinator_key:
            raise WireError(f"global state of round {header.round} is signed by {signer}, not by the "
                            f"coordinator's key {self.coordinator_key}")

    # ----------------------------------------------------------------------------- pushing

    def push_slice(self, piece: Slice, what: PushHeader, state: StateBytes = NO_STATE) -> tuple[int, pb.Receipt | None]:
        """One slice's PushUpdate stream, and after its payload ``state``, the committed inner state's
        bytes on the rounds that upload it (trainer.runtime.state_commit): its wire bytes (what the
        coordinator counts), and the update receipt if it completed the update. Raises grpc.RpcError
        when the coordinator refuses it (a duplicate counts as sent)."""
        assert self.config is not None
        payload, sha = piece.payload, sha256_hex(piece.payload)
        header = update_header(self.config.run_id, self.worker_id, piece, what, sha, state.size)
        header.signature = slice_signature(self.key, self.run_digest, what.round, piece)
        sizes: list[int] = []  # the wire bytes of each message of the last attempt

        def stream() -> Iterator[pb.UpdateChunk]:  # a fresh iterator per attempt, its chunks made as sent
            self.link.call()
            sizes.clear()
            for message in update_messages(header, payload, state):
                sizes.append(message.ByteSize())
                self.link.transfer("up", sizes[-1])
                self.bytes_sent += sizes[-1]
                yield message

        try:
            response = self.call(f"push round {what.round} {slice_name(piece)}",
                                 lambda: self.stub.PushUpdate(stream(), timeout=120, metadata=self.session))
            log.info("round %d: %s accepted as %s", what.round, slice_name(piece), response.update_cid)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            log.info("round %d: coordinator already holds this worker's %s", what.round, slice_name(piece))
            response = pb.PushUpdateResponse()  # no receipt: the first reply had it
        return sum(sizes), response.receipt if response.HasField("receipt") else None

    def submit_report(self, signed: SignedReport) -> pb.Receipt | None:
        """Send a signed report; returns the coordinator's report receipt when it took it."""
        round_, request = signed.report.round, pb.SubmitReportRequest(worker_id=self.worker_id,
                                                                      signed_report=canonical_json(signed.to_json()))
        try:
            response = self.call(f"report round {round_}", lambda: self.stub.SubmitReport(
                request, timeout=60, metadata=self.session))
            log.info("round %d: signed report accepted", round_)
            return response.receipt if response.HasField("receipt") else None
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                log.warning("round %d: report refused (%s): %s", round_, exc.code().name, clip(exc.details(), 200))
            return None


def checked_config(config_json: bytes, config_cid: str, pinned: RunConfig | None) -> RunConfig:
    """The run configuration a coordinator sent, parsed as untrusted and checked against the CID it
    names and the configuration ``pinned`` at the first Join (None before it)."""
    actual = CID.of(config_json, Codec.JSON)
    if str(actual) != config_cid:
        raise WorkerError(f"run configuration hashes to {actual}, coordinator named {config_cid}")
    try:  # a hostile coordinator names the CID of whatever it sends: parse it as untrusted
        config = RunConfig.from_json(loads_bounded(config_json, max_bytes=MAX_CONFIG_JSON,
                                                   what="the coordinator's run configuration"))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # JSONBoundsError, ConfigError among them
        raise WorkerError(f"the coordinator's run configuration is refused: {clip(exc, 300)}") from None
    if pinned is not None and config.cid != pinned.cid:
        raise WorkerError(f"coordinator now runs config {config.cid}, not {pinned.cid}")
    return config


def learn_schedule(schedule: WorkerSchedule | None, header: pb.GlobalHeader, params: Params) -> None:
    """What θ⁽ᵍ⁾'s header says of the inner steps ahead (trainer.rounds.schedule.WorkerSchedule.learn)."""
    assert schedule is not None  # set at the first Join, before any fetch
    codec = None
    if header.encoding == Encoding.LOWRANK_INT4:  # already checked whole by the decode
        raw = json_object(header.compression_header, "compression_header of the global update")
        codec = CodecHeader.parse(raw, layout_of(params))
    try:
        schedule.learn(header.round, header.next_inner_steps, header.second_inner_steps, codec)
    except ScheduleError as exc:
        raise WorkerError(str(exc)) from None


def heartbeats(client: CoordinatorClient, stop: threading.Event) -> None:
    """Say the client's round and phase every heartbeat interval until ``stop``, from the first Join
    on (so a worker setting up after it, e.g. starting its pipeline stages, is alive and "starting").
    After a failed heartbeat the next waits at least a growing ``Backoff``, until one succeeds."""
    backoff = Backoff(floor=client.heartbeat_interval_s)
    wait_s = client.heartbeat_interval_s
    while not stop.wait(wait_s):
        wait_s = client.heartbeat_interval_s
        if not client.session:  # not joined yet: nothing to say
            continue
        try:
            client.say(client.round, client.phase)
            backoff.reset()
        except grpc.RpcError as exc:
            wait_s = max(wait_s, backoff.next_delay())
            log.debug("heartbeat failed: %s", clip(exc.details(), 200))
            if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                # The coordinator restarted and forgot this session: join again now rather than
                # at the next call, which may be a whole inner loop away, so it keeps us live.
                try:
                    client.join()
                except (grpc.RpcError, WorkerError) as rejoin:
                    log.warning("heartbeat: could not join again: %s", rejoin)


def heartbeat_interval(dictated_s: float) -> float:
    """The coordinator's heartbeat interval, held to [HEARTBEAT_FLOOR_S, HEARTBEAT_CEILING_S]."""
    interval = bounded(dictated_s, HEARTBEAT_FLOOR_S, HEARTBEAT_CEILING_S)
    if interval != dictated_s:
        log.warning("the coordinator asks for a heartbeat every %.4gs; sending one every %.4gs (bounds %g to %gs)",
                    dictated_s, interval, HEARTBEAT_FLOOR_S, HEARTBEAT_CEILING_S)
    return interval


def wait_after_empty(backoff: Backoff, took_s: float, fetch_wait_s: float) -> None:
    """Wait before asking again for a global state the coordinator said it has not (the long-poll
    it held counts toward the wait); refuse one that keeps answering without holding the poll."""
    if took_s >= fetch_wait_s / 2:  # held: longer than the backoff's first wait already
        backoff.reset()
        return
    if backoff.retries >= MAX_EARLY_EMPTY:
        raise WorkerError(f"the coordinator answered 'no new global state yet' {backoff.retries + 1} times in a "
                          f"row without holding the {fetch_wait_s:g}s long-poll asked for; it misbehaves")
    backoff.wait(took_s)


def check_size(config: RunConfig | None, header: pb.GlobalHeader) -> None:
    """A global state is no larger than the run's model, dense (trainer.net.limits.dense_payload_limit)."""
    assert config is not None  # set at the first Join, before any fetch
    limit = dense_payload_limit(estimated_parameters(config.model))
    if not 0 <= header.payload_size <= limit:
        raise WireError(f"global state of round {header.round} declares {header.payload_size} bytes, more than "
                        f"the {limit} this run's model can need")


def check_pinned_genesis(config: RunConfig | None, header: pb.GlobalHeader) -> None:
    """θ⁽⁰⁾ from existing weights (trainer.model.init_weights) is the one the run's config pins by its CID,
    whatever the coordinator sends."""
    pinned = config.model.init_params if config is not None else ""
    if header.round == 0 and pinned and header.params_cid != pinned:
        raise WorkerError(f"the coordinator's θ⁽⁰⁾ is {header.params_cid}, but the run's config pins "
                          f"model.init_params = {pinned}")


def global_params(header: pb.GlobalHeader, payload: bytes, held: tuple[str, Params] | None,
                  device: torch.device | None = None) -> Params:
    """θ⁽ʳ⁾ from a fetched payload: held already, dense, or θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾) (rebuilt on
    ``device``, the same bits); each checked against the params CID the (signed) header names."""
    if header.encoding == Encoding.HELD:
        if held is None or held[0] != header.params_cid or payload:
            raise WireError(f"the coordinator says this worker holds {header.params_cid}; it holds "
                            f"{held[0] if held else 'nothing'}")
        return held[1]
    if header.encoding == Encoding.DENSE_F32:
        if str(CID.of(payload)) != header.params_cid:
            raise WireError(f"global parameters hash to {CID.of(payload)}, header names {header.params_cid}")
        return decode_params(payload)
    if header.encoding != Encoding.LOWRANK_INT4:
        raise WireError(f"unknown global state encoding {header.encoding}")
    if held is None or header.base_params_cid != held[0]:
        raise WireError(f"the global update applies to {header.base_params_cid}, this worker holds "
                        f"{held[0] if held else 'nothing'}")
    codec = json_object(header.compression_header, "compression_header of the global update")
    params = apply_update(held[1], decode_update(payload, codec, layout_of(held[1]), device))
    rebuilt = cid_of_chunks(params_chunks(params))  # hashed a tensor at a time: no whole bytes beside θ
    if str(rebuilt) != header.params_cid:
        raise WireError(f"rebuilt parameters hash to {rebuilt}, header names {header.params_cid}")
    return params
