"""The verifier of "dev" evidence: the software stand-in of attestation.dev, which PROVES NOTHING.

    well formed  the quote parses in the TDX v4 layout the dev provider writes, the record carries a
                 65-byte dev_signature, and the quote's QE vendor id is the dev marker
    verify       signature    the policy trusts some dev root, and the dev_signature recovers to one
                 consistency  MRTD is REPORTDATA[32:64] padded with zeros, the RTMRs are zero

A policy admits dev evidence only with allow_dev=True; that check, like REPORTDATA, debug and the
allowlist, is policy.verify_evidence's, before and after this verifier. The measurement of dev
evidence is the code measurement the verifier expected (REPORTDATA[32:64] once REPORTDATA passed).

Its evidence keeps the TDX-shaped quote of the v1 wire format; a dev format of its own would be a
new provider name (a new evidence schema) with its own record fields, read by a verifier like this.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .dev import DEV_QE_VENDOR_ID, WARNING, recover_dev_signer
from .errors import EvidenceError, PolicyViolation
from .evidence import Evidence, Provider, VerifiedEvidence, check_dev_signature
from .tdx import parse_quote

if TYPE_CHECKING:  # pragma: no cover
    from .policy import Policy
    from .verifier import Expected


class DevVerifier:
    """Verifies "dev" evidence: signed by a trusted dev root and self-consistent (module docstring)."""

    name = Provider.DEV
    proves_nothing = True
    measures_code = True
    carries_dev_signature = True

    def canonical_quote(self, evidence: Evidence) -> bytes:
        quote = parse_quote(bytes(evidence.quote))  # raises TdxQuoteError (an EvidenceError) by field
        check_dev_signature(evidence, carried=True)
        if quote.qe_vendor_id != DEV_QE_VENDOR_ID:
            raise EvidenceError(
                "dev evidence: QE vendor id at offset 12 is "
                f"{quote.qe_vendor_id.hex()}, expected the dev marker {DEV_QE_VENDOR_ID.hex()}"
            )
        return quote.raw

    def verify(self, evidence: Evidence, expected: Expected, policy: Policy) -> VerifiedEvidence:
        quote = parse_quote(evidence.quote)
        details = quote.details()
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
        if quote.mrtd != quote.report_data[32:64] + bytes(16) or any(r != bytes(48) for r in quote.rtmrs):
            raise PolicyViolation(
                "consistency",
                "dev quote's MRTD is not REPORTDATA[32:64] padded with zeros, or its RTMRs are not zero",
            )
        details["dev_root"] = signer
        details["evidence"] = "DEV: PROVES NOTHING"
        return VerifiedEvidence(
            provider=self.name, measurement=expected.code_measurement, report_data=quote.report_data,
            debug=quote.debug, proves_nothing=True, label="DEV evidence: PROVES NOTHING",
            details=details, warnings=(WARNING,),
        )

    def acceptance(self, verified: VerifiedEvidence) -> str:
        return f"accepted DEV evidence, which PROVES NOTHING: {WARNING}"
