"""The coordinator's trust layer over a chain: trainer.coordinator.trust.RunTrust implemented.

It ties the gate (settlement.gate: attestation and admission, push signatures, report checks), the
report book (settlement.report_book) and the ledger outbox (settlement.outbox), and runs the settlement
loop: every ``interval_s``, queue each round whose reports are in (or whose report timeout passed),
in order, and flush the outbox to the ledger. A chain that holds another record than ours, or an
outbox item that cannot be read, cannot be fixed by retrying: the loop says so and stops the
coordinator (exit 1), leaving every round in the outbox for the next start.
"""

from __future__ import annotations

import logging
import threading

from attestation import SignedReport, WorkerKey, code_measurement
from attestation.receipt import NO_REPORT, Receipt, SignedReceipt, sign_receipt
from attestation.report import Domain
from settlement.chain import Chain
from settlement.gate import TrustGate, TrustSettings
from settlement.ledger import Ledger, Registry
from settlement.outbox import Outbox, OutboxError, RecordConflict
from settlement.report_book import ReportBook
from storage_client import CID, Manifest
from trainer.coordinator.run import Run
from trainer.coordinator.trust import PublishedRounds
from trainer.net.limits import clip

log = logging.getLogger("dilocox.settlement")


class LedgerTrust:
    def __init__(self, gate: TrustGate, book: ReportBook, ledger: Ledger, outbox: Outbox, signer: WorkerKey) -> None:
        self.gate, self.book, self.ledger, self.outbox, self.signer = gate, book, ledger, outbox, signer
        self.domain = gate.domain
        self.chain_id, self.ledger_address = gate.domain.chain_id, gate.domain.ledger
        self.lag = 0  # published rounds not yet confirmed on chain, kept by the settlement loop

    # RunTrust ------------------------------------------------------------------------------

    def challenge(self, worker_id: str) -> bytes:
        return self.gate.challenge(worker_id)

    def admit(self, worker_id: str, address: str, evidence: bytes, nonce: bytes) -> str:
        return self.gate.admit(worker_id, address, evidence, nonce)

    def check_update(self, worker_id: str, address: str | None, round_: int, stage: int, num_stages: int,
                     payload_sha256: str, signature: bytes) -> None:
        self.gate.check_update(worker_id, address, round_, stage, num_stages, payload_sha256, signature)

    def take_report(self, worker_id: str, address: str | None, signed: SignedReport, manifest_cid: CID,
                    manifest: Manifest, parent: Manifest, data_digest: bytes) -> None:
        self.gate.check_report(worker_id, address, signed, manifest_cid, manifest, parent, data_digest)
        self.book.add(worker_id, signed)

    def receipt(self, worker: str, round_: int, update_digest: bytes,
                report_digest: bytes = NO_REPORT) -> SignedReceipt:
        return sign_receipt(self.signer, self.domain,
                            Receipt(self.gate.run_id, round_, worker, update_digest, report_digest))

    def recorded_through(self) -> int:
        """The last round the ledger has confirmed: those queued, less those still in the outbox."""
        waiting = sum(1 for item in self.outbox.pending() if item["kind"] == "round")
        return self.book.queued_through - waiting

    def settled(self, head_round: int) -> bool:
        return self.book.queued_through >= head_round and not self.outbox.pending()

    def settle(self, rounds: PublishedRounds, until: threading.Event, stop: threading.Event, failure: list[str],
               interval_s: float = 0.5) -> None:
        last_error = ""
        while not until.is_set():
            try:
                manifests, closed_at, now = rounds.published()
                self.book.queue_due(manifests, closed_at, now)
                self.outbox.flush(self.ledger)
                self.lag = max(manifests) - self.recorded_through()
            except (RecordConflict, OutboxError) as exc:
                failure.append(f"the ledger cannot be caught up: {clip(exc, 400)}")
                stop.set()
                return
            except Exception as exc:  # never let the settlement thread die silently: say why (once), keep going
                if str(exc) != last_error:
                    log.exception("settlement step failed; retrying")
                    last_error = str(exc)
            until.wait(interval_s)


def open_trust(settings: TrustSettings, run: Run) -> LedgerTrust:
    """The trust layer of ``run``: its gate, report book and outbox, and the run created on the
    ledger (queued in the outbox) if it is not yet."""
    chain = Chain(settings.rpc_url, settings.private_key)
    dep, run_dir = settings.deployment, run.run_dir
    outbox = Outbox(run_dir.path / "outbox", settings.confirmations)
    gate = TrustGate(
        store=run_dir.store, registry=Registry(chain, dep.registry), policy=settings.policy, run_id=run.run_digest,
        domain=Domain(dep.chain_id, dep.ledger), code=code_measurement(str(run.config_cid)),
        verification_time=settings.verification_time, outbox=outbox,
    )
    book = ReportBook(run_dir, outbox, run.run_digest, settings.report_timeout_s, settings.challenge_window)
    genesis_cid, genesis = run.manifests[0]
    book.ensure_run(genesis_cid, genesis)
    return LedgerTrust(gate, book, Ledger(chain, dep.ledger), outbox, WorkerKey(settings.private_key))
