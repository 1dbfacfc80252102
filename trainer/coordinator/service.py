"""The coordinator's gRPC service: who may call, and what a call may cost, before the state machine.

Every RPC passes these steps, in order, before trainer.coordinator.machine sees it:

  1. decoding    a message that does not decode is refused (INVALID_ARGUMENT) with one log line,
                 never a traceback (``_parser``: the deserializer returns ``MALFORMED``); the same
                 for grpc.health.v1 (``health_handler``). Every refusal's log line is budgeted per
                 party, the peer's host (trainer.limits.LogBudget);
  2. fields      every string/bytes/repeated field is bounded, worker ids and phases have their
                 form (trainer.limits); refusals quote at most a short prefix of what was sent;
  3. identity    FetchGlobal, PushUpdate, SubmitReport and Heartbeat act for a worker: they carry
                 its id and the session token of its latest Join in the call's metadata
                 (``METADATA_WORKER``, ``METADATA_SESSION``), and the id in the request must be the
                 same. Anything else is UNAUTHENTICATED and changes nothing: no refusal filed, no
                 traffic counted, no phase or liveness set;
  4. resources   Challenge and Join are rate-limited per connection and in all; PushUpdate and FetchGlobal hold
                 one of a bounded number of slots per worker and in all, Join one of a few, and a
                 slot whose call makes no progress for the idle allowance is cancelled
                 (trainer.limits.CallSlots). The thread pool is larger than all slots together, so
                 health and Status always answer.

Then the service translates: protobuf messages into the machine's plain types and back, and a
trainer.refusal.Refusal's reason into its status code (``STATUS_OF``); anything unexpected becomes
INTERNAL with one rate-limited log line. A session token is 32 random bytes given in JoinResponse;
only its sha256 is kept, and a new Join of the same worker replaces it (trainer.coordinator.registry
says who may re-join a live worker's id).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import threading
import time
from typing import Callable, Iterator, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2

from proto import CHUNK_BYTES, METADATA_SESSION, METADATA_WORKER, PROTOCOL_VERSION, SERVICE_NAME, Encoding, WorkerPhase, pb
from trainer.aggregation import InvalidUpdate, checked_update
from trainer.coordinator.machine import Coordinator
from trainer.coordinator.state import GlobalState, StatusView, UpdateHeader
from trainer.limits import (
    CallSlots, Exhausted, FieldError, LogBudget, Slot, TokenBucket, check_fields, check_phase, check_worker_id,
    clip,
)
from trainer.refusal import Reason, Refusal
from trainer.wire import WireError, chunked, json_object, reassemble, sha256_hex

log = logging.getLogger("dilocox.service")
T = TypeVar("T")

LONG_POLL_MAX_S = 30.0   # the longest a FetchGlobal may wait for a round to close
STREAM_SLOTS = 32        # PushUpdate + FetchGlobal calls at once, in all
STREAM_SLOTS_PER_WORKER = 8
JOIN_SLOTS = 4           # Joins being verified at once (evidence, chain)
THREADS = 64             # > STREAM_SLOTS + JOIN_SLOTS: the rest serve health, Status and short calls
MAX_RPCS = 256           # beyond this gRPC itself answers RESOURCE_EXHAUSTED, before any thread
MAX_STREAMS_PER_CONNECTION = 64

_CODE = grpc.StatusCode
# Every refusal reason's status code: the one place the round logic's reasons meet gRPC.
STATUS_OF: dict[Reason, grpc.StatusCode] = {
    Reason.MALFORMED: _CODE.INVALID_ARGUMENT, Reason.BAD_CLAIM: _CODE.INVALID_ARGUMENT,
    Reason.REPLAYED: _CODE.INVALID_ARGUMENT, Reason.SCREENED_OUT: _CODE.INVALID_ARGUMENT,
    Reason.PROTOCOL: _CODE.FAILED_PRECONDITION, Reason.WRONG_RUN: _CODE.FAILED_PRECONDITION,
    Reason.FINISHED: _CODE.FAILED_PRECONDITION, Reason.STALE_ROUND: _CODE.FAILED_PRECONDITION,
    Reason.ROUND_NOT_OPEN: _CODE.FAILED_PRECONDITION, Reason.WRONG_BASE: _CODE.FAILED_PRECONDITION,
    Reason.NOT_PUBLISHED: _CODE.FAILED_PRECONDITION, Reason.NOT_PARTICIPANT: _CODE.FAILED_PRECONDITION,
    Reason.NO_LEDGER: _CODE.FAILED_PRECONDITION, Reason.BAD_NONCE: _CODE.FAILED_PRECONDITION,
    Reason.HALTED: _CODE.FAILED_PRECONDITION,
    Reason.NO_SESSION: _CODE.UNAUTHENTICATED, Reason.BAD_SIGNATURE: _CODE.UNAUTHENTICATED,
    Reason.NO_EVIDENCE: _CODE.UNAUTHENTICATED, Reason.UNKNOWN_WORKER: _CODE.PERMISSION_DENIED,
    Reason.NOT_ADMITTED: _CODE.PERMISSION_DENIED, Reason.DUPLICATE: _CODE.ALREADY_EXISTS,
    Reason.ID_HELD: _CODE.ALREADY_EXISTS, Reason.REGISTRY_FULL: _CODE.RESOURCE_EXHAUSTED,
    Reason.CHAIN_UNAVAILABLE: _CODE.UNAVAILABLE,
}


class _Malformed:
    """What a request that does not decode arrives as (see module docstring, step 1)."""

    def __repr__(self) -> str:
        return "MALFORMED"


MALFORMED = _Malformed()


def _parser(message_type: type) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError, or worse on hostile bytes: never let gRPC log a traceback
            return MALFORMED
    return parse


def _decoded(request: object, what: str) -> None:
    if request is MALFORMED:
        raise FieldError(f"the {what} message does not decode")


class Sessions:
    """Session tokens of joined workers: worker id → sha256(token). Thread-safe; bounded by the
    coordinator's worker registry (``retain``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, bytes] = {}

    def issue(self, worker_id: str) -> bytes:
        token = os.urandom(32)
        with self._lock:
            self._digests[worker_id] = hashlib.sha256(token).digest()
        return token

    def valid(self, worker_id: str, token: bytes) -> bool:
        with self._lock:
            digest = self._digests.get(worker_id)
        return digest is not None and hmac.compare_digest(digest, hashlib.sha256(token).digest())

    def retain(self, worker_ids: set[str]) -> None:
        with self._lock:
            self._digests = {w: d for w, d in self._digests.items() if w in worker_ids}


