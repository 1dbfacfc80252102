"""The verifier of NVIDIA GPU evidence: an SPDM attestation report checked offline, beside a TEE quote.

GPU evidence is not a provider of its own: it measures the GPU's firmware and mode, not the code the
worker runs, and has no REPORTDATA to bind the code measurement. It travels beside a provider's quote
(the evidence record's optional `gpu_report` / `gpu_cert_chain`, attestation.evidence), and a policy
that sets `Policy.gpu` (a GpuPolicy) requires it and checks it with `NvidiaGpuVerifier.verify`,
after the quote's own checks. In order, each failure a PolicyViolation naming the check:

    gpu.chain        the chain (leaf first) ends at a root the policy pins (by default NVIDIA's
                     device identity CA, attestation/roots/nvidia_device_identity_ca.pem, never
                     fetched), each certificate is signed by the next, every issuer is a CA, every
                     certificate is valid at the verification time (`now`, the clock unless given),
                     none is on the policy's offline revoked list, and the leaf's key is ECDSA P-384
    gpu.signature    the leaf key signed request || response (ECDSA P-384, SHA-384): the GPU's
                     device attestation key, so every field below is the GPU's own
    gpu.request      the request asked for every measurement block, and the response answers its slot
    gpu.nonce        the request's nonce is the one the verifier derived itself: REPORTDATA[0:32],
                     sha256("dilocox/worker-key/v1" || worker address || run id || join nonce)
                     (attestation.keys.key_binding); never read from the evidence
    gpu.fwid         the report's FWID (opaque field 20, when it has one) is the leaf certificate's
                     TCG DICE FWID: the report comes from the firmware the certificate names
    gpu.mode         CC mode: where the opaque data says the GPU's mode (feature flag, field 36) it
                     is one the policy allows (SPT, MPT: confidential computing; PPCIE is not)
    gpu.debug        where the report has a DMTF device-mode block (SPDM 1.2), no debug mode is or
                     has been active since reset and the device is in normal operational mode
    gpu.rim          the report's driver and VBIOS versions are those of the pinned RIMs
    gpu.measurement  every active golden measurement of the pinned RIMs (or pinned digest set) is
                     matched by the report's block at that index (index 35, NVDEC0, is skipped when
                     the report says NVDEC0 is disabled, as NVIDIA's verifiers do)

How CC mode and DevTools show: a Hopper GPU produces this report only in CC (or PPCIE) mode, and
NVIDIA's verifier reports "dbgstat: disabled" and "secboot: true" exactly when every golden
measurement of the production RIMs matches; DevTools mode changes measured configuration, so the
measurement check is also the DevTools check. What is not checked offline: OCSP revocation of the
chain (`GpuPolicy.revoked` is the offline stand-in: certificates the operator has learnt are
revoked) and the RIMs' own signatures (the operator pins RIMs they obtained and checked;
docs/trust.md).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from collections.abc import Iterable, Mapping

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding

from .errors import EvidenceError, PolicyViolation
from .nvidia_gpu import (
    ALL_MEASUREMENTS,
    DMTF_DEVICE_MODE,
    DMTF_RAW,
    NONCE_SIZE,
    NVDEC_DISABLED,
    NVDEC_ENABLED,
    SIGNATURE_SIZE,
    GoldenMeasurement,
    GpuEvidence,
    GpuReport,
    Rim,
)

NVIDIA_DEVICE_ROOT = Path(__file__).parent / "roots" / "nvidia_device_identity_ca.pem"
NVIDIA_DEVICE_ROOT_SHA256 = "102bf659d5419614c9d8e6aecebc80454eb26b1df6a769ac720b9a690b167b48"  # of its DER
DEFAULT_GPU_MODES: frozenset[str] = frozenset({"SPT", "MPT"})
FWID_EXTENSIONS = (x509.ObjectIdentifier("2.23.133.5.4.1"), x509.ObjectIdentifier("2.23.133.5.4.1.1"))
NVDEC0_INDEX = 35  # the RIM index NVIDIA skips when NVDEC0 is disabled
_SHA384_OID = bytes.fromhex("0609608648016503040202")
_DEBUG_BITS = 0x0F  # DeviceModeState: (non-)invasive debug active, or active since the last reset
_NORMAL_MODE = 0x04  # OperationalModeState: normal operational mode


@functools.cache
def nvidia_device_root() -> bytes:
    """The pinned NVIDIA device identity root CA (DER), checked against its pinned digest."""
    cert = x509.load_pem_x509_certificate(NVIDIA_DEVICE_ROOT.read_bytes())
    der = cert.public_bytes(Encoding.DER)
    if hashlib.sha256(der).hexdigest() != NVIDIA_DEVICE_ROOT_SHA256:
        raise RuntimeError(f"{NVIDIA_DEVICE_ROOT} is not the pinned NVIDIA device root")
    return der


def _root_der(root: bytes | x509.Certificate) -> bytes:
    if isinstance(root, x509.Certificate):
        return root.public_bytes(Encoding.DER)
    root = bytes(root)
    if root.lstrip().startswith(b"-----BEGIN"):
        return x509.load_pem_x509_certificate(root).public_bytes(Encoding.DER)
    return x509.load_der_x509_certificate(root).public_bytes(Encoding.DER)


@dataclass(frozen=True)
class GpuPolicy:
    """What GPU evidence must be; setting `Policy.gpu` to one makes GPU evidence required.

    golden          the reference measurements (GoldenMeasurement, by RIM index): from pinned RIM
                    files (`from_rims`, `from_rim_files`) or a pinned digest set (`from_digests`);
                    at least one is required
    driver_version  the driver version the report must name (the driver RIM's); None: not checked
    vbios_version   the VBIOS version the report must name (the VBIOS RIM's); None: not checked
    roots           DER root certificates a chain may end at (default: NVIDIA's pinned device root)
    allowed_modes   modes a report that states one may be in (default SPT, MPT: CC modes)
    revoked         sha256 digests of DER certificates refused wherever they are in a chain (the
                    offline revocation list: OCSP is not asked)
    """

    golden: tuple[GoldenMeasurement, ...]
    driver_version: str | None = None
    vbios_version: str | None = None
    roots: frozenset[bytes] = field(default_factory=lambda: frozenset({nvidia_device_root()}))
    allowed_modes: frozenset[str] = DEFAULT_GPU_MODES
    revoked: frozenset[bytes] = frozenset()

    def __post_init__(self) -> None:
        golden = tuple(sorted(self.golden, key=lambda g: g.index))
        if not golden:
            raise ValueError("a GPU policy needs golden measurements (pinned RIMs or a pinned digest set)")
        indexes = [g.index for g in golden]
        if len(set(indexes)) != len(indexes):
            raise ValueError("the golden measurements name one index twice (driver and VBIOS RIM conflict)")
        if any(not 0 <= i < 254 or not g.values for i, g in zip(indexes, golden)):
            raise ValueError("golden measurement indexes are 0..253, each with at least one value")
        object.__setattr__(self, "golden", golden)
        object.__setattr__(self, "roots", frozenset(_root_der(r) for r in self.roots))
        if not self.roots:
            raise ValueError("a GPU policy needs at least one pinned root")
        object.__setattr__(self, "allowed_modes", frozenset(self.allowed_modes))
        revoked = frozenset(bytes.fromhex(r) if isinstance(r, str) else bytes(r) for r in self.revoked)
        if any(len(r) != 32 for r in revoked):
            raise ValueError("revoked certificates are named by the 32-byte sha256 of their DER")
        object.__setattr__(self, "revoked", revoked)
        for name in ("driver_version", "vbios_version"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, str(value).lower())

    @classmethod
    def from_rims(cls, driver: Rim, vbios: Rim, **kwargs: object) -> GpuPolicy:
        """The golden measurements and versions of a driver RIM and a VBIOS RIM."""
        return cls(golden=driver.measurements + vbios.measurements, driver_version=driver.version,
                   vbios_version=vbios.version, **kwargs)  # type: ignore[arg-type]

    @classmethod
    def from_rim_files(cls, driver: str | Path, vbios: str | Path, *, driver_sha256: str | bytes | None = None,
                       vbios_sha256: str | bytes | None = None, **kwargs: object) -> GpuPolicy:
        """Pinned RIM files (and, given, their pinned sha256 digests)."""
        return cls.from_rims(Rim.load(driver, source="driver", sha256=driver_sha256),
                             Rim.load(vbios, source="vbios", sha256=vbios_sha256), **kwargs)

    @classmethod
    def from_digests(cls, golden: Mapping[int, Iterable[bytes]], *, source: str = "pinned",
                     **kwargs: object) -> GpuPolicy:
        """A pinned digest set: {RIM index (0-based): accepted values}."""
        return cls(golden=tuple(GoldenMeasurement(int(i), frozenset(bytes(v) for v in vs), source)
                                for i, vs in golden.items()), **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GpuClaim:
    """What verified GPU evidence says: the GPU's model, serial, firmware versions, mode and
    measurements, all signed by its device key and checked against the policy."""

    hwmodel: str  # the common name of the device identity certificate (chain[1]), e.g. "GH100 A01 GSP BROM"
    ueid: str  # the leaf certificate's serial number, decimal (NVIDIA's ueid)
    driver_version: str
    vbios_version: str
    mode: str  # the feature flag, or "CC (unstated)" for reports without one
    measurements: bytes  # sha256 over the report's measurement blocks, in order
    matched: int  # golden measurements compared

    def details(self) -> dict[str, str]:
        return {
            "gpu": "NVIDIA GPU attestation verified offline",
            "gpu_hwmodel": self.hwmodel,
            "gpu_ueid": self.ueid,
            "gpu_driver_version": self.driver_version,
            "gpu_vbios_version": self.vbios_version,
            "gpu_mode": self.mode,
            "gpu_measurements": self.measurements.hex(),
            "gpu_golden_matched": str(self.matched),
        }


def _der_elements(data: bytes) -> list[tuple[int, bytes]]:
    """The (tag, content) elements of a DER string, one level; [] when it is not DER."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < 2:
            return []
        tag, first = data[pos], data[pos + 1]
        if first < 0x80:
            length, header = first, 2
        else:
            n = first & 0x7F
            if not 1 <= n <= 3 or len(data) - pos < 2 + n:
                return []
            length, header = int.from_bytes(data[pos + 2:pos + 2 + n], "big"), 2 + n
        if pos + header + length > len(data):
            return []
        out.append((tag, data[pos + header:pos + header + length]))
        pos += header + length
    return out


def _fwids(data: bytes, depth: int = 0) -> list[bytes]:
    """SHA-384 digests of FWID ::= SEQUENCE { hashAlg OID, digest OCTET STRING } inside `data`."""
    found: list[bytes] = []
    if depth > 8:
        return found
    elements = _der_elements(data)
    for i, (tag, content) in enumerate(elements):
        if tag == 0x06 and b"\x06" + bytes([len(content)]) + content == _SHA384_OID and i + 1 < len(elements):
            next_tag, next_content = elements[i + 1]
            if next_tag == 0x04 and len(next_content) == 48:
                found.append(next_content)
        elif tag & 0x20:  # constructed: look inside
            found.extend(_fwids(content, depth + 1))
    return found


def certificate_fwid(cert: x509.Certificate) -> bytes | None:
    """The first SHA-384 FWID of the certificate's TCG DICE extension, if it has one."""
    for oid in FWID_EXTENSIONS:
        try:
            ext = cert.extensions.get_extension_for_oid(oid)
        except x509.ExtensionNotFound:
            continue
        value = ext.value.value if isinstance(ext.value, x509.UnrecognizedExtension) else b""
        fwids = _fwids(value)
        if fwids:
            return fwids[0]
    return None


def _utc(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _verify_chain(ders: tuple[bytes, ...], policy: GpuPolicy, now: float) -> list[x509.Certificate]:
    roots = policy.roots
    if len(ders) < 2:
        raise PolicyViolation("gpu.chain", f"the chain has {len(ders)} certificate; a leaf and its root at least")
    if ders[-1] not in roots:
        raise PolicyViolation("gpu.chain", "the chain does not end at a root this policy pins")
    for i, der in enumerate(ders):
        if hashlib.sha256(der).digest() in policy.revoked:
            raise PolicyViolation("gpu.chain", f"certificate {i} is on this policy's revoked list")
    certs = [x509.load_der_x509_certificate(d) for d in ders]
    for i, cert in enumerate(certs):
        if not cert.not_valid_before_utc.timestamp() <= now <= cert.not_valid_after_utc.timestamp():
            raise PolicyViolation(
                "gpu.chain",
                f"certificate {i} is valid {_utc(cert.not_valid_before_utc.timestamp())} to "
                f"{_utc(cert.not_valid_after_utc.timestamp())}, not at {_utc(now)}",
            )
    for i in range(len(certs) - 1):
        issuer = certs[i + 1]
        try:
            ca = issuer.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        except x509.ExtensionNotFound:
            ca = False
        if not ca:
            raise PolicyViolation("gpu.chain", f"certificate {i + 1} issues certificate {i} but is not a CA")
        try:
            certs[i].verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature):
            raise PolicyViolation("gpu.chain", f"certificate {i} is not signed by certificate {i + 1}") from None
    key = certs[0].public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name != "secp384r1":
        raise PolicyViolation("gpu.chain", "the leaf's key is not ECDSA P-384")
    return certs


def _verify_signature(report: GpuReport, leaf: x509.Certificate) -> None:
    key = leaf.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey)
    half = SIGNATURE_SIZE // 2
    r = int.from_bytes(report.signature[:half], "big")
    s = int.from_bytes(report.signature[half:], "big")
    try:
        key.verify(encode_dss_signature(r, s), report.signed_bytes, ec.ECDSA(hashes.SHA384()))
    except InvalidSignature:
        raise PolicyViolation(
            "gpu.signature", "the report's signature does not verify with the leaf certificate's key"
        ) from None


def _check_mode(report: GpuReport, policy: GpuPolicy) -> str:
    mode = report.feature_flag
    if mode is not None and mode not in policy.allowed_modes:
        raise PolicyViolation(
            "gpu.mode",
            f"the GPU reports mode {mode[:20]}, not a CC mode this policy allows ({', '.join(sorted(policy.allowed_modes))})",
        )
    for block in report.blocks:
        if block.value_type & 0x7F != DMTF_DEVICE_MODE:
            continue
        if not block.value_type & DMTF_RAW or len(block.value) != 16:
            raise PolicyViolation("gpu.debug", f"device-mode block {block.index} is not the 16-byte raw form")
        operational, device = int.from_bytes(block.value[4:8], "little"), int.from_bytes(block.value[12:16], "little")
        if device & _DEBUG_BITS:
            raise PolicyViolation("gpu.debug", f"device-mode block {block.index} says debug mode is or was active")
        if operational != _NORMAL_MODE:
            raise PolicyViolation("gpu.debug", f"device-mode block {block.index} says the GPU is not in normal mode")
    return mode or "CC (unstated)"


def _check_measurements(report: GpuReport, policy: GpuPolicy) -> int:
    nvdec = report.nvdec0_status
    if nvdec is not None and nvdec not in (NVDEC_ENABLED, NVDEC_DISABLED):
        raise PolicyViolation("gpu.measurement", "the report's NVDEC0 status is neither enabled nor disabled")
    matched = 0
    for golden in policy.golden:
        if golden.index == NVDEC0_INDEX and nvdec == NVDEC_DISABLED:
            continue
        block = report.block(golden.block_index)
        if block is None:
            raise PolicyViolation(
                "gpu.measurement",
                f"the {golden.source} RIM measures index {golden.index}, which the report does not carry",
            )
        if block.value not in golden.values:
            raise PolicyViolation(
                "gpu.measurement",
                f"index {golden.index} differs from the pinned {golden.source} RIM: other firmware or "
                "configuration, or CC DevTools/debug mode",
            )
        matched += 1
    return matched


class NvidiaGpuVerifier:
    """Verifies GpuEvidence offline against a GpuPolicy (module docstring)."""

    name = "nvidia-gpu"

    def verify(self, evidence: GpuEvidence, *, expected_nonce: bytes, policy: GpuPolicy,
               now: float | None = None) -> GpuClaim:
        if not isinstance(evidence, GpuEvidence):
            raise PolicyViolation("gpu", f"GPU evidence must be GpuEvidence, not {type(evidence).__name__}")
        if not isinstance(expected_nonce, (bytes, bytearray)) or len(expected_nonce) != NONCE_SIZE:
            raise ValueError(f"expected_nonce must be {NONCE_SIZE} bytes")
        when = time.time() if now is None else float(now)
        try:
            report, ders = evidence.parsed(), evidence.certificates()
        except EvidenceError as exc:
            raise PolicyViolation("gpu.format", str(exc)) from None
        certs = _verify_chain(ders, policy, when)
        _verify_signature(report, certs[0])
        if report.request_param2 != ALL_MEASUREMENTS or report.response_param2 & 0x0F != report.request_slot & 0x0F:
            raise PolicyViolation("gpu.request", "the request did not ask for every block, or the response is for another slot")
        if not hmac.compare_digest(report.nonce, bytes(expected_nonce)):
            raise PolicyViolation(
                "gpu.nonce", "the report's nonce is not the verifier's binding of worker key, run and join nonce"
            )
        fwid = report.fwid
        if fwid is not None and certificate_fwid(certs[0]) != fwid:
            raise PolicyViolation("gpu.fwid", "the report's FWID is not the one its leaf certificate names")
        mode = _check_mode(report, policy)
        driver, vbios = report.driver_version or "", report.vbios_version or ""
        if policy.driver_version is not None and driver != policy.driver_version:
            raise PolicyViolation("gpu.rim", f"the report's driver version is not the pinned RIM's ({policy.driver_version[:24]})")
        if policy.vbios_version is not None and vbios != policy.vbios_version:
            raise PolicyViolation("gpu.rim", f"the report's VBIOS version is not the pinned RIM's ({policy.vbios_version[:24]})")
        matched = _check_measurements(report, policy)
        try:
            hwmodel = certs[1].subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
        except IndexError:
            hwmodel = ""
        digest = hashlib.sha256(b"".join(bytes([b.index]) + b.value for b in report.blocks)).digest()
        return GpuClaim(hwmodel=str(hwmodel), ueid=str(certs[0].serial_number), driver_version=driver,
                        vbios_version=vbios, mode=mode, measurements=digest, matched=matched)

    def acceptance(self, claim: GpuClaim) -> str:
        return (f"accepted NVIDIA GPU evidence: {claim.hwmodel}, driver {claim.driver_version}, VBIOS "
                f"{claim.vbios_version}, {claim.matched} golden measurements matched (offline; no OCSP)")
