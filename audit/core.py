"""``run_audit``: re-verify a run's lineage from the ledger and the store, and nothing else.

Nothing the coordinator keeps for itself (HEAD, rounds.jsonl, its outbox) is read: every starting
point is on chain, and every object is re-hashed from the store. Each failed check becomes a
``Failure(round, object, check, message)``; the audit goes on after a failure, so one run shows
every problem at once.

Checks, by name:

  run                   the ledger knows the run (found by id, or the one run whose genesis is here)
  registry              the ledger consults the registry being audited
  run-id                runId is the digest of the genesis manifest (docs/trust.md)
  object                a named object is in the store and re-hashes to its CID
  manifest              a manifest parses (schema, fields, sorted participants and traffic,
                        traffic sums equal to bytes_up / bytes_down, no downlink at genesis)
  genesis               the genesis manifest is round 0 without a parent
  genesis-checkpoint    the chain's genesis checkpoint is the sha256 of θ⁽⁰⁾'s bytes
  config                the chain's configDigest is the config's CID; every round names that config
                        and the genesis run id; the config parses
  rounds                the ledger's rounds are 1..lastRound, each once, in order
  ledger                the ledger's roundCommitment of each round equals its RoundRecorded event's and
                        the hash of the facts recorded (block, workers, tokens, checkpoint, manifest),
                        and the recording transactions can be decoded
  manifest-round        manifest.round is the round it was recorded as
  parent                manifest.parent is the CID of the previous round's (recorded) manifest
  checkpoint            the round's on-chain checkpoint is the sha256 of the manifest's params
  parent-checkpoint     the round's on-chain parent is the previous round's params digest
  rederive              Δ = the stored updates, clipped (threshold over their norms and the previous K
                        rounds' ρ̃) and averaged by the config's rule (trainer.aggregation.aggregate),
                        outer_step from the parent's stored params and momentum, and with a compressed downlink θ = θ_parent − decompress(C)
                        with the carried error (audit.rederive): the bytes hash to the manifest's
                        params and outer_state (genesis momentum is zero); a downlink object is
                        present exactly when the config compresses
  report-count          the workers the event credits are the signers of the call's reports, and the
                        call carried as many unreported updates as the event says
  report-signature      the EIP-712 signature recovers to report.worker (this chain, this ledger)
  report-binding        report runId / round / parentCheckpoint / checkpoint / manifestDigest are the
                        round's
  report-participant    report.updateDigest is the update CID of one manifest participant
  report-duplicate      one report per worker, one per participant
  report-fields         trainLossE6, tokens, innerSteps, bytesSent, bytesReceived equal the
                        participant entry
  report-eval-loss      evalLossE6 equals the manifest's eval_loss_e6
  data-digest           dataDigest is the digest of the shard the participant trained on, from the
                        run's config and corpus (trainer.data.shard_digest)
  admitted              the signer has a WorkerAdmitted event at or before the recording block
  revoked               ... and no WorkerRevoked event at or before it
  measurement-allowed   its admitted measurement was allowlisted as of the recording block
  admission-record      the admission record (CID(JSON, evidenceDigest)) exists, re-hashes and
                        names the worker and the measurement
  evidence              the evidence exists, re-hashes and passes attestation.verify_evidence with
                        the REPORTDATA the record implies, under the auditor's policy
  unreported            each update the coordinator recorded without a report is one participant's,
                        and no participant's update is both reported and unreported
  ghost                 every participant is accounted for on the ledger: by a worker's signed report,
                        or by the coordinator's unreported list (an update in the average that nobody
                        answers for is a ghost)
  tally                 ledger.contribution_of(run, worker) equals the reports' tokens and rounds
  total-contribution    ledger.total_contribution_of(worker) equals the worker's credits over every run
                        the ledger created (their RoundRecorded events)
  payout                (with the deployment's reward pool) every RewardPaid out of the run is what a
                        recorded round entitles its worker to, once, and the run is not paid past its
                        funding
  recorder              each round's recording transaction was sent by the run's coordinator
  unrecorded            the store's lineage goes at most ``max_unrecorded`` rounds past the ledger's
                        last round (manifests of the run whose parent chain leads to it)
  replay                (``replay`` > 0) each sampled contribution, and each one replayed on the way to
                        rebuild a worker's AdamW state, is within REPLAY_TOLERANCE of what H inner
                        steps on its shard from its parent checkpoint give (audit.replay)
  rescore               (``replay`` > 0) the held-out loss of each sampled round's checkpoint,
                        recomputed, is within EVAL_TOLERANCE of the manifest's

"As of the recording block" is the state after that whole block, rebuilt from the registry's
events (WorkerAdmitted, WorkerRevoked, MeasurementSet), never from the registry's current views: a
worker revoked after a round was recorded does not spoil that round, and a key revoked in the
same block as the recording counts as revoked. Historical ``eth_call`` is not used because a chain
restored from an anvil state file has no history of state, only of blocks and logs.

A participant without a worker's report is a failure (``ghost``) unless the coordinator recorded
its update as unreported; such updates are listed as warnings, because they count in the round on
the coordinator's word alone (docs/trust.md).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from attestation import DEV_WARNING, Policy, ReportError, SignedReport, checksum_address
from attestation.report import Domain
from settlement import ChainError, Ledger, Registry, registry_artifact
from settlement.ledger import commitment_of
from settlement.rewards import RewardPool
from storage_client import (
    CID,
    Codec,
    CorruptObjectError,
    InvalidCIDError,
    Manifest,
    ManifestError,
    MissingObjectError,
    ObjectStore,
    Participant,
    StoreError,
    from_e6,
    loads_bounded,
)
from storage_client.manifest import SCHEMA as MANIFEST_SCHEMA
from trainer.config import ConfigError, RunConfig
from trainer.data import CorpusError, load_corpus, shard_digest

from .admission import AdmissionCheck, check_admission
from .replay import EVAL_TOLERANCE, REPLAY_TOLERANCE, replay_run
from .rederive import RederiveError, clip_history, genesis_outer_state, rederive, stored_round_norm
from .result import AuditResult, Failure, RoundRow


def _hex(b: bytes | None) -> str | None:
    return None if b is None else "0x" + b.hex()


def _digest(cid_text: str) -> bytes:
    return CID.parse(cid_text).digest


@dataclass
class _Loaded:
    """A round whose manifest could be read: what the next round needs of it."""

    cid: CID
    manifest: Manifest
    params: bytes | None  # stored bytes, when present and intact
    outer_state: bytes | None


class _Audit:
    def __init__(self, store: ObjectStore, ledger: Ledger, registry: Registry, policy: Policy,
                 rederive: bool, max_unrecorded: int = 0, replay: int = 0, replay_seed: int = 0,
                 rewards: RewardPool | None = None) -> None:
        self.store = store
        self.rewards = rewards
        self.replay = replay
        self.replay_seed = replay_seed
        self.max_unrecorded = max_unrecorded
        self.ledger = ledger
        self.registry = registry
        self.policy = policy
        self.rederiving = rederive
        self.result = AuditResult(rederived=rederive)
        self.domain: Domain | None = None
        self.config: RunConfig | None = None
        self._admission_checks: dict[tuple[str, bytes], tuple[int, AdmissionCheck]] = {}
        self._warned: set[str] = set()
        self.norms: dict[int, list[float] | None] = {}  # round -> its stored updates' norms (keep_norms)
        self._shard_digests: list[bytes] | None = None  # shard_digests()
        self.run_view: dict[str, Any] = {}  # the ledger's runOf view of the audited run

    # -- bookkeeping --------------------------------------------------------------------------------

    def fail(self, round_: int | None, obj: str, check: str, message: str) -> None:
        self.result.failures.append(Failure(round_, obj, check, message))

    def warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            self.result.warnings.append(message)

    def get(self, round_: int, cid: CID | str, what: str) -> bytes | None:
        """The object's bytes, or None after recording why (missing, corrupt)."""
        try:
            return self.store.get(cid)
        except MissingObjectError:
            self.fail(round_, str(cid), "object", f"{what} is missing from the store")
        except CorruptObjectError as exc:
            self.fail(round_, str(cid), "object",
                      f"{what} does not re-hash to its CID: expected sha256 {exc.expected}, got {exc.actual}")
        except (StoreError, InvalidCIDError, ValueError) as exc:
            self.fail(round_, str(cid), "object", f"{what} cannot be read: {exc}")
        return None

    def load_manifest(self, round_: int, cid: CID) -> Manifest | None:
        try:
            return Manifest.from_json(self.store.get_json(cid))
        except MissingObjectError:
            self.fail(round_, str(cid), "object", f"the manifest of round {round_} is missing from the store")
        except CorruptObjectError as exc:
            self.fail(round_, str(cid), "object", f"the manifest of round {round_} does not re-hash to its CID: "
                                                  f"expected sha256 {exc.expected}, got {exc.actual}")
        except (StoreError, ManifestError) as exc:
            self.fail(round_, str(cid), "manifest", f"the manifest of round {round_} is not a valid manifest: {exc}")
        return None

    # -- the run ------------------------------------------------------------------------------------

    def resolve_run(self, run_id: bytes | None) -> tuple[bytes, dict[str, Any]] | None:
        if run_id is not None:
            run = self.ledger.run_of(run_id)
            if run is None:
                self.fail(None, "0x" + run_id.hex(), "run",
                          f"the ledger {self.ledger.address} has no run 0x{run_id.hex()}")
                return None
            return run_id, run
        created = self.ledger.runs_created()
        if not created:
            self.fail(None, self.ledger.address, "run", "the ledger holds no run")
            return None
        here = [e for e in created if self.store.has(CID(Codec.JSON, e["genesisManifest"]))]
        candidates = here if here else created
        ids = sorted({bytes(e["runId"]) for e in candidates})
        if len(ids) != 1:
            listing = ", ".join("0x" + i.hex() for i in ids)
            self.fail(None, self.ledger.address, "run",
                      f"the ledger holds {len(ids)} runs whose genesis is {'in this store' if here else 'anywhere'} "
                      f"({listing}); name the one to audit")
            return None
        run = self.ledger.run_of(ids[0])
        if run is None:
            self.fail(None, "0x" + ids[0].hex(), "run", "RunCreated was emitted but runOf does not know the run")
            return None
        return ids[0], run

    def check_genesis(self, run_id: bytes, run: dict[str, Any]) -> _Loaded | None:
        genesis_cid = CID(Codec.JSON, run["genesisManifest"])
        row = RoundRow(round=0, manifest=str(genesis_cid), checkpoint=_hex(run["genesisCheckpoint"]),
                       participants=0, reports=0, eval_loss=None)
        self.result.rounds.append(row)
        if run_id != run["genesisManifest"]:
            self.fail(0, str(genesis_cid), "run-id",
                      f"runId 0x{run_id.hex()} is not the genesis manifest's digest 0x{run['genesisManifest'].hex()}")
        manifest = self.load_manifest(0, genesis_cid)
        if manifest is None:
            return None
        row.eval_loss = from_e6(manifest.eval_loss_e6)
        if manifest.round != 0 or manifest.parent is not None or manifest.participants:
            self.fail(0, str(genesis_cid), "genesis",
                      f"the genesis manifest must be round 0 with no parent and no participants; it is round "
                      f"{manifest.round}, parent {manifest.parent}, {len(manifest.participants)} participant(s)")
        params = self.get(0, manifest.params, "θ⁽⁰⁾ (genesis params)")
        outer = self.get(0, manifest.outer_state, "the genesis outer state")
        config_bytes = self.get(0, manifest.config, "the run config")
        if _digest(manifest.params) != run["genesisCheckpoint"]:
            self.fail(0, manifest.params, "genesis-checkpoint",
                      f"the chain's genesis checkpoint 0x{run['genesisCheckpoint'].hex()} is not the digest of "
                      f"the genesis params {manifest.params}")
        if _digest(manifest.config) != run["configDigest"]:
            self.fail(0, manifest.config, "config",
                      f"the chain's configDigest 0x{run['configDigest'].hex()} is not the genesis config "
                      f"{manifest.config}")
        if config_bytes is not None:
            try:
                self.config = RunConfig.from_json(self.store.get_json(manifest.config))
            except (StoreError, ConfigError, ValueError) as exc:
                self.fail(0, manifest.config, "config", f"the run config does not parse: {exc}")
        if self.rederiving and params is not None and outer is not None:
            try:
                expected = genesis_outer_state(params)
            except RederiveError as exc:
                self.fail(0, manifest.params, "rederive", str(exc))
            else:
                if hashlib.sha256(expected).digest() != _digest(manifest.outer_state):
                    self.fail(0, manifest.outer_state, "rederive",
                              "the genesis outer state is not zero momentum for every parameter")
        return _Loaded(genesis_cid, manifest, params, outer)

    # -- rounds -------------------------------------------------------------------------------------

    def check_round(self, run_id: bytes, record: dict[str, Any], parent: _Loaded | None,
                    genesis: _Loaded | None, parent_checkpoint: bytes) -> _Loaded | None:
        r = int(record["round"])
        cid = CID(Codec.JSON, record["manifestDigest"])
        reports: list[SignedReport] = record.get("reports", [])
        row = RoundRow(round=r, manifest=str(cid), checkpoint=_hex(record["checkpoint"]), participants=None,
                       reports=len(reports), eval_loss=None)
        self.result.rounds.append(row)

        if record.get("parentCheckpoint") != parent_checkpoint:
            self.fail(r, f"round {r} on chain", "parent-checkpoint",
                      f"the ledger recorded parent 0x{record.get('parentCheckpoint', b'').hex()}, but the previous "
                      f"round's checkpoint on chain is 0x{parent_checkpoint.hex()}")
        unreported: list[bytes] = record.get("unreported", [])
        row.unreported = len(unreported)
        credited = [checksum_address(w) for w in record.get("workers", [])]
        signers = [rep.report.worker for rep in reports]
        if credited != signers or int(record.get("unreportedCount", 0)) != len(unreported):
            self.fail(r, f"round {r} on chain", "report-count",
                      f"RoundRecorded credits {len(credited)} worker(s) and says {record.get('unreportedCount', 0)} "
                      f"unreported update(s); the recording call carried reports of {len(signers)} and "
                      f"{len(unreported)} unreported" + ("" if len(credited) != len(signers) else
                                                         ": the credited workers are not the reports' signers"))
        stored = self.ledger.round_commitment(run_id, r)
        derived = commitment_of(record)
        if stored != record.get("commitment") or stored != derived:
            self.fail(r, f"round {r} on chain", "ledger",
                      f"the ledger keeps commitment 0x{stored.hex()} for the round, its RoundRecorded event says "
                      f"0x{bytes(record.get('commitment', b'')).hex()}, and the recorded facts hash to "
                      f"0x{derived.hex()} (the round was overwritten, or the ledger is not what it claims)")
        coordinator = checksum_address(self.run_view["coordinator"])
        if record.get("sender") != coordinator:
            self.fail(r, f"round {r} on chain", "recorder",
                      f"round {r} was recorded by {record.get('sender')} (tx {record.get('tx_hash')}), not by the run's "
                      f"coordinator {coordinator}")

        manifest = self.load_manifest(r, cid)
        if manifest is None:
            self.check_reports(run_id, r, record, None, parent)
            return None
        row.participants = len(manifest.participants)
        row.eval_loss = from_e6(manifest.eval_loss_e6)

        if manifest.round != r:
            self.fail(r, str(cid), "manifest-round", f"the manifest recorded as round {r} says round {manifest.round}")
        if parent is not None and manifest.parent != str(parent.cid):
            self.fail(r, str(cid), "parent",
                      f"the manifest names parent {manifest.parent}, but round {r - 1}'s manifest on chain is "
                      f"{parent.cid}")
        elif parent is None:
            self.fail(r, str(cid), "parent", f"round {r - 1}'s manifest cannot be read, so this round's parent "
                                             "link cannot be followed")
        if genesis is not None:
            if manifest.config != genesis.manifest.config:
                self.fail(r, str(cid), "config",
                          f"the manifest names config {manifest.config}, the run's is {genesis.manifest.config}")
            if manifest.run_id != genesis.manifest.run_id:
                self.fail(r, str(cid), "config",
                          f"the manifest names run {manifest.run_id!r}, the genesis {genesis.manifest.run_id!r}")

        params = self.get(r, manifest.params, f"θ⁽{r}⁾ (params of round {r})")
        outer = self.get(r, manifest.outer_state, f"the outer state of round {r}")
        self.get(r, manifest.config, "the run config")
        updates: dict[str, bytes] = {}
        for p in manifest.participants:
            data = self.get(r, p.update, f"the update of participant {p.worker}")
            if data is not None:
                updates[p.worker] = data

        if _digest(manifest.params) != record["checkpoint"]:
            self.fail(r, manifest.params, "checkpoint",
                      f"the chain's checkpoint 0x{record['checkpoint'].hex()} is not the digest of the manifest's "
                      f"params {manifest.params}")
        if parent is not None and _digest(parent.manifest.params) != record.get("parentCheckpoint"):
            self.fail(r, parent.manifest.params, "parent-checkpoint",
                      f"the chain's parent checkpoint 0x{record.get('parentCheckpoint', b'').hex()} is not the "
                      f"digest of round {r - 1}'s params {parent.manifest.params}")

        if self.rederiving:
            self.check_rederive(r, manifest, parent, updates)
            self.keep_norms(r, manifest, updates)
        self.check_reports(run_id, r, record, manifest, parent)
        return _Loaded(cid, manifest, params, outer)

    def keep_norms(self, r: int, manifest: Manifest, updates: dict[str, bytes]) -> None:
        """Round r's ρ̃ (trainer.aggregation.round_norm of its stored updates' norms), part of the clip
        threshold of the next K rounds; None when an update is unavailable or unreadable."""
        self.norms[r] = None
        if len(updates) == len(manifest.participants):
            try:
                self.norms[r] = [stored_round_norm(updates)]
            except RederiveError:
                pass

    def history(self, r: int) -> list[float] | None:
        """ρ̃ of rounds max(1, r-K)..r-1, or None when one of them is unknown."""
        assert self.config is not None
        return clip_history(self.norms, r, self.config.rounds.clip_history_rounds)

    def check_rederive(self, r: int, manifest: Manifest, parent: _Loaded | None, updates: dict[str, bytes]) -> None:
        if self.config is not None and self.config.rounds.clip_multiple > 0 and self.history(r) is None:
            self.fail(r, str(manifest.params), "rederive",
                      f"cannot re-derive the round: the clip threshold takes the norms of the previous "
                      f"{self.config.rounds.clip_history_rounds} round(s)' updates, and one of them is unavailable")
            return
        if self.config is None or parent is None or parent.params is None or parent.outer_state is None \
                or len(updates) != len(manifest.participants):
            self.fail(r, str(manifest.params), "rederive",
                      "cannot re-derive the round: the config, the parent's params or outer state, or an update "
                      "is unavailable (see the failures above)")
            return
        downlink = None
        if (manifest.downlink is not None) != self.config.compression.enabled:
            self.fail(r, str(manifest.params), "rederive",
                      f"the config {'compresses' if self.config.compression.enabled else 'does not compress'} "
                      f"the global update, but the manifest {'names a' if manifest.downlink else 'has no'} "
                      "compressed downlink object")
            return
        if manifest.downlink is not None:
            sent = self.get(r, manifest.downlink.payload, f"the compressed global update of round {r}")
            header = self.get(r, manifest.downlink.header, f"the codec header of round {r}'s global update")
            if sent is None or header is None:
                self.fail(r, str(manifest.params), "rederive",
                          "cannot re-derive the round: its compressed global update is unavailable")
                return
            try:
                downlink = (sent, json.loads(header))
            except ValueError as exc:
                self.fail(r, manifest.downlink.header, "rederive", f"the codec header is not JSON: {exc}")
                return
        try:
            derived = rederive(self.config.outer, parent.params, parent.outer_state, updates, downlink,
                               rounds=self.config.rounds, history=self.history(r) or ())
        except RederiveError as exc:
            self.fail(r, str(manifest.params), "rederive", str(exc))
            return
        if derived.params_digest != _digest(manifest.params):
            self.fail(r, manifest.params, "rederive",
                      f"aggregate of the {len(updates)} stored update(s) + outer step from round {r - 1} gives params "
                      f"sha256 {derived.params_digest.hex()}, the manifest names {manifest.params}")
        if derived.outer_state_digest != _digest(manifest.outer_state):
            self.fail(r, manifest.outer_state, "rederive",
                      f"the re-derived outer state hashes to {derived.outer_state_digest.hex()}, the manifest "
                      f"names {manifest.outer_state}")

    # -- reports ------------------------------------------------------------------------------------

    def check_reports(self, run_id: bytes, r: int, record: dict[str, Any], manifest: Manifest | None,
                      parent: _Loaded | None) -> None:
        assert self.domain is not None
        block = int(record["block"])
        by_update = {} if manifest is None else {_digest(p.update): p for p in manifest.participants}
        matched: dict[str, str] = {}  # participant worker id -> report label
        signers: dict[str, str] = {}
        for i, signed in enumerate(record.get("reports", [])):
            rep = signed.report
            label = f"report[{i}] {rep.worker}"
            signature_ok = True
            try:
                signed.verify(self.domain)
            except ReportError as exc:
                signature_ok = False
                self.fail(r, label, "report-signature", str(exc))
            wrong = []
            if rep.run_id != run_id:
                wrong.append(f"runId 0x{rep.run_id.hex()}")
            if rep.round != r:
                wrong.append(f"round {rep.round}")
            if rep.parent_checkpoint != record.get("parentCheckpoint"):
                wrong.append(f"parentCheckpoint 0x{rep.parent_checkpoint.hex()}")
            elif parent is not None and rep.parent_checkpoint != _digest(parent.manifest.params):
                wrong.append(f"parentCheckpoint 0x{rep.parent_checkpoint.hex()} (not round {r - 1}'s params)")
            if rep.checkpoint != record["checkpoint"]:
                wrong.append(f"checkpoint 0x{rep.checkpoint.hex()}")
            if rep.manifest_digest != record["manifestDigest"]:
                wrong.append(f"manifestDigest 0x{rep.manifest_digest.hex()}")
            if wrong:
                self.fail(r, label, "report-binding", "the report is not about this round: " + ", ".join(wrong))
            if rep.worker in signers:
                self.fail(r, label, "report-duplicate",
                          f"{rep.worker} already reported this round ({signers[rep.worker]})")
            signers.setdefault(rep.worker, label)

            if manifest is not None:
                p = by_update.get(rep.update_digest)
                if p is None:
                    self.fail(r, label, "report-participant",
                              f"updateDigest 0x{rep.update_digest.hex()} is not the update of any participant of "
                              f"the manifest")
                else:
                    if p.worker in matched:
                        self.fail(r, label, "report-duplicate",
                                  f"participant {p.worker}'s update is already claimed by {matched[p.worker]}")
                    matched.setdefault(p.worker, label)
                    diffs = [f"{name} {got} (manifest {want})" for name, got, want in (
                        ("trainLossE6", rep.train_loss_e6, p.train_loss_e6), ("tokens", rep.tokens, p.tokens),
                        ("innerSteps", rep.inner_steps, p.inner_steps), ("bytesSent", rep.bytes_sent, p.bytes_sent),
                        ("bytesReceived", rep.bytes_received, p.bytes_received),
                    ) if got != want]
                    if diffs:
                        self.fail(r, label, "report-fields",
                                  f"the report for participant {p.worker} differs from the manifest: "
                                  + ", ".join(diffs))
                    self.check_data_digest(r, label, p, rep.data_digest)
                if rep.eval_loss_e6 != manifest.eval_loss_e6:
                    self.fail(r, label, "report-eval-loss",
                              f"evalLossE6 {rep.eval_loss_e6}, the manifest says {manifest.eval_loss_e6}")
            if signature_ok:
                self.check_signer(run_id, r, label, rep.worker, block)

        if manifest is not None:
            self.check_accounted(r, record, manifest, matched)

    def check_data_digest(self, r: int, label: str, p: Participant, signed: bytes) -> None:
        """A report's dataDigest is the digest of the shard its participant trained on, as the
        config implies it (trainer.data.shard_digest of Corpus.shard)."""
        digests = self.shard_digests()
        if digests is None:
            return
        if p.shard >= len(digests):
            self.fail(r, label, "data-digest", f"participant {p.worker} names shard {p.shard}, but the config "
                                               f"splits the corpus into {len(digests)}")
        elif signed != digests[p.shard]:
            self.fail(r, label, "data-digest",
                      f"dataDigest 0x{signed.hex()} is not the digest of shard {p.shard} of {len(digests)} of the "
                      f"run's corpus (0x{digests[p.shard].hex()}), which participant {p.worker} trained on")

    def shard_digests(self) -> list[bytes] | None:
        """Each shard's digest, from the run's config and corpus (computed once); None, with one
        failure, when the corpus cannot be read here."""
        if self._shard_digests is None and self.config is not None:
            cfg = self.config
            try:
                corpus = load_corpus(cfg.data, cfg.seed, cfg.model.block_size)
            except CorpusError as exc:
                self.fail(None, cfg.data.corpus, "data-digest",
                          f"the run's corpus cannot be read here, so no report's dataDigest can be checked: {exc}")
                self._shard_digests = []
            else:
                n = cfg.rounds.expected_workers
                self._shard_digests = [shard_digest(corpus.shard(i, n)) for i in range(n)]
        return self._shard_digests or None

    def check_accounted(self, r: int, record: dict[str, Any], manifest: Manifest, matched: dict[str, str]) -> None:
        """Every participant has a worker's report or is on the coordinator's unreported list; every
        unreported entry is a participant that has no report."""
        unreported: list[bytes] = record.get("unreported", [])
        by_update = {_digest(p.update): p for p in manifest.participants}
        vouched: set[str] = set()
        for j, digest in enumerate(unreported):
            p = by_update.get(digest)
            label = f"unreported[{j}] 0x{digest.hex()}"
            if p is None:
                self.fail(r, label, "unreported", "the coordinator recorded an unreported update that is no "
                                                  "participant's update in the manifest")
            elif p.worker in matched:
                self.fail(r, label, "unreported", f"participant {p.worker}'s update is recorded both as reported "
                                                  f"({matched[p.worker]}) and as unreported")
            else:
                vouched.add(p.worker)
        for p in manifest.participants:
            if p.worker in vouched:
                self.warn(f"round {r}: participant {p.worker} did not report; its update {p.update} counts in the "
                          f"round on the coordinator's word alone (recorded as unreported, credited to nobody)")
            elif p.worker not in matched:
                self.fail(r, p.update, "ghost",
                          f"participant {p.worker}'s update is in the round, but no worker signed a report for it "
                          f"and the coordinator did not record it as unreported")

    def check_signer(self, run_id: bytes, r: int, label: str, worker: str, block: int) -> None:
        admitted = [a for a in self.admissions.get(worker, []) if a["block"] <= block]
        if not admitted:
            later = self.admissions.get(worker, [])
            when = f" (only later, at block {later[0]['block']})" if later else ""
            self.fail(r, label, "admitted",
                      f"{worker} was never admitted to registry {self.registry.address} before the round was "
                      f"recorded at block {block}{when}")
            return
        admission = admitted[-1]
        revoked = [v for v in self.revocations.get(worker, []) if v["block"] <= block]
        if revoked:
            self.fail(r, label, "revoked",
                      f"{worker} was revoked at block {revoked[0]['block']}, and the round was recorded at block "
                      f"{block}")
        measurement = bytes(admission["measurement"])
        if not self.measurement_allowed(measurement, block):
            self.fail(r, label, "measurement-allowed",
                      f"{worker}'s measurement 0x{measurement.hex()} was not allowlisted at block {block}")
        key = (worker, bytes(admission["evidence_digest"]))
        if key in self._admission_checks:
            first, checked = self._admission_checks[key]
            if not checked.ok:
                self.fail(r, label, "admission", f"{worker}'s admission record or evidence did not verify "
                                                 f"(see round {first})")
            return
        checked = check_admission(self.store, worker=worker, measurement=measurement,
                                  evidence_digest=key[1], run_id=run_id, policy=self.policy)
        self._admission_checks[key] = (r, checked)
        for obj, check, message in checked.failures:
            self.fail(r, obj, check, message)
        for warning in checked.warnings:
            self.warn(warning)

    def measurement_allowed(self, measurement: bytes, block: int) -> bool:
        allowed = False
        for event in self.measurement_events:
            if event["block"] > block:
                break
            if bytes(event["measurement"]) == measurement:
                allowed = bool(event["allowed"])
        return allowed

    # -- the registry's history ----------------------------------------------------------------------

    def read_registry(self) -> None:
        self.admissions: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in self.registry.admissions():
            self.admissions[checksum_address(e["worker"])].append(e)
        self.revocations: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for e in self.registry.revocations():
            self.revocations[checksum_address(e["worker"])].append(e)
        contract = self.registry.chain.contract(self.registry.address, registry_artifact().abi)
        logs = self.registry.chain.read(
            lambda: contract.events.MeasurementSet.get_logs(from_block=self.registry.from_block), "MeasurementSet logs")
        self.measurement_events = sorted(
            ({"measurement": bytes(e["args"]["measurement"]), "allowed": bool(e["args"]["allowed"]),
              "block": int(e["blockNumber"]), "log_index": int(e["logIndex"])} for e in logs),
            key=lambda e: (e["block"], e["log_index"]))

    # -- tallies ------------------------------------------------------------------------------------

    def check_tallies(self, run_id: bytes, rounds: list[dict[str, Any]]) -> None:
        """``contributionOf(run, worker)`` equals the run's recorded reports of that worker, and
        ``totalContributionOf(worker)`` the worker's credits over every run on this ledger (summed from
        each run's RoundRecorded events: the tokens each round credits each of its workers)."""
        tokens: dict[str, int] = defaultdict(int)
        counted: dict[str, int] = defaultdict(int)
        for record in rounds:
            for signed in record.get("reports", []):
                tokens[signed.report.worker] += signed.report.tokens
                counted[signed.report.worker] += 1
        workers = set(tokens) | {checksum_address(w) for record in rounds for w in record.get("workers", [])}
        for worker in sorted(workers):
            got = self.ledger.contribution_of(run_id, worker)
            want = {"tokens": tokens.get(worker, 0), "rounds": counted.get(worker, 0)}
            self.result.tallies[worker] = {"tokens": want["tokens"], "rounds": want["rounds"]}
            if (int(got["tokens"]), int(got["rounds"])) != (want["tokens"], want["rounds"]):
                self.fail(None, worker, "tally",
                          f"the ledger credits {worker} with {got['tokens']} tokens over {got['rounds']} round(s); "
                          f"its recorded reports sum to {want['tokens']} tokens over {want['rounds']} round(s)")
        if not workers:
            return
        try:
            totals = self.totals_over_runs()
        except ChainError as exc:
            self.fail(None, self.ledger.address, "total-contribution", f"the ledger's runs cannot be read: {exc}")
            return
        for worker in sorted(workers):
            got = self.ledger.total_contribution_of(worker)
            want = totals.get(worker, {"tokens": 0, "rounds": 0})
            self.result.tallies[worker]["total_tokens"] = want["tokens"]
            if (int(got["tokens"]), int(got["rounds"])) != (want["tokens"], want["rounds"]):
                self.fail(None, worker, "total-contribution",
                          f"the ledger's totalContributionOf({worker}) is {got['tokens']} tokens over {got['rounds']} "
                          f"round(s); its rounds over all {len(self.ledger.runs_created())} run(s) credit "
                          f"{want['tokens']} tokens over {want['rounds']} round(s)")

    def totals_over_runs(self) -> dict[str, dict[str, int]]:
        """Each worker's credits over every run this ledger created, from the RoundRecorded events."""
        totals: dict[str, dict[str, int]] = defaultdict(lambda: {"tokens": 0, "rounds": 0})
        for created in self.ledger.runs_created():
            for event in self.ledger.recorded_round_events(bytes(created["runId"])):
                for worker in event["workers"]:
                    total = totals[checksum_address(worker)]
                    total["tokens"] += int(event["tokens"])
                    total["rounds"] += 1
        return totals

    def check_payouts(self, run_id: bytes) -> None:
        """Every reward the pool paid out of this run is one a recorded round entitles (``payout``),
        and each worker's earnings and payments go in the result (settlement.rewards.statement)."""
        if self.rewards is None:
            return
        try:
            statement = self.rewards.statement(run_id)
        except ChainError as exc:
            self.fail(None, self.rewards.address, "payout", f"the reward pool cannot be read: {exc}")
            return
        if statement is None:
            return
        self.result.rewards = statement
        for worker, account in sorted(statement.workers.items()):
            for problem in account.overpaid:
                self.fail(None, worker, "payout", f"the reward pool paid {worker} for a round no record entitles "
                                                  f"it to: {problem}")
        if statement.paid > statement.funded:
            self.fail(None, self.rewards.address, "payout",
                      f"the pool paid {statement.paid} out of this run, funded with {statement.funded}")

    # -- everything ---------------------------------------------------------------------------------

    def run(self, run_id: bytes | None) -> AuditResult:
        self.domain = self.ledger.domain()
        consulted = checksum_address(self.ledger.registry_address())
        if consulted != checksum_address(self.registry.address):
            self.fail(None, self.ledger.address, "registry",
                      f"the ledger consults registry {consulted}, not the audited {self.registry.address}")
        resolved = self.resolve_run(run_id)
        if resolved is None:
            return self.finish()
        run_id, run = resolved
        self.run_view = run
        self.result.run_id = run_id
        self.read_registry()
        genesis = self.check_genesis(run_id, run)

        try:
            rounds = self.ledger.recorded_rounds(run_id)
        except ChainError as exc:
            self.fail(None, self.ledger.address, "ledger", f"the recorded rounds cannot be read: {exc}")
            return self.finish()
        last = int(run["lastRound"])
        numbers = [int(rec["round"]) for rec in rounds]
        if numbers != list(range(1, last + 1)):
            self.fail(None, self.ledger.address, "rounds",
                      f"the ledger's lastRound is {last}, but its RoundRecorded events are for rounds {numbers}")

        parent, parent_checkpoint = genesis, bytes(run["genesisCheckpoint"])
        loaded = {0: genesis.manifest} if genesis is not None else {}
        for record in rounds:
            parent = self.check_round(run_id, record, parent, genesis, parent_checkpoint)
            parent_checkpoint = bytes(record["checkpoint"])
            if parent is not None:
                loaded[parent.manifest.round] = parent.manifest
        if self.replay > 0:
            self.check_replay(loaded)
        self.check_tallies(run_id, rounds)
        self.check_payouts(run_id)
        if genesis is not None:
            last = CID(Codec.JSON, bytes(rounds[-1]["manifestDigest"])) if rounds else genesis.cid
            self.check_unrecorded(genesis.manifest.run_id, last, len(rounds))
        return self.finish()

    def check_replay(self, manifests: dict[int, Manifest]) -> None:
        """``--replay K``: K sampled contributions re-run from their parent checkpoint, shard and
        committed state, and their rounds re-scored (audit.replay)."""
        if self.config is None:
            self.fail(None, "replay", "replay", "the run config could not be read, so nothing can be replayed")
            return
        outcome = replay_run(self.store, self.config, manifests, self.replay, self.replay_seed)
        self.result.replay = outcome
        for round_, obj, message in outcome.problems:
            self.fail(round_, obj, "replay", message)
        for row in outcome.rows:
            if row.status != "MISMATCH":
                continue
            update = {p.worker: p.update for p in manifests[row.round].participants}[row.worker]
            if row.distance is None:
                self.fail(row.round, update, "replay", f"{row.worker}'s update cannot be replayed: {row.note}")
            else:
                self.fail(row.round, update, "replay",
                          f"{row.worker}'s update is {row.distance:.3g} away (relative L2) from what "
                          f"{self.config.inner.steps} inner steps on shard "
                          f"{ {p.worker: p.shard for p in manifests[row.round].participants}[row.worker]} "
                          f"from round {row.round - 1}'s checkpoint give; an honest replay is within "
                          f"{REPLAY_TOLERANCE:g}")
        for score in outcome.rescored:
            if not score.ok:
                self.fail(score.round, manifests[score.round].params, "rescore",
                          f"the held-out loss of round {score.round}'s checkpoint is {score.recomputed:.6f}, the "
                          f"manifest and its reports say {score.reported:.6f} (tolerance {EVAL_TOLERANCE:g})")

    def check_unrecorded(self, run_name: str, last: CID, last_round: int) -> None:
        """How far the store's lineage goes past the ledger's last round: the longest chain of the
        run's manifests in the store whose parent links lead to ``last``."""
        children = _manifests_by_parent(self.store, run_name)
        depth, tip, frontier = 0, last, [last]
        while frontier:
            nxt = [c for cid in frontier for c in children.get(str(cid), [])]
            if not nxt:
                break
            depth, tip, frontier = depth + 1, nxt[0], nxt
        if depth == 0:
            return
        rounds = f"round {last_round + 1}" if depth == 1 else f"rounds {last_round + 1}..{last_round + depth}"
        message = (f"the store holds {rounds} of this run past the ledger's last round {last_round} (up to manifest "
                   f"{tip}), which the ledger does not record")
        if depth > self.max_unrecorded:
            self.fail(None, str(tip), "unrecorded", f"{message}; at most {self.max_unrecorded} allowed")
        else:
            self.warn(message)

    def finish(self) -> AuditResult:
        result = self.result
        for row in result.rounds:
            row.status = "FAIL" if result.failures_of(row.round) else "ok"
        if any(c.provider == "dev" and c.ok for _, c in self._admission_checks.values()):
            result.warnings.insert(0, "DEV ATTESTATION ACCEPTED: workers of this run were admitted on dev evidence; "
                                      "its signatures and bindings verified, but it PROVES NOTHING about what code "
                                      f"ran. {DEV_WARNING}")
        return result


