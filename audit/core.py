"""``run_audit``: re-verify a run's lineage from the ledger and the store, and nothing else.

Nothing the coordinator keeps for itself (HEAD, rounds.jsonl, its outbox) is read: every starting
point is on chain, and every object is re-hashed from the store. Each failed check becomes a
``Failure(round, object, check, message)``; the audit goes on after a failure, so one run shows
every problem at once.

The checks, each with what it checks and the module that makes it, are audit.checks.AuditCheck.

"As of the recording block" is the state after that whole block, rebuilt from the registry's
events (WorkerAdmitted, WorkerRevoked, MeasurementSet), never from the registry's current views: a
worker revoked after a round was recorded does not spoil that round, and a key revoked in the
same block as the recording counts as revoked. Historical ``eth_call`` is not used because a chain
restored from an anvil state file has no history of state, only of blocks and logs.

A participant without a worker's report is a failure (``ghost``) unless the coordinator recorded
its update as unreported; such updates are listed in the result's roster (settlement.roster: the
worker ids the run's reports bind to addresses, and each unreported update with its worker's id),
and said loudly, because they count in the round on the coordinator's word alone and earn their
workers nothing (docs/trust.md).

Every participant, reported or not, must have been pushed by an admitted key of the run
(audit.push_signatures): a ghost the coordinator lists as unreported fails by name.

This module walks the run and hands each part to the modules that check it (audit.lineage, tallies,
reports, push signatures, signers, recompute); they record into one audit.findings.Findings.
"""

from __future__ import annotations

import os

from attestation import Policy
from attestation.receipt import SignedReceipt
from settlement import ChainError, Ledger, Registry
from settlement.receipt_court import ReceiptCourt
from settlement.records import RoundRecord, RunRecord, Tenures
from settlement.rewards import RewardPool
from settlement.roster import roster_of
from storage_client import CID, Codec, Store, from_e6, hex_or_none
from trainer.progress import Progress

from .checks import AuditCheck
from .findings import Findings
from .lineage import Lineage, Loaded, check_unrecorded
from .push_signatures import PushSignatures
from .receipts import check_receipt_faults, check_update_receipts
from .recompute import Recomputation
from .report_checks import ReportChecks
from .result import AuditResult, RoundRow
from .signers import Signers
from .tallies import Tallies

# Why dev evidence proves nothing, in one sentence (the provider's own WARNING says it again at length).
DEV_NOTE = ("it is made and signed in software by a local development key; no hardware measured or isolated "
            "the workers (development only)")

