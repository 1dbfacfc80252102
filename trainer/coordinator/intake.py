"""The open round's intake: accepted updates, stage slices, refusals and traffic, journalled.

An accepted push is stored at once, as the bytes that crossed the wire and the record naming them
(trainer.runstore.update_record), and journalled in <run>/pending, so a coordinator restart keeps it (the
record re-opened exactly as on arrival). A stage slice's journal entry names a record of that one
slice; the completed update's record names all of them. A worker of P pipeline stages pushes P slices; its update counts once all P are in (Δ̂ᵢ = their
union, checked whole), and one refused slice drops the worker's others for the round. An update
byte-identical to one already accepted in the run (``accepted_cids``, by the record's identity
without signatures, trainer.runstore.update_record.identity_cid; rebuilt on restart from the
manifests and the journal) is refused as a replay. Each slice's record keeps the signature its push
carried, so the store holds, for every counted update, what its worker signed.

Refusals: each is filed in the round's record (the first ``MAX_REFUSALS_KEPT`` per worker) and
logged within a per-worker budget (trainer.net.limits.LogBudget), so a flood of refused pushes from a
joined worker costs a few log lines a minute.

Traffic: every byte of every RPC stream is counted per worker and direction into the round open at
the time; the manifest records it, and each participant's ``bytes_received`` is the fetch of the
state its update built on (``served``), which its signed report restates.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from attestation.receipt import SignedReceipt
from proto import Encoding
from storage_client import CID, Codec, to_e6
from trainer.codec.wire import layout_of
from trainer.coordinator import checks
from trainer.coordinator.registry import WorkerRegistry
from trainer.coordinator.run import Run
from trainer.coordinator.state import Accepted, JournalEntry, OpenRound, StageSlices, UpdateHeader
from trainer.coordinator.trust import RunTrust
from trainer.net.limits import LogBudget
from trainer.net.refusal import Reason, Refusal
from trainer.rounds.aggregation import CheckedUpdate, exact_norm
from trainer.rounds.update_source import UpdateSource
from trainer.runstore.spool import Spool
from trainer.runstore.update_record import (
    identity_cid,
    open_update,
    parse_record,
    record_bytes,
    slice_ref,
    store_slice,
    stored_identity,
)

log = logging.getLogger("dilocox.coordinator")

MAX_REFUSALS_KEPT = 8  # per worker and round, in Status and rounds.jsonl
SERVED_KEPT = 4  # fetches remembered per worker: an update builds on the newest state or, overlapped, the one before


class Intake:
    """What the open round holds. Methods named ``*_locked`` or called from the coordinator under
    its lock expect it held; ``accept``, ``complete`` and ``refuse`` take it themselves."""

    def __init__(self, run: Run, registry: WorkerRegistry, lock: threading.Condition,
                 clock: Callable[[], float]) -> None:
        self.run, self.registry, self._lock, self.clock = run, registry, lock, clock
        self.round = OpenRound(number=run.global_state.round + 1, opened_at=clock())
        store = run.run_dir.store
        self.accepted_cids: dict[str, tuple[int, str]] = {}  # identity_cid of each accepted update
        for r, (_, m) in sorted(run.manifests.items()):
            for p in m.participants:
                self.accepted_cids.setdefault(stored_identity(store, p.update), (r, p.worker))
        # Wire bytes of each worker's completed FetchGlobal streams, by params CID served.
        self.served: dict[str, dict[str, int]] = {}
        # The log line of a refused push is budgeted per worker: a joined worker's flood of bad
        # pushes costs a few lines a minute, not one each (the record keeps MAX_REFUSALS_KEPT).
        self.budget = LogBudget(log)
        self._reload()

    # ------------------------------------------------------------------------- journal

    def _reload(self) -> None:
        """Updates, and stage slices, accepted before a restart for the still-open round stay accepted."""
        store, number = self.run.run_dir.store, self.round.number
        layout, model = layout_of(self.run.global_state.params), self.run.config.model
        for worker, raw in sorted(self.run.run_dir.pending(number).items()):
            entry = JournalEntry.from_json(raw)
            self.round.accepted[worker] = Accepted(open_update(store, entry.cid, layout, model), entry)  # re-hashed
            self.accepted_cids.setdefault(stored_identity(store, entry.cid), (number, worker))
            self.round.first_accept(self.clock())
            log.info("round %d: kept %s's update %s from before the restart", number, worker, entry.cid)
        for worker, held in sorted(self.run.run_dir.pending(number, "stages").items()):
            if worker in self.round.accepted:
                continue
            num_stages, entries = StageSlices.entries_from_json(held)
            part = StageSlices(num_stages)
            for stage, entry in sorted(entries.items()):
                part.slices[stage] = Accepted(open_update(store, entry.cid, layout, model, whole=False), entry)
            self.round.partial[worker] = part
            log.info("round %d: kept %d of %s's %d stage slices from before the restart", number,
                     len(part.slices), worker, part.num_stages)

    def _journal_accepted(self) -> None:
        self.run.run_dir.save_pending(self.round.number, {w: a.entry.to_json() for w, a in self.round.accepted.items()})

    def _journal_partial(self) -> None:
        self.run.run_dir.save_pending(self.round.number, {w: p.to_json() for w, p in sorted(self.round.partial.items())},
                                      "stages")

    # ------------------------------------------------------------------------- under the coordinator's lock

    def delivered(self) -> set[str]:
        """Workers that delivered to the open round: a push accepted or refused, or word that they abandoned it."""
        return set(self.round.accepted) | set(self.round.refused) | self.registry.abandoned(self.round.number)

    def busy(self) -> set[str]:
        return set(self.round.accepted) | set(self.round.partial)

    def forget_unregistered(self) -> None:
        for worker in set(self.served) - set(self.registry.workers):
            del self.served[worker]

    def count(self, worker_id: str, nbytes: int, direction: dict[str, int]) -> None:
        """Add to ``direction`` (the open round's ``up`` or ``down``); streams from ids that never
        joined belong to no worker of the run."""
        if worker_id in self.registry:
            direction[worker_id] = direction.get(worker_id, 0) + nbytes

    def served_state(self, worker_id: str, params_cid: str, nbytes: int) -> None:
        """A FetchGlobal stream of ``params_cid`` reached its end: ``nbytes`` in all."""
        if worker_id in self.registry:
            served = self.served.setdefault(worker_id, {})
            served.pop(params_cid, None)  # newest last
            served[params_cid] = nbytes
            while len(served) > SERVED_KEPT:
                del served[next(iter(served))]

    def open_next(self, number: int) -> None:
        self.round = OpenRound(number=number, opened_at=self.clock())

    # ------------------------------------------------------------------------- accepting

    def _check_open(self, h: UpdateHeader) -> None:
        checks.check_round(self.round, self.run.finished, self.run.config.run_id, h.worker_id, h.round, h.stage,
                           h.num_stages)

    def _entry(self, h: UpdateHeader, cid: CID, wire_bytes: int) -> JournalEntry:
        # The fetch this update built on, as this coordinator counted it; after a restart it has no
        # count and takes the worker's (which the worker's signed report restates).
        received = self.served.get(h.worker_id, {}).get(h.base_params_cid, int(h.base_bytes_received))
        single = h.num_stages == 1
        return JournalEntry(  # tokens and inner steps follow from the config and the store (checks.check_form)
            cid=str(cid), train_loss_e6=to_e6(h.train_loss), tokens=self.run.round_tokens(h.round),
            inner_steps=self.run.inner_steps(h.round), bytes_sent=wire_bytes, bytes_received=received,
            shard=self.registry.workers[h.worker_id].shard,
            state=h.inner_state_sha256,  # a worker of several stages names its one commitment in every slice
            base_params_cid=None if single else h.base_params_cid, kernels=checks.pushed_kernels(h))

    def _count_accepted(self, worker_id: str, accepted: Accepted, identity: str) -> None:
        self.accepted_cids.setdefault(identity, (self.round.number, worker_id))
        self.round.accepted[worker_id] = accepted
        self.round.first_accept(self.clock())
        self._journal_accepted()
        self._lock.notify_all()

    def accept(self, h: UpdateHeader, update: CheckedUpdate, wire_bytes: int,
               screen: Callable[[UpdateSource], float], payload: bytes,
               state: Spool | None = None) -> tuple[CID, int, StageSlices | None]:
        """Store and journal a checked update or slice (``payload``: its bytes as pushed; ``state``: the
        inner state it carried, checked, stored by CID before the record); returns its record's CID,
        the open round, and the worker's slices when this one completed them (the caller checks and
        counts the union). What is held until the close is the update's compact source and its norm."""
        header = h.compression_header if h.encoding == Encoding.LOWRANK_INT4 else None
        ref = slice_ref(h.stage, h.num_stages, h.encoding, payload, header, h.signature)  # signature kept
        record, identity = record_bytes([ref]), identity_cid([ref])
        if h.num_stages == 1:
            with self._lock:  # a replay is refused by its hash before any held-out evaluation
                checks.check_replay(self.accepted_cids, identity)
            screen(update.source)
        store = self.run.run_dir.store
        store_slice(store, ref, payload, header)  # the bytes before the record, the record before the journal
        if state is not None:  # its CID digest is the commitment (trainer.runtime.state_commit.state_cid)
            with state.in_use():
                store.put_chunks(state.chunks())
        cid = store.put(record, Codec.JSON)
        norm = update.norm if h.num_stages == 1 else None
        with self._lock:
            self._check_open(h)  # the round may have moved
            entry = self._entry(h, cid, wire_bytes)
            if h.num_stages == 1:
                checks.check_replay(self.accepted_cids, identity)
                self._count_accepted(h.worker_id, Accepted(update.source, entry, norm), identity)
                log.info("round %d: accepted %s from %s (loss %.4f)", h.round, cid, h.worker_id, h.train_loss)
                return cid, self.round.number, None
            part = self.round.partial.setdefault(h.worker_id, StageSlices(h.num_stages))
            checks.check_sibling(h, entry, part)
            part.slices[h.stage] = Accepted(update.source, entry)
            self._journal_partial()
            self.round.first_accept(self.clock())
            open_round = self.round.number
            part.completing = len(part.slices) == part.num_stages
        log.info("round %d: accepted stage %d of %d slice %s from %s", h.round, h.stage, h.num_stages, cid,
                 h.worker_id)
        return cid, open_round, part if part.completing else None

    def complete(self, h: UpdateHeader, part: StageSlices, update: UpdateSource, norm: float) -> CID:
        """Count the union of a worker's stage slices, checked whole by the caller; returns the CID
        of the counted update's record."""
        store = self.run.run_dir.store
        refs = [parse_record(store.get(part.slices[stage].entry.cid))[0] for stage in range(part.num_stages)]
        cid = store.put(record_bytes(refs), Codec.JSON)
        first = part.slices[0].entry
        entry = JournalEntry(cid=str(cid), train_loss_e6=first.train_loss_e6, tokens=first.tokens,
                             inner_steps=first.inner_steps, bytes_sent=sum(a.entry.bytes_sent for a in part.slices.values()),
                             bytes_received=first.bytes_received, shard=first.shard, state=first.state,
                             kernels=first.kernels)
        with self._lock:
            r = self.round
            if r.number != h.round or r.closing or r.partial.get(h.worker_id) is not part:
                # The round closed without this worker meanwhile: none of its slices counts.
                raise Refusal(Reason.STALE_ROUND,
                              f"round {h.round} closed before {h.worker_id}'s last stage slice was counted")
            checks.check_replay(self.accepted_cids, identity_cid(refs))
            del r.partial[h.worker_id]
            self._count_accepted(h.worker_id, Accepted(update, entry, exact_norm(update)), identity_cid(refs))
            self._journal_partial()
        log.info("round %d: accepted %s from %s, %d stage slices (loss %.4f, norm %.4g)", h.round, cid,
                 h.worker_id, part.num_stages, h.train_loss, norm)
        return cid

    def receipt_again(self, h: UpdateHeader, trust: RunTrust | None) -> tuple[CID, int, SignedReceipt] | None:
        """A push that repeats one this worker's update already counted with (its reply was lost): the
        counted record's CID, the open round and its update receipt, signed again (attestation.receipt:
        the same receipt, byte for byte, as the first reply's, and after a restart too: what it
        says comes from the journal or the published manifest). None for anything else (no ledger; a
        round or stage not counted; another payload or signature than the stored slice's), which the
        header's checks then refuse as before (a duplicate: ALREADY_EXISTS). The session's worker is
        authenticated, and the header's signature checked again by its admitted key."""
        with self._lock:
            counted = self._counted_update(h.worker_id, h.round)
            state = self.registry.workers.get(h.worker_id)
            open_round = self.round.number
        address = state.address if state is not None else None
        if trust is None or counted is None or not address or h.run_id != self.run.config.run_id:
            return None
        try:
            record = self.run.run_dir.store.get(counted)
        except (OSError, ValueError):  # StoreError: the checks below refuse the push as before
            return None
        if not _repeats(h, record):
            return None
        trust.check_update(h.worker_id, address, h.round, h.stage, h.num_stages, h.payload_sha256, h.signature)
        return counted, open_round, trust.receipt(address, h.round, counted.digest)

    def _counted_update(self, worker_id: str, round_: int) -> CID | None:
        """The record of ``worker_id``'s whole update counted in ``round_``: accepted into the open round
        (journalled) or a participant of a published round."""
        if round_ == self.round.number:
            accepted = self.round.accepted.get(worker_id)
            return None if accepted is None else CID.parse(accepted.entry.cid)
        published = self.run.manifests.get(round_)
        participants = published[1].participants if published is not None else ()
        update = next((p.update for p in participants if p.worker == worker_id), None)
        return None if update is None else CID.parse(update)

    def refuse(self, h: UpdateHeader, refusal: Refusal) -> None:
        """File a refusal: the worker is out of the round, and its other stage slices of the round
        go with it. A duplicate changes nothing: what it repeats is held."""
        if not refusal.reason.files:
            self.budget.log(logging.INFO, "refused push", h.worker_id, "round %d: %s from %s", h.round,
                            refusal.message, h.worker_id)
            return
        dropped = None
        with self._lock:
            if h.round == self.round.number and h.worker_id in self.registry:
                filed = self.round.refused.setdefault(h.worker_id, [])
                if len(filed) < MAX_REFUSALS_KEPT:  # the record keeps the first few, the log a budgeted few a minute
                    filed.append(refusal.message)
                dropped = self.round.partial.pop(h.worker_id, None)
                if dropped is not None:
                    self._journal_partial()
        self.budget.log(logging.WARNING, "refused push", h.worker_id, "round %d: refused %s from %s: %s%s", h.round,
                        h.what, h.worker_id, refusal.message,
                        f" (its {len(dropped.slices)} other slice(s) dropped)" if dropped and dropped.slices else "")


def _repeats(h: UpdateHeader, record: bytes) -> bool:
    """Whether push header ``h`` is the one a slice of the stored ``record`` was pushed with: its stage,
    payload digest and signature (what the worker signed; the signature was checked when it came)."""
    try:
        refs = parse_record(record)
    except ValueError:  # RecordError: a record the coordinator stored parses, or nothing is repeated
        return False
    return any(ref.stage == h.stage and ref.num_stages == h.num_stages and ref.payload_sha256 == h.payload_sha256
               and ref.signature == h.signature.hex() for ref in refs)
