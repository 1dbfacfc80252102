"""One verifier per attestation provider, behind one interface, chosen by the evidence's provider.

Evidence names its provider (``Evidence.provider``, the JSON ``provider``); the verifier registered
under that name is the only code that reads the provider's quote:

    verifier = verifier_for(evidence.provider)     # EvidenceError for a name nobody registered
    verifier.canonical_quote(evidence)             # at Evidence construction: well formed or refused
    claim = verifier.verify(evidence, expected, policy)  # signature chain, TCB, ...: PolicyViolation

What every provider's claim must then satisfy is checked once, outside the providers, by
``policy.verify_evidence``: the policy's allow_dev for providers that prove nothing (before the
verifier runs), then on the returned claim REPORTDATA = the expected 64 bytes (worker key, run,
nonce, code measurement), no debug TD unless allowed, and the measurement on the allowlist.

Adding a TEE is one new module with a class that has this interface, plus one
``register_verifier(...)`` line at the end of this module (a test registers its own and unregisters
it again). The built-ins:

    tdx  attestation.tdx_verifier.TdxVerifier  TDX quote v4/v5 through dcap-qvl (attestation.dcap)
    dev  attestation.dev_verifier.DevVerifier  the software stand-in that PROVES NOTHING

GPU evidence (NVIDIA confidential-computing GPUs) is not a provider: it measures the GPU, not the
code, and has no REPORTDATA to bind the code measurement, so it travels beside any provider's quote
(the record's gpu_report / gpu_cert_chain) and policy.verify_evidence checks it with
attestation.nvidia_gpu_verifier.NvidiaGpuVerifier when the policy's ``gpu`` settings require it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .errors import EvidenceError
from .evidence import _shown

if TYPE_CHECKING:  # pragma: no cover
    from .evidence import Evidence, VerifiedEvidence
    from .policy import Policy


@dataclass(frozen=True)
class Expected:
    """What the verifier expects of evidence, all derived by the verifier itself, none read from it.

    report_data  the 64 bytes REPORTDATA must equal: report_data(worker address, run id, nonce,
                 code measurement); its last 32 bytes are the verifier's own code measurement
    now          unix seconds at which collateral and certificates are judged (None: the clock)
    """

    report_data: bytes
    now: int | None = None

    @property
    def code_measurement(self) -> bytes:
        """The verifier's own code measurement (REPORTDATA[32:64])."""
        return self.report_data[32:64]


class EvidenceVerifier(Protocol):
    """What a provider's verifier offers.

    name                   the evidence's ``provider`` it verifies; its registry key
    proves_nothing         evidence a policy accepts only with allow_dev (a software stand-in)
    measures_code          its measurement is the code measurement itself (REPORTDATA[32:64]),
                           not a hardware measurement of the code
    carries_dev_signature  its evidence record carries a ``dev_signature`` beside the quote
                           (the v1 evidence wire format has that one extra field)
    """

    name: str
    proves_nothing: bool
    measures_code: bool
    carries_dev_signature: bool

    def canonical_quote(self, evidence: Evidence) -> bytes:
        """The quote of well-formed evidence without trailing padding; EvidenceError naming the
        field otherwise. Says nothing about whether the evidence is true."""
        ...

    def verify(self, evidence: Evidence, expected: Expected, policy: Policy) -> VerifiedEvidence:
        """The provider's own checks (signatures, collateral, TCB); PolicyViolation naming the
        check that failed. Returns the claim the shared checks then judge."""
        ...

    def acceptance(self, verified: VerifiedEvidence) -> str:
        """One line to log once evidence is accepted."""
        ...


_VERIFIERS: dict[str, EvidenceVerifier] = {}


def register_verifier(verifier: EvidenceVerifier) -> None:
    """Make `verifier` the one for evidence whose provider is `verifier.name`."""
    name = str(verifier.name)
    if name in _VERIFIERS:
        raise ValueError(f"an evidence verifier for provider {name!r} is registered already")
    _VERIFIERS[name] = verifier


def unregister_verifier(name: str) -> None:
    """Forget the verifier of provider `name` (tests that register their own clean up with this)."""
    _VERIFIERS.pop(str(name), None)


def registered_providers() -> tuple[str, ...]:
    """The provider names that have a verifier, in registration order."""
    return tuple(_VERIFIERS)


def verifier_for(provider: object) -> EvidenceVerifier:
    """The verifier of `provider` (untrusted: EvidenceError naming the known providers if none)."""
    verifier = _VERIFIERS.get(provider) if isinstance(provider, str) else None
    if verifier is None:
        raise EvidenceError(f"unknown evidence provider {_shown(provider)}; known: {registered_providers()}")
    return verifier


# The registry of built-in providers: one line per provider.
from .tdx_verifier import TdxVerifier  # noqa: E402  (the verifiers import Expected from here)
from .dev_verifier import DevVerifier  # noqa: E402

register_verifier(TdxVerifier())
register_verifier(DevVerifier())
