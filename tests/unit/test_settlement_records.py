"""settlement.records without a chain: web3's values become typed records, and malformed ones are refused."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hexbytes import HexBytes

from settlement.records import Contribution, RoundRecord, RunRecord

WORKER = "0x70997970C51812dc3A010C7d01b50e0d17dc79C8"


def h(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def round_log(**args: Any) -> dict[str, Any]:
    """A RoundRecorded log as web3 gives it: HexBytes, lists, addresses as the node spells them."""
    fields = {"runId": HexBytes(h("run")), "round": 3, "checkpoint": HexBytes(h("ckpt")),
              "manifestDigest": HexBytes(h("manifest")), "tokens": 1000, "workers": [WORKER.lower()],
              "unreportedCount": 1, "commitment": HexBytes(h("commitment"))}
    return {"args": fields | args, "blockNumber": 12, "transactionHash": HexBytes(h("tx")), "logIndex": 2}


def test_an_event_becomes_a_typed_record() -> None:
    record = RoundRecord.from_event(round_log())
    assert type(record.run_id) is bytes and record.run_id == h("run")
    assert record.workers == (WORKER,) and record.report_count == 1  # checksummed, a tuple
    assert (record.block, record.tx_hash, record.log_index) == (12, "0x" + h("tx").hex(), 2)
    assert (record.sender, record.parent_checkpoint, record.reports, record.unreported) == (None, None, (), ())
    assert record.facts() == (h("ckpt"), h("manifest"), 1000, 12, 1, [WORKER])
    called = record.with_call(sender=WORKER.lower(), parent_checkpoint=HexBytes(h("parent")), reports=[],
                              unreported=[HexBytes(h("u"))])
    assert (called.sender, called.parent_checkpoint, called.unreported) == (WORKER, h("parent"), (h("u"),))
    assert called.facts_commitment() == record.facts_commitment()  # the calldata is not in the facts


@pytest.mark.parametrize(("field", "value", "message"), [
    ("checkpoint", HexBytes(b"\x01" * 31), "checkpoint must be 32 bytes, got 31 bytes"),
    ("tokens", -1, "tokens must be an unsigned integer"),
    ("round", True, "round must be an unsigned integer"),
    ("workers", WORKER, "workers must be an array"),
    ("workers", ["0x1234"], r"workers\[0\] must be an address"),
])
def test_a_malformed_event_is_refused_by_field(field: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RoundRecord.from_event(round_log(**{field: value}))


def test_structs_become_records_keyed_by_their_solidity_names() -> None:
    run = RunRecord.from_struct({"coordinator": WORKER.lower(), "lastRound": 2, "challengeWindow": 0,
                                 "lastCheckpoint": h("2"), "genesisCheckpoint": h("0"), "configDigest": h("c"),
                                 "genesisManifest": h("g")})
    assert (run.coordinator, run.last_round, run.genesis_checkpoint) == (WORKER, 2, h("0"))
    assert Contribution.from_struct({"tokens": 5, "rounds": 1}) == Contribution(tokens=5, rounds=1)
    with pytest.raises(ValueError, match="rounds must be an unsigned integer"):
        Contribution.from_struct({"tokens": 5, "rounds": "1"})
