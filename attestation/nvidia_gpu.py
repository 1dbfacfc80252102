"""NVIDIA confidential-computing GPU evidence (Hopper H100/H200, Blackwell B200): the bytes, bounded
and parsed. What they prove is attestation.nvidia_gpu_verifier's; this module reads and checks form only.

A GPU in CC mode answers an SPDM GET_MEASUREMENTS request with a response signed by its device
attestation key; NVML hands the guest both messages back to back (the "attestation report") and the
key's certificate chain. The report, as DMTF DSP0274 (SPDM 1.1/1.2) lays it out, little-endian:

    request   (37 bytes)  SPDMVersion(1) RequestResponseCode(1)=0xE0 Param1(1) Param2(1)
                          Nonce(32) SlotIDParam(1)
    response              SPDMVersion(1) RequestResponseCode(1)=0x60 Param1(1) Param2(1)
                          NumberOfBlocks(1) MeasurementRecordLength(3) MeasurementRecord
                          Nonce(32, the responder's) OpaqueLength(2) OpaqueData Signature(96)
    block                 Index(1) MeasurementSpecification(1)=1 (DMTF) MeasurementSize(2)
                          DMTFSpecMeasurementValueType(1) DMTFSpecMeasurementValueSize(2) Value
    opaque data           a run of DataType(2) DataSize(2) Data fields (NVIDIA's ids: 3 driver
                          version, 6 VBIOS version, 11 NVDEC0 status, 20 FWID, 36 feature flag, ...)

The signature (ECDSA P-384 over SHA-384, r || s) covers request || response up to the signature.
The request's nonce is the requester's: the verifier's binding of worker key, run and join nonce.

Everything here reads untrusted bytes: sizes are bounded before anything is parsed
(MAX_GPU_REPORT_BYTES, MAX_GPU_CHAIN_BYTES, MAX_GPU_CHAIN_CERTS), every length is checked against
what is left, nothing may follow the signature, and refusals are EvidenceError naming the field and
the limit, never quoting the input.

The certificate chain travels as DER certificates, leaf first, concatenated (`chain_from_pem` turns
NVML's PEM text into that form). Reference measurements come from NVIDIA's RIMs (SWID tags, one for
the driver, one for the VBIOS): `Rim.from_swidtag` reads their active golden measurements.
"""

from __future__ import annotations

import hashlib
import struct
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509

from .errors import EvidenceError

MAX_GPU_REPORT_BYTES = 32 * 1024  # a Hopper report is 4,117 bytes (64 blocks of SHA-384, 422 bytes of opaque data)
MAX_GPU_CHAIN_BYTES = 16 * 1024  # a Hopper chain is 5 certificates, 3,360 bytes of DER
MAX_GPU_CHAIN_CERTS = 8
MAX_RIM_BYTES = 1 << 20  # a RIM is some 20 KiB of XML

SPDM_VERSIONS = frozenset({0x11, 0x12})
GET_MEASUREMENTS = 0xE0
MEASUREMENTS = 0x60
REQUEST_SIZE = 37
NONCE_SIZE = 32
SIGNATURE_SIZE = 96  # ECDSA P-384: r || s
ALL_MEASUREMENTS = 0xFF  # Param2 of a request for every block
DMTF_SPECIFICATION = 0x01

# NVIDIA's opaque data field ids (the ones the verifier reads)
OPAQUE_DRIVER_VERSION = 3
OPAQUE_VBIOS_VERSION = 6
OPAQUE_NVDEC0_STATUS = 11
OPAQUE_FWID = 20
OPAQUE_DATA_VERSION = 34
OPAQUE_FEATURE_FLAG = 36
FEATURE_FLAGS = {0: "SPT", 1: "MPT", 2: "PPCIE"}  # single / multi GPU passthrough (CC), protected PCIe
NVDEC_ENABLED, NVDEC_DISABLED = 0xAA, 0x55

# DMTF measurement value types (DSP0274 1.2): bit 7 set means a raw bit stream, not a digest
DMTF_RAW = 0x80
DMTF_DEVICE_MODE = 0x05  # OperationalModeCapabilities, OperationalModeState, DeviceModeCapabilities, DeviceModeState


