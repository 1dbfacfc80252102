"""settlement.Outbox without a chain: ordering, durability, idempotent flushing and failure handling.

The ledger here is an in-memory stand-in with the contract's rules that matter to the outbox
(runs, sequential rounds); tests/integration/test_settlement.py runs the same paths on anvil.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from attestation.keys import WorkerKey
from attestation.report import Domain, RoundReport, SignedReport
from settlement import ChainError, ChainUnavailable, Outbox, OutboxError, RecordConflict, TxReverted
from settlement.records import RoundRecord, RunRecord

ADDRESS = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
DOMAIN = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


RUN = h("run")


def reports(round_: int, checkpoint: bytes | None = None) -> list[SignedReport]:
    key = WorkerKey.generate()
    report = RoundReport(run_id=RUN, round=round_, worker=key.address, parent_checkpoint=h("ckpt", round_ - 1),
                         checkpoint=checkpoint or h("ckpt", round_), manifest_digest=h("manifest", round_),
                         update_digest=h("u"), data_digest=h("d"),
                         train_loss_e6=-1, eval_loss_e6=2, tokens=10, inner_steps=3, bytes_sent=4,
                         bytes_received=5)
    return [SignedReport(report, key.sign_digest(report.digest(DOMAIN)))]


@dataclass
class FakeChain:
    address: str = ADDRESS


@dataclass
class FakeLedger:
    """The ledger's bookkeeping, with switches for an unreachable node and a refusal."""

    chain: FakeChain = field(default_factory=FakeChain)
    runs: dict[bytes, RunRecord] = field(default_factory=dict)
    rounds: dict[tuple[bytes, int], RoundRecord] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    down: bool = False
    refuse: str | None = None
    fail: str | None = None
    head: int = 1

    def _check(self) -> None:
        if self.down:
            raise ChainUnavailable("http://127.0.0.1:9", "connection refused")
        if self.fail:
            raise ChainError(self.fail)
        if self.refuse:
            raise TxReverted(self.refuse, error=self.refuse.split("(")[0])

    def run_of(self, run_id: bytes) -> RunRecord | None:
        if self.down:
            raise ChainUnavailable("http://127.0.0.1:9", "connection refused")
        return self.runs.get(run_id)

    def round_of(self, run_id: bytes, round_: int) -> RoundRecord | None:
        return self.rounds.get((run_id, round_))

    def create_run(self, run_id: bytes, genesis: bytes, config: bytes, manifest: bytes,
                   challenge_window: int = 0) -> dict[str, int]:
        self._check()
        self.sent.append("create_run")
        self.runs[run_id] = RunRecord(coordinator=ADDRESS, last_round=0, challenge_window=challenge_window,
                                      last_checkpoint=genesis, genesis_checkpoint=genesis, config_digest=config,
                                      genesis_manifest=manifest)
        return {"blockNumber": 1, "gasUsed": 1}

    def head_block(self) -> int:
        if self.down:
            raise ChainUnavailable("http://127.0.0.1:9", "connection refused")
        return self.head

    def record_round(self, run_id: bytes, round_: int, parent: bytes, checkpoint: bytes, manifest: bytes,
                     signed: list[SignedReport], unreported: list[bytes] = ()) -> dict[str, int]:
        self._check()
        assert signed or unreported
        run = self.runs[run_id]
        assert round_ == run.last_round + 1 and parent == run.last_checkpoint
        assert all(isinstance(s, SignedReport) for s in signed)
        self.sent.append(f"round {round_}")
        self.runs[run_id] = replace(run, last_round=round_, last_checkpoint=checkpoint)
        self.head += 1
        self.rounds[(run_id, round_)] = RoundRecord(
            run_id=run_id, round=round_, checkpoint=checkpoint, manifest_digest=manifest,
            tokens=signed[0].report.tokens if signed else 0, workers=tuple(s.report.worker for s in signed),
            unreported_count=len(unreported), commitment=bytes(32), block=self.head, tx_hash="0x" + "00" * 32,
            log_index=0, sender=ADDRESS, parent_checkpoint=parent, reports=tuple(signed), unreported=tuple(unreported))
        return {"blockNumber": self.head, "gasUsed": 1}

    def lose_after(self, round_: int) -> None:
        """The chain comes back behind: rounds after ``round_`` are gone (0: only the run is left;
        -1: the run too)."""
        for key in [k for k in self.rounds if k[1] > round_]:
            del self.rounds[key]
        if round_ < 0:
            self.runs.clear()
            return
        for run_id, run in self.runs.items():
            last = self.rounds[(run_id, round_)].checkpoint if round_ else run.genesis_checkpoint
            self.runs[run_id] = replace(run, last_round=round_, last_checkpoint=last)


