"""Verification policy: which evidence a verifier accepts, and the one function that decides.

    verified = verify_evidence(evidence_or_bytes, expected_report_data=report_data(worker_address,
                               run_id, nonce, code_measurement), policy=Policy(...))

Checks, in order; the first that fails raises PolicyViolation naming it:

    format       the bytes parse as Evidence (only when bytes are passed)
    provider     dev evidence only with allow_dev=True
    signature    dev: the signature recovers to one of dev_roots
    dcap         tdx: the quote's signature chain verifies with dcap-qvl against the collateral and
                 its TCB status is allowed; skipped (with proves_nothing=True) when dcap-qvl or
                 collateral is missing, unless require_dcap=True, which refuses instead
    consistency  dev: MRTD is the code measurement padded with zeros, RTMRs are zero
    report_data  REPORTDATA equals the expected 64 bytes (binds worker key, run, nonce, code)
    debug        a TD with TUD.DEBUG only with allow_debug=True
    measurement  the measurement is in allowed_measurements, when that set is given

The measurement is sha256(MRTD||RTMR0..3) for tdx and the code measurement (REPORTDATA[32:64]) for
dev. On chain, WorkerRegistry keeps the allowlist; allowed_measurements is the same check off chain.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from .dev import WARNING as DEV_WARNING
from .dev import recover_dev_signer
from .errors import AttestationUnavailable, EvidenceError, PolicyViolation
from .evidence import Evidence, VerifiedEvidence
from .keys import WorkerKey, checksum_address, report_data
from .providers import EvidenceProvider
from .tdx import dcap_verify, measurement_of, parse_quote

log = logging.getLogger("dilocox.attestation")



@dataclass(frozen=True)
class Policy:
    """What a verifier accepts. The defaults accept hardware evidence only and refuse debug TDs.

    allow_dev             accept the dev provider's evidence (which proves nothing)
    allow_debug           accept TDs launched with TUD.DEBUG (host can read their memory)
    require_dcap          refuse tdx evidence whose signature chain cannot be checked
    dev_roots             addresses of trusted development roots (any hex case accepted)
    allowed_measurements  32-byte measurements accepted; None skips the check
    allowed_tcb_statuses  dcap-qvl TCB statuses accepted when DCAP verification runs
    """

    allow_dev: bool = False
    allow_debug: bool = False
    require_dcap: bool = False
    dev_roots: frozenset[str] = frozenset()
    allowed_measurements: frozenset[bytes] | None = None
    allowed_tcb_statuses: frozenset[str] = field(default_factory=lambda: frozenset({"UpToDate"}))

    def __post_init__(self) -> None:
        if isinstance(self.dev_roots, str):
            raise TypeError("dev_roots must be a collection of addresses, not one string")
        object.__setattr__(
            self, "dev_roots", frozenset(checksum_address(a) for a in self.dev_roots)
        )
        if self.allowed_measurements is not None:
            ms = frozenset(bytes(m) for m in self.allowed_measurements)
            bad = [m for m in ms if len(m) != 32]
            if bad:
                raise ValueError(f"allowed measurements must be 32 bytes; got {bad[0].hex()}")
            object.__setattr__(self, "allowed_measurements", ms)
        object.__setattr__(self, "allowed_tcb_statuses", frozenset(self.allowed_tcb_statuses))

    @classmethod
    def development(cls, *dev_roots: str, **kwargs: Any) -> Policy:
        """A policy that accepts dev evidence signed by these roots. It PROVES NOTHING."""
        return cls(allow_dev=True, dev_roots=frozenset(dev_roots), **kwargs)


def verify_evidence(
    evidence: Evidence | bytes,
    *,
    expected_report_data: bytes,
    policy: Policy,
    collateral: Any = None,
    now: int | None = None,
) -> VerifiedEvidence:
    """Check evidence against a policy and the REPORTDATA the verifier expects; see the module
    docstring for the checks. `collateral` (and `now`, unix seconds) go to dcap-qvl for tdx."""
    if not isinstance(expected_report_data, (bytes, bytearray)) or len(expected_report_data) != 64:
        raise ValueError("expected_report_data must be 64 bytes")
    expected_report_data = bytes(expected_report_data)
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a Policy, not {type(policy).__name__}")
    if not isinstance(evidence, Evidence):
        try:
            evidence = Evidence.from_bytes(evidence)
        except EvidenceError as exc:
            raise PolicyViolation("format", str(exc)) from None

    quote = parse_quote(evidence.quote)
    details = quote.details()
    warnings: list[str] = []

    if evidence.provider == "dev":
        if not policy.allow_dev:
            raise PolicyViolation(
                "provider",
                "evidence comes from the 'dev' provider, which proves nothing, and this policy "
                "does not allow it (allow_dev=False)",
            )
        if not policy.dev_roots:
            raise PolicyViolation("signature", "dev evidence, but the policy trusts no dev roots")
        try:
            signer = recover_dev_signer(evidence)
        except EvidenceError as exc:
            raise PolicyViolation("signature", str(exc)) from None
        if signer not in policy.dev_roots:
            raise PolicyViolation(
                "signature",
                f"dev evidence is signed by {signer}, which is not a trusted dev root "
                f"({', '.join(sorted(policy.dev_roots))})",
            )
        code = quote.report_data[32:64]
        if quote.mrtd != code + bytes(16) or any(r != bytes(48) for r in quote.rtmrs):
            raise PolicyViolation(
                "consistency",
                "dev quote's MRTD is not the code measurement REPORTDATA[32:64] padded with zeros, "
                "or its RTMRs are not zero",
            )
        measurement = code
        proves_nothing = True
        details["dev_root"] = signer
        warnings.append(DEV_WARNING)
    else:
        proves_nothing = False
        try:
            result = dcap_verify(quote.raw, collateral, now=now)
        except AttestationUnavailable as exc:
            if policy.require_dcap:
                raise PolicyViolation(
                    "dcap",
                    f"the policy requires a verified quote signature (require_dcap=True), but {exc}",
                ) from None
            proves_nothing = True
            warnings.append(
                f"TDX quote signature NOT verified ({exc}); without it anyone can forge this quote"
            )
        except EvidenceError as exc:
            raise PolicyViolation("dcap", str(exc)) from None
        else:
            if result.status not in policy.allowed_tcb_statuses:
                raise PolicyViolation(
                    "dcap",
                    f"TCB status {result.status!r} is not allowed "
                    f"({', '.join(sorted(policy.allowed_tcb_statuses))}); advisories: "
                    f"{', '.join(result.advisory_ids) or 'none'}",
                )
            details["tcb_status"] = result.status
            if result.advisory_ids:
                details["advisory_ids"] = ",".join(result.advisory_ids)
        measurement = measurement_of(quote)

    if quote.report_data != expected_report_data:
        raise PolicyViolation(
            "report_data",
            f"REPORTDATA is {quote.report_data.hex()}, expected {expected_report_data.hex()} "
            "(wrong worker key, run, nonce or code measurement)",
        )
    if quote.debug and not policy.allow_debug:
        raise PolicyViolation(
            "debug",
            "the TD was launched with TUD.DEBUG (its memory is readable by the host) and the "
            "policy does not allow debug TDs (allow_debug=False)",
        )
    if policy.allowed_measurements is not None and measurement not in policy.allowed_measurements:
        raise PolicyViolation(
            "measurement", f"measurement {measurement.hex()} is not in the policy's allowlist"
        )

    for warning in warnings:
        log.warning("accepted %s evidence: %s", evidence.provider, warning)
    return VerifiedEvidence(
        provider=evidence.provider,
        measurement=measurement,
        report_data=quote.report_data,
        debug=quote.debug,
        proves_nothing=proves_nothing,
        details=details,
        warnings=tuple(warnings),
    )


def attest(
    provider: EvidenceProvider,
    key: WorkerKey,
    run_id: bytes,
    nonce: bytes,
    code_measurement: bytes,
) -> Evidence:
    """Evidence from `provider` binding `key`'s address to run, join nonce and code measurement."""
    return provider.evidence(report_data(key.address, run_id, nonce, code_measurement))