def _field(value: object, name: str, limit: int) -> bytes:
    """bytes of at most `limit`, or EvidenceError naming the field and the limit."""
    if isinstance(value, (bytearray, memoryview)):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise EvidenceError(f"{name} must be bytes, not {type(value).__name__}")
    if len(value) > limit:
        raise EvidenceError(f"{name} is {len(value)} bytes; the limit is {limit}")
    return value


class _Reader:
    """Reads a bounded byte string front to back; running short is an EvidenceError naming the field."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data, self.pos, self.what = data, 0, what

    def take(self, n: int, name: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise EvidenceError(
                f"{self.what}: {name} needs {n} bytes at offset {self.pos}, {len(self.data) - self.pos} are left"
            )
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def u8(self, name: str) -> int:
        return self.take(1, name)[0]

    def le(self, n: int, name: str) -> int:
        return int.from_bytes(self.take(n, name), "little")

    @property
    def left(self) -> int:
        return len(self.data) - self.pos


@dataclass(frozen=True)
class MeasurementBlock:
    """One DMTF measurement block: its SPDM index (1..254), value type and value."""

    index: int
    value_type: int
    value: bytes


@dataclass(frozen=True)
class GpuReport:
    """A parsed GET_MEASUREMENTS request + signed response (module docstring)."""

    raw: bytes
    spdm_version: int
    request_param1: int
    request_param2: int
    nonce: bytes  # the requester's nonce: the verifier's binding
    request_slot: int
    response_param1: int
    response_param2: int
    blocks: tuple[MeasurementBlock, ...]
    responder_nonce: bytes
    opaque: tuple[tuple[int, bytes], ...]  # (DataType, Data) in report order
    signature: bytes

    @property
    def signed_bytes(self) -> bytes:
        """What the signature covers: request || response up to the signature."""
        return self.raw[:-SIGNATURE_SIZE]

    def block(self, index: int) -> MeasurementBlock | None:
        return next((b for b in self.blocks if b.index == index), None)

    def opaque_field(self, data_type: int) -> bytes | None:
        return next((v for t, v in self.opaque if t == data_type), None)

    @property
    def driver_version(self) -> str | None:
        value = self.opaque_field(OPAQUE_DRIVER_VERSION)
        return None if value is None else value.split(b"\x00", 1)[0].decode("ascii", "replace").lower()

    @property
    def vbios_version(self) -> str | None:
        """NVIDIA's xx.xx.xx.xx.xx form: the little-endian 32-bit word's bytes high to low, then
        the OEM byte (bytes 00 9f 00 96 01 ... read 96.00.9f.00.01)."""
        value = self.opaque_field(OPAQUE_VBIOS_VERSION)
        if value is None or len(value) < 5:
            return None
        return ".".join(f"{b:02x}" for b in (value[3], value[2], value[1], value[0], value[4]))

    @property
    def fwid(self) -> bytes | None:
        return self.opaque_field(OPAQUE_FWID)

    @property
    def nvdec0_status(self) -> int | None:
        value = self.opaque_field(OPAQUE_NVDEC0_STATUS)
        return None if not value else value[0]

    @property
    def feature_flag(self) -> str | None:
        """The GPU's mode as its opaque data says (SPT, MPT, PPCIE), when it says one."""
        value = self.opaque_field(OPAQUE_FEATURE_FLAG)
        if value is None:
            return None
        number = int.from_bytes(value[:8], "little")
        return FEATURE_FLAGS.get(number, f"unknown({number})")

    def encode(self) -> bytes:
        """The report's bytes from its fields (equal to `raw` for a parsed report)."""
        record = b"".join(
            struct.pack("<BBH", b.index, DMTF_SPECIFICATION, 3 + len(b.value))
            + struct.pack("<BH", b.value_type, len(b.value)) + b.value
            for b in self.blocks
        )
        opaque = b"".join(struct.pack("<HH", t, len(v)) + v for t, v in self.opaque)
        request = bytes([self.spdm_version, GET_MEASUREMENTS, self.request_param1, self.request_param2])
        request += self.nonce + bytes([self.request_slot])
        response = bytes([self.spdm_version, MEASUREMENTS, self.response_param1, self.response_param2,
                          len(self.blocks)]) + len(record).to_bytes(3, "little") + record
        response += self.responder_nonce + struct.pack("<H", len(opaque)) + opaque + self.signature
        return request + response


