"""The coordinator's trust gate: who may join, whose updates count, which reports get settled.

docs/trust.md has the whole design. In short:

  Challenge   a nonce bound to the asking worker id (``JoinNonces``): valid for one Join of that
              id within ``NONCE_TTL_S``; nothing is stored per challenge, so no caller can evict
              or overwrite another's nonce.
  Join        evidence over REPORTDATA(address, runId, nonce, code measurement) must pass the
              policy and name an allowlisted measurement; every byte of REPORTDATA is derived here
              (the code measurement is this coordinator's own, of its code and the run's config),
              none taken from the evidence. The admission record goes to the store and
              ``admitWorker`` to the registry (skipped for a key that is already active).
  FetchGlobal the coordinator signs what a worker trains from (``global_digest``).
  PushUpdate  the header is signed by the admitted key: sha256("dilocox/update/v2" ‖ runId ‖
              uint64be(round) ‖ uint32be(stage) ‖ uint32be(num_stages) ‖ payload sha256).
  Report      a participant's EIP-712 RoundReport must be signed by its key and agree with the
              round's manifest field by field; complete rounds go, in order, to the outbox that
              records them on the ledger.
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

import grpc

from attestation import (
    Evidence, EvidenceError, Policy, PolicyViolation, ReportError, SignatureError, SignedReport,
    checksum_address, code_measurement, recover_address, report_data, verify_evidence,
)
from attestation.admission import admission_record
from attestation.report import Domain
from settlement import Chain, ChainError, Deployment, Ledger, Outbox, Registry
from storage_client import CID, Manifest, ObjectStore
from trainer.refusal import Refusal
from trainer.run_dir import RunDir

log = logging.getLogger("dilocox.trust")

NONCE_TTL_S = 300.0
UPDATE_DOMAIN = b"dilocox/update/v2"
GLOBAL_DOMAIN = b"dilocox/global/v1"
EVAL_TOLERANCE_E6 = 1000  # a worker's own evaluation may differ from the manifest's by 1e-3


def update_digest(run_id: bytes, round_: int, stage: int, num_stages: int, payload_sha256_hex: str) -> bytes:
    """What a worker signs for each slice it pushes (stage 0 of 1 for a whole-model update): the
    stage is bound in, so a signed slice cannot be replayed as another stage's."""
    return hashlib.sha256(
        UPDATE_DOMAIN + run_id + round_.to_bytes(8, "big") + stage.to_bytes(4, "big")
        + num_stages.to_bytes(4, "big") + bytes.fromhex(payload_sha256_hex)
    ).digest()


def global_digest(run_id: bytes, round_: int, params_digest: bytes, manifest_digest: bytes) -> bytes:
    """What the coordinator signs for each global state it serves: the run, the round, and the
    digests of its parameters and manifest (the CIDs' sha256), so a worker trains only from a
    checkpoint the run's coordinator stands behind."""
    return hashlib.sha256(
        GLOBAL_DOMAIN + run_id + round_.to_bytes(8, "big") + params_digest + manifest_digest
    ).digest()


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
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker {worker_id!r}: the join nonce was not issued to this worker id by this "
                          f"coordinator; ask for a new Challenge")
        now = self.clock()
        age = now - int.from_bytes(nonce[:8], "big") / 1000
        if not 0 <= age <= self.ttl_s:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                          f"worker {worker_id!r}: the join nonce expired (valid for {self.ttl_s:.0f}s)")
        with self._lock:
            self._used = {n: t for n, t in self._used.items() if t > now}
            if nonce in self._used:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"worker {worker_id!r}: the join nonce was already used; ask for a new Challenge")
            self._used[nonce] = now + self.ttl_s