def _peer_host(context: grpc.ServicerContext) -> str:
    """"ipv4:127.0.0.1:5123" → "ipv4:127.0.0.1": the caller's host, for log lines and Join slots."""
    return context.peer().rsplit(":", 1)[0]


class CoordinatorService:
    """The Coordinator service's handlers (registered by ``handler``)."""

    def __init__(self, coordinator: Coordinator, *, idle_s: float = 30.0) -> None:
        self.c = coordinator
        self.sessions = Sessions()
        self.streams = CallSlots(total=STREAM_SLOTS, per_caller=STREAM_SLOTS_PER_WORKER, idle_s=idle_s)
        self.joins = CallSlots(total=JOIN_SLOTS, per_caller=JOIN_SLOTS, idle_s=120.0)
        # Per connection, so a flood from one client (or many on the same host, as on loopback or
        # behind one NAT) drains only its own buckets; the "*" buckets cap everyone together.
        self.challenges = TokenBucket(rate=5.0, burst=20.0)
        self.join_rate = TokenBucket(rate=2.0, burst=10.0)
        self.all_challenges = TokenBucket(rate=200.0, burst=400.0)
        self.all_joins = TokenBucket(rate=20.0, burst=40.0)
        self.budget = LogBudget(log)

    def close(self) -> None:
        self.streams.close()
        self.joins.close()

    # ------------------------------------------------------------------------- the steps

    def _call(self, context: grpc.ServicerContext, rpc: str, body: Callable[[], T]) -> T:
        """Run ``body``; turn every refusal into its status code, and anything else into INTERNAL."""
        peer = _peer_host(context)
        try:
            return body()
        except Refusal as r:
            code, message = STATUS_OF[r.reason], r.message
            if code == grpc.StatusCode.UNAUTHENTICATED:  # someone acting for a worker it is not
                self.budget.warning("unauthenticated", "%s from %s refused: %s", rpc, peer, message, party=peer)
        except FieldError as exc:
            self.budget.warning("field", "%s from %s refused: %s", rpc, peer, exc, party=peer)
            code, message = grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except Exhausted as exc:
            self.budget.warning("exhausted", "%s from %s refused: %s", rpc, peer, exc, party=peer)
            code, message = grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
        except OSError as exc:  # the store's disk is full or failing: the caller may retry later
            self.budget.warning("storage", "%s failed to store: %s", rpc, clip(exc, 200))
            code, message = grpc.StatusCode.UNAVAILABLE, "the coordinator cannot store data right now; retry later"
        except grpc.RpcError:  # the call was cancelled (by the caller, or as idle) while we read it
            self.budget.warning("cancelled", "%s from %s ended before its request was complete", rpc, peer,
                                party=peer)
            code, message = grpc.StatusCode.CANCELLED, "the call was cancelled"
        except Exception as exc:  # a bug, not the caller's fault: one line, the traceback only at debug
            self.budget.warning("internal", "%s failed: %s: %s", rpc, type(exc).__name__, clip(exc, 200), party=peer)
            log.debug("%s failed", rpc, exc_info=True)
            code, message = grpc.StatusCode.INTERNAL, "internal error; the coordinator's log says more"
        context.abort(code, message)
        raise AssertionError("unreachable")  # abort raises

    def _worker(self, context: grpc.ServicerContext, claimed: str | None = None) -> str:
        """The worker a call acts for, proved by its session token (step 3)."""
        metadata = dict(context.invocation_metadata() or ())
        worker = metadata.get(METADATA_WORKER, "")
        token = metadata.get(METADATA_SESSION, b"")
        if not isinstance(worker, str) or not worker or not isinstance(token, bytes):
            raise Refusal(Reason.NO_SESSION,
                          f"this call acts for a worker: send {METADATA_WORKER} and {METADATA_SESSION} metadata "
                          f"(the session token of your Join)")
        check_worker_id(worker)
        if not self.sessions.valid(worker, token):
            raise Refusal(Reason.NO_SESSION,
                          f"no session of worker {worker!r} has this token: Join again")
        if claimed is not None and claimed != worker:
            raise Refusal(Reason.NO_SESSION,
                          f"the request names worker {clip(claimed)}, but the session is {worker!r}'s")
        return worker

    def _rate(self, context: grpc.ServicerContext, bucket: TokenBucket, everyone: TokenBucket, what: str) -> None:
        if not bucket.allow(context.peer()):
            raise Exhausted(f"too many {what} requests on this connection; retry in a few seconds")
        if not everyone.allow("*"):
            raise Exhausted(f"too many {what} requests from all callers; retry in a few seconds")

    # ------------------------------------------------------------------------- unary

    def Challenge(self, request: pb.ChallengeRequest, context: grpc.ServicerContext) -> pb.ChallengeResponse:
        def body() -> pb.ChallengeResponse:
            _decoded(request, "ChallengeRequest")
            check_fields(request)
            check_worker_id(request.worker_id)
            self._rate(context, self.challenges, self.all_challenges, "Challenge")
            nonce = self.c.challenge(request.worker_id, request.protocol_version)
            chain_id, ledger = self._ledger()
            return pb.ChallengeResponse(
                nonce=nonce, run_digest=self.c.run.run_digest, config_json=self.c.run.config_bytes,
                config_cid=str(self.c.run.config_cid), attestation_required=self.c.trust is not None,
                chain_id=chain_id, ledger=ledger, coordinator_address=self.c.signer.address,
            )
        return self._call(context, "Challenge", body)

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinResponse:
        def body() -> pb.JoinResponse:
            _decoded(request, "JoinRequest")
            check_fields(request)
            check_worker_id(request.worker_id)
            self._rate(context, self.join_rate, self.all_joins, "Join")
            metadata = dict(context.invocation_metadata() or ())
            token = metadata.get(METADATA_SESSION, b"")
            proves = isinstance(token, bytes) and self.sessions.valid(request.worker_id, token)
            with self.joins.acquire(_peer_host(context), context.cancel):
                shard, open_round = self.c.join(request.worker_id, request.protocol_version, request.address,
                                                request.evidence, request.nonce, proves_session=proves)
            token = self.sessions.issue(request.worker_id)
            self.sessions.retain(self.c.registered())
            cfg = self.c.config
            chain_id, ledger = self._ledger()
            return pb.JoinResponse(
                protocol_version=PROTOCOL_VERSION, run_id=cfg.run_id, config_json=self.c.run.config_bytes,
                config_cid=str(self.c.run.config_cid), open_round=open_round, shard=shard,
                num_shards=cfg.rounds.expected_workers, heartbeat_interval_s=cfg.rounds.heartbeat_interval_s,
                run_digest=self.c.run.run_digest, chain_id=chain_id, ledger=ledger, session_token=token,
                coordinator_address=self.c.signer.address,
            )
        return self._call(context, "Join", body)

    def SubmitReport(self, request: pb.SubmitReportRequest, context: grpc.ServicerContext) -> pb.SubmitReportResponse:
        def body() -> pb.SubmitReportResponse:
            _decoded(request, "SubmitReportRequest")
            check_fields(request)
            worker = self._worker(context, request.worker_id)
            return pb.SubmitReportResponse(accepted=True, round=self.c.submit_report(worker, request.signed_report))
        return self._call(context, "SubmitReport", body)

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        def body() -> pb.HeartbeatResponse:
            _decoded(request, "HeartbeatRequest")
            check_fields(request)
            worker = self._worker(context, request.worker_id)
            check_phase(request.phase)
            open_round, finished = self.c.heartbeat(worker, request.round, WorkerPhase(request.phase))
            return pb.HeartbeatResponse(open_round=open_round, finished=finished)
        return self._call(context, "Heartbeat", body)

    def Status(self, request: pb.StatusRequest, context: grpc.ServicerContext) -> pb.StatusResponse:
        return self._call(context, "Status", lambda: status_message(self.c.status()))

    def _ledger(self) -> tuple[int, str]:
        trust = self.c.trust
        return (trust.chain_id, trust.ledger_address) if trust else (0, "")

    # ------------------------------------------------------------------------- streams

    def PushUpdate(self, request_iterator: Iterator[pb.UpdateChunk], context: grpc.ServicerContext) -> pb.PushUpdateResponse:
        def body() -> pb.PushUpdateResponse:
            worker = self._worker(context)
            with self.streams.acquire(worker, context.cancel) as slot:
                return self._push(worker, request_iterator, slot)
        return self._call(context, "PushUpdate", body)

    def _push(self, worker: str, request_iterator: Iterator[pb.UpdateChunk], slot: Slot) -> pb.PushUpdateResponse:
        first = next(request_iterator, None)
        slot.progress()
        if first is None or first is MALFORMED or not first.HasField("header"):
            raise FieldError("the first message of a push must be its header")
        check_fields(first)
        header = update_header(first.header)
        if header.worker_id != worker:
            raise Refusal(Reason.NO_SESSION,
                          f"the push header names worker {clip(header.worker_id)}, but the session is {worker!r}'s")
        wire_bytes = first.ByteSize()

        def data() -> Iterator[bytes]:
            nonlocal wire_bytes
            for message in request_iterator:
                slot.progress()
                if message is MALFORMED or not message.HasField("data"):
                    raise WireError("a push carries one header, then data chunks only")
                wire_bytes += message.ByteSize()
                yield message.data

        try:
            try:
                declared = self.c.admit_header(header)  # refused before a payload byte is read
                what = f"update from {worker} for round {header.round}"
                payload = reassemble(data(), header.payload_size, header.payload_sha256, what=what)
                decoding = time.perf_counter()
                update = checked_update(payload, declared, self.c.bound, encoding=Encoding(header.encoding),
                                        codec_header=codec_header(header))
                self.c.note_push(header.round, "decode", time.perf_counter() - decoding)
            except (WireError, InvalidUpdate) as exc:
                raise Refusal(Reason.MALFORMED, str(exc)) from exc
            finally:
                self.c.count_up(worker, wire_bytes)  # refused or not, these bytes crossed the network
            cid, open_round = self.c.accept(header, update, wire_bytes, payload)
        except Refusal as r:
            self.c.refuse(header, r)
            raise
        return pb.PushUpdateResponse(accepted=True, update_cid=str(cid), open_round=open_round)

    def FetchGlobal(self, request: pb.FetchGlobalRequest, context: grpc.ServicerContext) -> Iterator[pb.GlobalChunk]:
        def begin() -> tuple[str, Slot, tuple[GlobalState | None, int, bool]]:
            _decoded(request, "FetchGlobalRequest")
            check_fields(request)
            worker = self._worker(context, request.worker_id)
            slot = self.streams.acquire(worker, context.cancel)
            try:
                wait_s = min(max(request.wait_s, 0.0), LONG_POLL_MAX_S) if request.wait_s == request.wait_s else 0.0
                slot.waiting(wait_s)
                return worker, slot, self.c.wait_for_global(worker, request.min_round, wait_s)
            except BaseException:
                slot.release()
                raise

        worker, slot, (state, open_round, finished) = self._call(context, "FetchGlobal", begin)
        context.add_callback(slot.release)
        try:
            sent = 0
            for message in self._global_messages(state, open_round, finished, request.have_params_cid):
                self.c.count_down(worker, message.ByteSize())
                sent += message.ByteSize()
                yield message
                slot.progress()
            if state is not None:
                self.c.served_state(worker, str(state.params_cid), sent)
        finally:
            slot.release()

    def _global_messages(self, state: GlobalState | None, open_round: int, finished: bool,
                         have_params_cid: str) -> Iterator[pb.GlobalChunk]:
        if state is None:
            yield pb.GlobalChunk(header=pb.GlobalHeader(available=False, open_round=open_round))
            return
        header = pb.GlobalHeader(
            available=True, round=state.round, params_cid=str(state.params_cid),
            manifest_cid=str(state.manifest_cid), open_round=open_round, finished=finished,
            eval_loss_e6=state.eval_loss_e6, encoding=Encoding.DENSE_F32, signature=self.c.global_signature(state),
            eval_losses_e6=state.eval_losses_e6,
            next_inner_steps=self.c.run.inner_steps(state.round + 1),
            second_inner_steps=self.c.run.inner_steps(state.round + 2),
        )
        payload = state.payload
        if have_params_cid == str(state.params_cid):
            # The worker holds θ⁽ʳ⁾ already (θ⁽⁰⁾ it builds from the seed): the header says so.
            payload, header.encoding = b"", Encoding.HELD
        elif state.downlink is not None and have_params_cid == state.downlink.base_params_cid:
            # The worker holds θ⁽ʳ⁻¹⁾: the compressed global update is all it needs.
            down = state.downlink
            payload, header.compression_header, header.base_params_cid = down.payload, down.header, down.base_params_cid
            header.encoding = down.encoding
        header.payload_size, header.payload_sha256 = len(payload), sha256_hex(payload)
        yield pb.GlobalChunk(header=header)
        for piece in chunked(payload, CHUNK_BYTES):
            yield pb.GlobalChunk(data=piece)


