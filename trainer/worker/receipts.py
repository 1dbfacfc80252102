"""The worker's receipts: the coordinator's signed word that it counted this worker's update, and
took its report (attestation.receipt), checked on arrival and kept on disk.

Each receipt that comes back in a PushUpdate or SubmitReport reply is rebuilt from what this worker
knows (the run, its own key, the round, the digest of the update it sent, its report's digest): the
wire carries only what it cannot know (the coordinator's signature), so a receipt for anything else
than what was sent does not verify. It is kept only if signed by the coordinator key this worker
pinned at its first Join; ``dilocox settle prove-receipt`` checks that key against the ledger's
``runOf(runId).coordinator`` before it submits (as the court does).

On disk: ``<dir>/<runId hex>/<round>-update.json`` and ``<round>-report.json``, one signed receipt
each (attestation.receipt.SignedReceipt JSON), written atomically before the round's next step, so
a crash loses none that arrived. A receipt that is missing or does not verify is logged loudly and
the worker goes on: it only loses the proof.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from attestation import Domain
from attestation.receipt import NO_REPORT, Receipt, ReceiptError, SignedReceipt
from proto import pb
from storage_client import canonical_json, loads_bounded, write_atomic
from trainer.net.limits import FieldError, check_fields

if TYPE_CHECKING:
    from trainer.worker.client import CoordinatorClient

log = logging.getLogger("dilocox.worker")

MAX_RECEIPT_JSON = 4 << 10  # a signed receipt is about 500 bytes of JSON
MAX_RECEIPT_FILES = 1 << 20  # rounds × 2 a run's receipt folder may hold before reading it is refused


class ReceiptBook:
    """Signed receipts of one worker, by run and round, in ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    def path(self, run_id: bytes, round_: int, reported: bool) -> Path:
        return self.directory / run_id.hex() / f"{round_}-{'report' if reported else 'update'}.json"

    def keep_sent(self, client: CoordinatorClient, message: pb.Receipt | None, round_: int, update: bytes,
                  report: bytes = NO_REPORT) -> SignedReceipt | None:
        """Check and keep ``client``'s coordinator's receipt of the update (and report) this worker
        sent for ``round_``: what it must say is rebuilt from what was sent (``keep``)."""
        if client.domain is None or client.key is None:
            return None
        expected = Receipt(client.run_digest, round_, client.key.address, update, report)
        return self.keep(message, expected, client.domain, client.coordinator_key)

    def keep(self, message: pb.Receipt | None, expected: Receipt, domain: Domain | None,
             coordinator: str | None) -> SignedReceipt | None:
        """Check the receipt in ``message`` against what this worker sent (``expected``) and the
        coordinator's pinned key, and keep it; None (said in the log) when there is none or it fails."""
        what = f"round {expected.round}: the coordinator's {'report' if expected.reported else 'update'} receipt"
        if domain is None or coordinator is None:
            return None  # a run without a ledger: nothing to prove on chain
        if message is None:
            log.warning("%s is missing: this worker holds no proof that it counted", what)
            return None
        try:
            check_fields(message)
            if message.round != expected.round or message.update_digest != expected.update_digest:
                raise ReceiptError(f"it names round {message.round} and another update than the one sent")
            if (message.report_digest or NO_REPORT) != expected.report_digest:
                raise ReceiptError("it names another report than the one sent")
            signed = SignedReceipt(expected, message.signature)
            signed.verify(domain, coordinator)
        except (ReceiptError, FieldError) as exc:
            log.error("%s is refused: %s", what, exc)
            return None
        write_atomic(self.path(expected.run_id, expected.round, expected.reported),
                     canonical_json(signed.to_json()) + b"\n")
        return signed

    def runs(self) -> list[bytes]:
        """The runs this folder keeps receipts of (a sub-folder named by its 64 hex digits each)."""
        if not self.directory.is_dir():
            return []
        names = sorted(p.name for p in self.directory.iterdir() if p.is_dir())
        return [bytes.fromhex(n) for n in names if len(n) == 64 and all(c in "0123456789abcdef" for c in n)]

    def receipts(self, run_id: bytes) -> tuple[list[SignedReceipt], list[str]]:
        """Every receipt kept for ``run_id`` by round, and one line per file that is not one."""
        folder = self.directory / run_id.hex()
        kept: list[SignedReceipt] = []
        problems: list[str] = []
        if not folder.is_dir():
            return kept, problems
        files = sorted(folder.glob("*.json"))
        if len(files) > MAX_RECEIPT_FILES:
            return kept, [f"{folder} holds {len(files)} files, more than {MAX_RECEIPT_FILES}: not a receipt folder"]
        for path in files:
            try:
                with open(path, "rb") as f:
                    raw = f.read(MAX_RECEIPT_JSON + 1)
                signed = SignedReceipt.from_json(loads_bounded(raw, max_bytes=MAX_RECEIPT_JSON, what=str(path.name)))
                if signed.receipt.run_id != run_id:
                    raise ReceiptError("it is another run's receipt")
                kept.append(signed)
            except (OSError, ValueError) as exc:  # ReceiptError and JSONBoundsError are ValueErrors
                problems.append(f"{path}: not a receipt ({str(exc)[:160]})")
        kept.sort(key=lambda s: (s.receipt.round, s.receipt.reported))
        return kept, problems
