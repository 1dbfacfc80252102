"""The workers' signed reports of a round, against the chain's record and the round's manifest.

Checks ``report-signature``, ``report-binding`` (against the chain's record of the round),
``report-duplicate``, ``report-participant``, ``report-fields`` and ``report-eval-loss`` (what the
manifest says of the participant and of the round: attestation.report.manifest_claims, the rule
the coordinator enforces on intake), ``data-digest`` (the participant's shard, from the run's config
and corpus), ``unreported`` and ``ghost`` (every participant is answered for); each signer is
handed to audit.signers.
"""

from __future__ import annotations

from typing import Any

from attestation import ReportError, SignedReport
from attestation.report import Domain, RoundReport, manifest_claims, report_differences
from settlement.records import RoundRecord
from storage_client import Manifest, Participant, Store
from trainer.config import RunConfig
from trainer.data.corpus import CorpusError
from trainer.data.dataset import run_dataset

from .checks import AuditCheck
from .findings import Findings, cid_digest
from .lineage import Loaded
from .signers import Signers

# The claims of manifest_claims this module compares, and the check a difference fails. The others
# (runId, round, parentCheckpoint, checkpoint, manifestDigest) are compared with the chain's record
# of the round (report-binding), updateDigest is how a report finds its participant, and dataDigest
# needs the shard digests (data-digest).
_CHECK_OF_CLAIM = {"train_loss_e6": "report-fields", "tokens": "report-fields", "inner_steps": "report-fields",
                   "bytes_sent": "report-fields", "bytes_received": "report-fields",
                   "eval_loss_e6": "report-eval-loss"}


