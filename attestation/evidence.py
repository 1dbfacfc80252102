"""Evidence records: what a worker hands over to be admitted, and what verification concluded.

`Evidence` is the raw material: the provider's name and its quote bytes (a TDX quote v4 or v5, or
the dev stand-in in the v4 layout), plus, for the dev provider, the development root's signature.
The quote is kept up to the end of its declared signature data: padding that followed it in the
buffer it came from is dropped when Evidence is made, so the canonical form has none.
Its byte form is canonical JSON (storage_client.canonical_json), one byte string per record:

    {"dev_signature":"<130 hex>","provider":"dev","quote":"<hex>","schema":"dilocox.evidence/v1"}
    {"provider":"tdx","quote":"<hex>","schema":"dilocox.evidence/v1"}
    {"gpu_cert_chain":"<hex>","gpu_report":"<hex>","provider":"tdx","quote":"<hex>","schema":...}

Keys sorted, no whitespace, lowercase hex, `dev_signature` present exactly when provider is "dev"
(the verifier of a provider says whether it carries one: attestation.verifier). The provider's
verifier checks the quote is well formed; this module reads no quote itself.

GPU evidence travels beside the quote: `gpu_report` (an NVIDIA GPU's SPDM attestation report) and
`gpu_cert_chain` (its DER certificate chain, leaf first), both or neither, with any provider
(attestation.nvidia_gpu). A record without them has exactly the bytes, digest and CID it had before
they existed. Their hex is bounded before it is decoded (MAX_GPU_REPORT_BYTES, MAX_GPU_CHAIN_BYTES)
and the chain's certificate count before any certificate is parsed (MAX_GPU_CHAIN_CERTS); a policy
with `gpu` settings requires and verifies them (attestation.policy, attestation.nvidia_gpu_verifier).

The sha256 of these bytes is the `evidenceDigest` that WorkerRegistry records, and the bytes are
kept in the store as a RAW object (so `Evidence.cid()` names them). `from_bytes` accepts only this
exact form: anything else, including the same record re-serialised differently, is refused. It
reads untrusted bytes with bounded size and nesting (storage_client.loads_bounded) and raises
nothing but EvidenceError, whose messages quote at most a few dozen characters of the input.

`VerifiedEvidence` is what `policy.verify_evidence` returns once every check has passed.
"""

from __future__ import annotations

import enum

import hashlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from storage_client import CID, Codec, JSONBoundsError, canonical_json, loads_bounded

from .errors import EvidenceError
from .nvidia_gpu import MAX_GPU_CHAIN_BYTES, MAX_GPU_REPORT_BYTES, GpuEvidence

if TYPE_CHECKING:  # pragma: no cover
    from .nvidia_gpu_verifier import GpuClaim

SCHEMA = "dilocox.evidence/v1"


class Provider(enum.StrEnum):
    """Where evidence comes from (its JSON ``provider``)."""

    TDX = "tdx"  # an Intel TDX quote, verified through DCAP
    DEV = "dev"  # a software stand-in that PROVES NOTHING


MAX_EVIDENCE_BYTES = 4 << 20  # a quote is limited to 1 MiB, hex doubles it
MAX_EVIDENCE_DEPTH = 2  # a flat object of strings; anything nested is refused before parsing
DEV_SIGNATURE_SIZE = 65
GPU_FIELDS = frozenset({"gpu_report", "gpu_cert_chain"})
_HEX = frozenset("0123456789abcdef")


