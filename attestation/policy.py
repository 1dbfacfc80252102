"""Verification policy: which evidence a verifier accepts, and the one function that decides.

    verified = verify_evidence(evidence_or_bytes, expected_report_data=report_data(worker_address,
                               run_id, nonce, code_measurement), policy=Policy(...))

The verifier computes `code_measurement` itself (the coordinator: `code_measurement(config_cid)`
over its own code); nothing here takes it, or any other expected value, from the evidence.

Checks, in order; the first that fails raises PolicyViolation naming it. `provider` and the last
three are the checks every provider shares, made here; the others are made by the verifier
registered for the evidence's provider (attestation.verifier: tdx_verifier, dev_verifier):

    format       the bytes parse as Evidence (only when bytes are passed)
    provider     evidence of a provider that proves nothing (dev) only with allow_dev=True
    signature    dev: the signature recovers to one of dev_roots
    dcap         tdx: always. dcap-qvl verifies the quote's signature chain against the collateral
                 `policy.dcap` names, at `now`, and its TCB status must be allowed
                 (attestation.dcap); no collateral configured is a refusal. There is no path that
                 accepts a TDX quote unverified.
    consistency  dev: MRTD is REPORTDATA[32:64] padded with zeros, RTMRs are zero
    report_data  REPORTDATA equals the expected 64 bytes (binds worker key, run, nonce, code)
    debug        a TD with TUD.DEBUG only with allow_debug=True (dcap-qvl refuses debug TDs
                 itself, so this admits debug dev evidence only)
    measurement  the measurement is in allowed_measurements, when that set is given
    gpu          with `policy.gpu` set (a GpuPolicy): the record carries GPU evidence
                 (gpu_report, gpu_cert_chain) and attestation.nvidia_gpu_verifier accepts it, its
                 nonce being REPORTDATA[0:32], the same binding of worker key, run and join nonce
                 (checks gpu.chain, gpu.signature, gpu.request, gpu.nonce, gpu.fwid, gpu.mode,
                 gpu.debug, gpu.rim, gpu.measurement; gpu.format for malformed GPU evidence).
                 Without `policy.gpu`, GPU evidence a record carries is not verified, and the
                 result says so in its warnings.

The measurement is sha256(MRTD||RTMR0..3) for tdx, and for dev the code measurement the verifier
expected (equal to REPORTDATA[32:64] once report_data passed). On chain, WorkerRegistry keeps the
allowlist; allowed_measurements is the same check off chain. `proves_nothing` is True exactly for
dev evidence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from .dcap import DcapSettings
from .errors import EvidenceError, PolicyViolation
from .evidence import Evidence, VerifiedEvidence
from .keys import WorkerKey, checksum_address, report_data
from .nvidia_gpu_verifier import GpuPolicy, NvidiaGpuVerifier
from .providers import EvidenceProvider
from .verifier import EvidenceVerifier, Expected, verifier_for

log = logging.getLogger("dilocox.attestation")


@dataclass(frozen=True)
class Policy:
    """What a verifier accepts. The defaults accept hardware evidence only, refuse debug TDs, and
    (having no collateral) refuse every TDX quote until `dcap` says where collateral comes from.

    allow_dev             accept the dev provider's evidence, which PROVES NOTHING (default False)
    allow_debug           accept TDs launched with TUD.DEBUG (default False)
    dev_roots             addresses of trusted development roots (any hex case accepted)
    allowed_measurements  32-byte measurements accepted; None (default) skips the check
    dcap                  DcapSettings: collateral_file or pccs_url, allowed_tcb_statuses
                          (default {"UpToDate"}), pccs_timeout_s
    gpu                   GpuPolicy: require NVIDIA GPU evidence beside the quote, checked
                          against its pinned roots and RIMs (default None: not required)
    """

    allow_dev: bool = False
    allow_debug: bool = False
    dev_roots: frozenset[str] = frozenset()
    allowed_measurements: frozenset[bytes] | None = None
    dcap: DcapSettings = field(default_factory=DcapSettings)
    gpu: GpuPolicy | None = None

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
        if not isinstance(self.dcap, DcapSettings):
            raise TypeError(f"dcap must be DcapSettings, not {type(self.dcap).__name__}")
        if self.gpu is not None and not isinstance(self.gpu, GpuPolicy):
            raise TypeError(f"gpu must be a GpuPolicy or None, not {type(self.gpu).__name__}")

    @classmethod
    def development(cls, *dev_roots: str, **kwargs: Any) -> Policy:
        """A policy that accepts dev evidence signed by these roots. It PROVES NOTHING."""
        return cls(allow_dev=True, dev_roots=frozenset(dev_roots), **kwargs)


def _refuse_unless_allowed(verifier: EvidenceVerifier, policy: Policy) -> None:
    """A provider that proves nothing only with allow_dev, before its verifier reads anything."""
    if verifier.proves_nothing and not policy.allow_dev:
        raise PolicyViolation(
            "provider",
            f"evidence comes from the {str(verifier.name)!r} provider, which PROVES NOTHING, and this policy "
            "does not allow it (allow_dev=False)",
        )


def _check_claim(claim: VerifiedEvidence, expected_report_data: bytes, policy: Policy) -> None:
    """The checks every provider's claim must pass: REPORTDATA, debug, the allowlist."""
    if claim.report_data != expected_report_data:
        raise PolicyViolation(
            "report_data",
            f"REPORTDATA is {claim.report_data.hex()}, expected {expected_report_data.hex()} "
            "(wrong worker key, run, nonce or code measurement)",
        )
    if claim.debug and not policy.allow_debug:
        raise PolicyViolation(
            "debug",
            "the TD was launched with TUD.DEBUG (its memory is readable by the host) and the "
            "policy does not allow debug TDs (allow_debug=False)",
        )
    if policy.allowed_measurements is not None and claim.measurement not in policy.allowed_measurements:
        raise PolicyViolation(
            "measurement", f"measurement {claim.measurement.hex()} is not in the policy's allowlist"
        )