def parse_report(data: bytes) -> GpuReport:
    """Parse an attestation report (request + response); EvidenceError naming the field otherwise."""
    data = _field(data, "gpu_report", MAX_GPU_REPORT_BYTES)
    r = _Reader(data, "gpu_report")
    version = r.u8("request SPDMVersion")
    if version not in SPDM_VERSIONS:
        raise EvidenceError(f"gpu_report: SPDM version 0x{version:02x} is not one of 1.1, 1.2")
    if (code := r.u8("request code")) != GET_MEASUREMENTS:
        raise EvidenceError(f"gpu_report: request code is 0x{code:02x}, expected GET_MEASUREMENTS 0xe0")
    param1, param2 = r.u8("request Param1"), r.u8("request Param2")
    nonce = r.take(NONCE_SIZE, "request nonce")
    slot = r.u8("request SlotIDParam")
    if (rversion := r.u8("response SPDMVersion")) != version:
        raise EvidenceError(f"gpu_report: response SPDM version 0x{rversion:02x} differs from the request's")
    if (code := r.u8("response code")) != MEASUREMENTS:
        raise EvidenceError(f"gpu_report: response code is 0x{code:02x}, expected MEASUREMENTS 0x60")
    rparam1, rparam2 = r.u8("response Param1"), r.u8("response Param2")
    count = r.u8("NumberOfBlocks")
    record = _Reader(r.take(r.le(3, "MeasurementRecordLength"), "MeasurementRecord"), "gpu_report record")
    blocks: list[MeasurementBlock] = []
    seen: set[int] = set()
    while record.left:
        index = record.u8("block index")
        if index in (0, 0xFF) or index in seen:
            raise EvidenceError(f"gpu_report: measurement block index {index} is reserved or repeated")
        if (spec := record.u8("MeasurementSpecification")) != DMTF_SPECIFICATION:
            raise EvidenceError(f"gpu_report: block {index} has MeasurementSpecification {spec}, not DMTF (1)")
        size = record.le(2, "MeasurementSize")
        block = _Reader(record.take(size, f"block {index}"), f"gpu_report block {index}")
        value_type = block.u8("DMTFSpecMeasurementValueType")
        value = block.take(block.le(2, "DMTFSpecMeasurementValueSize"), "value")
        if block.left:
            raise EvidenceError(f"gpu_report: block {index} has {block.left} bytes after its value")
        seen.add(index)
        blocks.append(MeasurementBlock(index, value_type, value))
    if len(blocks) != count:
        raise EvidenceError(f"gpu_report: NumberOfBlocks is {count} but the record holds {len(blocks)}")
    responder_nonce = r.take(NONCE_SIZE, "response nonce")
    opaque_reader = _Reader(r.take(r.le(2, "OpaqueLength"), "OpaqueData"), "gpu_report opaque data")
    opaque: list[tuple[int, bytes]] = []
    while opaque_reader.left:
        data_type = opaque_reader.le(2, "opaque DataType")
        if any(t == data_type for t, _ in opaque):
            raise EvidenceError(f"gpu_report: opaque field {data_type} is repeated")
        opaque.append((data_type, opaque_reader.take(opaque_reader.le(2, "opaque DataSize"), f"opaque field {data_type}")))
    signature = r.take(SIGNATURE_SIZE, "signature")
    if r.left:
        raise EvidenceError(f"gpu_report: {r.left} bytes follow the {SIGNATURE_SIZE}-byte signature")
    return GpuReport(
        raw=data, spdm_version=version, request_param1=param1, request_param2=param2, nonce=nonce,
        request_slot=slot, response_param1=rparam1, response_param2=rparam2, blocks=tuple(blocks),
        responder_nonce=responder_nonce, opaque=tuple(opaque), signature=signature,
    )


