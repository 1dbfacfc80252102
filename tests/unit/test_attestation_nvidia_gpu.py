"""Tests for NVIDIA GPU evidence (attestation.nvidia_gpu, attestation.nvidia_gpu_verifier).

NVIDIA's own samples (tests/data/nvidia, README there) are accepted with their nonces and chains at a
time inside the chain's validity; every refusal is one row of REFUSALS. Variants that need a valid
signature over altered fields (debug mode, CC mode off, a measurement, ...) are re-signed with a test
P-384 chain made here, whose root the test pins (NVIDIA's signature cannot be forged).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import re
import struct
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID

from attestation import (
    MAX_GPU_CHAIN_BYTES,
    MAX_GPU_CHAIN_CERTS,
    MAX_GPU_REPORT_BYTES,
    DevRoot,
    DevProvider,
    Evidence,
    EvidenceError,
    GpuEvidence,
    GpuPolicy,
    NvidiaGpuVerifier,
    Policy,
    PolicyViolation,
    Rim,
    WorkerKey,
    attest,
    chain_from_pem,
    key_binding,
    nvidia_device_root,
    parse_report,
    report_data,
    report_from_hex,
    verify_evidence,
)
from attestation.nvidia_gpu import MeasurementBlock, split_chain
from attestation.nvidia_gpu_verifier import NVIDIA_DEVICE_ROOT, certificate_fwid
from attestation.policy import GPU_NOT_VERIFIED

DATA = Path(__file__).resolve().parent.parent / "data" / "nvidia"
HOPPER_NONCE = bytes.fromhex("931d8dd0add203ac3d8b4fbde75e115278eefcdceac5b87671a748f32364dfcb")
OLD_NONCE = bytes.fromhex("4cff7f5380ead8fad8ec2c531c110aca4302a88f603792801a8ca29ee151af2e")
DRIVER_RIM_SHA256 = "1b939fae0138ceda87c434820e1e118739861b070c0043677a68807049eae668"
VBIOS_RIM_SHA256 = "3f9877de674d57ead7095bf3d32f8aa3fb1881d524bf4c7e5cf504fcac47c6bf"
NOW = int(datetime(2025, 6, 1, tzinfo=timezone.utc).timestamp())  # inside every chain's window
BEFORE = int(datetime(2019, 1, 1, tzinfo=timezone.utc).timestamp())  # before the NVIDIA leaf's notBefore
RUN = hashlib.sha256(b"genesis manifest").digest()
JOIN_NONCE = hashlib.sha256(b"join nonce 1").digest()
CODE = hashlib.sha256(b"code").digest()
SHA384_OID = bytes.fromhex("0609608648016503040202")

VERIFIER = NvidiaGpuVerifier()


# --- NVIDIA's samples ---------------------------------------------------------------------------


def _hopper() -> GpuEvidence:
    return GpuEvidence(report_from_hex((DATA / "hopperAttestationReport.txt").read_text()),
                       chain_from_pem((DATA / "hopperCertChain.txt").read_bytes()))


def _old() -> GpuEvidence:
    return GpuEvidence(report_from_hex((DATA / "attestationReport.txt").read_text()),
                       chain_from_pem((DATA / "gpuAkCertChain.txt").read_bytes()))


def _rims() -> tuple[Rim, Rim]:
    return (Rim.load(DATA / "Driver_RIM_test_no_gpu.swidtag", source="driver", sha256=DRIVER_RIM_SHA256),
            Rim.load(DATA / "1010_0200_882_96005E0001_test_no_gpu.swidtag", source="vbios", sha256=VBIOS_RIM_SHA256))


def _pinned_digests(evidence: GpuEvidence, **kwargs) -> GpuPolicy:
    """A digest set pinned from the report itself (nvtrust has no RIMs for the Hopper sample)."""
    return GpuPolicy.from_digests({b.index - 1: [b.value] for b in evidence.parsed().blocks}, **kwargs)


HOPPER = _hopper()
OLD = _old()
HOPPER_POLICY = _pinned_digests(HOPPER)
RIM_POLICY = GpuPolicy.from_rims(*_rims())


def test_nvidia_hopper_sample_is_accepted_with_its_nonce_and_chain():
    claim = VERIFIER.verify(HOPPER, expected_nonce=HOPPER_NONCE, policy=HOPPER_POLICY, now=NOW)
    assert claim.hwmodel == "GH100 A01 GSP BROM"
    assert (claim.driver_version, claim.vbios_version) == ("550.90.07", "96.00.9f.00.01")
    assert claim.matched == 63  # 64 blocks; index 35 (NVDEC0, disabled in this report) is skipped
    assert claim.mode == "CC (unstated)"
    assert claim.details()["gpu_hwmodel"] == "GH100 A01 GSP BROM"
    report = HOPPER.parsed()
    assert report.nonce == HOPPER_NONCE and report.spdm_version == 0x11
    assert len(HOPPER.report) == 4117 and len(HOPPER.cert_chain) == 3360 and len(HOPPER.certificates()) == 5
    assert certificate_fwid(x509.load_der_x509_certificate(HOPPER.certificates()[0])) == report.fwid


def test_nvidia_earlier_sample_matches_nvidias_own_rims():
    driver, vbios = _rims()
    assert (driver.version, vbios.version) == ("545.00", "96.00.5e.00.01")
    assert (len(driver.measurements), len(vbios.measurements)) == (21, 12)
    policy = GpuPolicy.from_rim_files(DATA / "Driver_RIM_test_no_gpu.swidtag",
                                      DATA / "1010_0200_882_96005E0001_test_no_gpu.swidtag",
                                      driver_sha256=DRIVER_RIM_SHA256, vbios_sha256=VBIOS_RIM_SHA256)
    claim = VERIFIER.verify(OLD, expected_nonce=OLD_NONCE, policy=policy, now=NOW)
    assert claim.matched == 32  # 33 active golden measurements, index 35 skipped (NVDEC0 disabled)
    assert OLD.parsed().fwid is None  # the earlier firmware reported no FWID


def test_report_encodes_back_to_its_bytes_and_its_vbios_version_reads_as_nvidias():
    for evidence in (HOPPER, OLD):
        report = evidence.parsed()
        assert report.encode() == evidence.report
    assert HOPPER.parsed().vbios_version == "96.00.9f.00.01"  # NVIDIA's nvmlHandlerTest says the same


def test_pinned_nvidia_root_is_the_file_and_its_digest():
    der = nvidia_device_root()
    assert hashlib.sha256(der).hexdigest() == "102bf659d5419614c9d8e6aecebc80454eb26b1df6a769ac720b9a690b167b48"
    assert HOPPER.certificates()[-1] == der == OLD.certificates()[-1]
    assert HOPPER_POLICY.roots == frozenset({der})
    assert NVIDIA_DEVICE_ROOT.parent.name == "roots"


def test_rim_pinned_by_digest_refuses_another_file(tmp_path):
    other = tmp_path / "rim.swidtag"
    other.write_bytes((DATA / "Driver_RIM_test_no_gpu.swidtag").read_bytes().replace(b"545.00", b"545.01"))
    with pytest.raises(EvidenceError, match="pinned sha256"):
        Rim.load(other, source="driver", sha256=DRIVER_RIM_SHA256)


# --- a test chain and re-signed reports ---------------------------------------------------------


def _fwid_extension(fwid: bytes) -> x509.UnrecognizedExtension:
    inner = SHA384_OID + b"\x04\x30" + fwid
    fwid_seq = b"\x30" + bytes([len(inner)]) + inner
    tagged = b"\xa6" + bytes([len(fwid_seq)]) + fwid_seq
    return x509.UnrecognizedExtension(x509.ObjectIdentifier("2.23.133.5.4.1"), b"\x30" + bytes([len(tagged)]) + tagged)


def _cert(name: str, key, issuer_name: str, issuer_key, *, ca: bool, fwid: bytes | None = None,
          not_after: datetime | None = None) -> x509.Certificate:
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer_name)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(not_after or start + timedelta(days=3650)))
    if ca:
        builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
    if fwid is not None:
        builder = builder.add_extension(_fwid_extension(fwid), critical=False)
    return builder.sign(issuer_key, hashes.SHA384())


@dataclasses.dataclass
class SigningChain:
    leaf_key: ec.EllipticCurvePrivateKey
    certs: list[x509.Certificate]
    fwid: bytes

    @property
    def der(self) -> bytes:
        return b"".join(c.public_bytes(Encoding.DER) for c in self.certs)

    @property
    def root(self) -> bytes:
        return self.certs[-1].public_bytes(Encoding.DER)


def _test_chain(*, ca_intermediate: bool = True, leaf_curve: ec.EllipticCurve | None = None) -> SigningChain:
    root_key, ica_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    leaf_key = ec.generate_private_key(leaf_curve or ec.SECP384R1())
    fwid = hashlib.sha384(b"test firmware").digest()
    root = _cert("Test Device Identity CA", root_key, "Test Device Identity CA", root_key, ca=True)
    ica = _cert("Test GPU BROM", ica_key, "Test Device Identity CA", root_key, ca=ca_intermediate)
    leaf = _cert("Test GPU FMC LF", leaf_key, "Test GPU BROM", ica_key, ca=False, fwid=fwid)
    return SigningChain(leaf_key, [leaf, ica, root], fwid)


CHAIN = _test_chain()


def _sign(report, key: ec.EllipticCurvePrivateKey) -> bytes:
    """`report` (a GpuReport, fields possibly replaced) encoded and signed by `key`."""
    unsigned = dataclasses.replace(report, signature=bytes(96)).encode()[:-96]
    r, s = decode_dss_signature(key.sign(unsigned, ec.ECDSA(hashes.SHA384())))
    return unsigned + r.to_bytes(48, "big") + s.to_bytes(48, "big")


def _base(nonce: bytes = OLD_NONCE, chain: SigningChain = CHAIN):
    """NVIDIA's earlier sample (measurements matching NVIDIA's RIMs) with this chain's FWID added."""
    report = OLD.parsed()
    return dataclasses.replace(report, nonce=nonce, opaque=report.opaque + ((20, chain.fwid),))