GPU_NOT_VERIFIED = "GPU evidence is carried but was not verified: the policy has no gpu settings"


def _check_gpu(evidence: Evidence, claim: VerifiedEvidence, expected_report_data: bytes, policy: Policy,
               now: int | None) -> VerifiedEvidence:
    """GPU evidence beside the quote: required and verified when the policy has gpu settings."""
    if policy.gpu is None:
        if evidence.gpu is None:
            return claim
        return replace(claim, warnings=claim.warnings + (GPU_NOT_VERIFIED,))
    if evidence.gpu is None:
        raise PolicyViolation(
            "gpu", "this policy requires GPU evidence (gpu_report, gpu_cert_chain) and the record carries none"
        )
    gpu = NvidiaGpuVerifier().verify(evidence.gpu, expected_nonce=expected_report_data[:32], policy=policy.gpu,
                                     now=now)
    return replace(claim, gpu=gpu, details={**claim.details, **gpu.details()})


def verify_evidence(
    evidence: Evidence | bytes,
    *,
    expected_report_data: bytes,
    policy: Policy,
    now: int | None = None,
    log_acceptance: bool = True,
) -> VerifiedEvidence:
    """Check evidence against a policy and the REPORTDATA the verifier expects; see the module
    docstring for the checks. `now` (unix seconds, default the real clock) is the time at which
    dcap-qvl judges the collateral and certificates of tdx evidence, and the GPU certificate chain
    is judged. `log_acceptance`: log what was
    accepted (an auditor that reports every admission itself turns it off, so dev evidence is said
    once per audit, not once per worker)."""
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

    verifier = verifier_for(evidence.provider)
    _refuse_unless_allowed(verifier, policy)
    claim = verifier.verify(evidence, Expected(expected_report_data, now), policy)
    _check_claim(claim, expected_report_data, policy)
    claim = _check_gpu(evidence, claim, expected_report_data, policy, now)
    if log_acceptance:
        (log.warning if claim.proves_nothing else log.info)(verifier.acceptance(claim))
        if claim.gpu is not None:
            log.info(NvidiaGpuVerifier().acceptance(claim.gpu))
    return claim


def attest(
    provider: EvidenceProvider,
    key: WorkerKey,
    run_id: bytes,
    nonce: bytes,
    code_measurement: bytes,
) -> Evidence:
    """Evidence from `provider` binding `key`'s address to run, join nonce and code measurement."""
    return provider.evidence(report_data(key.address, run_id, nonce, code_measurement))