def _der_length(data: bytes, pos: int, what: str) -> tuple[int, int]:
    """(content length, header length) of the DER element at `pos`."""
    if len(data) - pos < 2:
        raise EvidenceError(f"{what}: truncated DER header at offset {pos}")
    first = data[pos + 1]
    if first < 0x80:
        return first, 2
    n = first & 0x7F
    if not 1 <= n <= 3 or len(data) - pos < 2 + n:
        raise EvidenceError(f"{what}: DER length at offset {pos} is malformed or over 3 bytes")
    return int.from_bytes(data[pos + 2:pos + 2 + n], "big"), 2 + n


def split_chain(data: bytes) -> tuple[bytes, ...]:
    """The DER certificates of a concatenated chain, leaf first. Bounded before anything is parsed:
    MAX_GPU_CHAIN_BYTES, then MAX_GPU_CHAIN_CERTS while walking the headers; then each must parse
    as an X.509 certificate."""
    data = _field(data, "gpu_cert_chain", MAX_GPU_CHAIN_BYTES)
    certs: list[bytes] = []
    pos = 0
    while pos < len(data):
        if len(certs) == MAX_GPU_CHAIN_CERTS:
            raise EvidenceError(f"gpu_cert_chain holds more than {MAX_GPU_CHAIN_CERTS} certificates (the limit)")
        if data[pos] != 0x30:
            raise EvidenceError(f"gpu_cert_chain: certificate {len(certs)} does not start with a DER SEQUENCE")
        length, header = _der_length(data, pos, "gpu_cert_chain")
        end = pos + header + length
        if end > len(data):
            raise EvidenceError(f"gpu_cert_chain: certificate {len(certs)} is truncated")
        certs.append(data[pos:end])
        pos = end
    if not certs:
        raise EvidenceError("gpu_cert_chain is empty")
    for i, der in enumerate(certs):
        try:
            x509.load_der_x509_certificate(der)
        except ValueError:
            raise EvidenceError(f"gpu_cert_chain: certificate {i} is not a DER X.509 certificate") from None
    return tuple(certs)


def chain_from_pem(text: bytes | str) -> bytes:
    """NVML's PEM certificate chain (leaf first) as the DER concatenation evidence carries."""
    from cryptography.hazmat.primitives.serialization import Encoding

    raw = text.encode("ascii", "replace") if isinstance(text, str) else text
    raw = _field(raw, "gpu_cert_chain PEM", 2 * MAX_GPU_CHAIN_BYTES)
    try:
        certs = x509.load_pem_x509_certificates(raw)
    except ValueError:
        raise EvidenceError("gpu_cert_chain PEM holds no readable certificate") from None
    if len(certs) > MAX_GPU_CHAIN_CERTS:
        raise EvidenceError(f"gpu_cert_chain holds more than {MAX_GPU_CHAIN_CERTS} certificates (the limit)")
    return b"".join(c.public_bytes(Encoding.DER) for c in certs)


def report_from_hex(text: bytes | str) -> bytes:
    """The report's bytes from NVIDIA's hex text form (as in its samples), bounded before decoding."""
    raw = text.decode("ascii", "replace") if isinstance(text, bytes) else str(text)
    raw = raw.strip()
    if len(raw) > 2 * MAX_GPU_REPORT_BYTES:
        raise EvidenceError(f"gpu_report hex is {len(raw)} characters; the limit is {2 * MAX_GPU_REPORT_BYTES}")
    try:
        return bytes.fromhex(raw)
    except ValueError:
        raise EvidenceError("gpu_report is not hex of whole bytes") from None


