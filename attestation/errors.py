"""The exceptions of the attestation package, in one place so every module can raise them.

    EvidenceError           bytes that are not well-formed evidence (a quote, an evidence record)
    AttestationError        a provider could not produce evidence
    AttestationUnavailable  ... because this machine has no such provider (no TEE, no configfs-tsm)
    PolicyViolation         evidence is well formed but a verification policy refuses it
"""

from __future__ import annotations

from storage_client import DilocoxError


class EvidenceError(ValueError):
    """Raised when evidence bytes (a quote, a serialised Evidence record) are malformed."""


class AttestationError(DilocoxError, RuntimeError):
    """Raised when a provider fails to produce evidence."""


class AttestationUnavailable(AttestationError):
    """Raised when the requested provider does not exist on this machine."""


class PolicyViolation(DilocoxError):
    """Raised when verification refuses evidence; `check` names the check that failed.

    Checks: "format", "provider", "signature", "dcap", "consistency", "report_data",
    "debug", "measurement".
    """

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check = check
        self.message = message
