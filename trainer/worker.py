"""A worker: joins a run, then round after round fetches θ⁽ʳ⁻¹⁾, runs H inner steps, pushes Δ⁽ʳ⁾.

The worker trusts nothing it receives without checking: the channel is TLS to the coordinator's
pinned certificate or a CA (trainer.tls; plaintext only with --insecure), the run configuration must
hash to the CID the coordinator names, every global state must carry the coordinator's signature
(trainer.trust.global_digest, by the key named at the first Join, which may not change) and hash to
its CID, and the corpus to the configured digest. Every call made for this worker after Join carries
its session token (trainer.service).

Rounds, synchronous (DiLoCo) and with DiLoCoX's one-step-delay overlap (``rounds.overlap``):

    synchronous   s⁽ʳ⁾ = θ⁽ʳ⁻¹⁾                      wait for the round before to close, then train
    overlapped    s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Δᵢ⁽ʳ⁻¹⁾  (r ≥ 2)    train at once; push Δ⁽ʳ⁻¹⁾ / fetch θ⁽ʳ⁻¹⁾ meanwhile
    both          Δᵢ⁽ʳ⁾ = s⁽ʳ⁾ − θᵢ⁽ʳ'ᴴ⁾ after H inner steps;  θ⁽ʳ⁾ = Outer(θ⁽ʳ⁻¹⁾, mean Δ⁽ʳ⁾)

With overlap the global update reaches a worker one round late: round r builds on θ⁽ʳ⁻²⁾ plus
the worker's own last round, instead of θ⁽ʳ⁻¹⁾. The coordinator's arithmetic is the same in both
modes, so checkpoints, reports and the audit do not change.

A worker of P pipeline stages (``--stages P``, trainer.pipeline) pushes Δᵢ⁽ʳ⁾ as P slices, one
stream each, every slice encoded by the stage that computed it (trainer.uplink); a one-process
worker pushes its whole Δᵢ⁽ʳ⁾ as stage 0 of 1. With compression on (``compression.enabled``), both
directions travel as adaptive low-rank + int4: a slice is C(Δᵢ,ₛ⁽ʳ⁾ + eᵢ,ₛ) with this worker's
error feedback eᵢ,ₛ, and the fetch of θ⁽ʳ⁾ by a worker holding θ⁽ʳ⁻¹⁾ is the coordinator's
compressed global update, θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾) (trainer.downlink), checked against the
published CID before it is used.

The inner state a round starts from (AdamW, and the error feedback when compressed) is committed in
each push (``inner_state_sha256``, trainer.diloco.inner_state_digest) and moves only through counted
rounds: when a one-process worker's push is refused, the round is undone (AdamW and error feedback
restored), so an auditor rebuilds the state from the manifests alone (``dilocox audit --replay``).
A worker of several stages, and an overlapped one (whose next round is already training when the
refusal arrives), carries every refused slice's Δ̂ into its error feedback instead, so nothing is lost;
their contributions are not replayed.

Every byte is counted per direction: the log line and the ``--metrics`` record of each round, the
update header (``base_bytes_received``: the fetch this update built on) and the signed report
(``bytes_sent``, ``bytes_received``).

Faults it rides out:
  * coordinator unreachable (restart, network blip) or busy (RESOURCE_EXHAUSTED): every call is
    retried with backoff for up to ``reconnect_timeout_s``; after reconnecting, or when the
    coordinator no longer knows the session (it restarted), the worker joins again and re-sends an
    update the coordinator may not have received (a duplicate is answered ALREADY_EXISTS and counts
    as sent);
  * dropped from a round (too late, or refused): it logs why and starts the next round from the
    latest global checkpoint.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import grpc
import torch

from attestation import (
    Domain, EvidenceProvider, RoundReport, SignatureError, SignedReport, WorkerKey, attest, checksum_address,
    code_measurement, recover_address,
)
from proto import CHANNEL_OPTIONS, PROTOCOL_VERSION, pb, pb_grpc
from storage_client import CID, Codec, canonical_json, strict_json, to_e6
from trainer.compression import CompressionError
from trainer.downlink import apply_update, decode_update
from trainer.config import RunConfig
from trainer.data import eval_batches, load_corpus, round_batches, shard_digest
from trainer.diloco import InnerLoop, InnerResult, evaluate, inner_state_digest, load_params, params_of
from trainer.link import Link
from trainer.service import session_metadata
from trainer.tls import ClientTls, TlsUnreachable, open_channel
from trainer.trust import EVAL_TOLERANCE_E6, global_digest, update_digest
from trainer.model import build_model
from trainer.pipeline import PipelinedInnerLoop, PipelineError
from trainer.uplink import Slice, Uplink, merged, merged_decision, record_of
from trainer.wire import (
    ENCODING_DENSE_F32, ENCODING_HELD, ENCODING_LOWRANK_INT4, Params, WireError, chunked, decode_params, encode_params, layout_of,
    json_object, reassemble, sha256_hex,
)

log = logging.getLogger("dilocox.worker")


def _slice_name(piece: Slice) -> str:
    return "update" if piece.num_stages == 1 else f"stage {piece.stage} of {piece.num_stages} slice"
T = TypeVar("T")

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class WorkerError(RuntimeError):
    """The worker cannot go on; the message says why."""


@dataclass(frozen=True)
class RoundWork:
    """A round's training: the inner loop's result, and its Δ encoded as one slice per stage."""

    result: InnerResult
    slices: list[Slice]
    state: str = ""  # sha256 of the inner state the round started from; "" where not committed
    # The AdamW and error-feedback state before the round, restored if the round does not count.
    snapshot: tuple[dict, list | None] | None = None


@dataclass(frozen=True)
class Pushed:
    """An update the coordinator holds: what this worker's report of that round will restate."""

    round: int
    update: bytes  # sha256 of the record: safetensors of the Δ̂ the coordinator rebuilt
    train_loss_e6: int
    tokens: int
    inner_steps: int
    bytes_sent: int
    bytes_received: int  # wire bytes of the fetch that delivered the parameters it started from
    parent: bytes  # sha256 of the parameters it started from