@dataclass(frozen=True)
class GpuEvidence:
    """A GPU's attestation report and its certificate chain, as they travel beside a TEE quote.
    Constructing it bounds and parses both (it says nothing about whether they are true)."""

    report: bytes
    cert_chain: bytes  # DER certificates, leaf first, concatenated

    def __post_init__(self) -> None:
        object.__setattr__(self, "report", _field(self.report, "gpu_report", MAX_GPU_REPORT_BYTES))
        object.__setattr__(self, "cert_chain", _field(self.cert_chain, "gpu_cert_chain", MAX_GPU_CHAIN_BYTES))
        parse_report(self.report)
        split_chain(self.cert_chain)

    def parsed(self) -> GpuReport:
        return parse_report(self.report)

    def certificates(self) -> tuple[bytes, ...]:
        return split_chain(self.cert_chain)

    def __repr__(self) -> str:
        return f"GpuEvidence(report={len(self.report)} bytes, cert_chain={len(self.cert_chain)} bytes)"


@dataclass(frozen=True)
class GoldenMeasurement:
    """A reference measurement: the RIM's index (0-based; the report's block index is one more),
    the values it may take (the RIM's alternatives), and where it comes from ("driver", "vbios")."""

    index: int
    values: frozenset[bytes]
    source: str

    @property
    def block_index(self) -> int:
        return self.index + 1


@dataclass(frozen=True)
class Rim:
    """The active golden measurements of one RIM (a SWID tag), its version and file digest.

    The RIM's own XML signature (to NVIDIA's RIM root) is not checked here: the operator pins a RIM
    they obtained and checked (docs/trust.md), by file and sha256."""

    source: str
    version: str  # the Meta element's colloquialVersion, lower case
    measurements: tuple[GoldenMeasurement, ...]
    sha256: bytes = field(repr=False)

    @classmethod
    def from_swidtag(cls, data: bytes, *, source: str) -> Rim:
        data = _field(data, f"{source} RIM", MAX_RIM_BYTES)
        if b"<!DOCTYPE" in data or b"<!ENTITY" in data:
            raise EvidenceError(f"{source} RIM declares a DTD or entities; a RIM has none")
        try:
            root = ElementTree.fromstring(data)
        except ElementTree.ParseError:
            raise EvidenceError(f"{source} RIM is not XML") from None
        version = None
        golden: dict[int, GoldenMeasurement] = {}
        for element in root.iter():
            tag = element.tag.rsplit("}", 1)[-1]
            if tag == "Meta":
                version = element.attrib.get("colloquialVersion")
            if tag != "Resource" or element.attrib.get("type", "Measurement") != "Measurement":
                continue
            attrs = {k.rsplit("}", 1)[-1]: v for k, v in element.attrib.items()}
            try:
                index, size, alternatives = int(attrs["index"]), int(attrs["size"]), int(attrs["alternatives"])
                values = frozenset(bytes.fromhex(attrs[f"Hash{i}"]) for i in range(alternatives))
            except (KeyError, ValueError):
                raise EvidenceError(f"{source} RIM has a measurement without index, size or hashes") from None
            if index in golden or any(len(v) != size for v in values):
                raise EvidenceError(f"{source} RIM: measurement {index} is repeated or not {size} bytes")
            if attrs.get("active") == "True":
                golden[index] = GoldenMeasurement(index, values, source)
        if not version:
            raise EvidenceError(f"{source} RIM has no Meta colloquialVersion")
        return cls(source=source, version=version.lower(), measurements=tuple(golden[i] for i in sorted(golden)),
                   sha256=hashlib.sha256(data).digest())

    @classmethod
    def load(cls, path: str | Path, *, source: str, sha256: bytes | str | None = None) -> Rim:
        """A pinned RIM file; refused when `sha256` is given and the file's digest differs."""
        path = Path(path)
        if path.stat().st_size > MAX_RIM_BYTES:
            raise EvidenceError(f"{source} RIM is over {MAX_RIM_BYTES} bytes (the limit)")
        rim = cls.from_swidtag(path.read_bytes(), source=source)
        if sha256 is not None:
            pinned = bytes.fromhex(sha256) if isinstance(sha256, str) else bytes(sha256)
            if rim.sha256 != pinned:
                raise EvidenceError(f"{source} RIM {path.name} does not have the pinned sha256")
        return rim