@dataclass
class TrustGate:
    """Admission, update signatures and report checks for one run (thread-safe)."""

    store: ObjectStore
    registry: Registry
    ledger: Ledger
    outbox: Outbox
    policy: Policy
    run_id: bytes
    domain: Domain
    code: bytes  # the code measurement every worker must attest to: this coordinator's code and config
    verification_time: int | None = None
    nonces: JoinNonces = field(default_factory=JoinNonces)

    def challenge(self, worker_id: str) -> bytes:
        return self.nonces.issue(worker_id)

    def admit(self, worker_id: str, address: str, evidence_bytes: bytes, nonce: bytes) -> str:
        """Verify a joining worker's evidence and admit its key on chain; returns the address."""
        try:
            address = checksum_address(address)
        except ValueError as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT, f"worker {worker_id!r}: bad address: {exc}") from exc
        if not evidence_bytes:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED,
                               f"worker {worker_id!r} sent no attestation evidence; this run requires it")
        self.nonces.take(worker_id, nonce)
        try:
            evidence = Evidence.from_bytes(evidence_bytes)
            verified = verify_evidence(
                evidence, expected_report_data=report_data(address, self.run_id, nonce, self.code),
                policy=self.policy, now=self.verification_time,
            )
        except PolicyViolation as exc:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                               f"worker {worker_id!r}: evidence refused ({exc.check}): {exc}") from exc
        except (ValueError, EvidenceError) as exc:
            raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                               f"worker {worker_id!r}: malformed evidence: {exc}") from exc
        try:
            if not self.registry.is_measurement_allowed(verified.measurement):
                raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
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
        except ChainError as exc:
            raise Refusal(grpc.StatusCode.UNAVAILABLE,
                               f"worker {worker_id!r} cannot be admitted now: {exc}") from exc
        note = " (DEV evidence: PROVES NOTHING)" if verified.provider == "dev" else f" ({verified.provider} evidence)"
        log.info("worker %s admitted as %s, measurement 0x%s, record %s%s", worker_id, address,
                 verified.measurement.hex()[:16], record, note)
        return address

    def check_update(self, worker_id: str, address: str | None, round_: int, stage: int, num_stages: int,
                     sha256_hex: str, signature: bytes) -> None:
        if address is None:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED,
                               f"worker {worker_id!r} has no admitted key in this run")
        try:
            signer = recover_address(update_digest(self.run_id, round_, stage, num_stages, sha256_hex), signature)
        except SignatureError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, f"update signature refused: {exc}") from exc
        if signer != address:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED,
                               f"update for round {round_} is signed by {signer}, not by worker "
                               f"{worker_id!r}'s admitted key {address}")

    def check_report(self, worker_id: str, address: str | None, signed: SignedReport, manifest_cid: CID,
                     manifest: Manifest, parent: Manifest, data_digest: bytes) -> None:
        """A participant's report must be signed by its key and restate the manifest exactly."""
        r = signed.report
        if address is None:
            raise Refusal(grpc.StatusCode.PERMISSION_DENIED, f"worker {worker_id!r} has no admitted key")
        try:
            signed.verify(self.domain)
        except ReportError as exc:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED, str(exc)) from exc
        if r.worker != address:
            raise Refusal(grpc.StatusCode.UNAUTHENTICATED,
                               f"report names worker {r.worker}, but {worker_id!r} is admitted as {address}")
        entry = {p.worker: p for p in manifest.participants}.get(worker_id)
        if entry is None:
            raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                               f"worker {worker_id!r} did not contribute to round {manifest.round}")
        expected = {
            "run_id": self.run_id, "parent_checkpoint": CID.parse(parent.params).digest,
            "checkpoint": CID.parse(manifest.params).digest, "manifest_digest": manifest_cid.digest,
            "update_digest": CID.parse(entry.update).digest,
            "data_digest": data_digest, "train_loss_e6": entry.train_loss_e6,
            "eval_loss_e6": manifest.eval_loss_e6, "tokens": entry.tokens,
            "inner_steps": entry.inner_steps, "bytes_sent": entry.bytes_sent,
            "bytes_received": entry.bytes_received,
        }
        for name, want in expected.items():
            got = getattr(r, name)
            if got != want:
                show = (lambda v: "0x" + v.hex()) if isinstance(want, bytes) else repr
                raise Refusal(grpc.StatusCode.INVALID_ARGUMENT,
                                   f"report for round {r.round}: {name} is {show(got)}, the manifest says {show(want)}")


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