class Worker:
    def __init__(self, address: str, worker_id: str, *, tls: ClientTls, attestation: EvidenceProvider | None = None,
                 reconnect_timeout_s: float = 120.0, fetch_wait_s: float = 5.0, link: Link | None = None,
                 metrics: Path | None = None, stages: int = 1) -> None:
        self.address = address
        self.worker_id = worker_id
        self.reconnect_timeout_s = reconnect_timeout_s
        self.fetch_wait_s = fetch_wait_s
        self.channel = self._open(tls)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.session: tuple[tuple[str, str | bytes], ...] = ()  # metadata of every call after Join
        self._joining = threading.Lock()
        self.coordinator_key: str | None = None  # the address that signs global states, from the first Join
        self.round = 0
        self.phase = "starting"
        self.config: RunConfig | None = None
        self.attestation = attestation
        self.link = link or Link()
        self.key: WorkerKey | None = None
        self.domain: Domain | None = None  # set when the run has a ledger
        self.run_digest = b""
        self._stop = threading.Event()
        self.bytes_sent = 0
        self.bytes_received = 0
        self.held: tuple[str, Params] | None = None  # the newest global parameters, by CID
        self.received_for: dict[str, int] = {}  # wire bytes of the fetch that delivered each CID
        self.metrics = metrics
        self.stages = stages  # pipeline stages: local processes, each a contiguous slice of the layers
        self.started_at = time.monotonic()  # reset when the first round starts
        self.compute_s = 0.0  # time in the inner loop, all rounds
        self.tokens = 0
        self._counted = (0, 0)  # bytes sent/received up to the last progress record

    # ----------------------------------------------------------------------------- plumbing

    def _open(self, tls: ClientTls) -> grpc.Channel:
        """The channel to the coordinator; a pinned certificate is fetched first, so a coordinator
        that is not up yet is waited for, as any unreachable coordinator is (``_call``)."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                return open_channel(self.address, tls, CHANNEL_OPTIONS)
            except TlsUnreachable as exc:
                if time.monotonic() >= deadline:
                    raise WorkerError(f"coordinator at {self.address} unreachable for "
                                      f"{self.reconnect_timeout_s:.0f}s: {exc}") from exc
                time.sleep(1.0)

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn``; while the coordinator is unreachable or busy, retry with backoff, then
        rejoin; when it no longer knows this worker's session, rejoin at once."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        delay, lost, rejoins = 0.2, False, 0
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
                                exc.details())
                    lost, rejoins = True, rejoins + 1
                    continue
                if exc.code() not in _RETRYABLE:
                    raise
                if time.monotonic() >= deadline:
                    raise WorkerError(
                        f"coordinator at {self.address} unreachable for {self.reconnect_timeout_s:.0f}s "
                        f"({what}: {exc.details()})"
                    ) from exc
                if not lost:
                    log.warning("%s: coordinator unreachable (%s); retrying", what, exc.details())
                lost = True
                time.sleep(delay)
                delay = min(delay * 2, 2.0)

    def join(self) -> pb.JoinResponse:
        """Challenge, attest (when the run has a ledger), join; set up on the first join. A worker
        id still held by a live session is retried until that session lapses (a restarted worker).
        One join at a time: the heartbeat thread may join again while the main thread calls."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                with self._joining:
                    return self._join_once()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() >= deadline:
                    raise
                log.warning("join: %s; retrying", exc.details())
                time.sleep(1.0)

    def _join_once(self) -> pb.JoinResponse:
        challenge = self.stub.Challenge(pb.ChallengeRequest(
            protocol_version=PROTOCOL_VERSION, worker_id=self.worker_id), timeout=30)
        config = self._checked_config(challenge.config_json, challenge.config_cid)
        self._check_coordinator_key(challenge.coordinator_address)
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
        self._check_coordinator_key(response.coordinator_address)
        if len(response.session_token) != 32:
            raise WorkerError("the coordinator's Join gave no session token; is it an older version?")
        self.session = session_metadata(self.worker_id, response.session_token)
        if self.config is None:
            self._set_up(config, response.shard, response.num_shards)
        self.heartbeat_interval_s = response.heartbeat_interval_s
        log.info("joined run %s at %s: shard %d of %d, open round %d%s", config.run_id, self.address,
                 response.shard, response.num_shards, response.open_round,
                 f", key {self.key.address}" if self.domain else "")
        return response

    def _check_coordinator_key(self, address: str) -> None:
        """Pin the coordinator's signing key at the first Join; it may not change during the run."""
        try:
            address = checksum_address(address)
        except (ValueError, TypeError) as exc:
            raise WorkerError(f"the coordinator names no valid signing key: {exc}") from exc
        if self.coordinator_key is None:
            self.coordinator_key = address
            log.info("coordinator signing key %s", address)
        elif address != self.coordinator_key:
            raise WorkerError(f"the coordinator's signing key changed from {self.coordinator_key} to {address}")

    def _checked_signature(self, header: pb.GlobalHeader) -> None:
        """A global state is used only if the run's coordinator signed it (trainer.trust.global_digest)."""
        try:
            digest = global_digest(self.run_digest, header.round, CID.parse(header.params_cid).digest,
                                   CID.parse(header.manifest_cid).digest)
            signer = recover_address(digest, header.signature)
        except (ValueError, SignatureError) as exc:
            raise WireError(f"global state of round {header.round} carries no valid coordinator signature: {exc}") from exc
        if signer != self.coordinator_key:
            raise WireError(f"global state of round {header.round} is signed by {signer}, not by the "
                            f"coordinator's key {self.coordinator_key}")

    def _checked_config(self, config_json: bytes, config_cid: str) -> RunConfig:
        actual = CID.of(config_json, Codec.JSON)
        if str(actual) != config_cid:
            raise WorkerError(f"run configuration hashes to {actual}, coordinator named {config_cid}")
        config = RunConfig.from_json(json.loads(config_json))
        if self.config is not None and config.cid != self.config.cid:
            raise WorkerError(f"coordinator now runs config {config.cid}, not {self.config.cid}")
        return config

    def _set_up(self, config: RunConfig, shard: int, num_shards: int) -> None:
        self.config = config
        self.shard_index = shard
        corpus = load_corpus(config.data, config.seed, config.model.block_size)
        self.shard = corpus.shard(shard, num_shards)
        self.data_digest = shard_digest(self.shard)
        self.eval_batches = eval_batches(
            corpus, seed=config.seed, count=config.data.eval_batches,
            batch_size=config.inner.batch_size, block_size=config.model.block_size,
        )
        self.model = build_model(config.model, config.seed)
        # θ⁽⁰⁾ is a function of the run's seed: built here, it need not cross the network. Its CID
        # is checked against the genesis checkpoint's when the coordinator serves it (as "held").
        genesis = params_of(self.model)
        self.held = (str(CID.of(encode_params(genesis))), genesis)
        n_layer = config.model.n_layer
        if not 1 <= self.stages <= n_layer:
            raise WorkerError(f"{self.stages} pipeline stages: this run's model has {n_layer} layers, "
                              f"so a worker can run 1 to {n_layer} stages")
        self.inner: InnerLoop | PipelinedInnerLoop
        if self.stages > 1:  # the stage processes share this worker's torch threads
            try:
                self.inner = PipelinedInnerLoop(config.model, config.inner, self.stages,
                                                compression=config.compression,
                                                threads_per_stage=max(1, torch.get_num_threads() // self.stages))
            except ValueError as exc:  # e.g. a batch that does not cut into equal microbatches
                raise WorkerError(f"{self.stages} pipeline stages: {exc}") from exc
        else:
            self.inner = InnerLoop(self.model, config.inner)
        # Error feedback lives as long as the worker (not its stage processes): what compression
        # drops is sent next round.
        self.uplink = Uplink(config.compression, self.stages)

    def _heartbeats(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_s):
            try:
                self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=self.round,
                                                        phase=self.phase), timeout=5, metadata=self.session)
            except grpc.RpcError as exc:
                log.debug("heartbeat failed: %s", exc.details())
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    # The coordinator restarted and forgot this session: join again now rather than
                    # at the next call, which may be a whole inner loop away, so it keeps us live.
                    try:
                        self.join()
                    except (grpc.RpcError, WorkerError) as rejoin:
                        log.warning("heartbeat: could not join again: %s", rejoin)

    # ----------------------------------------------------------------------------- a round

    def _finished(self, header: pb.GlobalHeader) -> int:
        wall = time.monotonic() - self.started_at
        log.info("run finished at round %d (%s); sent %d bytes, received %d; trained %.1fs of %.1fs (%.0f%%)",
                 header.round, header.manifest_cid, self.bytes_sent, self.bytes_received,
                 self.compute_s, wall, 100 * self.compute_s / wall if wall > 0 else 0.0)
        self._metric({"event": "finished", "rounds": int(header.round), "wall_s": wall,
                      "compute_s": self.compute_s, "tokens": self.tokens, "bytes_sent": self.bytes_sent,
                      "bytes_received": self.bytes_received})
        return 0

    def _metric(self, record: dict) -> None:
        """Append one JSON line to the metrics file, when the worker was given one."""
        if self.metrics is not None:
            with open(self.metrics, "a", encoding="utf-8") as f:
                f.write(strict_json(record, sort_keys=True) + "\n")

    def _round_done(self, round_: int, work: RoundWork, trained_s: float, waited_s: float) -> None:
        """Progress of one round: a log line, and a metrics record (bytes since the last one)."""
        result = work.result
        self.compute_s += trained_s
        self.tokens += result.tokens
        sent, received = self.bytes_sent - self._counted[0], self.bytes_received - self._counted[1]
        self._counted = (self.bytes_sent, self.bytes_received)
        decision = merged_decision(round_, work.slices)
        log.info("round %d: %d steps, loss %.4f, %d tokens, train %.2fs, waited %.2fs, %d bytes up, %d down%s",
                 round_, result.steps, result.mean_loss, result.tokens, trained_s, waited_s, sent, received,
                 f", uplink mean rank {decision.mean_rank:.1f}" if decision else "")
        record = {"event": "round", "round": round_, "tokens": result.tokens, "inner_steps": result.steps,
                  "train_loss": result.mean_loss, "compute_s": trained_s, "waited_s": waited_s,
                  "bytes_sent": sent, "bytes_received": received, "time": time.time()}
        if decision is not None:
            record["ranks"] = {name: d.rank for name, d in decision.tensors.items()}
            record["energy"] = decision.energy
        self._metric(record)

    def _exchange(self, round_: int, work: RoundWork, base_cid: str) -> tuple[Pushed | None, pb.GlobalHeader, Params]:
        """Push Δ⁽ʳ⁾, then fetch θ⁽ʳ⁾ (or whatever is newer): the part that overlaps compute."""
        pushed = self.push(round_, work, base_cid)
        header, params = self.fetch(round_)
        return pushed, header, params

    def _run_overlapped(self) -> int:
        """DiLoCoX's one-step-delay overlap (see the module docstring).

        While round r trains, the exchange of round r-1 (push Δ⁽ʳ⁻¹⁾, fetch θ⁽ʳ⁻¹⁾) runs in a
        background thread; round r started from θ⁽ʳ⁻²⁾ − Δ⁽ʳ⁻¹⁾, the newest global this worker
        held plus its own last round. A worker that finds itself behind (dropped, or the run moved
        on) starts over synchronously from the newest global.
        """
        held_header, held = self.fetch(0)
        if held_header.finished:
            return self._finished(held_header)
        r, start, base = held_header.round + 1, held, held_header.params_cid
        inflight: Future | None = None
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange") as exchange:
            while r <= self.config.rounds.rounds:
                self.round = r
                started = time.monotonic()
                try:
                    work = self.train(r, start)
                except PipelineError as exc:
                    # Start over from the round's checkpoint once it closes without us (see _abandon).
                    held_header, held = self.fetch(self._abandon(r, exc, inflight))
                    if held_header.finished:
                        return self._finished(held_header)
                    r, start, base, inflight = held_header.round + 1, held, held_header.params_cid, None
                    continue
                trained = time.monotonic() - started
                if inflight is not None:
                    pushed, held_header, held = inflight.result()
                    if pushed is not None and held_header.round == pushed.round and self.domain is not None:
                        self.report(pushed, held_header, held)
                    if held_header.finished or held_header.round != r - 1:
                        # Behind the run: this round's work builds on a stale base; start over.
                        log.warning("round %d: the run is at round %d; restarting from it", r, held_header.round)
                        if held_header.finished:
                            return self._finished(held_header)
                        r, start, base, inflight = held_header.round + 1, held, held_header.params_cid, None
                        continue
                inflight = exchange.submit(self._exchange, r, work, base)
                self._round_done(r, work, trained, time.monotonic() - started - trained)
                # s⁽ʳ⁺¹⁾ = θ⁽ʳ⁻¹⁾ − Δ⁽ʳ⁾: newest global held, plus this round's own progress.
                start = {k: held[k] - work.result.pseudo_gradient[k] for k in held}
                base = held_header.params_cid
                r += 1
            assert inflight is not None
            pushed, header, params = inflight.result()
            if pushed is not None and header.round == pushed.round and self.domain is not None:
                self.report(pushed, header, params)
            while not header.finished:
                header, _ = self.fetch(header.round + 1)
            return self._finished(header)

    def fetch(self, min_round: int) -> tuple[pb.GlobalHeader, Params]:
        """The global parameters of round >= ``min_round`` (waits for them), verified by their CID.

        When this worker holds the round before, the coordinator may send the compressed global
        update instead (trainer.downlink): θ⁽ʳ⁾ = θ⁽ʳ⁻¹⁾ − decompress(C⁽ʳ⁾), which must hash to the
        CID the header names; if it does not, the worker says so and fetches θ⁽ʳ⁾ dense.
        """
        self.phase = "waiting"
        dense_only = False
        while True:
            held = None if dense_only else self.held

            def call() -> tuple[pb.GlobalHeader, bytes | None, int]:
                self.link.call()
                stream = self.stub.FetchGlobal(pb.FetchGlobalRequest(
                    worker_id=self.worker_id, min_round=min_round, wait_s=self.fetch_wait_s,
                    have_params_cid=held[0] if held else ""), timeout=self.fetch_wait_s + 60, metadata=self.session)
                first = next(stream)
                size = first.ByteSize()
                self.bytes_received += size
                self.link.transfer("down", size)
                if not first.HasField("header"):
                    raise WireError("global state stream did not start with its header")
                header = first.header
                if not header.available:
                    return header, None, size

                def data() -> Iterator[bytes]:
                    nonlocal size
                    for message in stream:
                        size += message.ByteSize()
                        self.bytes_received += message.ByteSize()
                        self.link.transfer("down", message.ByteSize())
                        yield message.data
                payload = reassemble(data(), header.payload_size, header.payload_sha256,
                                     what=f"global state of round {header.round}")
                return header, payload, size

            header, payload, size = self._call("fetch global state", call)
            if payload is None:
                continue
            self._checked_signature(header)  # before a byte of the payload is used
            try:
                params = self._global_params(header, payload, held)
            except (WireError, CompressionError) as exc:
                if header.encoding == ENCODING_DENSE_F32:
                    raise
                log.error("round %d: the %s global state does not give the published parameters "
                          "(%s); fetching them dense", header.round, header.encoding, exc)
                dense_only = True
                continue
            self.held = (header.params_cid, params)
            self.received_for[header.params_cid] = size
            return header, params

    def _global_params(self, header: pb.GlobalHeader, payload: bytes,
                       held: tuple[str, Params] | None) -> Params:
        if header.encoding == ENCODING_HELD:
            if held is None or held[0] != header.params_cid or payload:
                raise WireError(f"the coordinator says this worker holds {header.params_cid}; it holds "
                                f"{held[0] if held else 'nothing'}")
            return held[1]
        if header.encoding == ENCODING_DENSE_F32:
            if str(CID.of(payload)) != header.params_cid:
                raise WireError(f"global parameters hash to {CID.of(payload)}, header names {header.params_cid}")
            return decode_params(payload)
        if header.encoding != ENCODING_LOWRANK_INT4:
            raise WireError(f"unknown global state encoding {header.encoding!r}")
        if held is None or header.base_params_cid != held[0]:
            raise WireError(f"the global update applies to {header.base_params_cid}, this worker holds "
                            f"{held[0] if held else 'nothing'}")
        codec = json_object(header.compression_header, "compression_header of the global update")
        params = apply_update(held[1], decode_update(payload, codec, layout_of(held[1])))
        rebuilt = CID.of(encode_params(params))
        if str(rebuilt) != header.params_cid:
            raise WireError(f"rebuilt parameters hash to {rebuilt}, header names {header.params_cid}")
        return params

    def push(self, round_: int, work: RoundWork, base_cid: str) -> Pushed | None:
        """Send Δ for ``round_``, one stream per stage slice; what was sent if the coordinator holds
        every slice, None if one was refused (the coordinator then drops the others: the worker is
        out of the round, which is undone or carried forward as the module docstring says)."""
        self.phase = "pushing"
        result = work.result
        received = self.received_for.get(base_cid, 0)
        # The round's record keeps the dense reconstruction Δ̂, which the coordinator rebuilds from
        # the slices bit for bit; the report restates its digest.
        record = record_of(merged(work.slices))
        decision = merged_decision(round_, work.slices)
        if decision is not None:
            log.info("round %d: compressed %d -> %d bytes in %d slice(s) (mean rank %.1f, energy %.3f)",
                     round_, len(record), sum(len(s.payload) for s in work.slices), len(work.slices),
                     decision.mean_rank, decision.energy)
        wire_bytes = 0
        for piece in work.slices:
            try:
                wire_bytes += self._push_slice(round_, result, piece, base_cid, received, work.state)
            except grpc.RpcError as exc:
                code = exc.code()
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
                    log.warning("round %d: %s refused (%s): %s", round_, _slice_name(piece), code.name,
                                exc.details())
                    if work.snapshot is not None and isinstance(self.inner, InnerLoop):
                        # The inner state moves only through counted rounds (trainer.diloco.InnerLoop),
                        # so that an auditor can rebuild it from the manifests: undo this round.
                        self.inner.restore(work.snapshot[0])
                        self.uplink.restore(work.snapshot[1])
                    else:
                        # Error feedback assumed these values arrived; none counts, so carry them.
                        self.uplink.carry_back(work.slices)
                    return None
                raise
        return Pushed(round_, CID.of(record).digest, to_e6(result.mean_loss), result.tokens,
                      result.steps, wire_bytes, received, CID.parse(base_cid).digest)

    def _push_slice(self, round_: int, result: InnerResult, piece: Slice, base_cid: str, received: int,
                    state: str = "") -> int:
        """One slice's PushUpdate stream; returns its wire bytes (what the coordinator counts)."""
        payload = piece.payload
        sha = sha256_hex(payload)
        header = pb.UpdateHeader(
            protocol_version=PROTOCOL_VERSION, run_id=self.config.run_id, round=round_,
            worker_id=self.worker_id, encoding=piece.encoding,
            compression_header=canonical_json(piece.codec_header) if piece.codec_header is not None else b"",
            tensors=[pb.TensorSpec(name=n, dtype=d, shape=s) for n, (d, s) in layout_of(piece.transmitted).items()],
            payload_size=len(payload), payload_sha256=sha, train_loss=result.mean_loss,
            tokens=result.tokens, inner_steps=result.steps, base_params_cid=base_cid,
            base_bytes_received=received, stage=piece.stage, num_stages=piece.num_stages,
            inner_state_sha256=state,
        )
        if self.key is not None:
            header.signature = self.key.sign_digest(
                update_digest(self.run_digest, round_, piece.stage, piece.num_stages, sha))
        messages = [pb.UpdateChunk(header=header)] + [pb.UpdateChunk(data=p) for p in chunked(payload)]
        wire_bytes = sum(m.ByteSize() for m in messages)

        def stream() -> Iterator[pb.UpdateChunk]:  # a fresh iterator per attempt
            self.link.call()
            for message in messages:
                self.link.transfer("up", message.ByteSize())
                self.bytes_sent += message.ByteSize()
                yield message

        try:
            response = self._call(f"push round {round_} {_slice_name(piece)}",
                                  lambda: self.stub.PushUpdate(stream(), timeout=120, metadata=self.session))
            log.info("round %d: %s accepted as %s", round_, _slice_name(piece), response.update_cid)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
            log.info("round %d: coordinator already holds this worker's %s", round_, _slice_name(piece))
        return wire_bytes

    def report(self, pushed: Pushed, header: pb.GlobalHeader, params: Params) -> None:
        """Sign and submit the RoundReport of a round this worker contributed to."""
        assert self.key is not None and self.domain is not None
        load_params(self.model, params)
        own = to_e6(evaluate(self.model, self.eval_batches))
        if abs(own - header.eval_loss_e6) > EVAL_TOLERANCE_E6:
            log.error("round %d: refusing to sign: the checkpoint evaluates to %.6f here, the manifest says %.6f",
                      pushed.round, own / 1e6, header.eval_loss_e6 / 1e6)
            return
        report = RoundReport(
            run_id=self.run_digest, round=pushed.round, worker=self.key.address,
            parent_checkpoint=pushed.parent, checkpoint=CID.parse(header.params_cid).digest,
            manifest_digest=CID.parse(header.manifest_cid).digest, update_digest=pushed.update, data_digest=self.data_digest, train_loss_e6=pushed.train_loss_e6,
            eval_loss_e6=header.eval_loss_e6, tokens=pushed.tokens, inner_steps=pushed.inner_steps,
            bytes_sent=pushed.bytes_sent, bytes_received=pushed.bytes_received,
        )
        signed = SignedReport(report, self.key.sign_digest(report.digest(self.domain)))
        raw = canonical_json(signed.to_json())
        try:
            self._call(f"report round {pushed.round}", lambda: self.stub.SubmitReport(
                pb.SubmitReportRequest(worker_id=self.worker_id, signed_report=raw), timeout=60, metadata=self.session))
            log.info("round %d: signed report accepted", pushed.round)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                return
            log.warning("round %d: report refused (%s): %s", pushed.round, exc.code().name, exc.details())

    def train(self, round_: int, params: Params) -> RoundWork:
        """The round's inner loop and its Δ encoded for the push, by the stages themselves when
        there are several; PipelineError when a pipeline stage failed (see _abandon)."""
        self.phase = "training"
        cfg = self.config
        batches = round_batches(
            self.shard, seed=cfg.seed, shard_index=self.shard_index, round_=round_,
            steps=cfg.inner.steps, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size,
        )
        if isinstance(self.inner, PipelinedInnerLoop):
            piped = self.inner.run(params, batches, self.uplink.states())
            self.uplink.update(piped.uplink_states)
            return RoundWork(InnerResult(piped.pseudo_gradient, piped.mean_loss, piped.tokens, piped.steps),
                             piped.slices)
        state = inner_state_digest(self.inner.state(), self.uplink.error_state())
        # Overlapped, the next round is training when a refusal comes back: nothing to undo then.
        snapshot = None if cfg.rounds.overlap else (self.inner.snapshot(), self.uplink.snapshot())
        result = self.inner.run(params, batches)
        return RoundWork(result, [self.uplink.encode(result.pseudo_gradient)], state, snapshot)

    def _abandon(self, round_: int, exc: PipelineError, inflight: Future | None = None) -> int:
        """Drop out of ``round_`` after a pipeline stage failed: push nothing for it, and tell the
        coordinator at once (phase "abandoned") so the round closes with the others. Returns the
        round whose checkpoint to go on from: ``round_`` (wait for it to close), or ``round_ - 1``
        when no other live worker is still on the round, which then could never close: this worker
        trains it again. Either way the next round starts fresh stage processes. ``inflight``: the
        overlapped path's exchange of the round before, which still counts and is waited for.
        """
        log.error("round %d: abandoned, no update pushed: %s", round_, exc)
        self.phase = "abandoned"
        try:
            self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=round_,
                                                    phase="abandoned"), timeout=5, metadata=self.session)
        except grpc.RpcError as rpc:  # the periodic heartbeat says it again
            log.warning("round %d: could not tell the coordinator: %s", round_, rpc.details())
        if inflight is not None:
            pushed, header, params = inflight.result()
            if pushed is not None and header.round == pushed.round and self.domain is not None:
                self.report(pushed, header, params)
        status = self._call("status", lambda: self.stub.Status(pb.StatusRequest(), timeout=10))
        if status.open_round == round_ and not any(
                w.alive and w.worker_id != self.worker_id and w.phase != "done"
                and not (w.phase == "abandoned" and w.round == round_) for w in status.workers):
            log.warning("round %d: no other live worker is on it; training it again", round_)
            return round_ - 1
        return round_

    def run(self) -> int:
        self._call("join", self.join)
        beat = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beat.start()
        # Wall time for utilisation runs from here (joined) to holding the final checkpoint.
        self.started_at = time.monotonic()
        try:
            if self.config.rounds.overlap:
                return self._run_overlapped()
            min_round = 0
            pushed: Pushed | None = None
            while True:
                header, params = self.fetch(min_round)
                if pushed is not None and header.round == pushed.round and self.domain is not None:
                    self.report(pushed, header, params)
                if header.finished:
                    return self._finished(header)
                self.round = header.round + 1
                started = time.monotonic()
                try:
                    work = self.train(self.round, params)
                except PipelineError as exc:
                    min_round, pushed = self._abandon(self.round, exc), None  # it closes without us
                    continue
                trained = time.monotonic() - started
                pushed = self.push(self.round, work, header.params_cid)
                self._round_done(self.round, work, trained, time.monotonic() - started - trained)
                min_round = self.round
        finally:
            self.phase = "done"
            self._stop.set()
            beat.join(timeout=10)  # no gRPC call may still be in flight when the channel closes
            try:  # tell the coordinator at once, so it need not wait for liveness to lapse
                self.stub.Heartbeat(pb.HeartbeatRequest(worker_id=self.worker_id, round=self.round,
                                                        phase="done"), timeout=2, metadata=self.session)
            except grpc.RpcError:
                pass
            if isinstance(self.inner, PipelinedInnerLoop):
                self.inner.close()  # stop the stage processes
            self.channel.close()
