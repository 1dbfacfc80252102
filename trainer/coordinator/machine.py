"""The coordinator's state machine: one run's rounds, driven by calls from the service.

Thread-safe (one lock); plain domain types in and out; refusals are trainer.net.refusal.Refusal with a
typed reason. The pieces it ties: the run (trainer.coordinator.run), the worker registry
(.registry), the push checks (.checks), screening (.screening), aggregation and publication
(.publish), and, when the run has a ledger, its trust layer (.trust).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from attestation import SignedReport
from attestation.receipt import SignedReceipt
from attestation.signing import global_digest
from proto import WorkerPhase
from storage_client import CID, Manifest, loads_bounded
from storage_client.manifest import Traffic
from trainer.codec.wire import Layout, layout_of
from trainer.coordinator import checks
from trainer.coordinator.intake import Intake
from trainer.coordinator.publish import derive_round, record_round
from trainer.coordinator.registry import WorkerRegistry
from trainer.coordinator.run import Run
from trainer.coordinator.screening import Screen
from trainer.coordinator.state import (
    GlobalState,
    OpenRound,
    RoundSummary,
    StallWatch,
    StatusView,
    UpdateHeader,
    WorkerView,
)
from trainer.coordinator.trust import RunTrust
from trainer.model.gpt import param_count
from trainer.net.limits import clip
from trainer.net.refusal import Reason, Refusal
from trainer.rounds.aggregation import CheckedUpdate, InvalidUpdate, check_norm, norm_bound
from trainer.rounds.update_source import UpdateSource
from trainer.runstore.round_inputs import ClipHistory, manifest_updates
from trainer.runstore.spool import Spool
from trainer.runtime.memory import release_free_memory

log = logging.getLogger("dilocox.coordinator")

MAX_REPORT_JSON = 16 << 10


class Coordinator:
    def __init__(self, run: Run, *, clock: Callable[[], float] = time.monotonic, trust: RunTrust | None = None) -> None:
        self.run, self.config, self.clock, self.trust = run, run.config, clock, trust
        # The key that signs every global state served: the run's coordinator account on the ledger,
        # or a key of this run directory when there is no ledger.
        self.signer = trust.signer if trust is not None else run.run_dir.signing_key()
        self._signatures: dict[str, bytes] = {}
        self._lock = threading.Condition()
        self.layout: Layout = layout_of(run.global_state.params)
        self.bound = norm_bound(self.config, param_count(run.model))
        rounds = self.config.rounds
        self.registry = WorkerRegistry(run.run_dir, run_id=self.config.run_id, num_shards=rounds.expected_workers,
                                       max_registered=max(16, 4 * rounds.expected_workers),
                                       liveness_s=rounds.liveness_timeout_s, clock=clock)
        self.screen = Screen(self.config, run.eval_tokens)
        self.intake = Intake(run, self.registry, self._lock, clock)
        # ρ̃ of the rounds closed (trainer.runstore.round_inputs): kept at their closing, or after a restart read
        # back from the stored updates their manifests name, as checkpoint rebuilding and the audit do.
        self.clip_history = ClipHistory(rounds, manifest_updates(run.run_dir.store, lambda e: run.manifests[e][1],
                                                                 self.layout, self.config.model))
        # Seconds on each round's pushes by phase ("decode", "intake"), for rounds.jsonl (bench scale).
        self.push_seconds: dict[int, dict[str, float]] = {}
        # Report deadlines of rounds published before a restart count from the restart.
        self.closed_at: dict[int, float] = {r: clock() for r in run.manifests}
        self._stall = StallWatch(rounds.straggler_timeout_s)
        self.halted: str | None = None  # why the run cannot go on, once the coordinator says so (halt)
        # Called under the lock, never blocking, when a round is published or the run halts.
        self.on_publish: list[Callable[[], None]] = []
        if trust is None:
            log.warning("no ledger configured: workers are not attested and rounds are not recorded on chain")

    # ----------------------------------------------------------------------------- queries

    @property
    def global_state(self) -> GlobalState:
        return self.run.global_state

    @property
    def round(self) -> OpenRound:
        return self.intake.round

    @property
    def finished(self) -> bool:
        return self.run.finished

    def registered(self) -> set[str]:
        with self._lock:
            return set(self.registry.workers)

    def live_workers_done(self) -> bool:
        with self._lock:
            return self.registry.live_done()

    def published(self) -> tuple[dict[int, tuple[CID, Manifest]], dict[int, float], float]:
        with self._lock:
            return dict(self.run.manifests), dict(self.closed_at), self.clock()

    def status(self) -> StatusView:
        with self._lock:
            now = self.clock()
            alive = self.registry.alive(now)
            workers = tuple(WorkerView.of(w, s, w in alive, now) for w, s in sorted(self.registry.workers.items()))
            return StatusView(self.config.run_id, self.round.number, self.config.rounds.rounds, self.finished,
                              workers, tuple(self.run.summaries), max(0, self.trust.lag) if self.trust else 0)

    # ----------------------------------------------------------------------------- joining

    def challenge(self, worker_id: str, protocol_version: int) -> bytes:
        """A nonce for the worker's evidence, bound to its id (empty when the run has no ledger)."""
        checks.check_protocol(protocol_version)
        return self.trust.challenge(worker_id) if self.trust else b""

    def join(self, worker_id: str, protocol_version: int, address: str = "", evidence: bytes = b"",
             nonce: bytes = b"", proves_session: bool = False) -> tuple[int, int]:
        """Admit a worker (trainer.coordinator.registry says who may take over a live id); returns
        its shard and the open round."""
        checks.check_protocol(protocol_version)
        admitted = self.trust.admit(worker_id, address, evidence, nonce) if self.trust else None
        with self._lock:
            state = self.registry.join(worker_id, admitted, proves_session, self.intake.busy())
            self.intake.forget_unregistered()
            return state.shard, self.round.number

    def heartbeat(self, worker_id: str, round_: int, phase: WorkerPhase) -> tuple[int, bool]:
        with self._lock:
            self.registry.heartbeat(worker_id, round_, phase)
            return self.round.number, self.finished

    # ----------------------------------------------------------------------------- fetching

    def global_signature(self, state: GlobalState) -> bytes:
        """The coordinator's signature over what a worker trains from (attestation.signing.global_digest)."""
        key = str(state.manifest_cid)
        with self._lock:
            signature = self._signatures.get(key)
        if signature is None:
            signature = self.signer.sign_digest(
                global_digest(self.run.run_digest, state.round, state.params_cid.digest, state.manifest_cid.digest))
            with self._lock:
                self._signatures = {key: signature}  # one state is served at a time
        return signature

    def global_for(self, worker_id: str, min_round: int) -> tuple[GlobalState | None, int, bool]:
        """(HEAD, open round, finished), HEAD None until ``min_round`` is published (see on_publish)."""
        with self._lock:
            self.registry.seen(worker_id)
            if self.run.global_state.round >= min_round or self.finished:
                return self.run.global_state, self.round.number, self.finished
            if self.halted is not None:
                raise Refusal(Reason.HALTED, f"the coordinator stopped the run: {self.halted}")
            return None, self.round.number, False

    def _published(self) -> None:  # a round was published or the run halted; under the lock
        for listener in self.on_publish:
            listener()

    def count_down(self, worker_id: str, nbytes: int, params_cid: str | None = None) -> None:
        with self._lock:  # bytes sent to a worker, and the state they carried if it was served whole
            self.intake.count(worker_id, nbytes, self.round.down)
            if params_cid is not None:
                self.intake.served_state(worker_id, params_cid, nbytes)

    # ----------------------------------------------------------------------------- pushing

    def admit_header(self, h: UpdateHeader) -> Layout:
        """Everything that can be checked before a payload byte is read (trainer.coordinator.checks,
        in its order); returns the layout the payload must have."""
        checks.check_protocol(h.protocol_version)
        with self._lock:
            if h.run_id != self.config.run_id:
                raise Refusal(Reason.WRONG_RUN,
                              f"update is for run {clip(h.run_id)}; this coordinator runs {self.config.run_id!r}")
            address = self.registry.seen(h.worker_id).address
            if self.halted is not None:
                raise Refusal(Reason.HALTED, f"the coordinator stopped the run: {self.halted}")
            checks.check_round(self.round, self.finished, self.config.run_id, h.worker_id, h.round, h.stage,
                               h.num_stages)
            g = self.run.global_state
            bases = {str(g.params_cid)}
            if self.config.rounds.overlap:  # one round stale is the point of the overlap
                bases.add(self.run.manifests[max(h.round - 2, 0)][1].params)
            checks.check_base(h, str(g.params_cid), bases)
            window = checks.state_window(self.run.manifests, h.worker_id, h.round, self.config.rounds.state_every)
        checks.check_digest_form(h)
        if self.trust is not None:
            self.trust.check_update(h.worker_id, address, h.round, h.stage, h.num_stages, h.payload_sha256,
                                    h.signature)
        expected = checks.stage_layout(self.layout, self.config.model, h.stage, h.num_stages)
        declared = checks.check_form(h, expected, self.config, self.run.inner_steps(h.round))
        checks.check_state_upload(h, self.layout, self.config, window, self.run.run_dir.store)
        return declared

    def count_up(self, worker_id: str, nbytes: int) -> None:
        """Bytes a worker sent, counted into the open round (refused pushes too: they crossed the network)."""
        with self._lock:
            self.intake.count(worker_id, nbytes, self.round.up)

    def refuse(self, h: UpdateHeader, refusal: Refusal) -> None:
        self.intake.refuse(h, refusal)

    def accept(self, h: UpdateHeader, update: CheckedUpdate, wire_bytes: int, payload: bytes,
               state: Spool | None = None) -> tuple[CID, int, SignedReceipt | None]:
        """Store and journal an update, or a stage slice, that passed every check
        (trainer.rounds.aggregation.checked_update), ``payload`` its bytes as pushed and ``state`` the
        inner state it carried (checks.check_state_spool; stored by CID); returns its record's CID, the open
        round, and the update receipt once the worker's whole update counts (a run with a ledger;
        attestation.receipt). The last slice of a worker completes its update."""
        def screen(candidate: UpdateSource) -> float:
            return self.screen.check(self.run.global_state, h.round, candidate)

        started = time.perf_counter()
        try:
            return self._accept(h, update, wire_bytes, screen, payload, state)
        finally:
            self.note_push(h.round, "intake", time.perf_counter() - started)

    def note_push(self, round_: int, phase: str, seconds: float) -> None:
        """Count ``seconds`` of work on a push of ``round_`` into that round's phase times."""
        with self._lock:
            if self.run.global_state.round < round_ <= self.run.global_state.round + 2:  # not a stale round
                phases = self.push_seconds.setdefault(round_, {})
                phases[phase] = phases.get(phase, 0.0) + seconds

    def _accept(self, h: UpdateHeader, update: CheckedUpdate, wire_bytes: int,
                screen: Callable[[UpdateSource], float], payload: bytes,
                state: Spool | None) -> tuple[CID, int, SignedReceipt | None]:
        cid, open_round, complete = self.intake.accept(h, update, wire_bytes, screen, payload, state)
        counted = cid if h.num_stages == 1 else None  # accepted whole under the lock the close takes: it counts
        if complete is not None:
            merged = complete.merged()
            try:
                norm = check_norm(merged, self.bound)
            except InvalidUpdate as exc:
                raise Refusal(Reason.MALFORMED, f"the update of all {complete.num_stages} stage slices: {exc}") from exc
            screen(merged)
            counted = self.intake.complete(h, complete, merged, norm)
        release_free_memory()  # the dense tensors decoded to check and store it
        with self._lock:
            state = self.registry.workers.get(h.worker_id)
        address = state.address if state is not None and self.trust is not None else None
        return cid, open_round, self.trust.receipt(address, h.round, counted.digest) if address and counted else None

    # ----------------------------------------------------------------------------- reports

    def submit_report(self, worker_id: str, raw: bytes) -> tuple[int, SignedReceipt | None]:
        """A participant's signed report of a published round; returns the round and the report receipt."""
        if self.trust is None:
            raise Refusal(Reason.NO_LEDGER, "this run has no ledger: reports are not collected")
        try:
            signed = SignedReport.from_json(loads_bounded(raw, max_bytes=MAX_REPORT_JSON, what="report"))
        except (ValueError, TypeError, KeyError) as exc:  # JSONBoundsError is a ValueError
            raise Refusal(Reason.MALFORMED, f"malformed report: {clip(exc, 160)}") from exc
        r = signed.report.round
        with self._lock:
            state = self.registry.known(worker_id)
            published, parent = self.run.manifests.get(r), self.run.manifests.get(r - 1)
        if published is None or parent is None or r == 0:
            raise Refusal(Reason.NOT_PUBLISHED, f"round {r} has no published checkpoint to report on")
        self.trust.take_report(worker_id, state.address, signed, published[0], published[1], parent[1],
                               self.run.shard_digests[state.shard])
        log.info("round %d: report from %s (%s) accepted", r, worker_id, state.address)
        report = signed.report  # filed before the round goes to the ledger: its recording must credit it
        return r, self.trust.receipt(report.worker, r, report.update_digest, report.digest(self.trust.domain))

    def settled(self) -> bool:
        return self.trust is None or self.trust.settled(self.run.global_state.round)

    # ----------------------------------------------------------------------------- closing

    def close_due(self) -> bool:
        """Close when ``quorum`` updates are in and every awaited live worker has delivered
        (registry.awaited), or ``straggler_timeout_s`` after the first accepted update."""
        with self._lock:
            r, now = self.round, self.clock()
            if self.finished or r.closing or not r.accepted:
                return False
            awaited, delivered = self.registry.awaited(now), self.intake.delivered()
            everyone_in = len(r.accepted) >= self.config.rounds.quorum and awaited <= delivered
            assert r.first_accept_at is not None
            if everyone_in or now - r.first_accept_at >= self.config.rounds.straggler_timeout_s:
                r.closing = True
                return True
            return False

    def stalled(self) -> str | None:
        """Why the open round can never close, in one line, or None (:class:`StallWatch`)."""
        with self._lock:
            return self._stall.check(self.round, self.registry.alive(self.clock()), self.clock(), self.finished)

    def halt(self, why: str) -> None:
        """Stop serving the run's rounds: a worker waiting for a global state is told ``why``."""
        with self._lock:
            self.halted = why
            self._published()

    def close_round(self) -> RoundSummary:
        """Aggregate and publish the closing round (called by one thread, after close_due)."""
        r, g, cfg = self.round, self.run.global_state, self.config
        started = self.clock()
        release_free_memory()
        history = self.clip_history.history(r.number)
        assert history is not None  # a closed round's ρ̃ is kept, or read back from the store
        derived = derive_round(self.run, r, g, history)
        with self._lock:
            traffic = tuple(Traffic(worker=w, up=r.up.get(w, 0), down=r.down.get(w, 0))
                            for w in sorted(set(r.up) | set(r.down)))
            refused = tuple(f"{w}: {m}" for w, ms in sorted(r.refused.items()) for m in ms)
            # Registered workers heard from in this round's liveness window that did not contribute.
            recent = self.registry.heard_since(r.opened_at - cfg.rounds.liveness_timeout_s)
            dropped = tuple(sorted(recent - set(r.accepted)))
            self.registry.closed(set(r.accepted), self.intake.delivered() - set(r.accepted))
            incomplete = {w: (len(p.slices), p.num_stages) for w, p in r.partial.items()}
        recording = time.perf_counter()
        manifest_cid, manifest = record_round(self.run, r, g, derived, traffic, dropped)
        phases = dict(derived.phases)
        phases["store"] = phases.get("store", 0.0) + time.perf_counter() - recording
        with self._lock:
            phases.update(self.push_seconds.pop(r.number, {}))
        for w, (have, of) in sorted(incomplete.items()):
            log.warning("round %d: %s dropped with %d of its %d stage slices", r.number, w, have, of)
        summary = RoundSummary.of(manifest_cid, manifest, refused, seconds=self.clock() - r.opened_at)
        self.run.run_dir.log_round({**dataclasses.asdict(summary), "phases": phases})
        with self._lock:
            self.clip_history.keep(r.number, derived.aggregated.norms)
            self.run.global_state = dataclasses.replace(derived.state, manifest_cid=manifest_cid)
            self.run.manifests[r.number] = (manifest_cid, manifest)
            self.run.summaries.append(summary)
            self.closed_at[r.number] = self.clock()
            self.intake.open_next(r.number + 1)
            self._published()
        release_free_memory()  # the parent state, now unreferenced
        log.info(
            "round %d closed in %.2fs (aggregation %.2fs): eval loss %.4f, %d participant(s)%s, "
            "%d bytes up, %d down (%s) -> %s",
            r.number, summary.seconds, self.clock() - started, derived.eval_loss, len(manifest.participants),
            f", dropped {', '.join(dropped)}" if dropped else "", manifest.bytes_up, manifest.bytes_down,
            ", ".join(f"{t.worker} ↑{t.up} ↓{t.down}" for t in traffic) or "no traffic", manifest_cid,
        )
        return summary