def _resigned(chain: SigningChain = CHAIN, **changes) -> GpuEvidence:
    return GpuEvidence(_sign(dataclasses.replace(_base(chain=chain), **changes), chain.leaf_key), chain.der)


TEST_POLICY = GpuPolicy.from_rims(*_rims(), roots=frozenset({CHAIN.root}))


def test_resigned_base_is_accepted_against_nvidias_rims_and_the_test_root():
    claim = VERIFIER.verify(_resigned(), expected_nonce=OLD_NONCE, policy=TEST_POLICY, now=NOW)
    assert claim.matched == 32 and claim.hwmodel == "Test GPU BROM"


def test_stated_cc_modes_and_a_clean_device_mode_block_are_accepted():
    for flag in (0, 1):  # SPT, MPT
        ev = _resigned(opaque=_base().opaque + ((36, bytes([flag, 0, 0, 0])),))
        assert VERIFIER.verify(ev, expected_nonce=OLD_NONCE, policy=TEST_POLICY, now=NOW).mode in ("SPT", "MPT")
    mode = struct.pack("<IIII", 0x3F, 0x04, 0x1F, 0x10)  # normal mode; debug active once since manufacture only
    ev = _resigned(blocks=_base().blocks + (MeasurementBlock(0xF0, 0x85, mode),))
    VERIFIER.verify(ev, expected_nonce=OLD_NONCE, policy=TEST_POLICY, now=NOW)


