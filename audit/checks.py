"""``AuditCheck``: every check the audit makes, by the name its failures carry, with what it checks.

A failure (audit.result.Failure) names its check with one of these; the value is the name printed
and written to the ``--json`` file (a ``StrEnum``: it compares, prints and serialises as that name).
Where each check lives:

  audit.lineage     RUN, RUN_ID, OBJECT, MANIFEST, GENESIS, GENESIS_CHECKPOINT, CONFIG, UPDATE_RECORD,
                    INNER_STEPS, MANIFEST_ROUND, PARENT, CHECKPOINT, PARENT_CHECKPOINT (against the
                    parent's params), UNRECORDED
  audit.tallies     ROUNDS, PARENT_CHECKPOINT (on chain), REPORT_COUNT, LEDGER, RECORDER, TALLY,
                    TOTAL_CONTRIBUTION, PAYOUT
  audit.report_checks     REPORT_SIGNATURE, REPORT_BINDING, REPORT_PARTICIPANT, REPORT_DUPLICATE, REPORT_FIELDS,
                    REPORT_EVAL_LOSS, DATA_DIGEST, UNREPORTED, GHOST
  audit.push_signatures   PUSH_SIGNATURE (and, for an unreported participant's signer, audit.signers')
  audit.signers     REGISTRY, ADMITTED, REVOKED, MEASUREMENT_ALLOWED, ADMISSION, and through
                    audit.admission ADMISSION_RECORD and EVIDENCE
  audit.recompute   REDERIVE, REPLAY, RESCORE, REVEAL
  audit.receipts    RECEIPT_FAULT, RECEIPT_WITHHELD
  audit.disputes    AUDITOR_EVIDENCE (and, through audit.core, TALLY for voids no verdict backs)
"""

from __future__ import annotations

from enum import StrEnum


