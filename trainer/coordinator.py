"""The coordinator: collects each round's pseudo-gradients over gRPC, aggregates, publishes.

Life of round r (the global checkpoint of round r-1 is the run's HEAD):

  open     workers fetch θ⁽ʳ⁻¹⁾ (FetchGlobal) and push Δᵢ⁽ʳ⁾ (PushUpdate), a worker of P pipeline
           stages as P slices, one stream per stage (trainer.uplink). Each push is checked
           (trainer.aggregation) against its stage's slice of the model; an accepted one is
           stored at once and journalled in <run>/pending, so a coordinator restart keeps it. A
           worker's update counts once all P slices are in (Δ̂ᵢ = their union, checked whole);
           one refused slice drops the worker's others for the round.
  close    when ``quorum`` updates are accepted and every live worker has delivered, or
           ``straggler_timeout_s`` after the first accepted update (late or dead workers, and
           workers missing a stage's slice, are dropped from the round; they rejoin at the next).
  publish  Δ⁽ʳ⁾ = the updates, each clipped to c × the lower median of the round's norms and the
           previous K rounds' ρ̃, averaged by the config's rule (mean, trimmed mean or median),
           (θ⁽ʳ⁾, m⁽ʳ⁾) = outer step; with compression on, the global update travels compressed and
           θ⁽ʳ⁾ is what the replicas rebuild from those bytes. All of it is
           trainer.transition.round_transition, the function the audit re-runs. θ⁽ʳ⁾, m⁽ʳ⁾ (and the downlink bytes) go to the store, then the
           round's manifest, then HEAD moves to it, then round r+1 opens.

Refused by name besides malformed pushes (trainer.aggregation's checks): an all-zero update, one
byte-identical to an update already accepted in the run (``accepted_cids``, rebuilt on restart from
the manifests and the pending journal), one that names no base or not the round's base, and claims
of tokens or inner steps other than the config's (H × batch_size × block_size tokens, H steps:
what the manifest records) or a train loss outside ``TRAIN_LOSS_BAND`` around the held-out loss of
the round's start checkpoint.

Traffic: every byte of every RPC stream is counted per worker and direction, into the round open
at the time; the manifest records it (``traffic``, ``bytes_up``/``bytes_down``), and each
participant's ``bytes_sent``/``bytes_received`` (its push, and the fetch of the state it built on),
which its signed report restates.

The state machine (:class:`Coordinator`) knows nothing of gRPC transport; trainer.service
translates RPCs into calls on it and refusals into gRPC status codes, and is where callers are
authenticated and bounded (trainer.limits): what reaches this class has passed both.

Who counts: a worker is in ``workers`` once it joined; ``dropped`` in a round's manifest names the
registered workers seen in the liveness window of that round that did not contribute, not every
id ever registered. The registry holds at most ``max_registered`` ids; a new id beyond that takes
the place of the longest-silent one that is not live, or is refused.
"""

from __future__ import annotations

import dataclasses
import os
import logging
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from proto import PROTOCOL_VERSION, pb
from storage_client import CID, Manifest, Participant, canonical_json, from_e6, lineage, loads_bounded, to_e6
from storage_client.manifest import Downlink, Traffic
from trainer.aggregation import (
    InvalidUpdate, check_layout, check_norm, exact_norm, norm_bound, round_norm,
)
from trainer.config import ConfigError, RunConfig
from trainer.data import Corpus, eval_batches, load_corpus, sample_batch, shard_digest
from trainer.compression import AdaptiveRankPolicy
from trainer.diloco import (
    downlink_error_of, evaluate, load_params, momentum_of, outer_state_of, params_of, zero_momentum,
)
from trainer.downlink import DownlinkCompressor
from trainer.transition import OuterState, round_transition
from trainer.model import build_model, param_count
from trainer.pipeline import stage_param_names
from trainer.uplink import record_of
from attestation import SignedReport, WorkerKey
from trainer.refusal import Refusal
from trainer.run_dir import RunDir
from trainer.limits import clip
from trainer.trust import ReportBook, TrustGate, TrustSettings, global_digest, open_gate
from trainer.wire import ENCODING_DENSE_F32, ENCODING_LOWRANK_INT4, Layout, Params, decode_params, encode_params, layout_of

log = logging.getLogger("dilocox.coordinator")

MAX_REPORT_JSON = 16 << 10
# A declared train loss must lie in [a·L0, b·L0 + c], L0 the held-out loss of the round's start.
TRAIN_LOSS_BAND = (0.2, 1.5, 0.5)
MAX_REFUSALS_KEPT = 8  # per worker and round, in Status and rounds.jsonl
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise Refusal(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"protocol version {version} is not supported: this coordinator speaks version "
            f"{PROTOCOL_VERSION}; upgrade the worker",
        )


@dataclass
class Accepted:
    update: Params
    entry: dict  # the journal entry: cid, train_loss_e6, tokens, inner_steps, bytes_sent, bytes_received
    norm: float | None = None  # exact_norm of a whole update, computed once (trainer.aggregation)


@dataclass
class StageSlices:
    """The slices a worker of several pipeline stages has delivered so far for the open round."""

    num_stages: int
    slices: dict[int, Accepted] = field(default_factory=dict)  # by stage; entry as Accepted's, per slice
    completing: bool = False  # the last slice is in: its merged update is being stored


@dataclass
class OpenRound:
    number: int
    opened_at: float
    first_accept_at: float | None = None
    accepted: dict[str, Accepted] = field(default_factory=dict)
    partial: dict[str, StageSlices] = field(default_factory=dict)  # workers with some stage slices in
    refused: dict[str, list[str]] = field(default_factory=dict)  # every refusal, by worker
    up: dict[str, int] = field(default_factory=dict)    # wire bytes by worker, worker → coordinator
    down: dict[str, int] = field(default_factory=dict)  # and coordinator → worker
    closing: bool = False


