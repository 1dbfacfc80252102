"""The coordinator's receipts (attestation.receipt) and the worker's book of them
(trainer.worker.receipts): typed data, JSON forms, refusals by name, what a worker keeps and refuses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from attestation import Domain, WorkerKey
from attestation.receipt import NO_REPORT, Receipt, ReceiptError, SignedReceipt, sign_receipt
from proto import pb
from trainer.worker.receipts import ReceiptBook

DOMAIN = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")
COORDINATOR = WorkerKey(bytes(range(1, 33)))
WORKER = WorkerKey(bytes(range(2, 34)))
RUN = bytes(range(32))
UPDATE = b"\x11" * 32
REPORT = b"\x22" * 32


def receipt(report: bytes = NO_REPORT, round_: int = 3) -> Receipt:
    return Receipt(RUN, round_, WORKER.address, UPDATE, report)


def wire(signed: SignedReceipt) -> pb.Receipt:
    r = signed.receipt
    return pb.Receipt(round=r.round, update_digest=r.update_digest,
                      report_digest=r.report_digest if r.reported else b"", signature=signed.signature)


def test_a_receipt_round_trips_and_verifies_for_the_coordinator_only() -> None:
    signed = sign_receipt(COORDINATOR, DOMAIN, receipt(REPORT))
    assert SignedReceipt.from_json(signed.to_json()) == signed
    assert signed.receipt.reported and not receipt().reported
    signed.verify(DOMAIN, COORDINATOR.address)
    with pytest.raises(ReceiptError, match="not by the run's coordinator"):
        signed.verify(DOMAIN, WORKER.address)
    with pytest.raises(ReceiptError, match="not by the run's coordinator"):  # another chain's domain
        signed.verify(Domain(1, DOMAIN.ledger), COORDINATOR.address)
    assert receipt(REPORT).digest(DOMAIN) != receipt().digest(DOMAIN) != receipt(round_=4).digest(DOMAIN)


@pytest.mark.parametrize("change", [
    lambda j: j.pop("signature"),
    lambda j: j.update(signature="0x" + "zz" * 65),
    lambda j: j.update(signature="0x" + "00" * 64),
    lambda j: j["receipt"].update(round=0),
    lambda j: j["receipt"].update(round="3"),
    lambda j: j["receipt"].update(worker="0x1234"),
    lambda j: j["receipt"].update(update_digest="0x" + "11" * 31),
    lambda j: j["receipt"].update(extra=1),
])
def test_malformed_receipts_are_refused_by_name(change) -> None:
    document = sign_receipt(COORDINATOR, DOMAIN, receipt()).to_json()
    change(document)
    with pytest.raises(ReceiptError):
        SignedReceipt.from_json(document)


def test_the_worker_keeps_a_receipt_of_what_it_sent_and_refuses_others(tmp_path: Path, caplog) -> None:
    book = ReceiptBook(tmp_path)
    good = sign_receipt(COORDINATOR, DOMAIN, receipt())
    assert book.keep(wire(good), receipt(), DOMAIN, COORDINATOR.address) == good
    reported = sign_receipt(COORDINATOR, DOMAIN, receipt(REPORT))
    assert book.keep(wire(reported), receipt(REPORT), DOMAIN, COORDINATOR.address) == reported
    assert book.runs() == [RUN] and book.receipts(RUN) == ([good, reported], [])

    caplog.set_level(logging.INFO, "dilocox.worker")
    other = sign_receipt(COORDINATOR, DOMAIN, Receipt(RUN, 4, WORKER.address, b"\x33" * 32))
    assert book.keep(wire(other), receipt(round_=4), DOMAIN, COORDINATOR.address) is None  # another update
    forged = sign_receipt(WORKER, DOMAIN, receipt(round_=5))
    assert book.keep(wire(forged), receipt(round_=5), DOMAIN, COORDINATOR.address) is None  # not the coordinator's
    huge = wire(sign_receipt(COORDINATOR, DOMAIN, receipt(round_=6)))
    huge.signature = b"\0" * 100_000
    assert book.keep(huge, receipt(round_=6), DOMAIN, COORDINATOR.address) is None  # over its bound
    assert book.keep(None, receipt(round_=7), DOMAIN, COORDINATOR.address) is None  # none sent
    assert book.keep(wire(good), receipt(), None, None) is None  # a run without a ledger: nothing to keep
    text = caplog.text
    assert "another update" in text and "is signed by" in text and "100000 bytes" in text and "missing" in text
    assert len(book.receipts(RUN)[0]) == 2  # none of them kept

    (tmp_path / RUN.hex() / "9-update.json").write_bytes(b"{" * 10_000)
    kept, problems = book.receipts(RUN)
    assert kept == [good, reported] and len(problems) == 1 and "9-update.json: not a receipt" in problems[0]