_MAX_MANIFEST_BYTES = 4 << 20  # larger objects in a store are tensors, not manifests


def _manifests_by_parent(store: ObjectStore, run_name: str) -> dict[str, list[CID]]:
    """The run's manifests in the store, by their parent's CID (sorted, so the result is the same
    on every machine). Objects that are not small JSON manifests of this run are skipped."""
    children: dict[str, list[CID]] = defaultdict(list)
    for hex_digest in store:
        cid = CID(Codec.JSON, bytes.fromhex(hex_digest))
        path = store.path_of(cid)
        try:
            if path.stat().st_size > _MAX_MANIFEST_BYTES:
                continue
            with path.open("rb") as f:
                if f.read(1) != b"{":
                    continue
            data = loads_bounded(store.get(cid), max_bytes=_MAX_MANIFEST_BYTES, what="manifest")
            if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
                continue
            manifest = Manifest.from_json(data)
        except (OSError, StoreError, ManifestError, ValueError):
            continue
        if manifest.run_id == run_name and manifest.parent is not None:
            children[manifest.parent].append(cid)
    return {parent: sorted(kids, key=str) for parent, kids in children.items()}


def run_audit(store: ObjectStore, ledger: Ledger, registry: Registry, *, run_id: bytes | None = None,
              policy: Policy, rederive: bool = True, max_unrecorded: int = 0, replay: int = 0,
              replay_seed: int | None = None, rewards: RewardPool | None = None) -> AuditResult:
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
    return _Audit(store, ledger, registry, policy, rederive, max_unrecorded, replay, seed, rewards).run(
        None if run_id is None else bytes(run_id))

