"""The report book: participants' signed reports by round, kept until their round is recorded.

settlement.ledger_trust checks each report (settlement.gate) before it is filed here; this module
decides when a round goes to the ledger outbox, and with which reports.
"""

from __future__ import annotations

import logging
import threading

from attestation import SignedReport
from settlement.outbox import Outbox
from storage_client import CID, Manifest
from trainer.net.refusal import Reason, Refusal
from trainer.runstore.run_dir import RunDir

log = logging.getLogger("dilocox.settlement")


class ReportBook:
    """Signed reports by round, kept on disk until their round is queued for the ledger.

    Rounds are queued strictly in order (the ledger refuses gaps): round r goes once every
    participant of r has reported, or ``report_timeout_s`` after r closed, whatever has arrived by
    then. The timeout counts from the moment a report could first be sent: r's publication (the
    coordinator's ``closed_at``, taken when θ⁽ʳ⁾ becomes what FetchGlobal serves; after a restart,
    the restart). A participant then needs only to fetch θ⁽ʳ⁾, check its share of the held-out
    claims and sign, which no worker defers behind training (trainer.worker.loops), so the timeout
    bounds a fetch and an evaluation, not a round of training.

    A participant without a report is listed by its update digest as unreported: the ledger
    records it on the coordinator's word and credits nobody, and the audit lists it. So a round
    whose participants all died before reporting is still recorded, and never blocks the rounds
    after it.

    A participant that missed its report of a round is *silent* (``state["silent"]``, kept on disk
    across restarts): later rounds are not held back for it, only for the others, until a report of
    it passes the gate again (``add``, in time or too late). So a worker that never reports costs
    the ledger one report timeout once, not one every round; its report of a later round still
    counts if it arrives before that round is queued. The price for an honest worker that missed
    one report: a round or two queued without waiting for it (its report arriving too late is
    refused, and uncredited), after which it is waited for again.
    """

    def __init__(self, run_dir: RunDir, outbox: Outbox, run_id: bytes, report_timeout_s: float,
                 challenge_window: int = 0) -> None:
        self.run_dir = run_dir
        self.outbox = outbox
        self.run_id = run_id
        self.report_timeout_s = report_timeout_s
        self.challenge_window = challenge_window
        self.state = run_dir.load("settlement.json", {"run_created": False, "queued_through": 0})
        self._lock = threading.Lock()

    @property
    def queued_through(self) -> int:
        return int(self.state["queued_through"])

    def _save(self) -> None:
        self.run_dir.save("settlement.json", self.state)

    def ensure_run(self, genesis_cid: CID, genesis: Manifest) -> None:
        with self._lock:
            if self.state["run_created"]:
                return
            self.outbox.enqueue_create_run(
                run_id=self.run_id, genesis_checkpoint=CID.parse(genesis.params).digest,
                config_digest=CID.parse(genesis.config).digest, genesis_manifest=genesis_cid.digest,
                challenge_window=self.challenge_window,
            )
            self.state["run_created"] = True
            self._save()

    @property
    def silent(self) -> set[str]:
        """Participants that missed a report and have not reported since: not waited for."""
        return set(self.state.get("silent", []))

    def add(self, worker_id: str, signed: SignedReport) -> None:
        r = signed.report.round
        with self._lock:
            if worker_id in self.silent:  # it reports again: later rounds wait for it again
                self.state["silent"] = sorted(self.silent - {worker_id})
                self._save()
                log.info("%s reports again (round %d): rounds wait for its report again", worker_id, r)
            if r <= self.queued_through:
                raise Refusal(Reason.NOT_PUBLISHED,
                              f"round {r} has already been handed to the ledger; report too late")
            held = self.run_dir.pending(r, "reports")
            if worker_id in held:
                raise Refusal(Reason.DUPLICATE, f"worker {worker_id!r} already reported round {r}")
            held[worker_id] = signed.to_json()
            self.run_dir.save_pending(r, held, "reports")

    def queue_due(self, manifests: dict[int, tuple[CID, Manifest]], closed_at: dict[int, float],
                  now: float) -> list[int]:
        """Hand every round that is ready, in order, to the outbox; returns the rounds queued."""
        queued = []
        with self._lock:
            while (r := self.queued_through + 1) in manifests:
                cid, manifest = manifests[r]
                held = self.run_dir.pending(r, "reports")
                silent = self.silent
                awaited = {p.worker for p in manifest.participants} - silent
                waited = now - closed_at.get(r, now)
                if not (awaited <= set(held) or waited >= self.report_timeout_s):
                    break
                parent = manifests[r - 1][1]
                unreported = {p.worker: CID.parse(p.update).digest for p in manifest.participants
                              if p.worker not in held}
                self.outbox.enqueue_round(
                    run_id=self.run_id, round=r, parent=CID.parse(parent.params).digest,
                    checkpoint=CID.parse(manifest.params).digest, manifest_digest=cid.digest,
                    reports=[held[w] for w in sorted(held)], unreported=list(unreported.values()),
                )
                self._note_unreported(r, sorted(unreported), silent, waited, bool(held))
                self.state["queued_through"] = r
                self._save()
                self.run_dir.clear_pending(r, "reports")
                queued.append(r)
        return queued

    def _note_unreported(self, r: int, unreported: list[str], silent: set[str], waited: float, any_held: bool) -> None:
        """Log round ``r``'s missing reports, and mark their workers silent (class docstring)."""
        if not unreported:
            return
        missed = [w for w in unreported if w not in silent]
        if missed:
            log.warning("round %d: no report from %s after %.0fs; queued for the ledger with %s update(s) "
                        "unreported (on the coordinator's word, credited to nobody); later rounds do not wait "
                        "for %s until it reports again", r, ", ".join(missed), waited,
                        "its" if not any_held else "their", "it" if len(missed) == 1 else "them")
        if len(missed) < len(unreported):
            log.info("round %d: queued without waiting for %s (silent since a missed report; unreported)", r,
                     ", ".join(w for w in unreported if w in silent))
        self.state["silent"] = sorted(silent | set(unreported))