@dataclass
class WorkerState:
    shard: int
    last_seen: float
    round: int = 0
    phase: str = "joined"
    address: str | None = None  # admitted key, when the run has a ledger


@dataclass(frozen=True)
class GlobalState:
    """The published global checkpoint: what FetchGlobal serves."""

    round: int
    params: Params
    momentum: Params
    payload: bytes  # safetensors of params; sha256 of it is the params CID
    params_cid: CID
    manifest_cid: CID
    eval_loss_e6: int
    # The compressed global update C⁽ʳ⁾ and its codec header (canonical JSON), and the CID of
    # θ⁽ʳ⁻¹⁾ it applies to; None when the round's update travels dense.
    downlink: tuple[bytes, bytes, str] | None = None
    downlink_error: Params = field(default_factory=dict)  # e⁽ʳ⁾, part of the outer state

    @property
    def outer(self) -> OuterState:
        return OuterState(self.params, self.momentum, self.downlink_error)


@dataclass(frozen=True)
class RoundSummary:
    round: int
    manifest_cid: str
    eval_loss: float
    mean_train_loss: float  # NaN for a round without participants (genesis): null in rounds.jsonl
    participants: tuple[str, ...]
    dropped: tuple[str, ...]
    refused: tuple[str, ...]
    bytes_up: int
    bytes_down: int
    seconds: float

    @classmethod
    def of(cls, cid: CID, m: Manifest, refused: tuple[str, ...] = (), seconds: float = 0.0) -> RoundSummary:
        losses = [from_e6(p.train_loss_e6) for p in m.participants]
        return cls(
            round=m.round, manifest_cid=str(cid), eval_loss=from_e6(m.eval_loss_e6),
            mean_train_loss=sum(losses) / len(losses) if losses else float("nan"),
            participants=tuple(p.worker for p in m.participants), dropped=m.dropped,
            refused=refused, bytes_up=m.bytes_up, bytes_down=m.bytes_down, seconds=seconds,
        )