class _Audit:
    """One audit: resolves the run, checks genesis, walks the recorded rounds in order, then the
    run-wide checks, and concludes."""

    # Set once the run's genesis is read: both need its config (None when it cannot be read).
    recompute: Recomputation
    reports: ReportChecks

    def __init__(self, store: Store, ledger: Ledger, registry: Registry, policy: Policy,
                 rederive: bool, max_unrecorded: int = 0, replay: int = 0, replay_seed: int = 0,
                 rewards: RewardPool | None = None, court: ReceiptCourt | None = None,
                 receipts: tuple[SignedReceipt, ...] = (), reveal: tuple[tuple[str, Store], ...] = ()) -> None:
        self.findings = Findings(AuditResult(rederived=rederive), store)
        self.reveal = reveal
        self.court, self.receipts = court, receipts
        self.ledger = ledger
        self.rederiving = rederive
        self.max_unrecorded = max_unrecorded
        self.replay = replay
        self.replay_seed = replay_seed
        self.lineage = Lineage(self.findings, ledger)
        self.policy = policy
        self.signers = Signers(self.findings, registry, policy)
        self.pushes = PushSignatures(self.findings, self.signers)
        self.tallies = Tallies(self.findings, ledger, rewards)

    def run(self, run_id: bytes | None) -> AuditResult:
        domain = self.ledger.domain()
        self.signers.check_consulted(self.ledger)
        resolved = self.lineage.resolve_run(run_id)
        if resolved is None:
            return self.finish()
        run_id, run = resolved
        self.findings.result.run_id = run_id
        self.signers.read_history()
        genesis = self.check_genesis(run_id, run)
        self.recompute = Recomputation(self.findings, self.lineage.config)
        if self.rederiving and genesis is not None:
            self.recompute.check_genesis(genesis)
        self.reports = ReportChecks(self.findings, domain, self.signers, self.lineage.config, self.findings.store)

        try:
            rounds = self.ledger.recorded_rounds(run_id)
        except ChainError as exc:
            self.findings.fail(None, self.ledger.address, AuditCheck.LEDGER, f"the recorded rounds cannot be read: {exc}")
            return self.finish()
        self.tallies.check_rounds(run.last_round, rounds)
        tenures = self.tenures(run_id, run)

        parent, parent_checkpoint = genesis, run.genesis_checkpoint
        loaded = {0: genesis.manifest} if genesis is not None else {}
        what = "audit: rounds checked" + (" and checkpoints re-derived" if self.rederiving else "")
        with Progress(what, len(rounds), unit="rounds") as progress:
            for record in rounds:
                parent = self.check_round(run_id, record, parent, genesis, parent_checkpoint,
                                          tenures.at(record.round))
                parent_checkpoint = record.checkpoint
                if parent is not None:
                    loaded[parent.manifest.round] = parent.manifest
                progress.advance()
        self.findings.result.roster = roster_of(self.findings.store, rounds)
        excused = check_update_receipts(self.findings, run_id, self.receipts, domain, tenures, loaded,
                                        self.findings.result.roster)
        if self.replay > 0:
            self.recompute.check_replay(loaded, self.replay, self.replay_seed, excused, self.reveal)
        self.tallies.check_tallies(run_id, rounds)
        self.tallies.check_payouts(run_id)
        self.read_disputes(run_id, run, rounds, tenures)
        check_receipt_faults(self.findings, self.court, run_id)
        if genesis is not None:
            last = CID(Codec.JSON, rounds[-1].manifest_digest) if rounds else genesis.cid
            check_unrecorded(self.findings, genesis.manifest.run_id, last, len(rounds), self.max_unrecorded)
        return self.finish()

    def tenures(self, run_id: bytes, run: RunRecord) -> Tenures:
        """Who held each round: the run's handovers on chain, which must chain up to its coordinator now
        (``ledger``, failed by name when they do not; the rounds are then judged against the coordinator now)."""
        try:
            handovers = self.ledger.handovers(run_id)
            tenures = Tenures.of(run.coordinator, handovers)
        except (ChainError, ValueError) as exc:
            self.findings.fail(None, self.ledger.address, AuditCheck.LEDGER,
                               f"the run's coordinators cannot be read from its handovers: {exc}")
            return Tenures.coerce(run.coordinator)
        for h in handovers:  # not a failure: said so that a reader knows who answers for which rounds
            self.findings.warn(f"the run passed from coordinator {h.previous} to {h.next} from round {h.from_round} "
                               f"on ({'voted in by its workers' if h.by_vote else 'handed over by its creator'}, "
                               f"block {h.block})")
        return tenures

    def read_disputes(self, run_id: bytes, run: RunRecord, rounds: list[RoundRecord], tenures: Tenures) -> None:
        """Every verdict upheld on the run, for the result, and the ledger's voided credit against them
        (``tally``: audit.disputes.unbacked_voids); a ledger that names no disputes contract may void
        nothing. Each signer of an upheld verdict must have an admission that holds up in the store
        (``auditor-evidence``: audit.disputes.unverified_auditors)."""
        from settlement.disputes import Disputes

        from .disputes import read_disputes, unbacked_voids, unverified_auditors

        unverified: dict[str, str] = {}
        try:
            voided = self.ledger.voided_credits(run_id)
            address = self.ledger.disputes_address()
            if address is None:
                problems = [(v.round, v.worker, "the ledger voided its credit, but names no disputes contract")
                            for v in voided]
            else:
                disputes = Disputes(self.ledger.chain, address, from_block=self.ledger.from_block)
                self.findings.result.disputes = read_disputes(disputes, run_id, tenures,
                                                              self.findings.result.roster)
                problems = unbacked_voids(disputes, voided, rounds, run, run_id, tenures)
                if self.findings.result.disputes:
                    unverified, notes = unverified_auditors(disputes, self.findings.store, run_id,
                                                            str(CID(Codec.JSON, run.config_digest)), self.policy)
                    for note in notes:
                        self.findings.warn(note)
        except (ChainError, ValueError) as exc:
            self.findings.fail(None, self.ledger.address, AuditCheck.LEDGER, f"the run's disputes cannot be read: {exc}")
            return
        for round_, worker, why in problems:
            self.findings.fail(round_, worker, AuditCheck.TALLY, f"round {round_}, credit of {worker}: {why}")
        for row in self.findings.result.disputes:
            for signer in row.signers:
                if signer in unverified:
                    self.findings.fail(row.verdict.round, signer, AuditCheck.AUDITOR_EVIDENCE,
                                       f"the verdict against {row.party_id} ({row.tx_hash}) is signed by auditor "
                                       f"{signer}: {unverified[signer]}")

    def check_genesis(self, run_id: bytes, run: RunRecord) -> Loaded | None:
        """Genesis's row of the table, and its lineage checks."""
        row = self._row(0, run.genesis_manifest, run.genesis_checkpoint, participants=0, reports=0)
        genesis = self.lineage.check_genesis(run_id, run)
        if genesis is not None:
            row.eval_loss = from_e6(genesis.manifest.eval_loss_e6)
        return genesis

    def check_round(self, run_id: bytes, record: RoundRecord, parent: Loaded | None, genesis: Loaded | None,
                    parent_checkpoint: bytes, coordinator: str) -> Loaded | None:
        """One recorded round: the ledger's record of it, its manifest and objects, its re-derivation
        and its reports. Returns what the next round needs, or None when the manifest cannot be read."""
        r = record.round
        row = self._row(r, record.manifest_digest, record.checkpoint, participants=None, reports=len(record.reports))
        row.unreported = len(record.unreported)
        self.tallies.check_record(run_id, record, parent_checkpoint, coordinator)
        read = self.lineage.check_round(record, parent, genesis)
        if read is None:
            self.reports.check(run_id, record, None, parent)
            return None
        loaded, updates = read
        row.participants = len(loaded.manifest.participants)
        row.eval_loss = from_e6(loaded.manifest.eval_loss_e6)
        if self.rederiving:
            self.recompute.check_round(r, loaded, parent, updates)
        self.reports.check(run_id, record, loaded.manifest, parent)
        self.pushes.check(run_id, record, loaded.manifest)
        return loaded

    def _row(self, r: int, manifest_digest: bytes, checkpoint: bytes, participants: int | None,
             reports: int) -> RoundRow:
        """Round r's row of the table, added to the result; what its manifest says is filled in later."""
        row = RoundRow(round=r, manifest=str(CID(Codec.JSON, manifest_digest)), checkpoint=hex_or_none(checkpoint),
                       participants=participants, reports=reports, eval_loss=None)
        self.findings.result.rounds.append(row)
        return row

    def finish(self) -> AuditResult:
        result = self.findings.result
        for row in result.rounds:
            row.status = "FAIL" if result.failures_of(row.round) else "ok"
        dev = self.signers.dev_admitted
        if dev:  # said once, naming every such worker (by id too, where its reports name one)
            ids = result.roster.ids if result.roster is not None else {}
            named = ", ".join(f"{'/'.join(ids[a])} ({a})" if ids.get(a) else a for a in dev)
            result.warnings.insert(0, f"DEV ATTESTATION ACCEPTED: {len(dev)} worker(s) of this run were admitted on "
                                      f"dev evidence: {named}; its signatures and bindings verified, but it PROVES "
                                      f"NOTHING about what code ran: {DEV_NOTE}")
        return result