def open_gate(settings: TrustSettings, store: ObjectStore, run_dir: RunDir, run_id: bytes,
              config_cid: CID) -> TrustGate:
    chain = Chain(settings.rpc_url, settings.private_key)
    dep = settings.deployment
    return TrustGate(
        store=store, registry=Registry(chain, dep.registry), ledger=Ledger(chain, dep.ledger),
        outbox=Outbox(run_dir.path / "outbox", settings.confirmations), policy=settings.policy, run_id=run_id,
        domain=Domain(dep.chain_id, dep.ledger), code=code_measurement(str(config_cid)),
        verification_time=settings.verification_time,
    )


class ReportBook:
    """Signed reports by round, kept on disk until their round is queued for the ledger.

    Rounds are queued strictly in order (the ledger refuses gaps): round r goes once every
    participant of r has reported, or ``report_timeout_s`` after r closed, whatever has arrived by
    then. A participant without a report is listed by its update digest as unreported: the ledger
    records it on the coordinator's word and credits nobody, and the audit lists it. So a round
    whose participants all died before reporting is still recorded, and never blocks the rounds
    after it.
    """

    def __init__(self, run_dir: RunDir, gate: TrustGate, report_timeout_s: float,
                 challenge_window: int = 0) -> None:
        self.run_dir = run_dir
        self.gate = gate
        self.report_timeout_s = report_timeout_s
        self.challenge_window = challenge_window
        self.state = run_dir.load("settlement.json", {"run_created": False, "queued_through": 0})
        self._lock = threading.Lock()

    @property
    def queued_through(self) -> int:
        return int(self.state["queued_through"])

    def _save(self) -> None:
        self.run_dir.save("settlement.json", self.state)

    def ensure_run(self, genesis_cid: CID, genesis: Manifest) -> None:
        with self._lock:
            if self.state["run_created"]:
                return
            self.gate.outbox.enqueue_create_run(
                run_id=self.gate.run_id, genesis_checkpoint=CID.parse(genesis.params).digest,
                config_digest=CID.parse(genesis.config).digest, genesis_manifest=genesis_cid.digest,
                challenge_window=self.challenge_window,
            )
            self.state["run_created"] = True
            self._save()

    def add(self, worker_id: str, signed: SignedReport) -> None:
        r = signed.report.round
        with self._lock:
            if r <= self.queued_through:
                raise Refusal(grpc.StatusCode.FAILED_PRECONDITION,
                              f"round {r} has already been handed to the ledger; report too late")
            held = self.run_dir.pending(r, "reports")
            if worker_id in held:
                raise Refusal(grpc.StatusCode.ALREADY_EXISTS, f"worker {worker_id!r} already reported round {r}")
            held[worker_id] = signed.to_json()
            self.run_dir.save_pending(r, held, "reports")

    def queue_due(self, manifests: dict[int, tuple[CID, Manifest]], closed_at: dict[int, float],
                  now: float) -> list[int]:
        """Hand every round that is ready, in order, to the outbox; returns the rounds queued."""
        queued = []
        with self._lock:
            while (r := self.queued_through + 1) in manifests:
                cid, manifest = manifests[r]
                held = self.run_dir.pending(r, "reports")
                expected = {p.worker for p in manifest.participants}
                waited = now - closed_at.get(r, now)
                if not (expected <= set(held) or waited >= self.report_timeout_s):
                    break
                parent = manifests[r - 1][1]
                unreported = {p.worker: CID.parse(p.update).digest for p in manifest.participants
                              if p.worker not in held}
                self.gate.outbox.enqueue_round(
                    run_id=self.gate.run_id, round=r, parent=CID.parse(parent.params).digest,
                    checkpoint=CID.parse(manifest.params).digest, manifest_digest=cid.digest,
                    reports=[held[w] for w in sorted(held)], unreported=list(unreported.values()),
                )
                if unreported:
                    log.warning("round %d: no report from %s after %.0fs; queued for the ledger with %s update(s) "
                                "unreported (on the coordinator's word, credited to nobody)", r,
                                ", ".join(sorted(unreported)), waited, "its" if not held else "their")
                self.state["queued_through"] = r
                self._save()
                self.run_dir.clear_pending(r, "reports")
                queued.append(r)
        return queued
