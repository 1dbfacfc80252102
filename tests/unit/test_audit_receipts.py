"""What the audit makes of the coordinator's receipts (audit.receipts): an update it receipted and did
not use fails the round against it, and a later replay mismatch of that worker is the coordinator's
(``receipt-withheld``), not the worker's (``replay``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attestation import Domain, WorkerKey
from attestation.receipt import Receipt, sign_receipt
from audit import recompute
from audit.checks import AuditCheck
from audit.findings import Findings
from audit.receipts import check_update_receipts
from audit.replay import ReplayOutcome, ReplayRow
from audit.result import AuditResult
from settlement.roster import Roster
from storage_client import CID, Codec, Manifest, ObjectStore, Participant
from tests.conftest import small_config

DOMAIN = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")
COORDINATOR, VICTIM, OTHER = (WorkerKey(bytes(range(k, k + 32))) for k in (1, 2, 3))
RUN = bytes(range(32))


def cid(text: str, codec: Codec = Codec.RAW) -> str:
    return str(CID.of(text.encode(), codec))


def manifest(r: int, workers: dict[str, str]) -> Manifest:
    return Manifest.new(run_id="run", round=r, parent=cid(f"m{r - 1}", Codec.JSON), config=cid("{}", Codec.JSON),
                        params=cid(f"θ{r}"), outer_state=cid(f"o{r}"), dropped=[], eval_loss_e6=3_000_000, bytes_up=0,
                        bytes_down=0, participants=[
                            Participant(worker=w, update=u, train_loss_e6=1, tokens=1, inner_steps=1, bytes_sent=0)
                            for w, u in sorted(workers.items())])


# Round 1 used only w0's update; the coordinator had receipted w1's too. Round 2 used both.
MANIFESTS = {1: manifest(1, {"w0": cid("w0 Δ1", Codec.JSON)}),
             2: manifest(2, {"w0": cid("w0 Δ2", Codec.JSON), "w1": cid("w1 Δ2", Codec.JSON)})}
ROSTER = Roster(ids={VICTIM.address: ["w1"], OTHER.address: ["w0"]})


def receipt(key: WorkerKey, worker: WorkerKey, r: int, update: str, run: bytes = RUN):
    return sign_receipt(key, DOMAIN, Receipt(run, r, worker.address, CID.parse(update).digest))


@pytest.fixture
def findings(tmp_path: Path) -> Findings:
    return Findings(AuditResult(rederived=False), ObjectStore(tmp_path))


def test_an_update_receipted_and_not_used_fails_the_coordinator(findings: Findings) -> None:
    held = [receipt(COORDINATOR, VICTIM, 1, cid("w1 Δ1", Codec.JSON)),  # withheld
            receipt(COORDINATOR, OTHER, 1, cid("w0 Δ1", Codec.JSON)),   # used
            receipt(COORDINATOR, VICTIM, 2, cid("w1 Δ2", Codec.JSON)),  # used
            receipt(VICTIM, VICTIM, 2, cid("forged", Codec.JSON)),      # not the coordinator's word
            receipt(COORDINATOR, VICTIM, 2, cid("other run", Codec.JSON), run=bytes(32)),
            receipt(COORDINATOR, VICTIM, 3, cid("w1 Δ3", Codec.JSON))]  # round not recorded: not audited
    excused = check_update_receipts(findings, RUN, held, DOMAIN, COORDINATOR.address, MANIFESTS, ROSTER)
    assert excused == {"w1": 1}
    (failure,) = findings.result.failures
    assert (failure.round, failure.check) == (1, AuditCheck.RECEIPT_WITHHELD)
    assert COORDINATOR.address in failure.message and "w1" in failure.message


@pytest.mark.parametrize("excused", [{}, {"w1": 1}, {"w1": 2}])
def test_a_replay_mismatch_after_a_withheld_update_is_the_coordinators(findings: Findings, monkeypatch,
                                                                        excused: dict[str, int]) -> None:
    row = ReplayRow(2, "w1", True, 1.03, "MISMATCH")
    outcome = ReplayOutcome([row], [], seed=1, steps=3, checked_steps=3, seconds=0.1, problems=[])
    monkeypatch.setattr(recompute, "replay_run", lambda *args: outcome)
    recompute.Recomputation(findings, small_config()).check_replay(MANIFESTS, 1, 1, excused)
    (failure,) = findings.result.failures
    if excused.get("w1", 2) < 2:  # withheld before the mismatched round: not this worker's fault
        assert failure.check == AuditCheck.RECEIPT_WITHHELD and "not this worker's fault" in failure.message
        assert "round 1" in failure.message
    else:
        assert failure.check == AuditCheck.REPLAY and "1.03 away" in failure.message


def test_a_row_past_the_replay_horizon_fails_the_run_and_accuses_no_worker(findings: Findings, monkeypatch) -> None:
    """rounds.state_every bounds every chain by the replay horizon, so a contribution the fallback
    cannot decide is the run's failure (replay-horizon), never a warning and never a worker's verdict."""
    row = ReplayRow(2, "w1", True, 0.3, "inconclusive", "contribution 6 of its chain", "auditor's")
    outcome = ReplayOutcome([row], [], seed=1, steps=3, checked_steps=3, seconds=0.1, problems=[])
    monkeypatch.setattr(recompute, "replay_run", lambda *args: outcome)
    recompute.Recomputation(findings, small_config()).check_replay(MANIFESTS, 1, 1)
    (failure,) = findings.result.failures
    assert failure.check == AuditCheck.REPLAY_HORIZON and failure.object == cid("w1 Δ2", Codec.JSON)
    assert "contribution 6 of its chain" in failure.message and "horizon" in failure.message