class AuditCheck(StrEnum):
    """A check of the audit: its value is the name a failure shows, ``description`` what it checks."""

    description: str

    def __new__(cls, name: str, description: str) -> AuditCheck:
        member = str.__new__(cls, name)
        member._value_ = name
        member.description = description
        return member

    RUN = ("run", "the ledger knows the run (found by id, or the one run whose genesis is here)")
    REGISTRY = ("registry", "the ledger consults the registry being audited")
    RUN_ID = ("run-id", "runId is the digest of the genesis manifest (docs/trust.md)")
    OBJECT = ("object", "a named object is in the store and re-hashes to its CID (params and outer state only "
                        "where the round keeps a full checkpoint: genesis, every rounds.checkpoint_every, the last)")
    UPDATE_RECORD = ("update-record", "each participant's update record, and the payloads and codec headers it "
                                      "names, fit the model, stage by stage (trainer.runstore.update_record)")
    MANIFEST = ("manifest", "a manifest parses (schema, fields, sorted participants and traffic, traffic sums "
                            "equal to bytes_up / bytes_down, no downlink at genesis)")
    GENESIS = ("genesis", "the genesis manifest is round 0 without a parent, and its params decode")
    GENESIS_CHECKPOINT = ("genesis-checkpoint", "the chain's genesis checkpoint is the sha256 of θ⁽⁰⁾'s bytes, "
                                                "which are model.init_params when the config pins weights")
    CONFIG = ("config", "the chain's configDigest is the config's CID; every round names that config and the "
                        "genesis run id; the config parses")
    ROUNDS = ("rounds", "the ledger's rounds are 1..lastRound, each once, in order")
    LEDGER = ("ledger", "each round's roundCommitment equals its RoundRecorded event's and the hash of the facts "
                        "recorded, and the recording transactions decode")
    MANIFEST_ROUND = ("manifest-round", "manifest.round is the round it was recorded as")
    PARENT = ("parent", "manifest.parent is the CID of the previous round's (recorded) manifest")
    INNER_STEPS = ("inner-steps", "every participant's inner_steps and tokens are the round's H_r and "
                                  "H_r·batch·block, H_r re-derived from round r−2's downlink header")
    CHECKPOINT = ("checkpoint", "the round's on-chain checkpoint is the sha256 of the manifest's params")
    PARENT_CHECKPOINT = ("parent-checkpoint", "the round's on-chain parent is the previous round's params digest")
    REDERIVE = ("rederive", "the round's params and outer state are what its stored updates give, clipped, "
                            "aggregated and stepped by the config's rules (audit.rederive)")
    REPORT_COUNT = ("report-count", "the workers the event credits are the signers of the call's reports, with "
                                    "as many unreported updates as the event says")
    REPORT_SIGNATURE = ("report-signature", "the EIP-712 signature recovers to report.worker (this chain, this "
                                            "ledger)")
    REPORT_BINDING = ("report-binding", "report runId / round / parentCheckpoint / checkpoint / manifestDigest "
                                        "are the round's")
    REPORT_PARTICIPANT = ("report-participant", "report.updateDigest is the update CID of one manifest participant")
    REPORT_DUPLICATE = ("report-duplicate", "one report per worker, one per participant")
    REPORT_FIELDS = ("report-fields", "trainLossE6, tokens, innerSteps, bytesSent, bytesReceived equal the "
                                      "participant entry (attestation.report.manifest_claims)")
    REPORT_EVAL_LOSS = ("report-eval-loss", "evalLossE6 equals the manifest's eval_loss_e6")
    DATA_DIGEST = ("data-digest", "dataDigest is the digest of the participant's shard, from the run's config and "
                                  "corpus or its pinned token index (trainer.data.dataset)")
    ADMITTED = ("admitted", "the signer has a WorkerAdmitted event at or before the recording block")
    REVOKED = ("revoked", "the signer has no WorkerRevoked event at or before the recording block")
    MEASUREMENT_ALLOWED = ("measurement-allowed", "the signer's admitted measurement was allowlisted as of the "
                                                  "recording block")
    ADMISSION = ("admission", "a signer whose admission record or evidence failed in an earlier round")
    ADMISSION_RECORD = ("admission-record", "the admission record (CID(JSON, evidenceDigest)) exists, re-hashes "
                                            "and names the worker and the measurement")
    EVIDENCE = ("evidence", "the evidence exists, re-hashes and passes attestation.verify_evidence with the "
                            "REPORTDATA the record implies, under the auditor's policy")
    UNREPORTED = ("unreported", "each update recorded without a report is one participant's, and none is both "
                                "reported and unreported")
    PUSH_SIGNATURE = ("push-signature", "every participant's update, reported or not, keeps a push signature on "
                                        "each slice, all by one key: the report's signer, or else a key admitted "
                                        "to the run (audit.signers)")
    GHOST = ("ghost", "every participant is accounted for on the ledger: by a signed report, or by the "
                      "coordinator's unreported list")
    TALLY = ("tally", "ledger.contribution_of(run, worker) equals the reports' tokens and rounds")
    TOTAL_CONTRIBUTION = ("total-contribution", "ledger.total_contribution_of(worker) equals the worker's credits "
                                                "over every run the ledger created")
    PAYOUT = ("payout", "each RewardPaid of the run is what a recorded round entitles, once; the run is not paid "
                        "past its funding; the pool's count of what it paid equals the events; it holds what it owes")
    RECORDER = ("recorder", "each round's recording transaction was sent by the run's coordinator")
    UNRECORDED = ("unrecorded", "the store's lineage goes at most max_unrecorded rounds past the ledger's last "
                                "round")
    REPLAY = ("replay", "each sampled contribution is within tolerance of what H inner steps on its shard from its "
                        "parent checkpoint give, in its worker's kernels where they run (audit.replay, replay_env)")
    REPLAY_HORIZON = ("replay-horizon", "every replayed chain a worker's kernels do not replay ends within the replay "
                                        "horizon (rounds.state_every ≤ trainer.config.REPLAY_HORIZON): the run "
                                        "stores the states that decide every contribution")
    REVEAL = ("reveal", "each sampled contribution's committed inner state, in a run that reveals them on "
                        "challenge, was revealed by its worker within rounds.reveal_deadline_s (audit.reveal)")
    RECEIPT_FAULT = ("receipt-fault", "no ReceiptFaultProven of the run: every worker whose update and report the "
                                      "coordinator receipted is credited in the recorded round (audit.receipts)")
    RECEIPT_WITHHELD = ("receipt-withheld", "every update the coordinator receipted (audit --receipts) is used by its "
                                            "round's manifest; a replay mismatch that follows one is the coordinator's")
    AUDITOR_EVIDENCE = ("auditor-evidence", "every signer of an upheld verdict has its admission record and "
                                            "evidence in the store, verifying under this policy for the audit "
                                            "code's measurement (audit.disputes.unverified_auditors)")
    RESCORE = ("rescore", "the recomputed held-out loss of each sampled round's checkpoint is within "
                          "EVAL_TOLERANCE of the manifest's")