def update_header(h: pb.UpdateHeader) -> UpdateHeader:
    """A push header as the state machine takes it (fields already bounded by check_fields)."""
    return UpdateHeader(
        protocol_version=h.protocol_version, run_id=h.run_id, worker_id=h.worker_id, round=h.round, stage=h.stage,
        num_stages=h.num_stages, encoding=h.encoding,
        tensors=tuple((t.name, t.dtype, tuple(int(d) for d in t.shape)) for t in h.tensors),
        payload_size=h.payload_size, payload_sha256=h.payload_sha256, train_loss=h.train_loss, tokens=h.tokens,
        inner_steps=h.inner_steps, base_params_cid=h.base_params_cid, base_bytes_received=h.base_bytes_received,
        signature=h.signature, compression_header=h.compression_header, inner_state_sha256=h.inner_state_sha256,
    )


def status_message(view: StatusView) -> pb.StatusResponse:
    return pb.StatusResponse(
        run_id=view.run_id, open_round=view.open_round, total_rounds=view.total_rounds, finished=view.finished,
        workers=[pb.WorkerStatus(**{**dataclasses.asdict(w), "phase": int(w.phase)}) for w in view.workers],
        rounds=[pb.RoundSummary(**dataclasses.asdict(s)) for s in view.rounds],
        ledger_lag_rounds=view.ledger_lag_rounds,
    )