def queue_run(outbox: Outbox, rounds: int) -> None:
    outbox.enqueue_create_run(RUN, h("ckpt", 0), h("config"), h("genesis"))
    for r in range(1, rounds + 1):
        outbox.enqueue_round(RUN, r, h("ckpt", r - 1), h("ckpt", r), h("manifest", r), reports(r))


def test_items_are_numbered_files_in_order(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox")
    queue_run(outbox, 2)
    names = sorted(p.name for p in (tmp_path / "outbox").iterdir())
    assert names == ["000001-create_run.json", "000002-round.json", "000003-round.json"]
    items = outbox.pending()
    assert [i["seq"] for i in items] == [1, 2, 3]
    item = json.loads((tmp_path / "outbox" / "000002-round.json").read_text())
    assert item["round"] == 1 and item["checkpoint"] == "0x" + h("ckpt", 1).hex()
    assert SignedReport.from_json(item["reports"][0]).report.round == 1
    # A new Outbox on the same directory (a restarted coordinator) continues the numbering.
    Outbox(tmp_path / "outbox").enqueue_round(RUN, 3, h("ckpt", 2), h("ckpt", 3), h("manifest", 3), reports(3))
    assert (tmp_path / "outbox" / "000004-round.json").is_file()


def test_enqueue_refuses_bad_input_and_keeps_duplicates_once(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    with pytest.raises(ValueError, match="run_id must be 32 bytes"):
        outbox.enqueue_create_run(b"short", h(0), h(1), h(2))
    with pytest.raises(ValueError, match="round must be an integer >= 1"):
        outbox.enqueue_round(RUN, 0, h(0), h(1), h(2), reports(1))
    with pytest.raises(ValueError, match="no participants"):
        outbox.enqueue_round(RUN, 1, h(0), h(1), h(2), [])
    with pytest.raises(ValueError):
        outbox.enqueue_round(RUN, 1, h(0), h(1), h(2), [{"report": {}, "signature": "0x00"}])
    assert outbox.pending() == []
    signed = reports(1)
    first = outbox.enqueue_round(RUN, 1, h(0), h(1), h(2), signed)
    assert outbox.enqueue_round(RUN, 1, h(0), h(1), h(2), [s.to_json() for s in signed]) == first
    assert len(outbox.pending()) == 1


def test_flush_sends_in_order_and_removes_each_after_its_receipt(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 3)
    assert outbox.flush(ledger) == [1, 2, 3]
    assert ledger.sent == ["create_run", "round 1", "round 2", "round 3"]
    assert outbox.pending() == [] and outbox.flush(ledger) == []


def test_flush_recognises_writes_already_on_chain(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 2)
    outbox.flush(ledger)
    queue_run(outbox, 2)  # as if the files survived a crash after the receipts
    assert outbox.flush(ledger) == [1, 2]
    assert ledger.sent == ["create_run", "round 1", "round 2"]  # nothing twice
    assert outbox.pending() == []


def test_flush_raises_on_a_conflicting_record(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 1)
    outbox.flush(ledger)
    outbox.enqueue_round(RUN, 1, h("ckpt", 0), h("forked"), h("manifest", 1), reports(1, h("forked")))
    with pytest.raises(RecordConflict) as exc:
        outbox.flush(ledger)
    assert h("ckpt", 1).hex() in str(exc.value) and h("forked").hex() in str(exc.value)
    assert len(outbox.pending()) == 1
    other = Outbox(tmp_path / "other")
    other.enqueue_create_run(RUN, h("another genesis"), h("config"), h("genesis"))
    with pytest.raises(RecordConflict, match="genesis checkpoint"):
        other.flush(ledger)


def test_unreachable_chain_keeps_items_and_logs_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger(down=True)
    queue_run(outbox, 2)
    before = {Path(i["file"]).name: Path(i["file"]).read_bytes() for i in outbox.pending()}
    with caplog.at_level(logging.INFO, logger="dilocox.settlement"):
        for _ in range(3):
            assert outbox.flush(ledger) == []
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1
        assert "chain RPC http://127.0.0.1:9 is unreachable: connection refused" in errors[0]
        assert "3 write(s) stay queued" in errors[0]
        assert {Path(i["file"]).name: Path(i["file"]).read_bytes() for i in outbox.pending()} == before
        ledger.down = False
        assert outbox.flush(ledger) == [1, 2]
    assert any("takes writes again" in r.getMessage() for r in caplog.records)


def test_a_refused_write_stops_the_flush(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 2)
    ledger.create_run(RUN, h("ckpt", 0), h("config"), h("genesis"))
    ledger.refuse = "LedgerWorkerNotActive(worker=0xabc)"
    with caplog.at_level(logging.ERROR, logger="dilocox.settlement"):
        assert outbox.flush(ledger) == []
    assert "recordRound for round 1 was refused by the ledger: LedgerWorkerNotActive(worker=0xabc)" in caplog.text
    assert [i["kind"] for i in outbox.pending()] == ["round", "round"]  # create_run was recognised


def test_a_node_refusing_the_transaction_is_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 1)
    ledger.create_run(RUN, h("ckpt", 0), h("config"), h("genesis"))
    ledger.fail = "recordRound: the node refused the transaction: insufficient funds for gas"
    with caplog.at_level(logging.ERROR, logger="dilocox.settlement"):
        assert outbox.flush(ledger) == [] and outbox.flush(ledger) == []
    assert len(caplog.records) == 1 and "insufficient funds" in caplog.records[0].getMessage()
    assert len(outbox.pending()) == 1


def test_unreadable_items_are_reported_not_dropped(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    (tmp_path / "000001-round.json").write_text("{not json")
    with pytest.raises(OutboxError, match="000001-round.json"):
        outbox.flush(FakeLedger())
    assert (tmp_path / "000001-round.json").exists()
    (tmp_path / "000001-round.json").write_text(json.dumps({"schema": "dilocox.outbox/v1", "kind": "create_run"}))
    with pytest.raises(OutboxError, match="kind its name says"):
        outbox.pending()
    # A broken file does not stop new writes from being queued behind it.
    assert outbox.enqueue_create_run(RUN, h(0), h(1), h(2)).name == "000002-create_run.json"


def test_concurrent_enqueues_and_flushes(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    outbox.enqueue_create_run(RUN, h("ckpt", 0), h("config"), h("genesis"))
    done: list[int] = []

    def flusher() -> None:
        for _ in range(50):
            done.extend(outbox.flush(ledger))

    thread = threading.Thread(target=flusher)
    thread.start()
    for r in range(1, 21):
        outbox.enqueue_round(RUN, r, h("ckpt", r - 1), h("ckpt", r), h("manifest", r), reports(r))
    thread.join()
    done.extend(outbox.flush(ledger))
    assert done == list(range(1, 21))
    assert ledger.sent == ["create_run"] + [f"round {r}" for r in range(1, 21)]


# -- confirmation depth, and a chain that comes back behind -------------------------------------------


def test_a_round_stays_queued_until_it_is_confirmations_deep_and_then_is_kept(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path, confirmations=3), FakeLedger()
    queue_run(outbox, 2)
    assert outbox.flush(ledger) == []  # sent in blocks 2 and 3 (head 3): depth 2 and 1
    assert ledger.sent == ["create_run", "round 1", "round 2"]
    assert [i["kind"] for i in outbox.pending()] == ["round", "round"]  # the run exists: set aside
    assert [i["kind"] for i in outbox.confirmed()] == ["create_run"]
    ledger.head += 1  # round 1 is 3 deep now, round 2 only 2
    assert outbox.flush(ledger) == [1]
    ledger.head += 1
    assert outbox.flush(ledger) == [2]
    assert outbox.pending() == [] and ledger.sent == ["create_run", "round 1", "round 2"]  # nothing sent twice
    assert [i["kind"] for i in outbox.confirmed()] == ["create_run", "round", "round"]  # the copies are kept
    with pytest.raises(ValueError, match="confirmations"):
        Outbox(tmp_path, confirmations=0)


def test_rounds_lost_by_the_chain_are_sent_again_in_order_once(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 4)
    assert outbox.flush(ledger) == [1, 2, 3, 4]
    ledger.lose_after(2)  # e.g. anvil restored from a state file dumped two blocks earlier
    ledger.sent.clear()
    outbox.enqueue_round(RUN, 5, h("ckpt", 4), h("ckpt", 5), h("manifest", 5), reports(5))
    with caplog.at_level(logging.ERROR, logger="dilocox.settlement"):
        assert outbox.flush(ledger) == [3, 4, 5]
    assert "came back behind: it shows round 2 as its last, but rounds 3..4 had been confirmed" in caplog.text
    assert ledger.sent == ["round 3", "round 4", "round 5"]
    assert outbox.flush(ledger) == [] and ledger.sent == ["round 3", "round 4", "round 5"]  # once
    assert [i.get("round") for i in outbox.confirmed()] == [None, 1, 2, 3, 4, 5]


def test_a_chain_that_lost_the_run_itself_gets_it_all_again(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 2)
    outbox.flush(ledger)
    ledger.lose_after(-1)  # a fresh chain at the same address
    ledger.sent.clear()
    assert outbox.flush(ledger) == [1, 2]
    assert ledger.sent == ["create_run", "round 1", "round 2"]


def test_a_chain_that_holds_another_round_is_a_conflict_even_after_confirmation(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 2)
    outbox.flush(ledger)
    ledger.lose_after(1)
    ledger.record_round(RUN, 2, h("ckpt", 1), h("someone else's"), h("manifest", 2), reports(2))
    with pytest.raises(RecordConflict, match="round 2"):
        outbox.flush(ledger)


def test_a_round_nobody_reported_is_queued_with_its_unreported_updates(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    outbox.enqueue_create_run(RUN, h("ckpt", 0), h("config"), h("genesis"))
    outbox.enqueue_round(RUN, 1, h("ckpt", 0), h("ckpt", 1), h("manifest", 1), [], [h("u2"), h("u1")])
    item = outbox.pending()[-1]
    assert item["reports"] == [] and item["unreported"] == sorted("0x" + h(u).hex() for u in ("u1", "u2"))
    with pytest.raises(ValueError, match="listed twice"):
        outbox.enqueue_round(RUN, 2, h("ckpt", 1), h("ckpt", 2), h("manifest", 2), [], [h("u"), h("u")])
    assert outbox.flush(ledger) == [1]
    assert ledger.rounds[(RUN, 1)].unreported_count == 2 and ledger.rounds[(RUN, 1)].report_count == 0


def test_items_written_by_the_previous_version_are_still_sent(tmp_path: Path) -> None:
    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 1)
    for item in outbox.pending():  # v1 items had no "unreported" list
        body = json.loads(Path(item["file"]).read_text())
        body["schema"] = "dilocox.outbox/v1"
        body.pop("unreported", None)
        Path(item["file"]).write_text(json.dumps(body))
    assert outbox.flush(ledger) == [1]


def test_a_conflict_stops_the_settlement_thread_and_the_coordinator(tmp_path: Path) -> None:
    """No retry fixes a chain holding another round r: the coordinator is told to stop (exit 1)."""
    from types import SimpleNamespace

    from attestation import WorkerKey
    from settlement.ledger_trust import LedgerTrust

    outbox, ledger = Outbox(tmp_path), FakeLedger()
    queue_run(outbox, 1)
    outbox.flush(ledger)
    ledger.lose_after(0)
    ledger.record_round(RUN, 1, h("ckpt", 0), h("forked"), h("manifest", 1), reports(1, h("forked")))
    gate = SimpleNamespace(domain=SimpleNamespace(chain_id=31337, ledger="0x" + "11" * 20))
    book = SimpleNamespace(queue_due=lambda *_: [], queued_through=1)
    trust = LedgerTrust(gate, book, ledger, outbox, WorkerKey.generate())
    rounds = SimpleNamespace(published=lambda: ({0: None, 1: None}, {}, 0.0))
    settling, stop, failure = threading.Event(), threading.Event(), []
    thread = threading.Thread(target=trust.settle, args=(rounds, settling, stop, failure, 0.01))
    thread.start()
    assert stop.wait(10)
    thread.join(10)
    assert not thread.is_alive() and len(failure) == 1 and "round 1" in failure[0]