# --- refusals: one row each -----------------------------------------------------------------------


def _flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1:]


def _hopper_with(report: bytes | None = None, chain: bytes | None = None) -> GpuEvidence:
    return GpuEvidence(HOPPER.report if report is None else report, HOPPER.cert_chain if chain is None else chain)


def _verify(evidence: Callable[[], GpuEvidence], *, nonce: bytes = HOPPER_NONCE, policy: GpuPolicy | None = None,
            now: int = NOW) -> Callable[[], object]:
    return lambda: VERIFIER.verify(evidence(), expected_nonce=nonce, policy=policy or HOPPER_POLICY, now=now)


def _test(evidence: Callable[[], GpuEvidence], **kwargs) -> Callable[[], object]:
    return _verify(evidence, nonce=OLD_NONCE, policy=TEST_POLICY, **kwargs)


HOPPER_CERTS = list(HOPPER.certificates())
OLD_CERTS = list(OLD.certificates())
RECORD_START = 37 + 8  # request, then the response header up to the record
OPAQUE_START = RECORD_START + 3520 + 32 + 2
SIG_START = len(HOPPER.report) - 96


def _device_mode(state: int, operational: int = 0x04) -> tuple[MeasurementBlock, ...]:
    return _base().blocks + (MeasurementBlock(0xF0, 0x85, struct.pack("<IIII", 0x3F, operational, 0x1F, state)),)