class ReportChecks:
    """Checks each recorded round's reports; ``config`` (None when unreadable) gives the shards."""

    def __init__(self, findings: Findings, domain: Domain, signers: Signers, config: RunConfig | None,
                 store: Store | None = None) -> None:
        self.findings = findings
        self.store = store  # holds a prepared run's token index (data.tokens_cid)
        self.domain = domain
        self.signers = signers
        self.config = config
        self._shard_digests: list[bytes] | None = None  # _shard_digests_or_none(), computed once

    def check(self, run_id: bytes, record: RoundRecord, manifest: Manifest | None, parent: Loaded | None) -> None:
        """The reports the recording call carried; with the round's manifest (None when unreadable),
        what they say of its participants, and that every participant is accounted for."""
        r, block = record.round, record.block
        by_update = {} if manifest is None else {cid_digest(p.update): p for p in manifest.participants}
        matched: dict[str, str] = {}  # participant worker id -> report label
        signers: dict[str, str] = {}  # signer -> report label
        for i, signed in enumerate(record.reports):
            rep = signed.report
            label = f"report[{i}] {rep.worker}"
            signature_ok = self._check_signature(r, label, signed)
            self._check_binding(run_id, r, label, rep, record, parent)
            if rep.worker in signers:
                self.findings.fail(r, label, AuditCheck.REPORT_DUPLICATE,
                                   f"{rep.worker} already reported this round ({signers[rep.worker]})")
            signers.setdefault(rep.worker, label)
            if manifest is not None:
                participant = self._match_participant(r, label, rep, by_update, matched)
                self._check_claims(run_id, r, label, rep, record, manifest, parent, participant)
            if signature_ok:
                self.signers.check(run_id, r, label, rep.worker, block)
        if manifest is not None:
            self._check_accounted(r, record, manifest, matched)

    def _check_signature(self, r: int, label: str, signed: SignedReport) -> bool:
        try:
            signed.verify(self.domain)
        except ReportError as exc:
            self.findings.fail(r, label, AuditCheck.REPORT_SIGNATURE, str(exc))
            return False
        return True

    def _check_binding(self, run_id: bytes, r: int, label: str, rep: RoundReport, record: RoundRecord,
                       parent: Loaded | None) -> None:
        """The report is about this round as the chain recorded it."""
        wrong = []
        if rep.run_id != run_id:
            wrong.append(f"runId 0x{rep.run_id.hex()}")
        if rep.round != r:
            wrong.append(f"round {rep.round}")
        if rep.parent_checkpoint != record.parent_checkpoint:
            wrong.append(f"parentCheckpoint 0x{rep.parent_checkpoint.hex()}")
        elif parent is not None and rep.parent_checkpoint != cid_digest(parent.manifest.params):
            wrong.append(f"parentCheckpoint 0x{rep.parent_checkpoint.hex()} (not round {r - 1}'s params)")
        if rep.checkpoint != record.checkpoint:
            wrong.append(f"checkpoint 0x{rep.checkpoint.hex()}")
        if rep.manifest_digest != record.manifest_digest:
            wrong.append(f"manifestDigest 0x{rep.manifest_digest.hex()}")
        if wrong:
            self.findings.fail(r, label, AuditCheck.REPORT_BINDING, "the report is not about this round: " + ", ".join(wrong))

    def _match_participant(self, r: int, label: str, rep: RoundReport, by_update: dict[bytes, Participant],
                           matched: dict[str, str]) -> Participant | None:
        """The participant whose update the report names (``report-participant``), claimed by one
        report only (``report-duplicate``); the first claim is the one kept in ``matched``."""
        participant = by_update.get(rep.update_digest)
        if participant is None:
            self.findings.fail(r, label, AuditCheck.REPORT_PARTICIPANT,
                               f"updateDigest 0x{rep.update_digest.hex()} is not the update of any participant of "
                               f"the manifest")
            return None
        if participant.worker in matched:
            self.findings.fail(r, label, AuditCheck.REPORT_DUPLICATE, f"participant {participant.worker}'s update is already "
                                                             f"claimed by {matched[participant.worker]}")
        matched.setdefault(participant.worker, label)
        return participant

    def _check_claims(self, run_id: bytes, r: int, label: str, rep: RoundReport, record: RoundRecord,
                      manifest: Manifest, parent: Loaded | None, participant: Participant | None) -> None:
        """What the report says of its participant (``report-fields``, ``data-digest``) and of the round
        (``report-eval-loss``) is what the manifest says; a report that is no participant's still
        restates the round's eval loss."""
        if participant is None:
            # manifest_claims states a participant's report; without one, the round's own claim remains.
            claims: dict[str, Any] = {"eval_loss_e6": manifest.eval_loss_e6}
        else:
            # The parent's manifest only gives the parentCheckpoint claim, which is not compared here
            # (_CHECK_OF_CLAIM); when it cannot be read, the round's own manifest stands in for it.
            claims = manifest_claims(run_id, record.manifest_digest, manifest,
                                     manifest if parent is None else parent.manifest, participant, None)
        differences = report_differences(rep, {name: claims[name] for name in _CHECK_OF_CLAIM if name in claims})
        fields = [str(d) for d in differences if _CHECK_OF_CLAIM[d.field.name] == "report-fields"]
        if participant is not None:
            if fields:
                self.findings.fail(r, label, AuditCheck.REPORT_FIELDS, f"the report for participant {participant.worker} "
                                                              f"differs from the manifest: " + ", ".join(fields))
            self._check_data_digest(r, label, participant, rep.data_digest)
        for d in differences:
            if _CHECK_OF_CLAIM[d.field.name] == "report-eval-loss":
                self.findings.fail(r, label, AuditCheck.REPORT_EVAL_LOSS, str(d))

    def _check_data_digest(self, r: int, label: str, p: Participant, signed: bytes) -> None:
        """A report's dataDigest is the digest of the shard its participant trained on, as the
        config implies it (trainer.data.dataset: shard_digest of Corpus.shard, or the prepared shards'
        sha256 from the run's pinned token index)."""
        digests = self._shard_digests_or_none()
        if digests is None:
            return
        if p.shard >= len(digests):
            self.findings.fail(r, label, AuditCheck.DATA_DIGEST, f"participant {p.worker} names shard {p.shard}, but the "
                                                        f"config splits the corpus into {len(digests)}")
        elif signed != digests[p.shard]:
            self.findings.fail(r, label, AuditCheck.DATA_DIGEST,
                               f"dataDigest 0x{signed.hex()} is not the digest of shard {p.shard} of {len(digests)} "
                               f"of the run's corpus (0x{digests[p.shard].hex()}), which participant {p.worker} "
                               f"trained on")

    def _shard_digests_or_none(self) -> list[bytes] | None:
        """Each shard's digest, from the run's config and corpus (computed once); None, with one
        failure, when the corpus cannot be read here."""
        if self._shard_digests is None and self.config is not None:
            cfg = self.config
            try:  # a prepared run's digests come from its pinned index in the store, not its token files
                self._shard_digests = list(run_dataset(cfg, self.store).shard_digests)
            except CorpusError as exc:
                self.findings.fail(None, cfg.data.tokens_cid or cfg.data.corpus, AuditCheck.DATA_DIGEST,
                                   f"the run's {'token index' if cfg.data.tokens else 'corpus'} cannot be read here, "
                                   f"so no report's dataDigest can be checked: {exc}")
                self._shard_digests = []
        return self._shard_digests or None

    def _check_accounted(self, r: int, record: RoundRecord, manifest: Manifest, matched: dict[str, str]) -> None:
        """Every participant has a worker's report or is on the coordinator's unreported list; every
        unreported entry is a participant that has no report."""
        by_update = {cid_digest(p.update): p for p in manifest.participants}
        vouched: set[str] = set()
        for j, digest in enumerate(record.unreported):
            p = by_update.get(digest)
            label = f"unreported[{j}] 0x{digest.hex()}"
            if p is None:
                self.findings.fail(r, label, AuditCheck.UNREPORTED, "the coordinator recorded an unreported update that is "
                                                           "no participant's update in the manifest")
            elif p.worker in matched:
                self.findings.fail(r, label, AuditCheck.UNREPORTED, f"participant {p.worker}'s update is recorded both as "
                                                           f"reported ({matched[p.worker]}) and as unreported")
            else:
                vouched.add(p.worker)
        # A vouched participant is not a failure; the audit says it loudly with its worker's id and
        # address (AuditResult.roster: settlement.roster.unreported_lines).
        for p in manifest.participants:
            if p.worker not in vouched and p.worker not in matched:
                self.findings.fail(r, p.update, AuditCheck.GHOST,
                                   f"participant {p.worker}'s update is in the round, but no worker signed a report "
                                   f"for it and the coordinator did not record it as unreported")
