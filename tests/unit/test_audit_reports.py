"""audit.report_checks without a chain: a round's signed reports against its record and its manifest."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import cast

import pytest

from attestation.keys import WorkerKey
from attestation.report import Domain, RoundReport, SignedReport
from audit.findings import Findings
from audit.lineage import Loaded
from audit.report_checks import ReportChecks
from audit.result import AuditResult
from audit.signers import Signers
from settlement.records import RoundRecord
from storage_client import CID, Codec, Manifest, ObjectStore, Participant, Traffic

DOMAIN = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")
RUN = hashlib.sha256(b"run").digest()
KEY = WorkerKey.generate()


def cid(text: str, codec: Codec = Codec.RAW) -> str:
    return str(CID.of(text.encode(), codec))


PARENT = Manifest.new(run_id="run", round=0, parent=None, config=cid("{}", Codec.JSON), params=cid("θ0"),
                      outer_state=cid("m0"), participants=[], dropped=[], eval_loss_e6=3_000_000, bytes_up=0,
                      bytes_down=0)
MANIFEST = Manifest.new(
    run_id="run", round=1, parent=cid("parent", Codec.JSON), config=cid("{}", Codec.JSON), params=cid("θ1"),
    outer_state=cid("m1"), dropped=[], eval_loss_e6=2_750_000, bytes_up=1_000, bytes_down=2_000,
    participants=[Participant(worker="w0", update=cid("Δ", Codec.JSON), train_loss_e6=2_500_000, tokens=4096, inner_steps=50,
                              bytes_sent=1_000, bytes_received=2_000)],
    traffic=[Traffic("w0", 1_000, 2_000)])
PARENT_CHECKPOINT = CID.parse(PARENT.params).digest
RECORD = RoundRecord(run_id=RUN, round=1, checkpoint=CID.parse(MANIFEST.params).digest,
                     manifest_digest=hashlib.sha256(b"manifest").digest(), tokens=4096, workers=(KEY.address,),
                     unreported_count=0, commitment=bytes(32), block=7, tx_hash="0x" + "00" * 32, log_index=0,
                     sender=KEY.address, parent_checkpoint=PARENT_CHECKPOINT)


def honest() -> RoundReport:
    p = MANIFEST.participants[0]
    return RoundReport(run_id=RUN, round=1, worker=KEY.address, parent_checkpoint=PARENT_CHECKPOINT,
                       checkpoint=RECORD.checkpoint, manifest_digest=RECORD.manifest_digest,
                       update_digest=CID.parse(p.update).digest, data_digest=bytes(32),
                       train_loss_e6=p.train_loss_e6, eval_loss_e6=MANIFEST.eval_loss_e6, tokens=p.tokens,
                       inner_steps=p.inner_steps, bytes_sent=p.bytes_sent, bytes_received=p.bytes_received)


class CheckedSigners:
    """Stands in for audit.signers.Signers: the registry is not what these tests are about."""

    def __init__(self) -> None:
        self.checked: list[str] = []

    def check(self, run_id: bytes, r: int, label: str, worker: str, block: int) -> None:
        self.checked.append(worker)


def audit(tmp_path: Path, report: RoundReport, parent: Loaded | None) -> AuditResult:
    findings = Findings(AuditResult(), ObjectStore(tmp_path / "store"))
    signers = CheckedSigners()
    checks = ReportChecks(findings, DOMAIN, cast(Signers, signers), config=None)
    record = dataclasses.replace(RECORD, reports=(SignedReport(report, KEY.sign_digest(report.digest(DOMAIN))),))
    checks.check(RUN, record, MANIFEST, parent)
    assert signers.checked == [KEY.address]
    return findings.result


@pytest.fixture(params=["parent", "no parent"])
def parent(request: pytest.FixtureRequest) -> Loaded | None:
    """The previous round's manifest, or None when it could not be read: the checks are the same."""
    return Loaded(CID.parse(MANIFEST.parent), PARENT, None, None) if request.param == "parent" else None


def test_an_honest_report_passes(tmp_path: Path, parent: Loaded | None) -> None:
    assert audit(tmp_path, honest(), parent).failures == []


def test_participant_fields_and_eval_loss_are_what_the_manifest_says(tmp_path: Path, parent: Loaded | None) -> None:
    report = dataclasses.replace(honest(), tokens=5096, bytes_received=1_999, eval_loss_e6=2_000_000)
    result = audit(tmp_path, report, parent)
    assert [f.check for f in result.failures] == ["report-fields", "report-eval-loss"]
    fields, eval_loss = (f.message for f in result.failures)
    assert "participant w0" in fields and "tokens is 5096" in fields and "4096" in fields
    assert "bytesReceived is 1999" in fields and "2000" in fields and "bytesSent" not in fields
    assert "evalLossE6 is 2000000" in eval_loss and "2750000" in eval_loss


def test_a_report_of_no_participant_still_restates_the_eval_loss(tmp_path: Path, parent: Loaded | None) -> None:
    report = dataclasses.replace(honest(), update_digest=bytes(32), tokens=1, eval_loss_e6=1)
    result = audit(tmp_path, report, parent)
    assert [f.check for f in result.failures] == ["report-participant", "report-eval-loss", "ghost"]
