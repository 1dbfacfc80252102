"""The coordinator's gRPC service: its handlers, and the translation between protobuf and the state machine.

Every call first passes trainer.coordinator.calls (connections, arrival, decoding, identity,
budgets, pace); then a handler bounds the request's fields (trainer.net.limits.check_fields), runs the
state machine (trainer.coordinator.machine) on a thread of the right pool, and translates
protobuf messages into the machine's plain types and back. Who acts for a worker: FetchGlobal,
PushUpdate, SubmitReport and Heartbeat carry its id and the session token of its latest Join; a
session token is 32 random bytes given in JoinResponse, only its sha256 is kept, and a new Join
of the same worker replaces it (trainer.coordinator.registry says who may re-join a live id).

What a call holds, and for how long:
  unary calls      a coroutine until the request arrives (ARRIVAL_S), then a thread for the
                   machine's answer; Join at most ``JOIN_SLOTS`` at once, Challenge, Join and
                   Status under rate limits per connection and in all.
  FetchGlobal      one of its worker's ``STREAMS_PER_WORKER["fetch"]``; its wait for a round
                   (a long-poll, ``LONG_POLL_MAX_S`` at most) costs a coroutine woken when a
                   round is published; sending keeps the pace (trainer.net.limits.Progress).
  PushUpdate       one of its worker's ``STREAMS_PER_WORKER["push"]``; the header within
                   ARRIVAL_S and checked before a payload byte is read, then the payload at the
                   pace, hashed as it arrives; decoding and storing take a HEAVY thread.

A worker that asks for it (FetchGlobalRequest.payload_by_cid) is sent, for a payload the run's store
holds, its CID instead of its bytes (GlobalHeader.payload_cid): the same bytes for every worker, served
once by CID from mirrors, with this coordinator's own gateway (``gateway``, trainer.coordinator.server)
the source of last resort.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2

from attestation.receipt import SignedReceipt
from proto import CHUNK_BYTES, PROTOCOL_VERSION, SERVICE_NAME, Encoding, WorkerPhase, pb
from storage_client import CID, Codec
from storage_client.gateway import GatewayServer
from trainer.codec.wire import Reassembly, WireError, chunked, json_object, sha256_hex
from trainer.coordinator.checks import check_state_spool
from trainer.coordinator.calls import HEAVY, MALFORMED, PUBLIC, WORKERS, CallGate, parser
from trainer.coordinator.machine import Coordinator
from trainer.coordinator.state import GlobalState, StatusView, UpdateHeader
from trainer.net.limits import (
    Exhausted,
    FieldError,
    StreamBudget,
    TokenBucket,
    check_fields,
    check_phase,
    check_worker_id,
    clip,
)
from trainer.net.refusal import Reason, Refusal
from trainer.rounds.aggregation import InvalidUpdate, checked_update
from trainer.runstore.spool import Spool

log = logging.getLogger("dilocox.service")

LONG_POLL_MAX_S = 30.0   # the longest a FetchGlobal may wait for a round to close
STREAMS_PER_WORKER = {"push": 2, "fetch": 4}  # a retry may overlap the call it replaces
JOIN_SLOTS = 4           # Joins being verified at once (evidence, chain)
MAX_STREAMS_PER_CONNECTION = 32
MAX_RPCS = 8192          # calls in flight in all; beyond, gRPC answers RESOURCE_EXHAUSTED


class CoordinatorService:
    """The Coordinator service's handlers (registered by ``handler``); one event loop calls them."""

    def __init__(self, coordinator: Coordinator, *, idle_s: float = 30.0) -> None:
        self.c = coordinator
        self.gate = CallGate(idle_s=idle_s)
        self.sessions, self.budget = self.gate.sessions, self.gate.budget
        self.streams = StreamBudget(STREAMS_PER_WORKER)
        self.joining = 0
        # Per connection, so a flood from one client drains only its own buckets; "*" caps everyone.
        self.challenges = TokenBucket(rate=5.0, burst=20.0)
        self.join_rate = TokenBucket(rate=2.0, burst=10.0)
        self.status_rate = TokenBucket(rate=10.0, burst=20.0)
        self.all_challenges = TokenBucket(rate=200.0, burst=400.0)
        self.all_joins = TokenBucket(rate=20.0, burst=40.0)
        self.all_status = TokenBucket(rate=200.0, burst=400.0)
        self._published: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.gateway: GatewayServer | None = None  # the store's gateway, when the coordinator serves one

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve on ``loop``: long-polls wake when the machine publishes a round or halts."""
        self._loop, self._published = loop, asyncio.Event()
        self.c.on_publish.append(self._notify)

    def _notify(self) -> None:  # any thread, under the machine's lock: never blocks
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed: the server is gone, nobody waits
            pass

    def _wake(self) -> None:
        assert self._published is not None
        self._published.set()
        self._published = asyncio.Event()

    def close(self) -> None:
        if self._notify in self.c.on_publish:
            self.c.on_publish.remove(self._notify)
        self.gate.close()

    # ------------------------------------------------------------------------- unary

    async def Challenge(self, context: grpc.aio.ServicerContext) -> pb.ChallengeResponse:
        async def body() -> pb.ChallengeResponse:
            request = await self.gate.arrival(context, "ChallengeRequest")
            check_fields(request)
            check_worker_id(request.worker_id)
            self.gate.rate(context, self.challenges, self.all_challenges, "Challenge")
            nonce = await self.gate.run(PUBLIC, self.c.challenge, request.worker_id, request.protocol_version)
            chain_id, ledger = self._ledger()
            return pb.ChallengeResponse(
                nonce=nonce, run_digest=self.c.run.run_digest, config_json=self.c.run.config_bytes,
                config_cid=str(self.c.run.config_cid), attestation_required=self.c.trust is not None,
                chain_id=chain_id, ledger=ledger, coordinator_address=self.c.signer.address,
            )
        return await self.gate.call(context, "Challenge", body)

    async def Join(self, context: grpc.aio.ServicerContext) -> pb.JoinResponse:
        async def body() -> pb.JoinResponse:
            request = await self.gate.arrival(context, "JoinRequest")
            check_fields(request)
            check_worker_id(request.worker_id)
            self.gate.rate(context, self.join_rate, self.all_joins, "Join")
            proves = self.sessions.valid(request.worker_id, self.gate.session_token(context))
            if self.joining >= JOIN_SLOTS:
                raise Exhausted(f"the coordinator is verifying {self.joining} joins, its limit; retry shortly")
            self.joining += 1
            try:
                shard, open_round = await self.gate.run(
                    HEAVY, lambda: self.c.join(request.worker_id, request.protocol_version, request.address,
                                               request.evidence, request.nonce, proves_session=proves))
            finally:
                self.joining -= 1
            token = self.sessions.issue(request.worker_id)
            self.sessions.retain(await self.gate.run(WORKERS, self.c.registered))
            cfg = self.c.config
            chain_id, ledger = self._ledger()
            return pb.JoinResponse(
                protocol_version=PROTOCOL_VERSION, run_id=cfg.run_id, config_json=self.c.run.config_bytes,
                config_cid=str(self.c.run.config_cid), open_round=open_round, shard=shard,
                num_shards=cfg.rounds.expected_workers, heartbeat_interval_s=cfg.rounds.heartbeat_interval_s,
                run_digest=self.c.run.run_digest, chain_id=chain_id, ledger=ledger, session_token=token,
                coordinator_address=self.c.signer.address, store_port=self.store_port,
            )
        return await self.gate.call(context, "Join", body)

    async def SubmitReport(self, context: grpc.aio.ServicerContext) -> pb.SubmitReportResponse:
        async def body() -> pb.SubmitReportResponse:
            worker = self.gate.worker(context)
            request = await self.gate.arrival(context, "SubmitReportRequest")
            check_fields(request)
            self.gate.same_worker(worker, request.worker_id)
            round_, receipt = await self.gate.run(WORKERS, self.c.submit_report, worker, request.signed_report)
            return pb.SubmitReportResponse(accepted=True, round=round_, receipt=receipt_message(receipt))
        return await self.gate.call(context, "SubmitReport", body)

    async def Heartbeat(self, context: grpc.aio.ServicerContext) -> pb.HeartbeatResponse:
        async def body() -> pb.HeartbeatResponse:
            worker = self.gate.worker(context)
            request = await self.gate.arrival(context, "HeartbeatRequest")
            check_fields(request)
            self.gate.same_worker(worker, request.worker_id)
            check_phase(request.phase)
            open_round, finished = await self.gate.run(WORKERS, self.c.heartbeat, worker, request.round,
                                                       WorkerPhase(request.phase))
            return pb.HeartbeatResponse(open_round=open_round, finished=finished)
        return await self.gate.call(context, "Heartbeat", body)

    async def Status(self, context: grpc.aio.ServicerContext) -> pb.StatusResponse:
        async def body() -> pb.StatusResponse:
            await self.gate.arrival(context, "StatusRequest")
            self.gate.rate(context, self.status_rate, self.all_status, "Status")
            status = status_message(await self.gate.run(PUBLIC, self.c.status))
            status.store_port = self.store_port
            status.store_bytes_served = self.gateway.bytes_out if self.gateway is not None else 0
            return status
        return await self.gate.call(context, "Status", body)

    @property
    def store_port(self) -> int:
        return int(self.gateway.server_address[1]) if self.gateway is not None else 0

    def _ledger(self) -> tuple[int, str]:
        trust = self.c.trust
        return (trust.chain_id, trust.ledger_address) if trust else (0, "")

    # ------------------------------------------------------------------------- streams

    async def PushUpdate(self, context: grpc.aio.ServicerContext) -> pb.PushUpdateResponse:
        async def body() -> pb.PushUpdateResponse:
            worker = self.gate.worker(context)
            with self.streams.hold("push", worker):
                return await self._push(worker, context)
        return await self.gate.call(context, "PushUpdate", body)

    async def _push(self, worker: str, context: grpc.aio.ServicerContext) -> pb.PushUpdateResponse:
        first = await self.gate.arrival(context, "UpdateChunk")
        if not first.HasField("header"):
            raise FieldError("the first message of a push must be its header")
        check_fields(first)
        header = update_header(first.header)
        if header.worker_id != worker:
            raise Refusal(Reason.NO_SESSION,
                          f"the push header names worker {clip(header.worker_id)}, but the session is {worker!r}'s")
        wire_bytes = first.ByteSize()
        # A push this worker's counted update already came with (its reply was lost): its receipt again,
        # before the checks that refuse it as a duplicate and before a payload byte is read.
        again = await self.gate.run(WORKERS, self.c.intake.receipt_again, header, self.c.trust)
        if again is not None:
            await self.gate.run(WORKERS, self.c.count_up, worker, wire_bytes)
            cid, open_round, receipt = again
            return pb.PushUpdateResponse(accepted=True, update_cid=str(cid), open_round=open_round,
                                         receipt=receipt_message(receipt))
        state: Spool | None = None
        try:
            try:
                declared = await self.gate.run(WORKERS, self.c.admit_header, header)  # before a payload byte
                joined = Reassembly(header.payload_size, header.payload_sha256,
                                    what=f"update from {worker} for round {header.round}")
                # The inner state's bytes (trainer.runtime.state_commit), checked against its commitment
                # as they arrive and spooled to the run's scratch folder: three times the model, never
                # whole in memory (trainer.runstore.spool).
                state = Spool(self.c.run.run_dir.scratch, header.inner_state_size, header.inner_state_sha256,
                              what=f"inner state from {worker} for round {header.round}")
                pace = self.gate.pace()
                while (message := await self.gate.read(context, pace)) is not grpc.aio.EOF:
                    if message is MALFORMED or message.HasField("header") or (
                            message.HasField("data") and state.received):
                        raise WireError("a push carries one header, then data chunks, then its state chunks only")
                    wire_bytes += message.ByteSize()
                    if message.HasField("data"):
                        joined.add(message.data)
                    else:
                        state.add(message.state)
                payload = joined.payload()
                update = await self.gate.run(HEAVY, self._decode, header, declared, payload)
                if header.inner_state_size:
                    state.finish()
                    await self.gate.run(HEAVY, check_state_spool, state, self.c.layout, self.c.config)
            except (WireError, InvalidUpdate) as exc:
                raise Refusal(Reason.MALFORMED, str(exc)) from exc
            finally:  # refused or not, these bytes crossed the network
                await self.gate.run(WORKERS, self.c.count_up, worker, wire_bytes)
            cid, open_round, receipt = await self.gate.run(HEAVY, self.c.accept, header, update, wire_bytes, payload,
                                                           state if header.inner_state_size else None)
        except Refusal as r:
            await self.gate.run(WORKERS, self.c.refuse, header, r)
            raise
        finally:  # stored by CID when accepted, or refused: the scratch file goes either way
            if state is not None:
                state.discard()
        return pb.PushUpdateResponse(accepted=True, update_cid=str(cid), open_round=open_round,
                                     receipt=receipt_message(receipt))

    def _decode(self, header: UpdateHeader, declared: object, payload: bytes) -> object:
        decoding = time.perf_counter()
        update = checked_update(payload, declared, self.c.bound, encoding=Encoding(header.encoding),
                                codec_header=codec_header(header))
        self.c.note_push(header.round, "decode", time.perf_counter() - decoding)
        return update

    async def FetchGlobal(self, context: grpc.aio.ServicerContext) -> None:
        async def body() -> None:
            worker = self.gate.worker(context)
            request = await self.gate.arrival(context, "FetchGlobalRequest")
            check_fields(request)
            self.gate.same_worker(worker, request.worker_id)
            with self.streams.hold("fetch", worker):
                wait_s = min(max(request.wait_s, 0.0), LONG_POLL_MAX_S) if request.wait_s == request.wait_s else 0.0
                state, open_round, finished = await self._wait_for_global(worker, request.min_round, wait_s)
                pace, sent, whole = self.gate.pace(), 0, False
                try:
                    for message in self._global_messages(state, open_round, finished, request.have_params_cid,
                                                         request.payload_by_cid and self.gateway is not None):
                        await self.gate.write(context, message, pace)
                        sent += message.ByteSize()
                    whole = state is not None
                finally:
                    await self.gate.run(WORKERS, self.c.count_down, worker, sent,
                                        str(state.params_cid) if whole else None)
        await self.gate.call(context, "FetchGlobal", body)

    async def _wait_for_global(self, worker: str, min_round: int,
                               wait_s: float) -> tuple[GlobalState | None, int, bool]:
        """The long-poll: costs a coroutine, woken when a round is published (or once a second)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            published = self._published  # taken before the check: a publication after it wakes us
            state, open_round, finished = await self.gate.run(WORKERS, self.c.global_for, worker, min_round)
            remaining = deadline - loop.time()
            if state is not None or remaining <= 0 or published is None:
                return state, open_round, finished
            try:
                await asyncio.wait_for(published.wait(), min(remaining, 1.0))
            except asyncio.TimeoutError:
                pass

    def _global_messages(self, state: GlobalState | None, open_round: int, finished: bool,
                         have_params_cid: str, by_cid: bool = False) -> Iterator[pb.GlobalChunk]:
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
        if by_cid and payload and self._named_by_cid(header):
            payload = b""
        yield pb.GlobalChunk(header=header)
        for piece in chunked(payload, CHUNK_BYTES):
            yield pb.GlobalChunk(data=piece)

    def _named_by_cid(self, header: pb.GlobalHeader) -> bool:
        """Name the payload ``header`` describes by its CID when the run's store holds it (the
        compressed downlink every round, θ⁽ʳ⁾ on a full checkpoint's), and its codec header likewise:
        the worker fetches them from its sources, this coordinator's gateway last."""
        store = self.c.run.run_dir.store
        cid = CID(Codec.RAW, bytes.fromhex(header.payload_sha256))
        if not store.has(cid):
            return False
        header.payload_cid = str(cid)
        codec_cid = CID.of(header.compression_header, Codec.JSON)
        if header.compression_header and store.has(codec_cid):
            header.compression_header_cid, header.compression_header = str(codec_cid), b""
        return True