def run_audit(store: Store, ledger: Ledger, registry: Registry, *, run_id: bytes | None = None,
              policy: Policy, rederive: bool = True, max_unrecorded: int = 0, replay: int = 0,
              replay_seed: int | None = None, rewards: RewardPool | None = None, court: ReceiptCourt | None = None,
              receipts: tuple[SignedReceipt, ...] = (), reveal: tuple[tuple[str, Store], ...] = ()) -> AuditResult:
    """Verify a run from the ledger (its views and events) and the store alone.

    @param store the run's object store
    @param ledger the ContributionLedger client (any account; nothing is sent)
    @param registry the WorkerRegistry client the ledger consults
    @param run_id the run (sha256 of its genesis manifest); None picks the ledger's run whose genesis
        manifest is in the store, when there is exactly one
    @param policy which attestation evidence the auditor accepts (dev evidence only with allow_dev)
    @param rederive recompute each round's params and outer state from the stored updates
    @param max_unrecorded how many rounds the store's lineage may go past the ledger's last round
        (0 for a finished run; more while the ledger catches up)
    @param replay how many sampled contributions to re-run (audit.replay); 0: none
    @param replay_seed the sample's seed; None draws one from os.urandom (reported in the result)
    @param rewards the deployment's reward pool: every payout out of the run is checked against the
        ledger's records, and each worker's earnings and payments reported
    @param court the deployment's ReceiptCourt: each omission a worker proved there fails its round
    @param receipts workers' receipts (audit.receipts): an update receipted and not used fails its round,
        and excuses its worker's later replay mismatches
    @param reveal where to ask for the committed inner states a replay needs, in a run whose workers
        reveal them on challenge (audit.reveal): (label, store) in order; a state none reveals within
        rounds.reveal_deadline_s names its worker
    @return every failure, one row per round, and warnings; ``ok`` only when every check passed
    @raise settlement.ChainUnavailable when the chain does not answer
    """
    if run_id is not None and (not isinstance(run_id, (bytes, bytearray)) or len(run_id) != 32):
        raise ValueError("run_id must be 32 bytes")
    if type(max_unrecorded) is not int or max_unrecorded < 0:
        raise ValueError("max_unrecorded must be an integer >= 0")
    if type(replay) is not int or replay < 0:
        raise ValueError("replay must be an integer >= 0")
    seed = int.from_bytes(os.urandom(4), "big") if replay_seed is None else int(replay_seed)
    return _Audit(store, ledger, registry, policy, rederive, max_unrecorded, replay, seed, rewards, court,
                  tuple(receipts), tuple(reveal)).run(
        None if run_id is None else bytes(run_id))

