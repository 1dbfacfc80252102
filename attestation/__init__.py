"""attestation: TEE evidence providers and signed round reports (docs/trust.md).

    evidence     Evidence (canonical bytes, digest = on-chain evidenceDigest), VerifiedEvidence
    tdx          TDX quote v4/v5 parser, v4 builder, measurement_of, TdxProvider (configfs-tsm)
    dcap         DcapSettings, dcap_verify: every TDX quote verified with dcap-qvl, or refused
    dev          DevProvider / DevRoot: a software stand-in that PROVES NOTHING
    keys         WorkerKey (never logged or written out), report_data, recover_address
    measurement  code_measurement: sha256 of the measured code files and the run config CID
    policy       Policy, verify_evidence (the checks every provider shares), attest
    verifier     EvidenceVerifier interface, the registry of one verifier per provider
    tdx_verifier TdxVerifier: "tdx" evidence, through dcap-qvl
    dev_verifier DevVerifier: "dev" evidence, which PROVES NOTHING
    nvidia_gpu   GpuEvidence: an NVIDIA GPU's SPDM attestation report + chain, bounded and parsed;
                 Rim (reference measurements from a SWID tag)
    nvidia_gpu_verifier  GpuPolicy, NvidiaGpuVerifier: GPU evidence beside the quote, verified offline
    providers    EvidenceProvider interface, open_provider("tdx" | "dev")
    report       signed round reports (EIP-712)
"""

from .dcap import TCB_STATUSES, CollateralWindow, DcapResult, DcapSettings, dcap_verify
from .dev import WARNING as DEV_WARNING
from .dev import DevProvider, DevRoot, dev_quote_digest, recover_dev_signer
from .errors import AttestationError, AttestationUnavailable, EvidenceError, PolicyViolation
from .evidence import SCHEMA as EVIDENCE_SCHEMA
from .evidence import Evidence, Provider, VerifiedEvidence
from .keys import (
    WORKER_KEY_DOMAIN,
    SignatureError,
    WorkerKey,
    address_bytes,
    checksum_address,
    key_binding,
    recover_address,
    report_data,
)
from .measurement import DEFAULT_PACKAGES, code_manifest, code_measurement
from .nvidia_gpu import (
    MAX_GPU_CHAIN_BYTES,
    MAX_GPU_CHAIN_CERTS,
    MAX_GPU_REPORT_BYTES,
    GoldenMeasurement,
    GpuEvidence,
    GpuReport,
    Rim,
    chain_from_pem,
    parse_report,
    report_from_hex,
)
from .nvidia_gpu_verifier import GpuClaim, GpuPolicy, NvidiaGpuVerifier, nvidia_device_root
from .policy import Policy, attest, verify_evidence
from .providers import EvidenceProvider, open_provider
from .report import Domain, ReportError, RoundReport, SignedReport
from .verifier import (
    EvidenceVerifier,
    Expected,
    register_verifier,
    registered_providers,
    unregister_verifier,
    verifier_for,
)
from .tdx import (
    DEFAULT_TSM_PATH,
    TdxProvider,
    TdxQuote,
    TdxQuoteError,
    build_quote_v4,
    measurement_of,
    parse_quote,
)

__all__ = [
    "DEV_WARNING",
    "DevProvider",
    "DevRoot",
    "dev_quote_digest",
    "recover_dev_signer",
    "AttestationError",
    "AttestationUnavailable",
    "EvidenceError",
    "PolicyViolation",
    "EVIDENCE_SCHEMA",
    "Evidence",
    "Provider",
    "VerifiedEvidence",
    "WORKER_KEY_DOMAIN",
    "SignatureError",
    "WorkerKey",
    "address_bytes",
    "checksum_address",
    "key_binding",
    "recover_address",
    "report_data",
    "DEFAULT_PACKAGES",
    "code_manifest",
    "code_measurement",
    "MAX_GPU_CHAIN_BYTES",
    "MAX_GPU_CHAIN_CERTS",
    "MAX_GPU_REPORT_BYTES",
    "GoldenMeasurement",
    "GpuEvidence",
    "GpuReport",
    "Rim",
    "chain_from_pem",
    "parse_report",
    "report_from_hex",
    "GpuClaim",
    "GpuPolicy",
    "NvidiaGpuVerifier",
    "nvidia_device_root",
    "Policy",
    "attest",
    "verify_evidence",
    "EvidenceVerifier",
    "Expected",
    "register_verifier",
    "registered_providers",
    "unregister_verifier",
    "verifier_for",
    "EvidenceProvider",
    "open_provider",
    "Domain",
    "ReportError",
    "RoundReport",
    "SignedReport",
    "DEFAULT_TSM_PATH",
    "TdxProvider",
    "TdxQuote",
    "TdxQuoteError",
    "build_quote_v4",
    "TCB_STATUSES",
    "CollateralWindow",
    "DcapResult",
    "DcapSettings",
    "dcap_verify",
    "measurement_of",
    "parse_quote",
]
