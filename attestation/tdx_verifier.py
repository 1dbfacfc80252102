"""The verifier of "tdx" evidence: an Intel TDX quote (v4 or v5) verified through DCAP.

    well formed  the quote parses (attestation.tdx.parse_quote, refusals name the field), the record
                 carries no dev_signature, and the quote is not the dev provider's (its QE vendor id
                 is not the dev marker: dev quotes prove nothing and must say so)
    verify       dcap-qvl verifies the quote's signature chain and TCB status against the collateral
                 ``policy.dcap`` names, at ``expected.now`` (attestation.dcap); every failure is
                 PolicyViolation("dcap"). There is no path that accepts a TDX quote unverified.

The measurement it returns is the hardware one, sha256(MRTD||RTMR0..3) (attestation.tdx); the
checks every provider shares (REPORTDATA, debug, allowlist) are policy.verify_evidence's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .dcap import dcap_verify
from .dev import DEV_QE_VENDOR_ID
from .errors import EvidenceError
from .evidence import Evidence, Provider, VerifiedEvidence, check_dev_signature
from .tdx import measurement_of, parse_quote

if TYPE_CHECKING:  # pragma: no cover
    from .policy import Policy
    from .verifier import Expected


class TdxVerifier:
    """Verifies "tdx" evidence with dcap-qvl (module docstring)."""

    name = Provider.TDX
    proves_nothing = False
    measures_code = False
    carries_dev_signature = False

    def canonical_quote(self, evidence: Evidence) -> bytes:
        quote = parse_quote(bytes(evidence.quote))  # raises TdxQuoteError (an EvidenceError) by field
        check_dev_signature(evidence, carried=False)
        if quote.qe_vendor_id == DEV_QE_VENDOR_ID:
            raise EvidenceError(
                "evidence labelled 'tdx' carries a dev-provider quote (QE vendor id "
                f"{DEV_QE_VENDOR_ID!r}); dev quotes prove nothing and must say so"
            )
        return quote.raw

    def verify(self, evidence: Evidence, expected: Expected, policy: Policy) -> VerifiedEvidence:
        quote = parse_quote(evidence.quote)
        details = quote.details()
        result = dcap_verify(quote.raw, policy.dcap, now=expected.now)
        details["tcb_status"] = result.status
        details["advisory_ids"] = ",".join(result.advisory_ids)
        details["collateral"] = result.collateral_source
        details["collateral_next_update"] = str(result.collateral_window.next_update)
        details["verified_at"] = str(result.verified_at)
        return VerifiedEvidence(
            provider=self.name, measurement=measurement_of(quote), report_data=quote.report_data,
            debug=quote.debug, proves_nothing=False,
            label=f"{self.name} quote verified by dcap-qvl (TCB {result.status})", details=details,
        )

    def acceptance(self, verified: VerifiedEvidence) -> str:
        return (f"accepted tdx evidence: dcap-qvl verified the quote (TCB {verified.details['tcb_status']}, "
                f"{verified.details['collateral']})")
