"""settlement.Outbox without a chain: ordering, durability, idempotent flushing and failure handling.

The ledger here is an in-memory stand-in with the contract's rules that matter to the outbox
(runs, sequential rounds); tests/integration/test_settlement.py runs the same paths on anvil.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from attestation.keys import WorkerKey
from attestation.report import Domain, RoundReport, SignedReport
from settlement import ChainError, ChainUnavailable, Outbox, OutboxError, RecordConflict, TxReverted

ADDRESS = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"
DOMAIN = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")


def h(*parts: object) -> bytes:
    return hashlib.sha256(repr(parts).encode()).digest()


RUN = h("run")


def reports(round_: int, checkpoint: bytes | None = None) -> list[SignedReport]:
    key = WorkerKey.generate()
    report = RoundReport(run_id=RUN, round=round_, worker=key.address, parent_checkpoint=h("ckpt", round_ - 1),
                         checkpoint=checkpoint or h("ckpt", round_), update_digest=h("u"), data_digest=h("d"),
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
    runs: dict[bytes, dict[str, Any]] = field(default_factory=dict)
    rounds: dict[tuple[bytes, int], dict[str, Any]] = field(default_factory=dict)
    sent: list[str] = field(default_factory=list)
    down: bool = False
    refuse: str | None = None
    fail: str | None = None

    def _check(self) -> None:
        if self.down:
            raise ChainUnavailable("http://127.0.0.1:9", "connection refused")
        if self.fail:
            raise ChainError(self.fail)
        if self.refuse:
            raise TxReverted(self.refuse, error=self.refuse.split("(")[0])

    def run_of(self, run_id: bytes) -> dict[str, Any] | None:
        if self.down:
            raise ChainUnavailable("http://127.0.0.1:9", "connection refused")
        return self.runs.get(run_id)

    def round_of(self, run_id: bytes, round_: int) -> dict[str, Any]:
        return self.rounds.get((run_id, round_), {"checkpoint": bytes(32), "manifestDigest": bytes(32),
                                                  "reportCount": 0, "recordedAt": 0})

    def create_run(self, run_id: bytes, genesis: bytes, config: bytes, manifest: bytes) -> dict[str, int]:
        self._check()
        self.sent.append("create_run")
        self.runs[run_id] = {"coordinator": ADDRESS, "lastRound": 0, "lastCheckpoint": genesis,
                             "genesisCheckpoint": genesis}
        return {"blockNumber": 1, "gasUsed": 1}

    def record_round(self, run_id: bytes, round_: int, parent: bytes, checkpoint: bytes, manifest: bytes,
                     signed: list[SignedReport]) -> dict[str, int]:
        self._check()
        run = self.runs[run_id]
        assert round_ == run["lastRound"] + 1 and parent == run["lastCheckpoint"]
        assert all(isinstance(s, SignedReport) for s in signed)
        self.sent.append(f"round {round_}")
        run.update(lastRound=round_, lastCheckpoint=checkpoint)
        self.rounds[(run_id, round_)] = {"checkpoint": checkpoint, "manifestDigest": manifest,
                                         "reportCount": len(signed), "recordedAt": 7}
        return {"blockNumber": 2, "gasUsed": 1}


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
    with pytest.raises(ValueError, match="no reports"):
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
    ledger.refuse = "WorkerNotActive(worker=0xabc)"
    with caplog.at_level(logging.ERROR, logger="dilocox.settlement"):
        assert outbox.flush(ledger) == []
    assert "recordRound for round 1 was refused by the ledger: WorkerNotActive(worker=0xabc)" in caplog.text
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