def _other_block_value():
    blocks = list(_base().blocks)
    blocks[9] = MeasurementBlock(blocks[9].index, blocks[9].value_type, bytes(48))  # block 10: VBIOS RIM index 9
    return tuple(blocks)


def _record(evidence_json: dict) -> bytes:
    return json.dumps(evidence_json, sort_keys=True, separators=(",", ":")).encode()


def _dev_record_with(gpu_fields: dict) -> Callable[[], object]:
    def run() -> object:
        key = WorkerKey.generate()
        ev = attest(DevProvider(DevRoot(hashlib.sha256(b"root").digest())), key, RUN, JOIN_NONCE, CODE)
        obj = json.loads(ev.to_bytes())
        obj.update(gpu_fields)
        return Evidence.from_bytes(_record(obj))
    return run


# (id, action, exception, the check or words the refusal names)
REFUSALS: list[tuple[str, Callable[[], object], type[Exception], str]] = [
    ("signature byte flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, SIG_START + 5))), PolicyViolation, "gpu.signature"),
    ("measurement byte flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, RECORD_START + 20))), PolicyViolation, "gpu.signature"),
    ("request nonce byte flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, 10))), PolicyViolation, "gpu.signature"),
    ("opaque data byte flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, OPAQUE_START + 6))), PolicyViolation, "gpu.signature"),
    ("request Param1 flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, 2))), PolicyViolation, "gpu.signature"),
    ("response header Param1 flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, 39))), PolicyViolation, "gpu.signature"),
    ("responder nonce byte flipped", _verify(lambda: _hopper_with(_flip(HOPPER.report, OPAQUE_START - 10))), PolicyViolation, "gpu.signature"),
    ("wrong expected nonce", _verify(lambda: HOPPER, nonce=OLD_NONCE), PolicyViolation, "gpu.nonce"),
    ("nonce re-signed but not the expected one", _test(lambda: _resigned(nonce=bytes(32))), PolicyViolation, "gpu.nonce"),
    ("wrong root pinned", _verify(lambda: HOPPER, policy=_pinned_digests(HOPPER, roots=frozenset({CHAIN.root}))), PolicyViolation, "gpu.chain"),
    ("chain signed by an unpinned root", _verify(lambda: _resigned()), PolicyViolation, "gpu.chain"),
    ("chain missing a certificate", _verify(lambda: _hopper_with(chain=b"".join(HOPPER_CERTS[:2] + HOPPER_CERTS[3:]))), PolicyViolation, "gpu.chain"),
    ("chain of the root alone", _verify(lambda: _hopper_with(chain=HOPPER_CERTS[-1])), PolicyViolation, "gpu.chain"),
    ("chain truncated", _verify(lambda: _hopper_with(chain=HOPPER.cert_chain[:-100])), EvidenceError, "truncated"),
    ("chain reordered", _verify(lambda: _hopper_with(chain=b"".join([HOPPER_CERTS[0], HOPPER_CERTS[2], HOPPER_CERTS[1]] + HOPPER_CERTS[3:]))), PolicyViolation, "gpu.chain"),
    ("chain with an extra certificate", _verify(lambda: _hopper_with(chain=HOPPER.cert_chain + CHAIN.root)), PolicyViolation, "gpu.chain"),
    ("chain over the count bound", _verify(lambda: _hopper_with(chain=HOPPER_CERTS[0] * (MAX_GPU_CHAIN_CERTS + 1))), EvidenceError, f"more than {MAX_GPU_CHAIN_CERTS}"),
    ("chain over the byte bound", _verify(lambda: _hopper_with(chain=HOPPER.cert_chain * 5)), EvidenceError, f"limit is {MAX_GPU_CHAIN_BYTES}"),
    ("chain not DER", _verify(lambda: _hopper_with(chain=b"\x31" + HOPPER.cert_chain[1:])), EvidenceError, "DER SEQUENCE"),
    ("leaf certificate swapped", _verify(lambda: _hopper_with(chain=b"".join(OLD_CERTS[:1] + HOPPER_CERTS[1:]))), PolicyViolation, "gpu.chain"),
    ("leaf and its issuer from another GPU", _verify(lambda: _hopper_with(chain=OLD.cert_chain)), PolicyViolation, "gpu.signature"),
    ("leaf certificate on the revoked list", _verify(lambda: HOPPER, policy=_pinned_digests(HOPPER, revoked=frozenset({hashlib.sha256(HOPPER_CERTS[0]).digest()}))), PolicyViolation, "revoked"),
    ("time before the chain's validity", _verify(lambda: HOPPER, now=BEFORE), PolicyViolation, "gpu.chain"),
    ("time after a test certificate expired", _test(lambda: _resigned(), now=int(datetime(2040, 1, 1, tzinfo=timezone.utc).timestamp())), PolicyViolation, "gpu.chain"),
    ("issuer that is not a CA", _verify(lambda: _resigned(_test_chain(ca_intermediate=False)), nonce=OLD_NONCE, policy=None), PolicyViolation, "gpu.chain"),
    ("leaf key not P-384", lambda: VERIFIER.verify(GpuEvidence(HOPPER.report, (c := _test_chain(leaf_curve=ec.SECP256R1())).der), expected_nonce=HOPPER_NONCE, policy=_pinned_digests(HOPPER, roots=frozenset({c.root})), now=NOW), PolicyViolation, "P-384"),
    ("debug mode on (device-mode block)", _test(lambda: _resigned(blocks=_device_mode(0x02))), PolicyViolation, "gpu.debug"),
    ("debug mode active since reset", _test(lambda: _resigned(blocks=_device_mode(0x08))), PolicyViolation, "gpu.debug"),
    ("not in normal operational mode", _test(lambda: _resigned(blocks=_device_mode(0x00, operational=0x02))), PolicyViolation, "gpu.debug"),
    ("CC mode off (feature flag PPCIE)", _test(lambda: _resigned(opaque=_base().opaque + ((36, bytes([2, 0, 0, 0])),))), PolicyViolation, "gpu.mode"),
    ("measurement re-signed to another value (RIM mismatch)", _test(lambda: _resigned(blocks=_other_block_value())), PolicyViolation, "gpu.measurement"),
    ("RIM mismatch: NVIDIA's RIMs against the Hopper sample", _verify(lambda: HOPPER, policy=RIM_POLICY), PolicyViolation, "gpu.rim"),
    ("RIM mismatch: measurements alone", _verify(lambda: HOPPER, policy=GpuPolicy(golden=RIM_POLICY.golden)), PolicyViolation, "gpu.measurement"),
    ("golden index the report does not carry", _test(lambda: _resigned(blocks=_base().blocks[1:])), PolicyViolation, "does not carry"),
    ("unknown (reserved) measurement index", _test(lambda: _resigned(blocks=_base().blocks + (MeasurementBlock(0xFF, 1, bytes(48)),))), EvidenceError, "reserved"),
    ("repeated measurement index", _test(lambda: _resigned(blocks=_base().blocks + _base().blocks[:1])), EvidenceError, "repeated"),
    ("driver version not the RIM's", _test(lambda: _resigned(opaque=tuple((t, b"545.01\x00" if t == 3 else v) for t, v in _base().opaque))), PolicyViolation, "gpu.rim"),
    ("NVDEC0 status neither enabled nor disabled", _test(lambda: _resigned(opaque=tuple((t, b"\x00" if t == 11 else v) for t, v in _base().opaque))), PolicyViolation, "NVDEC0"),
    ("FWID not the leaf certificate's", _test(lambda: _resigned(opaque=_base().opaque[:-1] + ((20, bytes(48)),))), PolicyViolation, "gpu.fwid"),
    ("request for one block only", _test(lambda: _resigned(request_param2=1)), PolicyViolation, "gpu.request"),
    ("response for another slot", _test(lambda: _resigned(response_param2=3)), PolicyViolation, "gpu.request"),
    ("truncated report", _verify(lambda: _hopper_with(HOPPER.report[:-1])), EvidenceError, "signature needs 96 bytes"),
    ("report cut inside the record", _verify(lambda: _hopper_with(HOPPER.report[:1000])), EvidenceError, "MeasurementRecord"),
    ("bytes after the signature", _verify(lambda: _hopper_with(HOPPER.report + b"\x00")), EvidenceError, "follow the 96-byte signature"),
    ("oversized report", _verify(lambda: _hopper_with(HOPPER.report * 8)), EvidenceError, f"limit is {MAX_GPU_REPORT_BYTES}"),
    ("garbage bytes", _verify(lambda: _hopper_with(bytes(range(256)) * 4)), EvidenceError, "SPDM version"),
    ("not a GET_MEASUREMENTS request", _verify(lambda: _hopper_with(b"\x11\x81" + HOPPER.report[2:])), EvidenceError, "request code"),
    ("NumberOfBlocks disagrees with the record", _verify(lambda: _hopper_with(HOPPER.report[:41] + b"\x3f" + HOPPER.report[42:])), EvidenceError, "NumberOfBlocks"),
    ("opaque length past the end", _verify(lambda: _hopper_with(HOPPER.report[:OPAQUE_START - 2] + b"\xff\x7f" + HOPPER.report[OPAQUE_START:])), EvidenceError, "OpaqueData"),
    ("repeated opaque field", _test(lambda: _resigned(opaque=_base().opaque + _base().opaque[:1])), EvidenceError, "repeated"),
    ("wrong hex (report text)", lambda: report_from_hex("zz" + (DATA / "hopperAttestationReport.txt").read_text()[2:]), EvidenceError, "not hex"),
    ("wrong hex (evidence record)", _dev_record_with({"gpu_report": "0g" * 10, "gpu_cert_chain": HOPPER.cert_chain.hex()}), EvidenceError, "not lowercase hex"),
    ("record gpu_report over its bound, refused before decoding", _dev_record_with({"gpu_report": "ab" * (MAX_GPU_REPORT_BYTES + 1), "gpu_cert_chain": HOPPER.cert_chain.hex()}), EvidenceError, f"limit is {MAX_GPU_REPORT_BYTES}"),
    ("record gpu_cert_chain over its bound", _dev_record_with({"gpu_report": HOPPER.report.hex(), "gpu_cert_chain": "ab" * (MAX_GPU_CHAIN_BYTES + 1)}), EvidenceError, f"limit is {MAX_GPU_CHAIN_BYTES}"),
    ("record with a report but no chain", _dev_record_with({"gpu_report": HOPPER.report.hex()}), EvidenceError, "needs both"),
]


def _hex_runs(text: str) -> list[str]:
    return re.findall(r"[0-9a-fA-F]{16,}", text)


INPUT_HEX = (HOPPER.report.hex() + HOPPER.cert_chain.hex() + OLD.report.hex() + OLD.cert_chain.hex()
             + CHAIN.der.hex() + _base().encode().hex())


@pytest.mark.parametrize("action, exception, names", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_refusal(action, exception, names):
    with pytest.raises(exception) as info:
        action()
    message = str(info.value)
    assert names in message, message
    assert len(message) <= 200, message
    assert not any(run.lower() in INPUT_HEX for run in _hex_runs(message)), message
    if isinstance(info.value, PolicyViolation):
        assert info.value.check.startswith("gpu")


def test_there_are_at_least_twenty_refusals_and_each_is_named_once():
    ids = [r[0] for r in REFUSALS]
    assert len(ids) >= 20 and len(set(ids)) == len(ids)


def test_policy_needs_golden_measurements_and_refuses_index_conflicts():
    with pytest.raises(ValueError, match="golden"):
        GpuPolicy(golden=())
    driver, vbios = _rims()
    with pytest.raises(ValueError, match="twice"):
        GpuPolicy.from_rims(driver, driver)


# --- GPU evidence beside the quote: the record and the policy -------------------------------------


@pytest.fixture(scope="module")
def dev_root(tmp_path_factory) -> DevRoot:
    return DevRoot.load_or_create(tmp_path_factory.mktemp("dev-root"))


def _dev_evidence(root: DevRoot, key: WorkerKey, gpu: GpuEvidence | None) -> Evidence:
    ev = attest(DevProvider(root), key, RUN, JOIN_NONCE, CODE)
    return dataclasses.replace(ev, gpu=gpu)


def _bound_gpu(key: WorkerKey, run: bytes = RUN) -> GpuEvidence:
    """GPU evidence whose nonce is the worker's binding, REPORTDATA[0:32]."""
    return GpuEvidence(_sign(_base(nonce=key_binding(key.address, run, JOIN_NONCE)), CHAIN.leaf_key), CHAIN.der)


def test_record_without_gpu_evidence_keeps_its_bytes(dev_root):
    key = WorkerKey.generate()
    ev = attest(DevProvider(dev_root), key, RUN, JOIN_NONCE, CODE)
    obj = json.loads(ev.to_bytes())
    assert set(obj) == {"schema", "provider", "quote", "dev_signature"}
    assert dataclasses.replace(ev, gpu=None).to_bytes() == ev.to_bytes()


def test_record_with_gpu_evidence_round_trips(dev_root):
    key = WorkerKey.generate()
    ev = _dev_evidence(dev_root, key, _bound_gpu(key))
    data = ev.to_bytes()
    assert {"gpu_report", "gpu_cert_chain"} <= set(json.loads(data))
    back = Evidence.from_bytes(data)
    assert back == ev and back.to_bytes() == data and back.digest() == ev.digest()
    assert "gpu=" in repr(back)


def test_policy_with_gpu_requires_and_verifies_gpu_evidence(dev_root, caplog):
    caplog.set_level(logging.INFO, logger="dilocox.attestation")
    key = WorkerKey.generate()
    expected = report_data(key.address, RUN, JOIN_NONCE, CODE)
    policy = Policy.development(dev_root.address, gpu=TEST_POLICY)
    claim = verify_evidence(_dev_evidence(dev_root, key, _bound_gpu(key)), expected_report_data=expected,
                            policy=policy, now=NOW)
    assert claim.gpu is not None and claim.gpu.matched == 32
    assert claim.details["gpu_driver_version"] == "545.00"
    assert "accepted NVIDIA GPU evidence" in caplog.text
    with pytest.raises(PolicyViolation, match="requires GPU evidence") as info:
        verify_evidence(_dev_evidence(dev_root, key, None), expected_report_data=expected, policy=policy, now=NOW)
    assert info.value.check == "gpu"
    with pytest.raises(PolicyViolation) as info:  # bound to another run
        verify_evidence(_dev_evidence(dev_root, key, _bound_gpu(key, run=bytes(32))),
                        expected_report_data=expected, policy=policy, now=NOW)
    assert info.value.check == "gpu.nonce"
    with pytest.raises(PolicyViolation) as info:  # from bytes: the record is parsed first
        verify_evidence(_dev_evidence(dev_root, key, _bound_gpu(key)).to_bytes(), expected_report_data=expected,
                        policy=policy, now=BEFORE)
    assert info.value.check == "gpu.chain"


def test_policy_without_gpu_says_gpu_evidence_was_not_verified(dev_root):
    key = WorkerKey.generate()
    expected = report_data(key.address, RUN, JOIN_NONCE, CODE)
    claim = verify_evidence(_dev_evidence(dev_root, key, _bound_gpu(key)), expected_report_data=expected,
                            policy=Policy.development(dev_root.address), now=NOW)
    assert claim.gpu is None and GPU_NOT_VERIFIED in claim.warnings


def test_split_chain_and_pem_agree():
    assert split_chain(HOPPER.cert_chain) == tuple(HOPPER_CERTS)
    assert parse_report(HOPPER.report) == HOPPER.parsed()


# --- interoperability with NVIDIA's own parser (only where nv-local-gpu-verifier is installed) ---


def test_nvidias_parser_agrees_on_the_sample(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its config module writes verifier.log into the working directory
    spdm = pytest.importorskip("verifier.attestation.spdm_msrt_resp_msg")
    req = pytest.importorskip("verifier.attestation.spdm_msrt_req_msg")
    config = pytest.importorskip("verifier.config")
    ours = HOPPER.parsed()
    theirs = spdm.SpdmMeasurementResponseMessage(HOPPER.report[37:], config.HopperSettings())
    request = req.SpdmMeasurementRequestMessage(HOPPER.report[:37])
    assert request.get_nonce() == ours.nonce
    assert theirs.get_nonce() == ours.responder_nonce
    assert theirs.get_signature() == ours.signature
    assert theirs.get_measurement_record().get_measurements() == [b.value.hex() for b in ours.blocks]
    opaque = theirs.get_opaque_data()
    assert opaque.get_data("OPAQUE_FIELD_ID_DRIVER_VERSION") == ours.opaque_field(3)
    assert opaque.get_data("OPAQUE_FIELD_ID_FWID") == ours.fwid
