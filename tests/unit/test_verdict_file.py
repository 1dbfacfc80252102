"""k-of-n verdict files (audit.verdict_file): read as hostile input, gathered into disputes only where
k distinct admitted auditors sign the same verdict; and the persistent auditor's directory
(audit.auditor). Pure logic: no chain."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from attestation import DevProvider, DevRoot, WorkerKey
from attestation.verdict import Verdict, disputes_domain
from audit.auditor import Auditor, AuditorCredentials, AuditorDirError
from audit.verdict_file import MAX_VERDICTS_FILE, VerdictFileError, gather, read_verdicts, write_verdicts
from storage_client import CID, Codec

CONFIG = str(CID(Codec.JSON, b"\x03" * 32))
DOMAIN = disputes_domain(31337, "0x" + "ab" * 20)
RUN = b"\x01" * 32
CHEAT = "0x" + "cd" * 20
COORDINATOR = "0x" + "ef" * 20


def verdict(round_: int = 1, party: str = CHEAT, check: str = "replay", evidence: bytes = b"\x02" * 32) -> Verdict:
    return Verdict(RUN, round_, party, check, evidence)


def signed_file(tmp_path: Path, key: WorkerKey, verdicts: list[Verdict], name: str | None = None) -> Path:
    path = tmp_path / (name or f"{key.address}.json")
    write_verdicts(path, DOMAIN, key.address, [(v, key.sign_digest(v.digest(DOMAIN))) for v in verdicts])
    return path


def test_a_written_file_reads_back_and_each_signature_is_its_auditors(tmp_path: Path) -> None:
    key = WorkerKey.generate()
    read = read_verdicts(signed_file(tmp_path, key, [verdict(1), verdict(2, COORDINATOR, "rederive")]))
    assert read.auditor == key.address and read.domain.to_eip712() == DOMAIN.to_eip712()
    assert [v for v, _ in read.signed] == [verdict(1), verdict(2, COORDINATOR, "rederive")]


@pytest.mark.parametrize("edit, says", [
    (lambda d: d.pop("auditor"), "not a dilocox.verdicts/v1 object"),
    (lambda d: d.update(schema="dilocox.verdicts/v9"), "not a dilocox.verdicts/v1 object"),
    (lambda d: d.update(extra=1), "not a dilocox.verdicts/v1 object"),
    (lambda d: d.update(chain_id=-1), "chain_id must be"),
    (lambda d: d.update(verdicts=[]), "verdicts must be a list of 1 to"),
    (lambda d: d["verdicts"][0]["verdict"].update(round=0), "round must be a uint64"),
    (lambda d: d["verdicts"][0]["verdict"].update(check_id="0x" + "00" * 32), "check_id is not keccak256"),
    (lambda d: d["verdicts"][0]["verdict"].update(party="x" * 5000), "party must be"),
    (lambda d: d["verdicts"][0].update(signature="0x1234"), "signature must be 0x and 65 bytes"),
    (lambda d: d["verdicts"][0]["verdict"].update(round=7), "is not 0x"),  # signed another verdict
    (lambda d: d.update(auditor="0x" + "11" * 20), "is not 0x"),  # another auditor's name on it
    (lambda d: d["verdicts"].append(d["verdicts"][0]), "listed twice"),
])
def test_a_malformed_file_is_refused_by_name(tmp_path: Path, edit, says: str) -> None:
    path = signed_file(tmp_path, WorkerKey.generate(), [verdict()])
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))
    with pytest.raises(VerdictFileError) as refused:
        read_verdicts(path)
    assert says in str(refused.value) and str(path) in str(refused.value)
    assert len(str(refused.value)) < 600  # never the input at length


def test_an_oversized_deep_or_missing_file_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (MAX_VERDICTS_FILE + 1))
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    for path, says in ((big, "more than"), (deep, "nests deeper"), (tmp_path / "none.json", "cannot be read"),
                       (tmp_path, "cannot be read")):
        with pytest.raises(VerdictFileError, match=says):
            read_verdicts(path)


def test_gather_sends_only_what_k_distinct_admitted_auditors_sign_alike(tmp_path: Path) -> None:
    a, b, c, outsider = (WorkerKey.generate() for _ in range(4))
    other = verdict(1, check="replay", evidence=b"\x09" * 32)  # round 1, same party, other evidence
    files = [read_verdicts(p) for p in (
        signed_file(tmp_path, a, [verdict(1), verdict(2)]),
        signed_file(tmp_path, b, [verdict(1), verdict(2), verdict(3, COORDINATOR, "rederive")]),
        signed_file(tmp_path, a, [verdict(1)], name="again.json"),  # a second file of a: dropped
        signed_file(tmp_path, outsider, [verdict(1)]),  # not admitted: dropped
        signed_file(tmp_path, c, [other, verdict(2)]),
    )]
    admitted = {a.address, b.address, c.address}
    found, lines = gather(files, DOMAIN, RUN, 2, admitted.__contains__)
    assert [(d.verdict, set(d.signers)) for d in found] == [(verdict(2), admitted)]
    assert len(found[0].signatures) == 3
    said = "\n".join(lines)
    assert "again.json" in said and "duplicate signer" in said
    assert f"{outsider.address} is not an auditor admitted" in said
    assert "round 1" in said and "the files disagree on the verdict" in said
    assert "round 3" in said and "signed by 1 admitted auditor(s), the run needs 2: not sent" in said
    assert len(lines) == 4

    elsewhere = disputes_domain(1, "0x" + "ab" * 20)  # the files were signed for chain 31337
    found, lines = gather(files[:1], elsewhere, RUN, 1, admitted.__contains__)
    assert found == [] and "not this chain's contract" in lines[0]
    found, lines = gather(files[:1], DOMAIN, b"\x07" * 32, 1, admitted.__contains__)
    assert found == [] and all("another run" in line for line in lines)


def test_a_persistent_auditor_is_attested_once_and_bound_to_its_run(tmp_path: Path) -> None:
    provider = DevProvider(DevRoot.load_or_create(tmp_path / "dev-root"))
    home = tmp_path / "auditor"
    first = Auditor.open(home, lambda: provider, RUN, CONFIG)
    assert stat.S_IMODE(os.stat(home / "auditor.key").st_mode) == 0o600
    again = Auditor.open(home, None, RUN, CONFIG)  # no provider needed: nothing to attest
    assert (again.address, again.nonce, again.evidence) == (first.address, first.nonce, first.evidence)
    public = AuditorCredentials.load(home)
    assert (public.address, public.run_id, public.config_cid) == (first.address, RUN, CONFIG)
    with pytest.raises(AuditorDirError, match="not of this one"):
        Auditor.open(home, lambda: provider, b"\x05" * 32, CONFIG)
    WorkerKey.generate().save(home / "auditor.key")
    with pytest.raises(AuditorDirError, match="is not the key of"):
        Auditor.open(home, lambda: provider, RUN, CONFIG)
    (home / "auditor.json").write_text("{" * 10_000)
    with pytest.raises(AuditorDirError, match="auditor.json"):
        AuditorCredentials.load(home)
    with pytest.raises(AuditorDirError, match="holds no auditor"):
        Auditor.open(tmp_path / "empty", None, RUN, CONFIG)
