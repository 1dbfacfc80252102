"""Tests for attestation: worker keys, evidence records, the dev provider, policy, measurement."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import pickle
import stat
import struct

import pytest
from eth_account import Account
from eth_utils import to_checksum_address

import attestation
from attestation import (
    DEV_WARNING,
    DevProvider,
    DevRoot,
    Evidence,
    EvidenceError,
    Policy,
    PolicyViolation,
    SignatureError,
    VerifiedEvidence,
    WorkerKey,
    attest,
    build_quote_v4,
    code_manifest,
    code_measurement,
    dev_quote_digest,
    open_provider,
    parse_quote,
    recover_address,
    report_data,
    verify_evidence,
)
from attestation.errors import AttestationError
from storage_client import CID, Codec

RUN = hashlib.sha256(b"genesis manifest").digest()
NONCE = hashlib.sha256(b"join nonce 1").digest()
CODE = hashlib.sha256(b"code").digest()
CONFIG_CID = str(CID.of(b'{"run":"test"}', Codec.JSON))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> DevRoot:
    return DevRoot.load_or_create(tmp_path_factory.mktemp("dev-root"))


@pytest.fixture(scope="module")
def provider(root) -> DevProvider:
    return DevProvider(root)


@pytest.fixture(scope="module")
def key() -> WorkerKey:
    return WorkerKey.generate()


@pytest.fixture
def dev_policy(root) -> Policy:
    return Policy(allow_dev=True, dev_roots=frozenset({root.address}))


# --- worker key and REPORTDATA ---------------------------------------------------------------


def test_report_data_layout(key):
    rd = report_data(key.address, RUN, NONCE, CODE)
    addr = bytes.fromhex(key.address[2:])
    assert len(rd) == 64
    assert rd[:32] == hashlib.sha256(b"dilocox/worker-key/v1" + addr + RUN + NONCE).digest()
    assert rd[32:] == CODE
    assert report_data(addr, RUN, NONCE, CODE) == rd  # 20 raw bytes or hex text
    assert report_data(key.address.lower(), RUN, NONCE, CODE) == rd
    assert key.report_data(RUN, NONCE, CODE) == rd


@pytest.mark.parametrize(
    "args",
    [
        ("0x1234", RUN, NONCE, CODE),
        (bytes(19), RUN, NONCE, CODE),
        (bytes(20), RUN[:31], NONCE, CODE),
        (bytes(20), RUN, NONCE + b"x", CODE),
        (bytes(20), RUN, NONCE, b""),
    ],
)
def test_report_data_refuses_wrong_sizes(args):
    with pytest.raises(ValueError):
        report_data(*args)


def test_worker_key_repr_hides_the_key(key):
    secret = key._key.hex()
    for text in (repr(key), str(key), f"{key}", repr([key])):
        assert secret not in text and secret.upper() not in text
        assert key.address in text
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(key)
    assert copy.deepcopy(key) is key
    assert not hasattr(key, "__dict__")  # nothing but the slots


def test_worker_keys_are_fresh_and_checksummed():
    a, b = WorkerKey.generate(), WorkerKey.generate()
    assert a.address != b.address
    assert a.address == Account.from_key(a._key).address  # EIP-55 checksummed


def test_sign_digest_recovers_to_address(key):
    digest = hashlib.sha256(b"a round report").digest()
    sig = key.sign_digest(digest)
    assert len(sig) == 65 and sig[64] in (27, 28)
    assert recover_address(digest, sig) == key.address
    # coincurve, independently of eth_keys
    coincurve = pytest.importorskip("coincurve")
    from eth_utils import keccak

    pub = coincurve.PublicKey.from_signature_and_message(
        sig[:64] + bytes([sig[64] - 27]), digest, hasher=None
    )
    assert "0x" + keccak(pub.format(compressed=False)[1:])[-20:].hex() == key.address.lower()
    assert recover_address(hashlib.sha256(b"other").digest(), sig) != key.address


def test_recover_address_refuses_malformed_and_malleable(key):
    digest = hashlib.sha256(b"x").digest()
    sig = key.sign_digest(digest)
    n = attestation.keys.SECP256K1_N
    r, s, v = sig[:32], int.from_bytes(sig[32:64], "big"), sig[64]
    high_s = r + (n - s).to_bytes(32, "big") + bytes([55 - v])  # same signer, malleable form
    with pytest.raises(SignatureError, match="high-s"):
        recover_address(digest, high_s)
    with pytest.raises(SignatureError, match="v is 1"):
        recover_address(digest, sig[:64] + b"\x01")
    with pytest.raises(SignatureError, match="65 bytes"):
        recover_address(digest, sig[:64])
    with pytest.raises(SignatureError, match="out of range"):
        recover_address(digest, bytes(64) + b"\x1b")


# --- evidence records ------------------------------------------------------------------------


def test_evidence_bytes_round_trip_and_digest(provider, key):
    ev = attest(provider, key, RUN, NONCE, CODE)
    data = ev.to_bytes()
    assert Evidence.from_bytes(data) == ev
    obj = json.loads(data)
    assert sorted(obj) == ["dev_signature", "provider", "quote", "schema"]
    assert obj["schema"] == "dilocox.evidence/v1" and obj["provider"] == "dev"
    assert bytes.fromhex(obj["quote"]) == ev.quote
    assert data == json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    assert ev.digest() == hashlib.sha256(data).digest()
    assert ev.cid() == CID.of(data, Codec.RAW)
    tdx = Evidence("tdx", build_quote_v4(report_data=bytes(64)))
    assert json.loads(tdx.to_bytes()).keys() == {"provider", "quote", "schema"}
    assert Evidence.from_bytes(tdx.to_bytes()) == tdx
    assert "PROVES NOTHING" in repr(ev)


def _dev_obj(provider, key) -> dict:
    return json.loads(attest(provider, key, RUN, NONCE, CODE).to_bytes())


def _dump(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda o: b"\xff\xfe", "not UTF-8"),
        (lambda o: b"", "not JSON"),
        (lambda o: b"[1,2]", "must be a JSON object"),
        (lambda o: _dump({**o, "schema": "dilocox.evidence/v2"}), "schema"),
        (lambda o: _dump({**o, "provider": "sev"}), "unknown evidence provider"),
        (lambda o: _dump({k: v for k, v in o.items() if k != "dev_signature"}), "wrong keys"),
        (lambda o: _dump({**o, "extra": 1}), "wrong keys"),
        (lambda o: _dump({**o, "quote": o["quote"].upper()}), "lowercase hex"),
        (lambda o: _dump({**o, "quote": o["quote"][:-1]}), "lowercase hex"),
        (lambda o: _dump({**o, "quote": 5}), "hex string"),
        (lambda o: _dump({**o, "quote": o["quote"][:-2]}), "TDX quote"),
        (lambda o: _dump({**o, "dev_signature": o["dev_signature"][:-2]}), "65-byte dev_signature"),
        (lambda o: json.dumps(o, sort_keys=True).encode(), "canonical form"),
        (lambda o: _dump(o) + b"\n", "canonical form"),
        (lambda o: _dump(o)[:-1] + b',"schema":"dilocox.evidence/v1"}', "repeats the key"),
        (lambda o: _dump({**o, "provider": "tdx"}), "wrong keys"),
    ],
)
def test_evidence_from_bytes_refuses_garbage(provider, key, mutate, needle):
    with pytest.raises(EvidenceError, match=needle):
        Evidence.from_bytes(mutate(_dev_obj(provider, key)))


def test_evidence_construction_checks_shape(provider, key):
    ev = attest(provider, key, RUN, NONCE, CODE)
    with pytest.raises(EvidenceError, match="unknown evidence provider"):
        Evidence("sgx", ev.quote)
    with pytest.raises(EvidenceError, match="needs a 65-byte dev_signature, got none"):
        Evidence("dev", ev.quote)
    with pytest.raises(EvidenceError, match="dev-provider quote"):
        Evidence("tdx", ev.quote)  # a dev quote cannot be relabelled as hardware evidence
    with pytest.raises(EvidenceError, match="must not carry a dev_signature"):
        Evidence("tdx", build_quote_v4(report_data=bytes(64)), dev_signature=bytes(65))
    with pytest.raises(EvidenceError, match="dev marker"):
        Evidence("dev", build_quote_v4(report_data=bytes(64)), dev_signature=ev.dev_signature)
    with pytest.raises(EvidenceError, match="TDX quote"):
        Evidence("tdx", b"\x04\x00")
    with pytest.raises(EvidenceError, match="must be bytes"):
        Evidence.from_bytes("text")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
        b'{"provider":"dev","quote":' + b"[" * 5_000 + b"]" * 5_000 + b',"schema":"dilocox.evidence/v1"}',
        b'{"schema":{"x":{"y":1}}}',
    ],
    ids=["deep-array", "deep-object", "nested-field", "three-levels"],
)
def test_evidence_from_bytes_refuses_nesting_with_evidence_error(data):
    """Deeply nested JSON once escaped as RecursionError; now every refusal is an EvidenceError."""
    with pytest.raises(EvidenceError, match="nests deeper than 2 levels"):
        Evidence.from_bytes(data)


def test_evidence_from_bytes_bounds_size_and_echo(provider, key):
    with pytest.raises(EvidenceError, match="more than"):
        Evidence.from_bytes(b" " * (attestation.evidence.MAX_EVIDENCE_BYTES + 1))
    obj = _dev_obj(provider, key)
    long = "x" * 10_000
    for data in (
        _dump({**obj, "schema": long}),
        _dump({**obj, "provider": long}),
        _dump({**obj, long: 1}),
        _dump(obj)[:-1] + f',"{long}":1,"{long}":2}}'.encode(),
    ):
        with pytest.raises(EvidenceError) as info:
            Evidence.from_bytes(data)
        assert len(str(info.value)) < 300 and "x" * 50 not in str(info.value)


def test_evidence_keeps_the_quote_without_padding():
    quote = build_quote_v4(report_data=bytes(range(64)))
    padded = Evidence("tdx", quote + bytes(70))
    assert padded.quote == quote and padded == Evidence("tdx", quote)
    assert Evidence.from_bytes(padded.to_bytes()) == padded
    obj = json.loads(padded.to_bytes())
    with pytest.raises(EvidenceError, match="70 bytes after its declared signature data"):
        Evidence.from_bytes(_dump({**obj, "quote": (quote + bytes(70)).hex()}))


# --- dev provider ----------------------------------------------------------------------------


def test_dev_quote_shape(provider, key):
    rd = report_data(key.address, RUN, NONCE, CODE)
    ev = provider.evidence(rd)
    q = parse_quote(ev.quote)
    assert q.tee_type == 0x81 and q.version == 4 and q.att_key_type == 2
    assert q.report_data == rd
    assert q.mrtd == CODE + bytes(16)
    assert q.rtmrs == (bytes(48),) * 4
    assert q.debug is False
    assert q.qe_vendor_id == b"dilocox-dev-only"
    assert q.signature_data == DEV_WARNING.encode()
    assert recover_address(dev_quote_digest(ev.quote), ev.dev_signature) == provider.root.address
    assert dev_quote_digest(ev.quote) == hashlib.sha256(b"dilocox/dev-quote/v1" + ev.quote).digest()


def test_dev_round_trip_verifies(provider, key, dev_policy):
    ev = attest(provider, key, RUN, NONCE, CODE)
    v = verify_evidence(
        Evidence.from_bytes(ev.to_bytes()),
        expected_report_data=report_data(key.address, RUN, NONCE, CODE),
        policy=dev_policy,
    )
    assert isinstance(v, VerifiedEvidence)
    assert v.provider == "dev"
    assert v.proves_nothing is True
    assert v.measurement == CODE  # the dev provider's allowlisted measurement is the code's
    assert v.report_data == report_data(key.address, RUN, NONCE, CODE)
    assert v.debug is False
    assert v.details["dev_root"] == provider.root.address
    assert v.details["mrtd"] == (CODE + bytes(16)).hex()
    assert v.details["rtmr0"] == "00" * 48
    assert v.warnings == (DEV_WARNING,)
    assert v.details["evidence"] == "DEV: PROVES NOTHING"
    assert v.label == "DEV evidence: PROVES NOTHING" and "DEV evidence: PROVES NOTHING" in repr(v)
    # bytes are accepted too
    same = verify_evidence(
        ev.to_bytes(), expected_report_data=v.report_data, policy=dev_policy
    )
    assert same.measurement == CODE


def test_accepting_dev_evidence_is_logged_as_dev(provider, key, dev_policy, caplog):
    ev = attest(provider, key, RUN, NONCE, CODE)
    with caplog.at_level(logging.INFO, logger="dilocox.attestation"):
        verify_evidence(ev, expected_report_data=report_data(key.address, RUN, NONCE, CODE), policy=dev_policy)
    accepted = [r for r in caplog.records if r.name == "dilocox.attestation"]
    assert len(accepted) == 1 and accepted[0].levelno == logging.WARNING
    assert "DEV" in accepted[0].getMessage() and "PROVES NOTHING" in accepted[0].getMessage()


def test_dev_says_it_proves_nothing(provider, root, caplog):
    assert "PROVES NOTHING" in DEV_WARNING
    assert attestation.dev.WARNING == DEV_WARNING
    assert "PROVES NOTHING" in repr(provider) and "PROVES NOTHING" in repr(root)
    assert provider.proves_nothing is True
    with caplog.at_level(logging.INFO, logger="dilocox"):
        DevProvider(root).evidence(bytes(64))
    assert caplog.records
    for record in caplog.records:
        assert "PROVES NOTHING" in record.getMessage()


def test_dev_refused_unless_policy_allows(provider, key, root):
    ev = attest(provider, key, RUN, NONCE, CODE)
    rd = report_data(key.address, RUN, NONCE, CODE)
    for policy in (Policy(), Policy(dev_roots=frozenset({root.address}))):
        with pytest.raises(PolicyViolation, match="PROVES NOTHING") as info:
            verify_evidence(ev, expected_report_data=rd, policy=policy)
        assert info.value.check == "provider" and "allow_dev=False" in str(info.value)
    with pytest.raises(PolicyViolation, match="trusts no dev roots"):
        verify_evidence(ev, expected_report_data=rd, policy=Policy(allow_dev=True))


def test_dev_refused_when_signed_by_another_root(provider, key, tmp_path):
    other = DevRoot.load_or_create(tmp_path / "other")
    assert other.address != provider.root.address
    ev = attest(provider, key, RUN, NONCE, CODE)
    rd = report_data(key.address, RUN, NONCE, CODE)
    with pytest.raises(PolicyViolation, match="not a trusted dev root") as info:
        verify_evidence(ev, expected_report_data=rd, policy=Policy.development(other.address))
    assert info.value.check == "signature"
    assert provider.root.address in str(info.value) and other.address in str(info.value)
    # and evidence from the other root is refused by a policy trusting only the first
    ev2 = attest(DevProvider(other), key, RUN, NONCE, CODE)
    with pytest.raises(PolicyViolation, match=other.address):
        verify_evidence(ev2, expected_report_data=rd, policy=Policy.development(provider.root.address))
    # trusting both accepts both; addresses in any case
    both = Policy.development(provider.root.address.lower(), other.address.upper().replace("0X", "0x"))
    for e in (ev, ev2):
        assert verify_evidence(e, expected_report_data=rd, policy=both).proves_nothing


@pytest.mark.parametrize(
    "offset",
    [30, 48 + 16, 48 + 120, 48 + 136, 48 + 328, 48 + 520, 48 + 583, 640],
    ids=["user_data", "mrseam", "td_attributes", "mrtd", "rtmr0", "report_data", "rd_end", "sig_data"],
)
def test_tampered_dev_quote_breaks_signature(provider, key, dev_policy, offset):
    ev = attest(provider, key, RUN, NONCE, CODE)
    quote = bytearray(ev.quote)
    quote[offset] ^= 0x01
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(
            Evidence("dev", bytes(quote), ev.dev_signature),
            expected_report_data=report_data(key.address, RUN, NONCE, CODE),
            policy=dev_policy,
        )
    assert info.value.check == "signature"
    assert "not a trusted dev root" in str(info.value)


@pytest.mark.parametrize(("offset", "needle"), [(0, "body type"), (1, "version"), (4, "TEE type"), (12, "dev marker")])
def test_tampered_dev_quote_header_refused_as_malformed(provider, key, offset, needle):
    ev = attest(provider, key, RUN, NONCE, CODE)
    quote = bytearray(ev.quote)
    quote[offset] ^= 0x01
    with pytest.raises(EvidenceError, match=needle):
        Evidence("dev", bytes(quote), ev.dev_signature)


def test_tampered_dev_signature_is_refused(provider, key, dev_policy):
    ev = attest(provider, key, RUN, NONCE, CODE)
    sig = bytearray(ev.dev_signature)
    sig[5] ^= 0xFF
    with pytest.raises(PolicyViolation) as info:
        verify_evidence(
            Evidence("dev", ev.quote, bytes(sig)),
            expected_report_data=report_data(key.address, RUN, NONCE, CODE),
            policy=dev_policy,
        )
    assert info.value.check == "signature"


def test_report_data_mismatch_refused(provider, key, dev_policy):
    ev = attest(provider, key, RUN, NONCE, CODE)
    other_key = WorkerKey.generate()
    cases = {
        "wrong nonce": report_data(key.address, RUN, hashlib.sha256(b"n2").digest(), CODE),
        "wrong address": report_data(other_key.address, RUN, NONCE, CODE),
        "wrong run": report_data(key.address, bytes(32), NONCE, CODE),
        "wrong code": report_data(key.address, RUN, NONCE, bytes(32)),
    }
    for why, expected in cases.items():
        with pytest.raises(PolicyViolation) as info:
            verify_evidence(ev, expected_report_data=expected, policy=dev_policy)
        assert info.value.check == "report_data", why
        text = str(info.value)
        assert expected.hex() in text and report_data(key.address, RUN, NONCE, CODE).hex() in text


def test_debug_dev_quote_refused_by_default(root, key, dev_policy):
    ev = attest(DevProvider(root, debug=True), key, RUN, NONCE, CODE)
    assert parse_quote(ev.quote).debug
    rd = report_data(key.address, RUN, NONCE, CODE)
    with pytest.raises(PolicyViolation, match="allow_debug=False") as info:
        verify_evidence(ev, expected_report_data=rd, policy=dev_policy)
    assert info.value.check == "debug"
    allowed = Policy.development(root.address, allow_debug=True)
    assert verify_evidence(ev, expected_report_data=rd, policy=allowed).debug is True


def test_measurement_allowlist(provider, key, root):
    ev = attest(provider, key, RUN, NONCE, CODE)
    rd = report_data(key.address, RUN, NONCE, CODE)
    ok = Policy.development(root.address, allowed_measurements=frozenset({CODE}))
    assert verify_evidence(ev, expected_report_data=rd, policy=ok).measurement == CODE
    bad = Policy.development(root.address, allowed_measurements=frozenset({bytes(32)}))
    with pytest.raises(PolicyViolation, match=f"measurement {CODE.hex()} is not") as info:
        verify_evidence(ev, expected_report_data=rd, policy=bad)
    assert info.value.check == "measurement"


def test_inconsistent_dev_quote_refused(root, key, dev_policy):
    """A dev root could sign anything; verification still insists on the dev layout."""
    rd = report_data(key.address, RUN, NONCE, CODE)
    quote = build_quote_v4(
        report_data=rd,
        mrtd=CODE + bytes(16),
        rtmrs=(bytes(48), bytes(48), bytes(48), b"\x01" * 48),
        qe_vendor_id=b"dilocox-dev-only",
        signature_data=b"x",
    )
    ev = Evidence("dev", quote, root.sign_quote(quote))
    with pytest.raises(PolicyViolation, match="RTMRs are not zero") as info:
        verify_evidence(ev, expected_report_data=rd, policy=dev_policy)
    assert info.value.check == "consistency"


def test_verify_refuses_garbage_bytes_as_format(dev_policy):
    with pytest.raises(PolicyViolation, match="not JSON") as info:
        verify_evidence(b"garbage", expected_report_data=bytes(64), policy=dev_policy)
    assert info.value.check == "format"
    with pytest.raises(ValueError, match="64 bytes"):
        verify_evidence(b"garbage", expected_report_data=bytes(32), policy=dev_policy)


def test_policy_normalises_and_checks():
    addr = "0x" + "ab" * 20
    p = Policy(dev_roots=frozenset({addr}), allowed_measurements=frozenset({bytes(32)}))
    assert p.dev_roots == frozenset({to_checksum_address(addr)})
    assert Policy().allow_dev is False and Policy().allow_debug is False
    assert Policy().dcap.allowed_tcb_statuses == frozenset({"UpToDate"})
    assert Policy().dcap.source is None  # no collateral: every TDX quote is refused
    with pytest.raises(ValueError, match="32 bytes"):
        Policy(allowed_measurements=frozenset({b"short"}))
    with pytest.raises(TypeError):
        Policy(dev_roots=addr)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Policy(dev_roots=frozenset({"0x1234"}))


# --- dev root storage ------------------------------------------------------------------------


def test_dev_root_is_created_once_with_private_mode(tmp_path):
    d = tmp_path / "roots"
    a = DevRoot.load_or_create(d)
    b = DevRoot.load_or_create(d)
    assert a.address == b.address
    key_file = d / "dev-root.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert (d / "dev-root.address").read_text().strip() == a.address
    secret = key_file.read_text().strip()
    assert len(bytes.fromhex(secret)) == 32
    assert secret not in repr(a)
    assert Account.from_key(bytes.fromhex(secret)).address == a.address
    with pytest.raises(TypeError):
        pickle.dumps(a)
    assert sorted(p.name for p in d.iterdir()) == ["dev-root.address", "dev-root.key"]


def test_dev_root_key_never_logged(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG):
        root = DevRoot.load_or_create(tmp_path / "r")
        DevProvider(root).evidence(bytes(64))
    secret = (tmp_path / "r" / "dev-root.key").read_text().strip()
    assert secret not in caplog.text


def test_dev_root_refuses_readable_key(tmp_path):
    DevRoot.load_or_create(tmp_path)
    os.chmod(tmp_path / "dev-root.key", 0o644)
    with pytest.raises(AttestationError, match="chmod 600"):
        DevRoot.load_or_create(tmp_path)
    os.chmod(tmp_path / "dev-root.key", 0o600)
    (tmp_path / "dev-root.key").write_text("nothex\n")
    with pytest.raises(AttestationError, match="not 32 bytes of hex"):
        DevRoot.load_or_create(tmp_path)


def test_open_provider(tmp_path):
    p = open_provider("dev", dev_root_dir=tmp_path / "r")
    assert isinstance(p, DevProvider) and p.name == "dev"
    with pytest.raises(ValueError, match="dev_root_dir"):
        open_provider("dev")
    with pytest.raises(ValueError, match="unknown attestation provider"):
        open_provider("sgx")


# --- code measurement ------------------------------------------------------------------------


def _tree(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__pycache__").mkdir()
    (pkg / "__init__.py").write_text("x = 1\n")
    (pkg / "sub" / "mod.py").write_text("y = 2\n")
    (pkg / "api.proto").write_text('syntax = "proto3";\n')
    (pkg / "api_pb2.py").write_text("generated\n")
    (pkg / "api_pb2_grpc.py").write_text("generated\n")
    (pkg / "notes.txt").write_text("not code\n")
    (pkg / "__pycache__" / "mod.cpython-311.py").write_text("cache\n")
    return pkg


def test_code_measurement_definition(tmp_path):
    pkg = _tree(tmp_path)
    manifest = code_manifest(CONFIG_CID, roots={"pkg": pkg})
    sha = lambda b: hashlib.sha256(b).hexdigest()
    assert manifest == {
        "code": {
            "pkg/__init__.py": sha(b"x = 1\n"),
            "pkg/api.proto": sha(b'syntax = "proto3";\n'),
            "pkg/sub/mod.py": sha(b"y = 2\n"),
        },
        "config": CONFIG_CID,
    }
    expected = hashlib.sha256(
        json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    ).digest()
    assert code_measurement(CONFIG_CID, roots={"pkg": pkg}) == expected


def test_code_measurement_changes_with_files_and_config(tmp_path):
    pkg = _tree(tmp_path)
    base = code_measurement(CONFIG_CID, roots={"pkg": pkg})
    assert code_measurement(CONFIG_CID, roots={"pkg": pkg}) == base  # deterministic
    other_cid = str(CID.of(b'{"run":"other"}', Codec.JSON))
    assert code_measurement(other_cid, roots={"pkg": pkg}) != base
    (pkg / "sub" / "mod.py").write_text("y = 3\n")
    changed = code_measurement(CONFIG_CID, roots={"pkg": pkg})
    assert changed != base
    (pkg / "sub" / "new.py").write_text("")
    assert code_measurement(CONFIG_CID, roots={"pkg": pkg}) != changed
    # excluded files do not count
    before = code_measurement(CONFIG_CID, roots={"pkg": pkg})
    (pkg / "api_pb2.py").write_text("regenerated\n")
    (pkg / "notes.txt").write_text("edited\n")
    (pkg / "__pycache__" / "x.py").write_text("z\n")
    assert code_measurement(CONFIG_CID, roots={"pkg": pkg}) == before
    # the package name is part of each path
    assert code_measurement(CONFIG_CID, roots={"pkh": pkg}) != before


def test_code_measurement_of_installed_packages():
    m = code_manifest(CONFIG_CID)
    paths = set(m["code"])
    assert "attestation/measurement.py" in paths
    assert "proto/dilocox.proto" in paths
    assert "trainer/worker/role.py" in paths and "storage_client/cid.py" in paths
    assert not any(p.endswith(("_pb2.py", "_pb2_grpc.py")) for p in paths)
    assert not any("__pycache__" in p for p in paths)
    assert len(code_measurement(CONFIG_CID)) == 32
    # a package that is not installed is skipped, not an error
    assert code_manifest(CONFIG_CID, packages=("no_such_package_xyz",))["code"] == {}


def test_code_measurement_refuses_bad_config_cid(tmp_path):
    with pytest.raises(ValueError, match="not a CID"):
        code_measurement("not-a-cid", roots={})
    with pytest.raises(TypeError):
        code_measurement(b"bytes", roots={})  # type: ignore[arg-type]
    with pytest.raises(FileNotFoundError):
        code_measurement(CONFIG_CID, roots={"pkg": tmp_path / "missing"})


def test_public_api_is_exported():
    for name in attestation.__all__:
        assert hasattr(attestation, name), name
    assert "TEE evidence providers and signed round reports" in attestation.__doc__


def test_header_offsets_of_dev_quote_independently(provider):
    """The dev quote's header, read with struct at the published offsets."""
    q = provider.quote(bytes(range(64)))
    version, key_type, tee = struct.unpack_from("<HHI", q, 0)
    assert (version, key_type, tee) == (4, 2, 0x81)
    assert q[48 + 520 : 48 + 584] == bytes(range(64))
    assert q[48 + 136 : 48 + 136 + 32] == bytes(range(32, 64))
    (sig_len,) = struct.unpack_from("<I", q, 632)
    assert len(q) == 636 + sig_len