def _shown(value: Any, limit: int = 40) -> str:
    """repr of an untrusted value, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _hex_field(obj: dict[str, Any], key: str) -> bytes:
    value = obj[key]
    if not isinstance(value, str):
        raise EvidenceError(f"evidence field {key!r} must be a hex string, not {type(value).__name__}")
    if len(value) % 2 or not set(value) <= _HEX:
        raise EvidenceError(f"evidence field {key!r} is not lowercase hex of whole bytes")
    return bytes.fromhex(value)


def _bounded_hex_field(obj: dict[str, Any], key: str, limit: int) -> bytes:
    """A hex field whose decoded size is bounded before it is decoded."""
    value = obj[key]
    if isinstance(value, str) and len(value) > 2 * limit:
        raise EvidenceError(f"evidence field {key!r} is {len(value) // 2} bytes; the limit is {limit}")
    return _hex_field(obj, key)


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise EvidenceError(f"evidence JSON repeats the key {_shown(k)}")
        out[k] = v
    return out


def check_dev_signature(evidence: Evidence, *, carried: bool) -> None:
    """The record's ``dev_signature`` is there (65 bytes) exactly when its provider carries one."""
    sig = evidence.dev_signature
    if not carried:
        if sig is not None:
            raise EvidenceError(f"{evidence.provider} evidence must not carry a dev_signature")
        return
    if not isinstance(sig, bytes) or len(sig) != DEV_SIGNATURE_SIZE:
        got = "none" if sig is None else (f"{len(sig)} bytes" if isinstance(sig, bytes) else type(sig).__name__)
        raise EvidenceError(f"{evidence.provider} evidence needs a {DEV_SIGNATURE_SIZE}-byte dev_signature, got {got}")


@dataclass(frozen=True)
class Evidence:
    """One provider's evidence. Constructing it checks it is well formed (not that it is true)."""

    provider: str  # a Provider for the built-ins; any name with a registered verifier
    quote: bytes
    dev_signature: bytes | None = None
    gpu: GpuEvidence | None = None  # a GPU's attestation report and chain, beside the quote

    def __post_init__(self) -> None:
        from .verifier import verifier_for  # the verifiers build Evidence too; import here to avoid a cycle

        verifier = verifier_for(self.provider)
        object.__setattr__(self, "provider", verifier.name)
        if not isinstance(self.quote, (bytes, bytearray)):
            raise EvidenceError(f"evidence quote must be bytes, not {type(self.quote).__name__}")
        if isinstance(self.dev_signature, bytearray):
            object.__setattr__(self, "dev_signature", bytes(self.dev_signature))
        if self.gpu is not None and not isinstance(self.gpu, GpuEvidence):
            raise EvidenceError(f"evidence gpu must be GpuEvidence, not {type(self.gpu).__name__}")
        # the provider's verifier parses the quote, refusing it by field, and drops its padding
        object.__setattr__(self, "quote", verifier.canonical_quote(self))

    def to_bytes(self) -> bytes:
        """The canonical byte form (module docstring); its sha256 is the on-chain evidenceDigest."""
        obj: dict[str, Any] = {"schema": SCHEMA, "provider": self.provider, "quote": self.quote.hex()}
        if self.dev_signature is not None:
            obj["dev_signature"] = self.dev_signature.hex()
        if self.gpu is not None:
            obj["gpu_report"] = self.gpu.report.hex()
            obj["gpu_cert_chain"] = self.gpu.cert_chain.hex()
        return canonical_json(obj)

    @classmethod
    def from_bytes(cls, data: bytes) -> Evidence:
        """Parse untrusted bytes; refuse anything that is not exactly the canonical form."""
        from .verifier import verifier_for

        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise EvidenceError(f"evidence must be bytes, not {type(data).__name__}")
        data = bytes(data)
        try:
            # Size and nesting first (json.loads recurses per level), then duplicate keys.
            loads_bounded(data, max_bytes=MAX_EVIDENCE_BYTES, max_depth=MAX_EVIDENCE_DEPTH, what="evidence")
            obj = json.loads(data.decode("utf-8"), object_pairs_hook=_refuse_duplicates)
        except EvidenceError:
            raise
        except JSONBoundsError as exc:
            raise EvidenceError(str(exc)) from None
        except (UnicodeDecodeError, ValueError, RecursionError):  # loads_bounded accepted it already
            raise EvidenceError("evidence is not JSON") from None
        if not isinstance(obj, dict):
            raise EvidenceError(f"evidence must be a JSON object, not {type(obj).__name__}")
        if obj.get("schema") != SCHEMA:
            raise EvidenceError(f"evidence schema is {_shown(obj.get('schema'))}, expected {SCHEMA!r}")
        verifier = verifier_for(obj.get("provider"))
        provider, signed = verifier.name, verifier.carries_dev_signature
        expected = {"schema", "provider", "quote"} | ({"dev_signature"} if signed else set())
        gpu_keys = set(obj) & GPU_FIELDS
        if gpu_keys and gpu_keys != GPU_FIELDS:
            raise EvidenceError("evidence carries one of gpu_report and gpu_cert_chain; GPU evidence needs both")
        expected |= gpu_keys
        if set(obj) != expected:
            missing = sorted(expected - set(obj))
            extra = sorted(set(obj) - expected)
            shown = ", ".join(_shown(k) for k in extra[:4]) + (f" and {len(extra) - 4} more" if len(extra) > 4 else "")
            raise EvidenceError(
                f"{provider} evidence has the wrong keys (missing {missing}, unexpected [{shown}])"
            )
        evidence = cls(
            provider=provider,
            quote=_hex_field(obj, "quote"),
            dev_signature=_hex_field(obj, "dev_signature") if signed else None,
            gpu=GpuEvidence(
                report=_bounded_hex_field(obj, "gpu_report", MAX_GPU_REPORT_BYTES),
                cert_chain=_bounded_hex_field(obj, "gpu_cert_chain", MAX_GPU_CHAIN_BYTES),
            ) if gpu_keys else None,
        )
        if len(evidence.quote) * 2 != len(obj["quote"]):
            raise EvidenceError(
                f"evidence quote carries {len(obj['quote']) // 2 - len(evidence.quote)} bytes after its "
                "declared signature data; the canonical form has no padding"
            )
        if evidence.to_bytes() != data:
            raise EvidenceError(
                "evidence is not in canonical form (sorted keys, no whitespace, lowercase hex); "
                "its digest would not match the one recorded"
            )
        return evidence

    def digest(self) -> bytes:
        """sha256 of `to_bytes()`: the evidenceDigest that WorkerRegistry records."""
        return hashlib.sha256(self.to_bytes()).digest()

    def cid(self) -> CID:
        """The RAW CID under which the store keeps `to_bytes()`."""
        return CID.of(self.to_bytes(), Codec.RAW)

    def __repr__(self) -> str:
        from .verifier import verifier_for

        note = f", {self.provider.upper()}: PROVES NOTHING" if verifier_for(self.provider).proves_nothing else ""
        gpu = f", gpu={len(self.gpu.report)}-byte report" if self.gpu is not None else ""
        return f"Evidence(provider={self.provider!r}, quote={len(self.quote)} bytes{gpu}{note})"