class Coordinator:
    """Round state machine with durable state in a :class:`RunDir`. Thread-safe."""

    def __init__(self, run_dir: RunDir, config: RunConfig | None, clock: Callable[[], float] = time.monotonic,
                 trust: TrustSettings | None = None) -> None:
        # The key that signs every global state served: the run's coordinator account on the ledger,
        # or a key of this run directory when there is no ledger.
        self.signer = WorkerKey(trust.private_key) if trust is not None else run_dir.signing_key()
        self._signatures: dict[str, bytes] = {}
        self.run_dir = run_dir
        self.store = run_dir.store
        self.clock = clock
        self._lock = threading.Condition()
        self.downlink: DownlinkCompressor | None = None
        # Wire bytes of each worker's completed FetchGlobal streams, by params CID served (the last
        # few): what a participant's record says it received for the state its update built on.
        self.served: dict[str, dict[str, int]] = {}
        head = run_dir.head()
        if head is None:
            if config is None:
                raise ConfigError(f"{run_dir.path} holds no run yet: a configuration is needed to start one")
            self._genesis(config)
        else:
            self._resume(head, config)
        self.layout: Layout = layout_of(self.global_state.params)
        self.bound = norm_bound(self.config, param_count(self.model))
        self.max_registered = max(16, 4 * self.config.rounds.expected_workers)
        self.workers: dict[str, WorkerState] = {
            w: WorkerState(shard=s, last_seen=float("-inf")) for w, s in run_dir.workers().items()
        }
        self.round = OpenRound(number=self.global_state.round + 1, opened_at=self.clock())
        # Every update accepted in this run, by CID: a byte-identical one is refused (a replay).
        self.accepted_cids: dict[str, tuple[int, str]] = {
            p.update: (r, p.worker) for r, (_, m) in sorted(self.manifests.items()) for p in m.participants}
        self.norm_history: dict[int, list[float]] = {}  # round -> [its ρ̃] (see _history)
        self._reload_pending()
        # The run's on-chain identity is its genesis manifest: config, corpus and θ⁽⁰⁾ in one digest.
        self.genesis_cid, genesis = self.manifests[0]
        self.run_digest = self.genesis_cid.digest
        # Report deadlines of rounds published before a restart count from the restart.
        self.started_at = self.clock()
        self.closed_at: dict[int, float] = {r: self.clock() for r in self.manifests}
        self.gate: TrustGate | None = None
        self.book: ReportBook | None = None
        self.ledger_lag = 0  # published rounds not yet confirmed on chain; kept by the settlement thread
        if trust is not None:
            self.gate = open_gate(trust, self.store, run_dir, self.run_digest, self.config_cid)
            self.book = ReportBook(run_dir, self.gate, trust.report_timeout_s, trust.challenge_window)
            self.book.ensure_run(self.genesis_cid, genesis)
        else:
            log.warning("no ledger configured: workers are not attested and rounds are not recorded on chain")

    # ----------------------------------------------------------------------------- set-up

    def _prepare(self, config: RunConfig, corpus: Corpus | None = None) -> None:
        self.config = config
        self.config_bytes = config.canonical()
        self.config_cid = self.store.put_json(config.to_json())
        self.model = build_model(config.model, config.seed)
        if config.compression.enabled:
            self.downlink = DownlinkCompressor(AdaptiveRankPolicy(config.compression))
        corpus = corpus or load_corpus(config.data, config.seed, config.model.block_size)
        shards = config.rounds.expected_workers
        self.shard_digests = [shard_digest(corpus.shard(i, shards)) for i in range(shards)]
        self.eval_batches = eval_batches(
            corpus, seed=config.seed, count=config.data.eval_batches,
            batch_size=config.inner.batch_size, block_size=config.model.block_size,
        )
        # Screening by effect (rounds.screen_margin): a model of its own, and each round's batches.
        self.eval_tokens = corpus.eval
        self.screen_model = build_model(config.model, config.seed) if config.rounds.screen_margin > 0 else None
        self._screen_lock = threading.Lock()
        self._screening: tuple[int, float, list] | None = None  # (round, start loss, batches)

    def _genesis(self, config: RunConfig) -> None:
        corpus = load_corpus(config.data, config.seed, config.model.block_size)
        # Pin the corpus bytes into the run's identity, so every worker must train on the same text.
        config = config.replace(data=dataclasses.replace(config.data, corpus_sha256=corpus.sha256))
        self._prepare(config, corpus)
        params = params_of(self.model)
        momentum = zero_momentum(params)
        payload = encode_params(params)
        params_cid = self.store.put(payload)
        manifest = Manifest(
            run_id=config.run_id, round=0, parent=None, config=str(self.config_cid),
            params=str(params_cid), outer_state=str(self.store.put(encode_params(outer_state_of(momentum)))),
            participants=(), dropped=(), eval_loss_e6=to_e6(evaluate(self.model, self.eval_batches)),
            bytes_up=0, bytes_down=0,
        )
        manifest_cid = manifest.store(self.store)
        self.run_dir.set_head(manifest_cid)
        self.global_state = GlobalState(0, params, momentum, payload, params_cid, manifest_cid,
                                        manifest.eval_loss_e6)
        self.manifests = {0: (manifest_cid, manifest)}
        self.summaries = [RoundSummary.of(manifest_cid, manifest)]
        self.run_dir.log_round(dataclasses.asdict(self.summaries[0]))
        log.info("run %s: genesis %s (config %s)", config.run_id, manifest_cid, self.config_cid)

    def _resume(self, head: CID, config: RunConfig | None) -> None:
        chain = lineage(self.store, head)  # re-hashes every manifest back to genesis
        tip_cid, tip = chain[-1]
        stored = RunConfig.from_json(self.store.get_json(tip.config))
        # A config given on resume must be the run's own; its corpus digest may be left for us to fill.
        pinned = config and config.replace(
            data=dataclasses.replace(config.data, corpus_sha256=stored.data.corpus_sha256))
        if pinned is not None and pinned.cid != stored.cid:
            raise ConfigError(
                f"{self.run_dir.path} holds run {stored.run_id!r} with config {tip.config}; the given "
                f"configuration differs ({pinned.cid}). Resume without --config, or use a new run directory"
            )
        self._prepare(stored)
        payload = self.store.get(tip.params)
        params = decode_params(payload)
        outer_state = decode_params(self.store.get(tip.outer_state))
        momentum = momentum_of(outer_state)
        downlink = None
        if tip.downlink is not None:
            header = canonical_json(self.store.get_json(tip.downlink.header))
            downlink = (self.store.get(tip.downlink.payload), header, chain[-2][1].params)
        load_params(self.model, params)
        # e carries on from the stored outer state; the rank policy's window starts afresh.
        self.global_state = GlobalState(tip.round, params, momentum, payload, CID.parse(tip.params), tip_cid,
                                        tip.eval_loss_e6, downlink, downlink_error_of(outer_state))
        self.manifests = {m.round: (cid, m) for cid, m in chain}
        self.summaries = [RoundSummary.of(cid, m) for cid, m in chain]
        log.info("run %s: resumed at round %d from %s", stored.run_id, tip.round, tip_cid)

    def _reload_pending(self) -> None:
        """Updates, and stage slices, accepted before a restart for the still-open round stay accepted."""
        for worker, entry in sorted(self.run_dir.pending(self.round.number).items()):
            update = decode_params(self.store.get(entry["cid"]))  # re-hashed on read
            self.round.accepted[worker] = Accepted(update, entry)
            self.accepted_cids.setdefault(entry["cid"], (self.round.number, worker))
            self.round.first_accept_at = self.round.first_accept_at or self.clock()
            log.info("round %d: kept %s's update %s from before the restart", self.round.number, worker, entry["cid"])
        for worker, held in sorted(self.run_dir.pending(self.round.number, "stages").items()):
            if worker in self.round.accepted:
                continue
            part = StageSlices(int(held["num_stages"]))
            for stage, entry in held["slices"].items():
                part.slices[int(stage)] = Accepted(decode_params(self.store.get(entry["cid"])), entry)
            self.round.partial[worker] = part
            log.info("round %d: kept %d of %s's %d stage slices from before the restart", self.round.number,
                     len(part.slices), worker, part.num_stages)

    def _journal_partial(self) -> None:
        """<run>/pending: the open round's stage slices of workers not yet complete (lock held)."""
        self.run_dir.save_pending(self.round.number, {
            w: {"num_stages": p.num_stages, "slices": {str(s): a.entry for s, a in sorted(p.slices.items())}}
            for w, p in sorted(self.round.partial.items())
        }, "stages")

    def stage_layout(self, stage: int, num_stages: int) -> Layout:
        """The tensors of stage ``stage`` of ``num_stages`` (trainer.pipeline's split of the model)."""
        n_layer = self.config.model.n_layer
        if not 1 <= num_stages <= n_layer:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"num_stages {num_stages}: this run's model of {n_layer} layer(s) splits into "
                          f"1 to {n_layer} pipeline stages")
        if not stage < num_stages:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"stage {stage} out of range for {num_stages} stages")
        if num_stages == 1:
            return self.layout
        names = stage_param_names(self.config.model, num_stages)[stage]
        return {name: self.layout[name] for name in names}

    # ----------------------------------------------------------------------------- queries

    @property
    def finished(self) -> bool:
        return self.global_state.round >= self.config.rounds.rounds

    def alive(self, now: float) -> set[str]:
        limit = self.config.rounds.liveness_timeout_s
        return {w for w, s in self.workers.items() if now - s.last_seen <= limit}

    def registered(self) -> set[str]:
        with self._lock:
            return set(self.workers)

    def live_workers_done(self) -> bool:
        """Every live worker has said it saw the end of the run. A worker registered before a
        restart and not heard from since counts as live for one liveness window after it: it is
        reconnecting (TLS, a new Join) to fetch the final checkpoint."""
        with self._lock:
            now = self.clock()
            alive = self.alive(now)
            if now - self.started_at <= self.config.rounds.liveness_timeout_s:
                alive |= {w for w, s in self.workers.items() if not math.isfinite(s.last_seen)}
            return all(s.phase == "done" for w, s in self.workers.items() if w in alive)

    def status(self) -> pb.StatusResponse:
        with self._lock:
            now = self.clock()
            alive = self.alive(now)
            workers = [
                pb.WorkerStatus(worker_id=w, shard=s.shard, alive=w in alive, round=s.round, phase=s.phase,
                                last_seen_s=now - s.last_seen if math.isfinite(s.last_seen) else -1.0)
                for w, s in sorted(self.workers.items())
            ]
            rounds = [pb.RoundSummary(**dataclasses.asdict(s)) for s in self.summaries]
            return pb.StatusResponse(run_id=self.config.run_id, open_round=self.round.number,
                                     total_rounds=self.config.rounds.rounds, finished=self.finished,
                                     workers=workers, rounds=rounds, ledger_lag_rounds=max(0, self.ledger_lag))

    # ----------------------------------------------------------------------------- RPC logic

    def global_signature(self, state: GlobalState) -> bytes:
        """The coordinator's signature over what a worker trains from (trainer.trust.global_digest)."""
        key = str(state.manifest_cid)
        with self._lock:
            signature = self._signatures.get(key)
        if signature is None:
            signature = self.signer.sign_digest(
                global_digest(self.run_digest, state.round, state.params_cid.digest, state.manifest_cid.digest))
            with self._lock:
                self._signatures = {key: signature}  # one state is served at a time
        return signature

    def challenge(self, worker_id: str, protocol_version: int) -> bytes:
        """A nonce for the worker's evidence, bound to its id (empty when the run has no ledger)."""
        check_protocol(protocol_version)
        return self.gate.challenge(worker_id) if self.gate else b""

    def join(self, worker_id: str, protocol_version: int, address: str = "", evidence: bytes = b"",
             nonce: bytes = b"", proves_session: bool = False) -> tuple[int, int]:
        """Admit a worker; returns its shard and the open round.

        A worker id that a live worker holds is taken over only by that worker: a caller that
        proves the id's current session (``proves_session``, checked by the service) or whose
        freshly verified key is the one the id was admitted with. Anyone else is refused with
        ALREADY_EXISTS until the holder's liveness lapses, so no caller can push a live worker out.
        """
        check_protocol(protocol_version)
        admitted = self.gate.admit(worker_id, address, evidence, nonce) if self.gate else None
        with self._lock:
            now = self.clock()
            num_shards = self.config.rounds.expected_workers
            state = self.workers.get(worker_id)
            if state is not None and not proves_session and worker_id in self.alive(now) and (
                    admitted is None or admitted != state.address):
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                              f"worker id {worker_id!r} is held by a live worker; a restarted worker may take "
                              f"it over once {self.config.rounds.liveness_timeout_s:.0f}s pass without word from it")
            if state is None:
                self._make_room(now)
                taken = {s.shard for s in self.workers.values()}
                free = [i for i in range(num_shards) if i not in taken]
                shard = free[0] if free else len(self.workers) % num_shards
                state = self.workers[worker_id] = WorkerState(shard=shard, last_seen=now)
                self.run_dir.save_workers({w: s.shard for w, s in self.workers.items()})
            state.last_seen, state.phase, state.address = now, "joined", admitted
            log.info("worker %s joined (shard %d of %d)", worker_id, state.shard, num_shards)
            return state.shard, self.round.number

    def _make_room(self, now: float) -> None:
        """Before registering a new id: at ``max_registered`` ids, forget the longest-silent one that
        is neither live nor holding anything in the open round (lock held)."""
        if len(self.workers) < self.max_registered:
            return
        busy = self.alive(now) | set(self.round.accepted) | set(self.round.partial)
        idle = [w for w in self.workers if w not in busy]
        if not idle:
            raise Refusal(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"run {self.config.run_id!r} has {len(self.workers)} registered workers, all live or "
                          f"contributing: the most it keeps")
        gone = min(idle, key=lambda w: self.workers[w].last_seen)
        del self.workers[gone]
        self.served.pop(gone, None)
        log.info("forgot worker %s (silent longest) to register a new one", gone)

    def _known(self, worker_id: str) -> WorkerState:
        state = self.workers.get(worker_id)
        if state is None:
            raise Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"unknown worker {worker_id!r}: it has not joined run {self.config.run_id!r}",
            )
        return state

    def heartbeat(self, worker_id: str, round_: int, phase: str) -> tuple[int, bool]:
        """A live worker's round and phase (one of trainer.limits.PHASES, checked by the service)."""
        with self._lock:
            state = self._known(worker_id)
            # A worker never resumes a round it abandoned: a later (or reordered) heartbeat of the
            # same round, e.g. "waiting" for it to close, leaves it abandoned; "done" still counts.
            if state.phase == "abandoned" and round_ == state.round and phase != "done":
                phase = "abandoned"
            state.last_seen, state.round, state.phase = self.clock(), round_, phase
            return self.round.number, self.finished

    def admit_header(self, h: pb.UpdateHeader) -> Layout:
        """Everything that can be checked before a payload byte is read (refusal order matters:
        a stale or duplicate push is reported as such even if its contents are also wrong)."""
        check_protocol(h.protocol_version)
        with self._lock:
            if h.run_id != self.config.run_id:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"update is for run {clip(h.run_id)}; this coordinator runs {self.config.run_id!r}")
            self._known(h.worker_id).last_seen = self.clock()
            self._check_round(h.worker_id, h.round, h.stage, h.num_stages)
            bases = {str(self.global_state.params_cid)}
            if self.config.rounds.overlap:  # one round stale is the point of the overlap
                bases.add(self.manifests[max(h.round - 2, 0)][1].params)
            if not h.base_params_cid:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"update for round {h.round} names no base_params_cid: an update must say which "
                              f"checkpoint it was computed from (the round starts from {self.global_state.params_cid})")
            if h.base_params_cid not in bases:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"update for round {h.round} was computed from {clip(h.base_params_cid)}, but the "
                              f"round starts from {self.global_state.params_cid}")
            start_loss = from_e6(self.global_state.eval_loss_e6)
        if h.encoding not in ENCODINGS:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"unsupported update encoding {clip(h.encoding, 32)}; supported: {', '.join(ENCODINGS)}")
        if not _SHA256_HEX.match(h.payload_sha256):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"payload_sha256 {clip(h.payload_sha256)} is not 64 lowercase hex digits")
        if self.gate is not None:
            self.gate.check_update(h.worker_id, self.workers[h.worker_id].address, h.round, h.stage,
                                   h.num_stages, h.payload_sha256, h.signature)
        expected = self.stage_layout(h.stage, h.num_stages)
        limit = sum(4 * math.prod(shape) for _, shape in expected.values()) + (1 << 20)
        if h.payload_size > limit:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"payload of {h.payload_size} bytes exceeds the {limit} a dense update can need")
        if not (h.train_loss == h.train_loss and abs(h.train_loss) < 1e6) or h.inner_steps < 1:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"implausible metrics: train_loss {h.train_loss}, inner_steps {h.inner_steps}")
        # Tokens and steps are not the worker's to claim: the config fixes them.
        cfg = self.config
        if h.tokens != self.round_tokens or h.inner_steps != cfg.inner.steps:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"claimed tokens {h.tokens}, inner_steps {h.inner_steps}; this run's round is "
                          f"{cfg.inner.steps} inner steps of {cfg.inner.batch_size}x{cfg.model.block_size} tokens: "
                          f"tokens {self.round_tokens}, inner_steps {cfg.inner.steps}")
        # The declared train loss (the mean over the H inner steps from the round's start) is bounded
        # against the coordinator's own held-out loss L0 of that start: in [0.2·L0, 1.5·L0 + 0.5].
        low, high = TRAIN_LOSS_BAND[0] * start_loss, TRAIN_LOSS_BAND[1] * start_loss + TRAIN_LOSS_BAND[2]
        if not low <= h.train_loss <= high:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"claimed train_loss {h.train_loss:.4g} is outside [{low:.4g}, {high:.4g}], the band "
                          f"around the round's start checkpoint's held-out loss {start_loss:.4g}")
        declared = {t.name: (t.dtype, tuple(int(d) for d in t.shape)) for t in h.tensors}
        if len(declared) != len(h.tensors):
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, "header names a tensor twice")
        try:
            check_layout(declared, expected)
        except InvalidUpdate as exc:
            where = f"stage {h.stage} of {h.num_stages}: " if h.num_stages > 1 else ""
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, where + str(exc)) from exc
        if h.num_stages == 1 and not _SHA256_HEX.match(h.inner_state_sha256):
            # What the update grew from besides θ: without it no auditor can replay the round.
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"inner_state_sha256 {clip(h.inner_state_sha256)} is not 64 lowercase hex digits: a "
                          f"one-process worker commits to the inner state each round starts from")
        if h.num_stages > 1 and h.inner_state_sha256:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          "a stage slice names an inner_state_sha256; workers of several stages commit none")
        return declared

    def _check_round(self, worker_id: str, round_: int, stage: int = 0, num_stages: int = 1) -> None:
        current = self.round
        if self.finished:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"run {self.config.run_id!r} has finished all rounds")
        if round_ < current.number or (round_ == current.number and current.closing):
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"stale round {round_}: it has closed; the open round is "
                          f"{current.number + (1 if current.closing else 0)}")
        if round_ > current.number:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"round {round_} is not open yet; the open round is {current.number}")
        if worker_id in current.accepted:
            raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                          f"worker {worker_id!r} already pushed an update for round {round_} "
                          f"({current.accepted[worker_id].entry['cid']})")
        part = current.partial.get(worker_id)
        if part is not None:
            if part.num_stages != num_stages:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"worker {worker_id!r} pushed round {round_} as {part.num_stages} stage slices, "
                              f"this one says {num_stages}")
            if stage in part.slices:
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                              f"worker {worker_id!r} already pushed stage {stage} of {num_stages} for round "
                              f"{round_} ({part.slices[stage].entry['cid']})")
            if part.completing:
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS,
                              f"worker {worker_id!r}'s update for round {round_} is being stored")

    def count_up(self, worker_id: str, nbytes: int) -> None:
        """Bytes a worker sent, counted into the open round (refused pushes too: they crossed the
        network). Streams from ids that never joined belong to no worker of the run."""
        with self._lock:
            if worker_id in self.workers:
                self.round.up[worker_id] = self.round.up.get(worker_id, 0) + nbytes

    def refuse(self, h: pb.UpdateHeader, refusal: Refusal) -> None:
        """File a refusal: the worker is out of the round, and its other stage slices of the round
        go with it. A duplicate (ALREADY_EXISTS) changes nothing: what it repeats is held."""
        message, dropped = refusal.message, None
        if refusal.code == grpc.StatusCode.ALREADY_EXISTS:
            log.info("round %d: %s from %s", h.round, message, h.worker_id)
            return
        with self._lock:
            if h.round == self.round.number and h.worker_id in self.workers:
                filed = self.round.refused.setdefault(h.worker_id, [])
                if len(filed) < MAX_REFUSALS_KEPT:  # the log has every one; the record keeps the first few
                    filed.append(message)
                dropped = self.round.partial.pop(h.worker_id, None)
                if dropped is not None:
                    self._journal_partial()
        what = "update" if h.num_stages <= 1 else f"stage {h.stage} of {h.num_stages} slice"
        log.warning("round %d: refused %s from %s: %s%s", h.round, what, h.worker_id, message,
                    f" (its {len(dropped.slices)} other slice(s) dropped)" if dropped and dropped.slices else "")

    def accept(self, h: pb.UpdateHeader, update: Params, wire_bytes: int) -> tuple[CID, int]:
        """Store and journal an update, or a stage slice, that passed every check; returns its
        record's CID and the open round. The last slice of a worker completes its update."""
        record = record_of(update)
        if h.num_stages == 1:
            with self._lock:  # a replay is refused by its hash before any held-out evaluation
                self._check_replay(str(CID.of(record)))
            self.screen(h.round, update)
        cid = self.store.put(record)  # before the journal names it
        norm = exact_norm(update) if h.num_stages == 1 else None  # outside the lock: a pass over Δ
        with self._lock:
            self._check_round(h.worker_id, h.round, h.stage, h.num_stages)  # the round may have moved
            # The fetch this update built on, as this coordinator counted it; after a restart it
            # has no count and takes the worker's (which the worker's signed report restates).
            received = self.served.get(h.worker_id, {}).get(h.base_params_cid, int(h.base_bytes_received))
            # Tokens and inner steps follow from the config (admit_header refused any other claim).
            entry = {
                "cid": str(cid), "train_loss_e6": to_e6(h.train_loss), "tokens": self.round_tokens,
                "inner_steps": self.config.inner.steps, "bytes_sent": wire_bytes, "bytes_received": received,
                "shard": self.workers[h.worker_id].shard,
                # A worker of several stages commits no inner state (each stage holds its own).
                "state": h.inner_state_sha256 if h.num_stages == 1 else None,
            }
            if h.num_stages == 1:
                self._check_replay(str(cid))
                self._accepted(h.worker_id, h.round, Accepted(update, entry, norm))
                open_round = self.round.number
                log.info("round %d: accepted %s from %s (loss %.4f)", h.round, cid, h.worker_id, h.train_loss)
                return cid, open_round
            part = self.round.partial.setdefault(h.worker_id, StageSlices(h.num_stages))
            entry["base_params_cid"] = h.base_params_cid
            _check_sibling(h, entry, part)
            part.slices[h.stage] = Accepted(update, entry)
            self._journal_partial()
            self.round.first_accept_at = self.round.first_accept_at or self.clock()
            open_round = self.round.number
            complete = len(part.slices) == part.num_stages
            part.completing = complete
        log.info("round %d: accepted stage %d of %d slice %s from %s", h.round, h.stage, h.num_stages, cid,
                 h.worker_id)
        if complete:
            self._complete(h, part)
        return cid, open_round

    def screen(self, round_: int, update: Params) -> float:
        """Screening by effect, when ``rounds.screen_margin`` > 0: the held-out loss of θ − Δᵢ, θ the
        round's start checkpoint, on ``data.eval_batches`` batches the coordinator draws from the
        held-out split with a private random seed once a round (workers cannot tune to them), must
        not exceed that of θ by more than the margin; returns the loss change (0.0 when off).
        Not part of the re-derivation: a refused update is in no manifest."""
        margin = self.config.rounds.screen_margin
        if self.screen_model is None or margin <= 0:
            return 0.0
        cfg, g = self.config, self.global_state
        started = time.perf_counter()
        with self._screen_lock, torch.no_grad():
            if self._screening is None or self._screening[0] != g.round:
                generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
                batches = [sample_batch(self.eval_tokens, cfg.inner.batch_size, cfg.model.block_size, generator)
                           for _ in range(cfg.data.eval_batches)]
                load_params(self.screen_model, g.params)
                self._screening = (g.round, evaluate(self.screen_model, batches), batches)
            _, before, batches = self._screening
            load_params(self.screen_model, {name: p - update[name] for name, p in g.params.items()})
            after = evaluate(self.screen_model, batches)
        log.info("round %d: screened an update in %.3fs: held-out loss %.4f -> %.4f", round_,
                 time.perf_counter() - started, before, after)
        if not after <= before + margin:  # NaN too
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"screened on held-out batches drawn for round {round_}, the update raises the loss of "
                          f"the round's start from {before:.4f} to {after:.4f}, more than the margin {margin:g}")
        return after - before

    @property
    def round_tokens(self) -> int:
        """The tokens of one worker's round: H steps of batch_size sequences of block_size tokens."""
        cfg = self.config
        return cfg.inner.steps * cfg.inner.batch_size * cfg.model.block_size

    def _check_replay(self, cid: str) -> None:
        """Refuse an update byte-identical to one already accepted in this run (lock held)."""
        seen = self.accepted_cids.get(cid)
        if seen is not None:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                          f"update {cid} is byte-identical to the update {seen[1]} had accepted in round "
                          f"{seen[0]}: a replayed update is refused")

    def _accepted(self, worker_id: str, round_: int, accepted: Accepted) -> None:
        """Count a worker's whole update in the open round and journal it (lock held)."""
        self.accepted_cids.setdefault(accepted.entry["cid"], (round_, worker_id))
        self.round.accepted[worker_id] = accepted
        self.round.first_accept_at = self.round.first_accept_at or self.clock()
        self.run_dir.save_pending(round_, {w: a.entry for w, a in self.round.accepted.items()})
        self._lock.notify_all()

    def _complete(self, h: pb.UpdateHeader, part: StageSlices) -> None:
        """All of a worker's stage slices are in: Δ̂ᵢ = their union, checked whole, counted."""
        update: Params = {}
        for stage in range(part.num_stages):
            update.update(part.slices[stage].update)
        try:
            norm = check_norm(update, self.bound)
        except InvalidUpdate as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"the update of all {part.num_stages} stage slices: {exc}") from exc
        self.screen(h.round, update)
        cid = self.store.put(record_of(update))
        first = part.slices[0].entry
        entry = {"cid": str(cid), "train_loss_e6": first["train_loss_e6"], "tokens": first["tokens"],
                 "inner_steps": first["inner_steps"], "bytes_received": first["bytes_received"],
                 "shard": first.get("shard", 0), "state": None,
                 "bytes_sent": sum(a.entry["bytes_sent"] for a in part.slices.values())}
        with self._lock:
            if self.round.number != h.round or self.round.closing or self.round.partial.get(h.worker_id) is not part:
                # The round closed without this worker meanwhile: none of its slices counts.
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"round {h.round} closed before {h.worker_id}'s last stage slice was counted")
            self._check_replay(str(cid))
            del self.round.partial[h.worker_id]
            self._accepted(h.worker_id, h.round, Accepted(update, entry, exact_norm(update)))
            self._journal_partial()
        log.info("round %d: accepted %s from %s, %d stage slices (loss %.4f, norm %.4g)", h.round, cid,
                 h.worker_id, part.num_stages, h.train_loss, norm)

    def _history(self, round_: int) -> list[float]:
        """ρ̃ of rounds max(1, r-K)..r-1, K = rounds.clip_history_rounds (trainer.aggregation.round_norm):
        kept from their closing, or after a restart recomputed from the stored updates the manifests
        name (as the audit does)."""
        out: list[float] = []
        for earlier in range(max(1, round_ - self.config.rounds.clip_history_rounds), round_):
            norms = self.norm_history.get(earlier)
            if norms is None:
                _, manifest = self.manifests[earlier]
                norms = [round_norm([exact_norm(decode_params(self.store.get(p.update)))
                                     for p in manifest.participants])]
                self.norm_history[earlier] = norms
            out.extend(norms)
        for old in [k for k in self.norm_history if k < round_ - self.config.rounds.clip_history_rounds]:
            del self.norm_history[old]
        return out

    def wait_for_global(self, worker_id: str, min_round: int, wait_s: float) -> tuple[GlobalState | None, int, bool]:
        deadline = self.clock() + max(0.0, min(wait_s, 60.0))
        with self._lock:
            self._known(worker_id).last_seen = self.clock()
            while self.global_state.round < min_round and not self.finished:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return None, self.round.number, False
                self._lock.wait(remaining)
            return self.global_state, self.round.number, self.finished

    def count_down(self, worker_id: str, nbytes: int) -> None:
        with self._lock:
            if worker_id in self.workers:
                self.round.down[worker_id] = self.round.down.get(worker_id, 0) + nbytes

    def served_state(self, worker_id: str, params_cid: str, nbytes: int) -> None:
        """A FetchGlobal stream of ``params_cid`` reached its end: ``nbytes`` in all."""
        with self._lock:
            if worker_id in self.workers:
                served = self.served.setdefault(worker_id, {})
                served.pop(params_cid, None)  # newest last
                served[params_cid] = nbytes
                while len(served) > 4:  # an update builds on the newest state or, overlapped, the one before
                    del served[next(iter(served))]

    # ----------------------------------------------------------------------------- reports

    def submit_report(self, worker_id: str, raw: bytes) -> int:
        """A participant's signed report of a published round; returns the round."""
        if self.gate is None or self.book is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, "this run has no ledger: reports are not collected")
        try:
            signed = SignedReport.from_json(loads_bounded(raw, max_bytes=MAX_REPORT_JSON, what="report"))
        except (ValueError, TypeError, KeyError) as exc:  # JSONBoundsError is a ValueError
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"malformed report: {clip(exc, 160)}") from exc
        r = signed.report.round
        with self._lock:
            state = self._known(worker_id)
            published = self.manifests.get(r)
            parent = self.manifests.get(r - 1)
        if published is None or parent is None or r == 0:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION, f"round {r} has no published checkpoint to report on")
        self.gate.check_report(worker_id, state.address, signed, published[0], published[1], parent[1],
                               self.shard_digests[state.shard])
        self.book.add(worker_id, signed)
        log.info("round %d: report from %s (%s) accepted", r, worker_id, state.address)
        return r

    def settle(self) -> list[int]:
        """Queue every round whose reports are in for the ledger, in order."""
        if self.book is None:
            return []
        with self._lock:
            manifests, closed_at = dict(self.manifests), dict(self.closed_at)
        return self.book.queue_due(manifests, closed_at, self.clock())

    def recorded_through(self) -> int:
        """The last round the ledger has confirmed: those queued, less those still in the outbox."""
        if self.book is None or self.gate is None:
            return self.global_state.round
        waiting = sum(1 for item in self.gate.outbox.pending() if item["kind"] == "round")
        return self.book.queued_through - waiting

    def settled(self) -> bool:
        """Every published round is queued and the outbox has confirmed it on chain."""
        if self.book is None or self.gate is None:
            return True
        return self.book.queued_through >= self.global_state.round and not self.gate.outbox.pending()

    # ----------------------------------------------------------------------------- closing

    def close_due(self) -> bool:
        with self._lock:
            r, now = self.round, self.clock()
            if self.finished or r.closing or not r.accepted:
                return False
            # A worker that abandoned this round (a pipeline stage failed) will push nothing for it.
            abandoned = {w for w, s in self.workers.items() if s.phase == "abandoned" and s.round == r.number}
            delivered = set(r.accepted) | set(r.refused) | abandoned
            everyone_in = len(r.accepted) >= self.config.rounds.quorum and self.alive(now) <= delivered
            assert r.first_accept_at is not None
            timed_out = now - r.first_accept_at >= self.config.rounds.straggler_timeout_s
            if everyone_in or timed_out:
                r.closing = True
                return True
            return False

    def close_round(self) -> RoundSummary:
        """Aggregate and publish the closing round (called by one thread, after close_due)."""
        r, g, cfg = self.round, self.global_state, self.config
        started = self.clock()
        result = round_transition(g.outer, {w: a.update for w, a in r.accepted.items()}, outer=cfg.outer,
                                  rounds=cfg.rounds, history=self._history(r.number),
                                  norms={w: a.norm for w, a in r.accepted.items() if a.norm is not None},
                                  downlink=self.downlink)
        aggregated, child = result.aggregated, result.state
        if aggregated.clipped:
            log.warning("round %d: clipped %s to norm %.4g (norms %s)", r.number,
                        ", ".join(aggregated.clipped), aggregated.threshold,
                        ", ".join(f"{w} {n:.4g}" for w, n in sorted(aggregated.norms.items())))
        params = child.params
        downlink, downlink_record = None, None
        if result.downlink is not None and self.downlink is not None:
            sent, header = result.downlink.payload, dict(result.downlink.header)
            downlink = (sent, canonical_json(header), str(g.params_cid))
            downlink_record = Downlink(payload=str(self.store.put(sent)), header=str(self.store.put_json(header)))
            decision = self.downlink.last_decision
            log.info("round %d: global update compressed to %d bytes (mean rank %.1f, energy %.3f)",
                     r.number, len(sent), decision.mean_rank, decision.energy)
        payload = child.params_bytes()
        params_cid = self.store.put(payload)
        outer_cid = self.store.put(child.outer_state_bytes())
        load_params(self.model, params)
        eval_loss = evaluate(self.model, self.eval_batches)
        with self._lock:
            traffic = tuple(Traffic(worker=w, up=r.up.get(w, 0), down=r.down.get(w, 0))
                            for w in sorted(set(r.up) | set(r.down)))
            refused = tuple(f"{w}: {m}" for w, ms in sorted(r.refused.items()) for m in ms)
            # Registered workers heard from in this round's liveness window that did not contribute.
            recent = r.opened_at - cfg.rounds.liveness_timeout_s
            dropped = tuple(sorted(w for w, s in self.workers.items() if s.last_seen >= recent and w not in r.accepted))
            incomplete = {w: (len(p.slices), p.num_stages) for w, p in r.partial.items()}
        manifest = Manifest(
            run_id=cfg.run_id, round=r.number, parent=str(g.manifest_cid), config=str(self.config_cid),
            params=str(params_cid), outer_state=str(outer_cid),
            participants=tuple(
                Participant(worker=w, update=a.entry["cid"], train_loss_e6=a.entry["train_loss_e6"],
                            tokens=a.entry["tokens"], inner_steps=a.entry["inner_steps"],
                            bytes_sent=a.entry["bytes_sent"], bytes_received=a.entry.get("bytes_received", 0),
                            shard=a.entry.get("shard", 0), state=a.entry.get("state"))
                for w, a in sorted(r.accepted.items())
            ),
            dropped=dropped, eval_loss_e6=to_e6(eval_loss), bytes_up=sum(t.up for t in traffic),
            bytes_down=sum(t.down for t in traffic), downlink=downlink_record, traffic=traffic,
        )
        manifest_cid = manifest.store(self.store)
        self.run_dir.set_head(manifest_cid)  # the round is durable from here on
        self.run_dir.clear_pending(r.number)
        self.run_dir.clear_pending(r.number, "stages")
        for w, (have, of) in sorted(incomplete.items()):
            log.warning("round %d: %s dropped with %d of its %d stage slices", r.number, w, have, of)
        summary = RoundSummary.of(manifest_cid, manifest, refused, seconds=self.clock() - r.opened_at)
        self.run_dir.log_round(dataclasses.asdict(summary))
        with self._lock:
            self.norm_history[r.number] = [round_norm(list(aggregated.norms.values()))]
            self.global_state = GlobalState(r.number, params, child.momentum, payload, params_cid, manifest_cid,
                                            manifest.eval_loss_e6, downlink, child.downlink_error)
            self.manifests[r.number] = (manifest_cid, manifest)
            self.closed_at[r.number] = self.clock()
            self.summaries.append(summary)
            self.round = OpenRound(number=r.number + 1, opened_at=self.clock())
            self._lock.notify_all()
        log.info(
            "round %d closed in %.2fs (aggregation %.2fs): eval loss %.4f, %d participant(s)%s, "
            "%d bytes up, %d down (%s) -> %s",
            r.number, summary.seconds, self.clock() - started, eval_loss, len(manifest.participants),
            f", dropped {', '.join(dropped)}" if dropped else "", manifest.bytes_up, manifest.bytes_down,
            ", ".join(f"{t.worker} ↑{t.up} ↓{t.down}" for t in traffic) or "no traffic", manifest_cid,
        )
        return summary


ENCODINGS = (ENCODING_DENSE_F32, ENCODING_LOWRANK_INT4)


def _check_sibling(h: pb.UpdateHeader, entry: dict, part: StageSlices) -> None:
    """A worker's stage slices come from one inner loop: the same metrics and the same base."""
    for stage, other in part.slices.items():
        for key in ("train_loss_e6", "tokens", "inner_steps", "base_params_cid"):
            if other.entry[key] != entry[key]:
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                              f"stage {h.stage} of {h.num_stages} says {key} {entry[key]!r}, but stage {stage} "
                              f"of the same round said {other.entry[key]!r}")