def receipt_message(signed: SignedReceipt | None) -> pb.Receipt | None:
    """The wire form of a coordinator's receipt (proto Receipt): what the worker cannot rebuild itself."""
    if signed is None:
        return None
    r = signed.receipt
    return pb.Receipt(round=r.round, update_digest=r.update_digest,
                      report_digest=r.report_digest if r.reported else b"", signature=signed.signature)


def update_header(h: pb.UpdateHeader) -> UpdateHeader:
    """A push header as the state machine takes it (fields already bounded by check_fields)."""
    return UpdateHeader(
        protocol_version=h.protocol_version, run_id=h.run_id, worker_id=h.worker_id, round=h.round, stage=h.stage,
        num_stages=h.num_stages, encoding=h.encoding,
        tensors=tuple((t.name, t.dtype, tuple(int(d) for d in t.shape)) for t in h.tensors),
        payload_size=h.payload_size, payload_sha256=h.payload_sha256, train_loss=h.train_loss, tokens=h.tokens,
        inner_steps=h.inner_steps, base_params_cid=h.base_params_cid, base_bytes_received=h.base_bytes_received,
        signature=h.signature, compression_header=h.compression_header, inner_state_sha256=h.inner_state_sha256,
        inner_state_size=h.inner_state_size,
        cpu_capability=h.cpu_capability, intra_op_threads=h.intra_op_threads,
        data_parallel=h.data_parallel,
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


class Health:
    """grpc.health.v1 with Check only (Watch would hold a call per caller for ever), served through
    the same gate as the service: a request that does not decode (a service name that is not
    UTF-8, say) is INVALID_ARGUMENT with at most one budgeted line, never a traceback."""

    def __init__(self, gate: CallGate) -> None:
        self.gate = gate
        self.statuses: dict[str, int] = {}

    def set(self, service: str, status: int) -> None:
        self.statuses[service] = status

    async def Check(self, context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        async def body() -> health_pb2.HealthCheckResponse:
            request = await self.gate.arrival(context, "HealthCheckRequest")
            status = self.statuses.get(request.service)
            if status is None:  # as grpc.health.v1 says: an unknown service is NOT_FOUND
                await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {clip(request.service)} here")
            return health_pb2.HealthCheckResponse(status=status)
        return await self.gate.call(context, "Health/Check", body)

    async def Watch(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch is not served; poll Check")


def _methods(service_name: str, methods: dict[str, tuple[object, type, type]]) -> grpc.GenericRpcHandler:
    """Every method served as a request stream (trainer.coordinator.calls: the handler awaits the
    request itself, with a deadline), with deserializers that never raise."""
    handlers = {}
    for name, (fn, request_type, response_kind) in methods.items():
        kind = grpc.stream_stream_rpc_method_handler if response_kind is _STREAM else grpc.stream_unary_rpc_method_handler
        async def behaviour(request_iterator: object, context: grpc.aio.ServicerContext, fn=fn) -> object:
            return await fn(context)  # the request is read by the handler (calls.CallGate.arrival)
        handlers[name] = kind(behaviour, request_deserializer=parser(request_type),
                              response_serializer=lambda m: m.SerializeToString())
    return grpc.method_handlers_generic_handler(service_name, handlers)


_UNARY, _STREAM = object(), object()


def health_handler(servicer: Health) -> grpc.GenericRpcHandler:
    return _methods("grpc.health.v1.Health", {
        "Check": (servicer.Check, health_pb2.HealthCheckRequest, _UNARY),
        "Watch": (servicer.Watch, health_pb2.HealthCheckRequest, _STREAM),
    })


def handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    return _methods(SERVICE_NAME, {
        "Challenge": (service.Challenge, pb.ChallengeRequest, _UNARY),
        "Join": (service.Join, pb.JoinRequest, _UNARY),
        "FetchGlobal": (service.FetchGlobal, pb.FetchGlobalRequest, _STREAM),
        "PushUpdate": (service.PushUpdate, pb.UpdateChunk, _UNARY),
        "SubmitReport": (service.SubmitReport, pb.SubmitReportRequest, _UNARY),
        "Heartbeat": (service.Heartbeat, pb.HeartbeatRequest, _UNARY),
        "Status": (service.Status, pb.StatusRequest, _UNARY),
    })