@dataclass(frozen=True)
class VerifiedEvidence:
    """The result of verification that passed.

    measurement   32 bytes, the value an allowlist holds: sha256(MRTD||RTMR0..3) for tdx, the code
                  measurement (REPORTDATA[32:64]) for dev
    report_data   the 64 bytes of REPORTDATA, equal to what the verifier expected
    debug         the TD's DEBUG attribute (only ever True when the policy allowed it)
    proves_nothing  True exactly for dev evidence (tdx evidence is only ever returned once
                  dcap-qvl verified it)
    details       the quote's fields as strings (mrtd, rtmr0..3, ... in hex); for dev also
                  "dev_root" and "evidence": "DEV: PROVES NOTHING"; for tdx "tcb_status",
                  "advisory_ids", "collateral", "collateral_next_update" and "verified_at"
    warnings      what a reader should know about how much this proves (dev: its WARNING; GPU
                  evidence carried but not verified because the policy has no gpu settings)
    label         how to show this evidence, said by its provider's verifier: dev evidence never
                  reads as anything but "DEV evidence: PROVES NOTHING"
    gpu           the GpuClaim of GPU evidence the policy required and verified (its fields are
                  also in details, as gpu_*)
    """

    provider: str
    measurement: bytes
    report_data: bytes
    debug: bool
    proves_nothing: bool
    label: str
    details: dict[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    gpu: GpuClaim | None = None  # what verified GPU evidence says; None when none was verified

    def __repr__(self) -> str:
        return (f"VerifiedEvidence({self.label}, measurement={self.measurement.hex()}, "
                f"debug={self.debug}, proves_nothing={self.proves_nothing})")
