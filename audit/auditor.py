"""An auditor as an attested party (docs/trust.md "Disputes"): its key, its evidence, its admission.

An auditor's secp256k1 key is made inside the process that audits, under its attestation provider
(the TDX provider, or the dev stand-in that PROVES NOTHING), exactly as a worker's is: its evidence
binds the key to the run and to the *audit code's* measurement through REPORTDATA

    REPORTDATA = sha256("dilocox/worker-key/v1" ‖ auditor address ‖ runId ‖ nonce) ‖ audit code measurement
    audit code measurement = attestation.audit_code_measurement(config CID)   (the worker's packages + audit/)

Admission (``admit``) is what the disputes contract's owner runs — the ledger's deployer, who owns the
worker registry, never the run's coordinator: it derives the expected REPORTDATA itself, verifies
the evidence under its policy, keeps the evidence and an admission record (attestation.admission,
the same record a worker's admission writes) in the run's store, and admits the key to the run with
the record's digest; it sets the run's threshold to 1 if none is set (the demo's 1 of 1). The key
never leaves the ``Auditor`` object: a verdict is signed in the process that attested.

A persistent auditor (``Auditor.open(DIR, …)``, ``dilocox audit --auditor-dir DIR``) is attested once
and keeps, in DIR, what it reuses across audits of one run:

    DIR/auditor.key    its key (0x + 64 hex, mode 0600; never logged)
    DIR/auditor.json   {"schema": "dilocox.auditor/v1", "auditor", "run_id", "nonce", "config"}
    DIR/evidence.bin   its Evidence bytes (the REPORTDATA above, for that nonce and config CID)

The owner admits it as a separate step from the public part alone (``AuditorCredentials.load``:
auditor.json and evidence.bin, never the key; ``dilocox settle admit-auditor``), verifying its
evidence as ``admit`` always does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from attestation import Evidence, EvidenceProvider, Policy, WorkerKey, attest, report_data, verify_evidence
from attestation.admission import admission_record
from attestation.evidence import MAX_EVIDENCE_BYTES
from attestation.measurement import audit_code_measurement
from attestation.verdict import Verdict
from settlement.disputes import Disputes
from settlement.provision import read_key_file
from storage_client import CID, Store, canonical_json, hex32, loads_bounded, unhex32, write_atomic

log = logging.getLogger("dilocox.audit")

AUDITOR_SCHEMA = "dilocox.auditor/v1"
KEY_FILE, IDENTITY_FILE, EVIDENCE_FILE = "auditor.key", "auditor.json", "evidence.bin"
MAX_IDENTITY_JSON = 4 << 10  # four short fields


class AuditorDirError(ValueError):
    """An auditor directory that is missing a file, bound to another run, or not one (names the file)."""


class AttestedAuditor(Protocol):
    """What admission reads of an auditor: its address and what binds it (never its key)."""

    @property
    def address(self) -> str: ...

    run_id: bytes
    nonce: bytes
    evidence: Evidence


@dataclass(frozen=True)
class AuditorCredentials:
    """The public part of a persistent auditor (its directory without the key): what the owner admits."""

    address: str
    run_id: bytes
    nonce: bytes
    evidence: Evidence
    config_cid: str

    @classmethod
    def load(cls, directory: Path) -> AuditorCredentials:
        """DIR/auditor.json and DIR/evidence.bin, read bounded and strictly (AuditorDirError naming the file)."""
        from attestation import EvidenceError, checksum_address

        identity, evidence = Path(directory) / IDENTITY_FILE, Path(directory) / EVIDENCE_FILE
        try:
            obj = loads_bounded(_read(identity, MAX_IDENTITY_JSON), max_bytes=MAX_IDENTITY_JSON, what=str(identity))
            if not isinstance(obj, dict) or set(obj) != {"schema", "auditor", "run_id", "nonce", "config"} \
                    or obj["schema"] != AUDITOR_SCHEMA:
                raise ValueError(f"not an {AUDITOR_SCHEMA} object of exactly schema, auditor, run_id, nonce, config")
            config = CID.parse(obj["config"]) if isinstance(obj["config"], str) else None
            if config is None:
                raise ValueError("config must be a CID")
            fields = (checksum_address(obj["auditor"]), unhex32(obj["run_id"], "run_id"),
                      unhex32(obj["nonce"], "nonce"))
        except ValueError as exc:  # JSONBoundsError, InvalidCIDError and bad addresses are ValueErrors
            raise AuditorDirError(f"{identity}: {str(exc)[:200]}") from None
        try:
            loaded = Evidence.from_bytes(_read(evidence, MAX_EVIDENCE_BYTES))
        except EvidenceError as exc:
            raise AuditorDirError(f"{evidence}: not evidence ({str(exc)[:160]})") from None
        return cls(*fields, loaded, str(config))


@dataclass(frozen=True)
class Auditor:
    """An attested auditor key for one run: its key (kept here only), the nonce and evidence that bind it."""

    key: WorkerKey
    run_id: bytes
    nonce: bytes
    evidence: Evidence

    @property
    def address(self) -> str:
        return self.key.address

    @classmethod
    def attest(cls, provider: EvidenceProvider, run_id: bytes, config_cid: str) -> Auditor:
        """A fresh key, attested by ``provider`` as bound to ``run_id`` and the audit code's measurement."""
        key = WorkerKey.generate()
        nonce = os.urandom(32)
        evidence = attest(provider, key, run_id, nonce, audit_code_measurement(config_cid))
        return cls(key, run_id, nonce, evidence)

    @classmethod
    def open(cls, directory: Path, provider: Callable[[], EvidenceProvider] | None, run_id: bytes,
             config_cid: str) -> Auditor:
        """The auditor kept in ``directory`` for ``run_id``; attested by ``provider()`` (opened only
        then) and kept there first when the directory holds none (``provider`` None: it must hold one).

        @raise AuditorDirError when it holds another run's auditor, a key that is not its address's,
            or broken files
        """
        directory = Path(directory)
        if not (directory / IDENTITY_FILE).exists():
            if provider is None:
                raise AuditorDirError(f"{directory} holds no auditor ({IDENTITY_FILE})")
            auditor = cls.attest(provider(), run_id, config_cid)
            auditor.save(directory, config_cid)
            log.info("auditor %s attested for run 0x%s… and kept in %s", auditor.address, run_id.hex()[:12], directory)
            return auditor
        public = AuditorCredentials.load(directory)
        if public.run_id != run_id or public.config_cid != config_cid:
            raise AuditorDirError(f"{directory} holds the auditor of run 0x{public.run_id.hex()[:12]}… (config "
                                  f"{public.config_cid}), not of this one: use one directory per run")
        key = WorkerKey(read_key_file(directory / KEY_FILE, f"auditor key {directory / KEY_FILE}"))
        if key.address != public.address:
            raise AuditorDirError(f"{directory / KEY_FILE} is not the key of {public.address} ({IDENTITY_FILE})")
        return cls(key, public.run_id, public.nonce, public.evidence)

    def save(self, directory: Path, config_cid: str) -> None:
        """Keep this auditor in ``directory`` (module docstring); auditor.json last, so that a directory
        with one is whole (a crash before it leaves an auditor to attest again)."""
        directory = Path(directory)
        self.key.save(directory / KEY_FILE)
        write_atomic(directory / EVIDENCE_FILE, self.evidence.to_bytes())
        write_atomic(directory / IDENTITY_FILE, canonical_json({
            "schema": AUDITOR_SCHEMA, "auditor": self.address, "run_id": hex32(self.run_id, "run_id"),
            "nonce": hex32(self.nonce, "nonce"), "config": config_cid}) + b"\n")

    def sign(self, verdict: Verdict, disputes: Disputes) -> bytes:
        """This auditor's signature over ``verdict`` in the disputes contract's domain."""
        return self.key.sign_digest(verdict.digest(disputes.domain()))


