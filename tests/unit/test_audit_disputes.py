"""Which audit failures become verdicts (audit.disputes.verdicts_of), and the Verdict's typed data
(attestation.verdict): pure logic, no chain (the digest is checked against the contract's in
tests/integration/test_disputes.py)."""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

from attestation import RoundReport, SignedReport, WorkerKey
from attestation.verdict import TYPE_STRING, Verdict, check_id, disputes_domain
from audit.checks import AuditCheck
from audit.disputes import verdicts_of
from audit.replay import ReplayRow
from audit.result import AuditResult, Failure
from settlement.records import RoundRecord
from settlement.roster import Roster

RUN = hashlib.sha256(b"run").digest()
COORDINATOR = WorkerKey.generate().address
CHEAT, HONEST = WorkerKey.generate(), WorkerKey.generate()


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


def report(key: WorkerKey, round_: int) -> SignedReport:
    r = RoundReport(run_id=RUN, round=round_, worker=key.address, parent_checkpoint=h("p", round_),
                    checkpoint=h("c", round_), manifest_digest=h("m", round_), update_digest=h("u", round_, key.address),
                    data_digest=h("d"), train_loss_e6=1, eval_loss_e6=1, tokens=1, inner_steps=1, bytes_sent=1,
                    bytes_received=1)
    return SignedReport(r, b"\x00" * 65)


def record(round_: int) -> RoundRecord:
    reports = sorted((report(CHEAT, round_), report(HONEST, round_)), key=lambda s: int(s.report.worker, 16))
    return RoundRecord(run_id=RUN, round=round_, checkpoint=h("c", round_), manifest_digest=h("m", round_), tokens=1,
                       workers=tuple(s.report.worker for s in reports), unreported_count=0, commitment=h("x"),
                       block=1, tx_hash="0x" + "00" * 32, log_index=0, reports=tuple(reports))


def result(failures: list[Failure], mismatched: list[tuple[int, str]]) -> AuditResult:
    rows = [ReplayRow(round=r, worker=w, sampled=True, distance=0.3, status="MISMATCH") for r, w in mismatched]
    rows.append(ReplayRow(round=1, worker="honest", sampled=True, distance=1e-4, status="ok"))
    return AuditResult(run_id=RUN, failures=failures, replay=SimpleNamespace(rows=rows),
                       roster=Roster(ids={CHEAT.address: ["cheat"], HONEST.address: ["honest"]}))


def test_a_replay_mismatch_is_a_verdict_against_the_worker_on_its_update() -> None:
    rounds = [record(1), record(2)]
    found = verdicts_of(result([], [(1, "cheat"), (2, "cheat"), (2, "nobody")]), rounds, COORDINATOR)
    assert [(v.round, v.party, v.check_name, v.evidence) for v in found] == [
        (1, CHEAT.address, "replay", h("u", 1, CHEAT.address)), (2, CHEAT.address, "replay", h("u", 2, CHEAT.address))]


def test_a_coordinator_failure_voids_the_round_and_its_worker_verdicts_are_not_sent() -> None:
    rounds = [record(1), record(2)]
    failures = [Failure(2, "cid", AuditCheck.GHOST, "a ghost"), Failure(2, "cid", AuditCheck.REDERIVE, "again"),
                Failure(None, "0x", AuditCheck.TALLY, "run-wide: no round"), Failure(1, "r", AuditCheck.DATA_DIGEST, "x")]
    found = verdicts_of(result(failures, [(1, "cheat"), (2, "cheat")]), rounds, COORDINATOR)
    assert [(v.round, v.party, v.check_name, v.evidence) for v in found] == [
        (1, CHEAT.address, "replay", h("u", 1, CHEAT.address)), (2, COORDINATOR, "ghost", h("m", 2))]


def test_nothing_to_dispute_without_a_run_or_failures() -> None:
    assert verdicts_of(AuditResult(), [], COORDINATOR) == []
    assert verdicts_of(result([], []), [record(1)], COORDINATOR) == []


def test_the_verdict_type_and_its_bounds() -> None:
    assert TYPE_STRING == "Verdict(bytes32 runId,uint64 round,address party,bytes32 check,bytes32 evidence)"
    v = Verdict(RUN, 3, CHEAT.address.lower(), "replay", h("e"))
    assert v.party == CHEAT.address and v.check == check_id("replay")
    assert v.to_json()["check_id"] == "0x" + check_id("replay").hex()
    domain = disputes_domain(31337, COORDINATOR)
    assert v.digest(domain) != Verdict(RUN, 4, CHEAT.address, "replay", h("e")).digest(domain)
    for bad in ({"round": 0}, {"round": 2**64}, {"check_name": ""}, {"check_name": "x" * 67},
                {"evidence": b"short"}, {"party": "0x12"}):
        fields = {"run_id": RUN, "round": 3, "party": CHEAT.address, "check_name": "replay", "evidence": h("e")}
        with pytest.raises(ValueError):
            Verdict(**(fields | bad))
