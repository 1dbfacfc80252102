"""Every update that counts is signed by an admitted worker (issue 28): the update record keeps each
slice's push signature (trainer.runstore.update_record, v2), and audit.push_signatures checks them
for every participant, reported or not, without a chain (the registry side is audit.signers', stood
in for here)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import cast

import pytest

from attestation.keys import WorkerKey
from attestation.report import SignedReport
from attestation.signing import update_digest
from audit.findings import Findings
from audit.push_signatures import PushSignatures
from audit.result import AuditResult
from audit.signers import Signers
from proto import Encoding
from storage_client import CID, Codec, ObjectStore
from tests.unit.test_audit_reports import DOMAIN, MANIFEST, RECORD, RUN, CheckedSigners, honest
from trainer.runstore.update_record import (
    RecordError,
    identity_cid,
    parse_record,
    record_bytes,
    slice_ref,
)

PAYLOADS = (b"stage zero bytes", b"stage one bytes")


def signed_record(store: ObjectStore, keys: tuple[WorkerKey | None, ...], round_: int = 1) -> str:
    """A record of len(keys) stage slices, slice s signed by keys[s] (None: unsigned), stored."""
    refs = []
    for stage, key in enumerate(keys):
        payload = PAYLOADS[stage]
        digest = update_digest(RUN, round_, stage, len(keys), hashlib.sha256(payload).hexdigest())
        refs.append(slice_ref(stage, len(keys), Encoding.DENSE_F32, payload, None,
                              b"" if key is None else key.sign_digest(digest)))
    return str(store.put(record_bytes(refs), Codec.JSON))


def audit(tmp_path: Path, updates: dict[str, str], reporter: WorkerKey | None) -> tuple[AuditResult, list[str]]:
    """Round 1 whose participants' updates are ``updates`` (worker -> record CID); ``reporter``
    signs a report naming w0's update (None: nobody reports, every participant is unreported)."""
    store = ObjectStore(tmp_path / "store")
    findings = Findings(AuditResult(), store)
    signers = CheckedSigners()
    template = MANIFEST.participants[0]
    manifest = dataclasses.replace(MANIFEST, participants=tuple(
        dataclasses.replace(template, worker=w, update=u) for w, u in sorted(updates.items())))
    reports = ()
    if reporter is not None:
        report = dataclasses.replace(honest(), worker=reporter.address,
                                     update_digest=CID.parse(updates["w0"]).digest)
        reports = (SignedReport(report, reporter.sign_digest(report.digest(DOMAIN))),)
    PushSignatures(findings, cast(Signers, signers)).check(RUN, dataclasses.replace(RECORD, reports=reports),
                                                          manifest)
    return findings.result, signers.checked


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(tmp_path / "store")


def test_a_signed_record_round_trips_and_keeps_its_identity_without_signatures(store: ObjectStore) -> None:
    key = WorkerKey.generate()
    cid = signed_record(store, (key, key))
    refs = parse_record(store.get(cid))
    assert all(r.signature is not None and len(r.signature) == 130 for r in refs)
    assert b'"dilocox.update/v2"' in store.get(cid)
    unsigned = signed_record(store, (None, None))
    assert b'"dilocox.update/v1"' in store.get(unsigned)  # a record without signatures: as before, byte for byte
    assert identity_cid(refs) == unsigned == identity_cid(parse_record(store.get(unsigned)))
    # another key signing the same bytes: another record, the same identity (the replay refusal's key)
    other = signed_record(store, (WorkerKey.generate(), WorkerKey.generate()))
    assert other != cid and identity_cid(parse_record(store.get(other))) == unsigned


@pytest.mark.parametrize("signature, named", [
    ("00" * 64, "signature must be null or 130 lowercase hex digits"),
    ("AB" * 65, "signature must be null or 130 lowercase hex digits"),
    (7, "signature must be null or 130 lowercase hex digits"),
])
def test_a_malformed_signature_in_a_record_is_named(store: ObjectStore, signature: object, named: str) -> None:
    obj = json.loads(store.get(signed_record(store, (WorkerKey.generate(),))))
    obj["slices"][0]["signature"] = signature
    with pytest.raises(RecordError, match=named):
        parse_record(json.dumps(obj).encode())
    with pytest.raises(RecordError, match="must be 65 bytes"):
        slice_ref(0, 1, Encoding.DENSE_F32, b"x", None, b"\x01" * 64)


def test_a_reported_update_must_be_pushed_by_its_reporter(tmp_path: Path) -> None:
    w0 = WorkerKey.generate()
    store = ObjectStore(tmp_path / "store")
    result, checked = audit(tmp_path, {"w0": signed_record(store, (w0,))}, reporter=w0)
    assert result.failures == [] and checked == []  # the report's signer is audit.signers' already
    other = WorkerKey.generate()
    result, _ = audit(tmp_path, {"w0": signed_record(store, (other,))}, reporter=w0)
    (failure,) = result.failures
    assert failure.check == "push-signature" and f"pushed by {other.address}" in failure.message
    assert f"signed by {w0.address}" in failure.message


def test_an_unreported_participant_is_checked_by_its_push_signer(tmp_path: Path) -> None:
    ghost = WorkerKey.generate()
    store = ObjectStore(tmp_path / "store")
    result, checked = audit(tmp_path, {"w0": signed_record(store, (ghost,))}, reporter=None)
    assert result.failures == [] and checked == [ghost.address]  # handed to audit.signers by its key


def test_unsigned_mixed_forged_and_doubled_updates_fail_by_participant(tmp_path: Path) -> None:
    store = ObjectStore(tmp_path / "store")
    a, b = WorkerKey.generate(), WorkerKey.generate()
    forged_cid = signed_record(store, (a,))
    forged = parse_record(store.get(forged_cid))[0]
    bad = dataclasses.replace(forged, signature="00" * 64 + "1b")  # r = s = 0: recovers to nothing
    updates = {"unsigned": signed_record(store, (None,)), "mixed": signed_record(store, (a, b)),
               "forged": str(store.put(record_bytes([bad]), Codec.JSON)), "w0": forged_cid, "w1": forged_cid}
    result, _ = audit(tmp_path, updates, reporter=None)
    messages = {f.message.split("'")[0].removeprefix("participant "): f.message for f in result.failures}
    assert all(f.check == "push-signature" for f in result.failures)
    assert "keeps no push signature" in messages["unsigned"]
    assert "signed by 2 different keys" in messages["mixed"]
    assert "does not recover to a key" in messages["forged"]
    assert "is participant w0's too" in messages["w1"]
    assert "w0" not in messages