def codec_header(h: UpdateHeader) -> dict | None:
    """The compression header of a compressed push, parsed (None for dense pushes)."""
    if h.encoding != Encoding.LOWRANK_INT4:
        return None
    try:
        return json_object(h.compression_header, "compression_header")
    except WireError as exc:
        raise InvalidUpdate(str(exc)) from exc


class _Health(health.HealthServicer):
    """grpc.health.v1 with Check only: Watch would hold a server thread per caller for ever."""

    def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.ServicerContext,
              send_response_callback: object = None) -> None:
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served; poll Check")


def health_handler(servicer: _Health, budget: LogBudget) -> grpc.GenericRpcHandler:
    """grpc.health.v1.Health served with the decoding of step 1: a request that does not decode (a
    service name that is not UTF-8, say) is INVALID_ARGUMENT with at most one budgeted line, where
    grpc_health's own registration would log a traceback and answer INTERNAL."""

    def check(request: object, context: grpc.ServicerContext) -> health_pb2.HealthCheckResponse:
        if request is MALFORMED:
            peer = _peer_host(context)
            budget.warning("field", "Health/Check from %s refused: the HealthCheckRequest message does not decode",
                           peer, party=peer)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the HealthCheckRequest message does not decode")
        return servicer.Check(request, context)

    def watch(request: object, context: grpc.ServicerContext) -> Iterator[health_pb2.HealthCheckResponse]:
        servicer.Watch(request, context)  # aborts
        yield from ()

    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler("grpc.health.v1.Health", {
        "Check": grpc.unary_unary_rpc_method_handler(
            check, request_deserializer=_parser(health_pb2.HealthCheckRequest), response_serializer=serialize),
        "Watch": grpc.unary_stream_rpc_method_handler(
            watch, request_deserializer=_parser(health_pb2.HealthCheckRequest), response_serializer=serialize),
    })


def handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """The Coordinator service's method handlers, with deserializers that never raise (step 1)."""
    unary, server_stream, client_stream = (grpc.unary_unary_rpc_method_handler, grpc.unary_stream_rpc_method_handler,
                                           grpc.stream_unary_rpc_method_handler)
    methods = {
        "Challenge": (unary, pb.ChallengeRequest, service.Challenge),
        "Join": (unary, pb.JoinRequest, service.Join),
        "FetchGlobal": (server_stream, pb.FetchGlobalRequest, service.FetchGlobal),
        "PushUpdate": (client_stream, pb.UpdateChunk, service.PushUpdate),
        "SubmitReport": (unary, pb.SubmitReportRequest, service.SubmitReport),
        "Heartbeat": (unary, pb.HeartbeatRequest, service.Heartbeat),
        "Status": (unary, pb.StatusRequest, service.Status),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: kind(fn, request_deserializer=_parser(request_type),
                   response_serializer=lambda m: m.SerializeToString())
        for name, (kind, request_type, fn) in methods.items()
    })


