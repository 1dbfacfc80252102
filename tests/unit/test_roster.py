"""settlement.roster without a chain: worker ids from signed reports and manifests, unreported updates."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from attestation.keys import WorkerKey
from attestation.report import Domain, RoundReport, SignedReport
from settlement.provision import KeyFileError, read_key_file
from settlement.records import RoundRecord
from settlement.roster import roster_of, short_address, unreported_lines
from storage_client import CID, Codec, Manifest, ObjectStore, Participant, Traffic

DOMAIN = Domain(31337, "0x5FbDB2315678afecb367f032d93F642f64180aa3")
RUN = hashlib.sha256(b"run").digest()
KEYS = {"site-a": WorkerKey.generate(), "site-b": WorkerKey.generate()}


def cid(text: str, codec: Codec = Codec.RAW) -> str:
    return str(CID.of(text.encode(), codec))


def stored_round(store: ObjectStore, r: int, reporting: tuple[str, ...]) -> RoundRecord:
    """Round r with both sites' updates in its manifest; ``reporting`` signed reports, the others unreported."""
    participants = [Participant(worker=w, update=cid(f"Δ{r}{w}", Codec.JSON), train_loss_e6=1, tokens=8, inner_steps=1,
                                bytes_sent=1, bytes_received=1) for w in sorted(KEYS)]
    manifest = Manifest.new(run_id="run", round=r, parent=cid(f"m{r - 1}", Codec.JSON), config=cid("{}", Codec.JSON),
                            params=cid(f"θ{r}"), outer_state=cid(f"o{r}"), dropped=[], eval_loss_e6=1, bytes_up=2,
                            bytes_down=2, participants=participants, traffic=[Traffic(w, 1, 1) for w in sorted(KEYS)])
    digest = manifest.store(store).digest
    updates = {p.worker: CID.parse(p.update).digest for p in participants}
    reports = []
    for w in reporting:
        report = RoundReport(run_id=RUN, round=r, worker=KEYS[w].address, parent_checkpoint=bytes(32),
                             checkpoint=bytes(32), manifest_digest=digest, update_digest=updates[w],
                             data_digest=bytes(32), train_loss_e6=1, eval_loss_e6=1, tokens=8, inner_steps=1,
                             bytes_sent=1, bytes_received=1)
        reports.append(SignedReport(report, KEYS[w].sign_digest(report.digest(DOMAIN))))
    return RoundRecord(run_id=RUN, round=r, checkpoint=bytes(32), manifest_digest=digest, tokens=8,
                       workers=tuple(KEYS[w].address for w in reporting), unreported_count=2 - len(reporting),
                       commitment=bytes(32), block=r, tx_hash="0x" + "00" * 32, log_index=0,
                       reports=tuple(reports), unreported=tuple(updates[w] for w in sorted(KEYS) if w not in reporting))


def test_ids_come_from_the_reports_and_unreported_updates_are_named(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "store")
    rounds = [stored_round(store, 1, ()), stored_round(store, 2, ("site-a",)), stored_round(store, 3, tuple(KEYS))]
    roster = roster_of(store, rounds)
    a, b = KEYS["site-a"].address, KEYS["site-b"].address
    assert roster.ids == {a: ["site-a"], b: ["site-b"]}
    assert roster.label(a) == f"site-a ({short_address(a)})" and roster.id_of("0x" + "11" * 20) == "?"
    assert [(u.round, u.worker, u.address) for u in roster.unreported] == [
        (1, "site-a", a), (1, "site-b", b), (2, "site-b", b)]
    lines = unreported_lines(roster)
    assert lines[0].startswith("round 1 was recorded with 0 report(s) for 2 update(s): participant site-a did "
                               f"not report ({short_address(a)})")
    assert lines[2].startswith("round 2 was recorded with 1 report(s) for 2 update(s): participant site-b")
    assert unreported_lines(roster_of(store, rounds[2:])) == []


def test_a_worker_that_never_reported_has_no_address_and_a_missing_manifest_is_skipped(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "store")
    silent = stored_round(store, 1, ())
    lost = stored_round(ObjectStore(tmp_path / "elsewhere"), 2, tuple(KEYS))  # its manifest is not in the store
    roster = roster_of(store, [silent, lost])
    assert roster.ids == {} and {u.address for u in roster.unreported} == {None}
    assert "address unknown: it never reported in this run" in unreported_lines(roster)[0]


def test_key_files(tmp_path: Path) -> None:
    good = tmp_path / "good.key"
    good.write_text("0x" + "ab" * 32 + "\n")
    assert read_key_file(good) == bytes.fromhex("ab" * 32)
    for name, content in (("short", "abcd"), ("junk", "zz" * 32), ("huge", "a" * 5000)):
        (tmp_path / name).write_text(content)
        with pytest.raises(KeyFileError, match="not a chain private key") as caught:
            read_key_file(tmp_path / name, "--key-file")
        assert content[:8] not in str(caught.value).replace(str(tmp_path), "")
    with pytest.raises(KeyFileError, match="no such file"):
        read_key_file(tmp_path / "nothing")