def _read(path: Path, limit: int) -> bytes:
    """At most ``limit`` + 1 bytes of ``path`` (AuditorDirError naming it when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read(limit + 1)
    except OSError as exc:
        raise AuditorDirError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None


def admit(owner: Disputes, store: Store, auditor: AttestedAuditor, config_cid: str, policy: Policy) -> CID:
    """Verify ``auditor``'s evidence as the disputes contract's owner and admit its key to the run;
    returns the admission record's CID. A key admitted already is left as it is.

    @raise attestation.PolicyViolation when the evidence does not bind the key to the audit code
    @raise settlement.TxReverted naming the contract's refusal (not the owner, the run's coordinator, …)
    """
    run_id = auditor.run_id
    measurement = audit_code_measurement(config_cid)
    expected = report_data(auditor.address, run_id, auditor.nonce, measurement)
    verified = verify_evidence(auditor.evidence, expected_report_data=expected, policy=policy)
    evidence_cid = store.put(auditor.evidence.to_bytes())
    record = store.put_json(admission_record(worker=auditor.address, run_id=run_id, nonce=auditor.nonce,
                                             measurement=verified.measurement, code_measurement=measurement,
                                             provider=verified.provider, evidence=evidence_cid))
    if not owner.is_auditor(run_id, auditor.address):
        owner.admit_auditor(run_id, auditor.address, verified.measurement, record.digest)
        if owner.panel_of(run_id)[1] == 0:
            owner.set_threshold(run_id, 1)
    note = f" ({verified.provider.upper()} evidence: PROVES NOTHING)" if verified.proves_nothing else ""
    log.info("auditor %s admitted to run 0x%s…, record %s%s", auditor.address, run_id.hex()[:12], record, note)
    return record
