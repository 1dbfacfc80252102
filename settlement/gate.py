"""The coordinator's trust gate: who may join, whose updates count, which reports are kept.

docs/trust.md has the whole design. In short:

  Challenge   a nonce bound to the asking worker id (``JoinNonces``): valid for one Join of that
              id within ``NONCE_TTL_S``; nothing is stored per challenge, so no caller can evict
              or overwrite another's nonce.
  Join        evidence over REPORTDATA(address, runId, nonce, code measurement) must pass the
              policy and name an allowlisted measurement; every byte of REPORTDATA is derived here
              (the code measurement is this coordinator's own, of its code and the run's config),
              none taken from the evidence. The admission record goes to the store and
              ``admitWorker`` to the registry (skipped for a key that is already active); once mined,
              the admission is kept in the ledger outbox, to be re-sent to a chain that comes back
              without it (settlement.outbox).
  FetchGlobal the coordinator signs what a worker trains from (attestation.signing.global_digest).
  PushUpdate  the header is signed by the admitted key (attestation.signing.update_digest).
  Report      a participant's EIP-712 RoundReport must be signed by its key and say what the round's
              manifest says, field by field (attestation.report.manifest_claims, the rule the audit
              re-checks); settlement.report_book keeps it until its round goes to the ledger.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from attestation import (
    Evidence,
    EvidenceError,
    Policy,
    PolicyViolation,
    ReportError,
    SignatureError,
    SignedReport,
    checksum_address,
    recover_address,
    report_data,
    verify_evidence,
)
from attestation.admission import admission_record
from attestation.report import Domain, manifest_claims, report_differences
from attestation.signing import update_digest
from settlement.chain import ChainError
from settlement.ledger import Deployment, Registry
from settlement.outbox import Outbox
from storage_client import CID, Manifest, Store
from trainer.net.refusal import Reason, Refusal

log = logging.getLogger("dilocox.trust")

NONCE_TTL_S = 300.0


@dataclass
class JoinNonces:
    """Challenge nonces that cost no memory until they are used.

        nonce = uint64be(issued, ms) ‖ HMAC-SHA256(secret, "dilocox/nonce/v1" ‖ worker id ‖ issued)[:24]

    A nonce is valid for a Join of the worker id it was issued to, within ``ttl_s``, once: spent
    nonces are remembered until they expire (one entry per Join that presented a genuine nonce, so
    their number is bounded by the Join rate limit times ``ttl_s``). The secret lives in this
    process only, so a restart invalidates outstanding nonces (the worker asks again).
    """

    ttl_s: float = NONCE_TTL_S
    clock: Callable[[], float] = time.time
    _secret: bytes = field(default_factory=lambda: os.urandom(32))
    _used: dict[bytes, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _mac(self, worker_id: str, issued: bytes) -> bytes:
        return hmac.new(self._secret, b"dilocox/nonce/v1" + worker_id.encode() + issued, hashlib.sha256).digest()[:24]

    def issue(self, worker_id: str) -> bytes:
        issued = int(self.clock() * 1000).to_bytes(8, "big")
        return issued + self._mac(worker_id, issued)

    def take(self, worker_id: str, nonce: bytes) -> None:
        """Spend ``nonce`` for a Join of ``worker_id``, or refuse it by name."""
        if len(nonce) != 32 or not hmac.compare_digest(nonce[8:], self._mac(worker_id, nonce[:8])):
            raise Refusal(Reason.BAD_NONCE,
                          f"worker {worker_id!r}: the join nonce was not issued to this worker id by this "
                          f"coordinator; ask for a new Challenge")
        now = self.clock()
        age = now - int.from_bytes(nonce[:8], "big") / 1000
        if not 0 <= age <= self.ttl_s:
            raise Refusal(Reason.BAD_NONCE,
                          f"worker {worker_id!r}: the join nonce expired (valid for {self.ttl_s:.0f}s)")
        with self._lock:
            self._used = {n: t for n, t in self._used.items() if t > now}
            if nonce in self._used:
                raise Refusal(Reason.BAD_NONCE,
                              f"worker {worker_id!r}: the join nonce was already used; ask for a new Challenge")
            self._used[nonce] = now + self.ttl_s


@dataclass
class TrustGate:
    """Admission, update signatures and report checks for one run (thread-safe)."""

    store: Store
    registry: Registry
    policy: Policy
    run_id: bytes
    domain: Domain
    code: bytes  # the code measurement every worker must attest to: this coordinator's code and config
    verification_time: int | None = None
    nonces: JoinNonces = field(default_factory=JoinNonces)
    # Where each admission is kept once mined, to be re-sent to a chain that comes back without it
    # (settlement.outbox.Outbox.archive_admission); None: not kept (a gate without a ledger outbox).
    outbox: Outbox | None = None

    def challenge(self, worker_id: str) -> bytes:
        return self.nonces.issue(worker_id)

    def admit(self, worker_id: str, address: str, evidence_bytes: bytes, nonce: bytes) -> str:
        """Verify a joining worker's evidence and admit its key on chain; returns the address."""
        try:
            address = checksum_address(address)
        except ValueError as exc:
            raise Refusal(Reason.MALFORMED, f"worker {worker_id!r}: bad address: {exc}") from exc
        if not evidence_bytes:
            raise Refusal(Reason.NO_EVIDENCE,
                          f"worker {worker_id!r} sent no attestation evidence; this run requires it")
        self.nonces.take(worker_id, nonce)
        try:
            evidence = Evidence.from_bytes(evidence_bytes)
            verified = verify_evidence(
                evidence, expected_report_data=report_data(address, self.run_id, nonce, self.code),
                policy=self.policy, now=self.verification_time,
            )
        except PolicyViolation as exc:
            raise Refusal(Reason.NOT_ADMITTED,
                          f"worker {worker_id!r}: evidence refused ({exc.check}): {exc}") from exc
        except (ValueError, EvidenceError) as exc:
            raise Refusal(Reason.MALFORMED,
                          f"worker {worker_id!r}: malformed evidence: {exc}") from exc
        try:
            if not self.registry.is_measurement_allowed(verified.measurement):
                raise Refusal(Reason.NOT_ADMITTED,
                              f"worker {worker_id!r}: measurement 0x{verified.measurement.hex()} is not "
                              f"on the registry's allowlist")
            if self.registry.is_active(address):
                log.info("worker %s: key %s is already admitted; fresh evidence checked", worker_id, address)
                return address
            evidence_cid = self.store.put(evidence_bytes)
            record = self.store.put_json(admission_record(
                worker=address, run_id=self.run_id, nonce=nonce, measurement=verified.measurement,
                code_measurement=self.code, provider=verified.provider, evidence=evidence_cid,
            ))
            self.registry.admit_worker(address, verified.measurement, record.digest)
            if self.outbox is not None:
                self.outbox.archive_admission(self.run_id, address, verified.measurement, record.digest)
        except ChainError as exc:
            raise Refusal(Reason.CHAIN_UNAVAILABLE,
                          f"worker {worker_id!r} cannot be admitted now: {exc}") from exc
        note = (f" ({verified.provider.upper()} evidence: PROVES NOTHING)" if verified.proves_nothing
                else f" ({verified.provider} evidence)")
        log.info("worker %s admitted as %s, measurement 0x%s, record %s%s", worker_id, address,
                 verified.measurement.hex()[:16], record, note)
        return address

    def check_update(self, worker_id: str, address: str | None, round_: int, stage: int, num_stages: int,
                     sha256_hex: str, signature: bytes) -> None:
        if address is None:
            raise Refusal(Reason.NOT_ADMITTED, f"worker {worker_id!r} has no admitted key in this run")
        try:
            signer = recover_address(update_digest(self.run_id, round_, stage, num_stages, sha256_hex), signature)
        except SignatureError as exc:
            raise Refusal(Reason.BAD_SIGNATURE, f"update signature refused: {exc}") from exc
        if signer != address:
            raise Refusal(Reason.BAD_SIGNATURE, f"update for round {round_} is signed by {signer}, not by worker "
                                                f"{worker_id!r}'s admitted key {address}")

    def check_report(self, worker_id: str, address: str | None, signed: SignedReport, manifest_cid: CID,
                     manifest: Manifest, parent: Manifest, data_digest: bytes) -> None:
        """A participant's report must be signed by its key and restate the manifest exactly."""
        r = signed.report
        if address is None:
            raise Refusal(Reason.NOT_ADMITTED, f"worker {worker_id!r} has no admitted key")
        try:
            signed.verify(self.domain)
        except ReportError as exc:
            raise Refusal(Reason.BAD_SIGNATURE, str(exc)) from exc
        if r.worker != address:
            raise Refusal(Reason.BAD_SIGNATURE,
                          f"report names worker {r.worker}, but {worker_id!r} is admitted as {address}")
        entry = {p.worker: p for p in manifest.participants}.get(worker_id)
        if entry is None:
            raise Refusal(Reason.NOT_PARTICIPANT, f"worker {worker_id!r} did not contribute to round {manifest.round}")
        claims = manifest_claims(self.run_id, manifest_cid.digest, manifest, parent, entry, data_digest)
        wrong = report_differences(r, claims)
        if wrong:
            raise Refusal(Reason.BAD_CLAIM, f"report for round {r.round}: {wrong[0]}")


@dataclass(frozen=True)
class TrustSettings:
    """How a coordinator reaches the ledger. The key is the coordinator's chain account (it is
    the run's coordinator on the ledger and a verifier in the registry); never logged."""

    rpc_url: str
    private_key: bytes
    deployment: Deployment
    policy: Policy
    report_timeout_s: float = 30.0
    verification_time: int | None = None  # unix seconds evidence is verified at; None: the clock
    confirmations: int = 1  # blocks deep a round must be before its outbox copy is set aside
    challenge_window: int = 0  # blocks before a recorded round's rewards can be claimed (CLI: --challenge-window)

    def __repr__(self) -> str:
        return f"TrustSettings(rpc_url={self.rpc_url!r}, ledger={self.deployment.ledger}, key=<hidden>)"
