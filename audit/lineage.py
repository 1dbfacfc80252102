"""The run's lineage in the store, followed from the ledger's starting points.

Checks ``run`` (which run is audited), ``run-id``, ``object``, ``manifest``, ``genesis``,
``genesis-checkpoint``, ``config``, ``manifest-round``, ``parent``, ``checkpoint``,
``parent-checkpoint`` (the chain's parent against the previous round's stored params),
``inner-steps`` (each participant's inner steps and tokens are the round's H_r, trainer.rounds.schedule),
``update-record`` (each participant's record, and the pushed bytes it names, fit the model) and
``unrecorded``; audit.core describes each. Whether the stored bytes are what the updates give is
audit.recompute's; the ledger's own records are audit.tallies'.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from settlement import Ledger
from settlement.records import RoundRecord, RunRecord
from storage_client import (
    CID,
    Codec,
    Manifest,
    ManifestError,
    Store,
    StoreError,
    hex_or_none,
)
from storage_client.manifest import SCHEMA as MANIFEST_SCHEMA
from trainer.codec import CompressionError
from trainer.codec.wire import Layout, WireError, decode_params, layout_of
from trainer.config import ConfigError, RunConfig
from trainer.rounds.schedule import round_tokens, stored_inner_steps
from trainer.rounds.update_source import UpdateSource
from trainer.runstore.checkpoints import is_full_checkpoint
from trainer.runstore.update_record import RecordError, open_update

from .checks import AuditCheck
from .findings import Findings, cid_digest


@dataclass
class Loaded:
    """A round whose manifest could be read: what the next round needs of it."""

    cid: CID
    manifest: Manifest
    params: bytes | None  # stored bytes, when present and intact
    outer_state: bytes | None


class Lineage:
    """Walks genesis and the recorded rounds' manifests; ``config`` is the run's, once genesis is read."""

    def __init__(self, findings: Findings, ledger: Ledger) -> None:
        self.findings = findings
        self.ledger = ledger
        self.config: RunConfig | None = None
        self.layout: Layout | None = None  # the model's tensors, from θ⁽⁰⁾: what an update must match
        # The manifests of the rounds read so far, by round: round r's H_r needs round r−2's.
        self.manifests: dict[int, Manifest] = {}

    def resolve_run(self, run_id: bytes | None) -> tuple[bytes, RunRecord] | None:
        """The audited run's id and the ledger's runOf view of it; None after a ``run`` failure.
        Without an id, the ledger's one run whose genesis manifest is in the store."""
        fail = self.findings.fail
        if run_id is not None:
            run = self.ledger.run_of(run_id)
            if run is None:
                fail(None, "0x" + run_id.hex(), AuditCheck.RUN, f"the ledger {self.ledger.address} has no run 0x{run_id.hex()}")
                return None
            return run_id, run
        created = self.ledger.runs_created()
        if not created:
            fail(None, self.ledger.address, AuditCheck.RUN, "the ledger holds no run")
            return None
        here = [e for e in created if self.findings.store.has(CID(Codec.JSON, e.genesis_manifest))]
        candidates = here if here else created
        ids = sorted({e.run_id for e in candidates})
        if len(ids) != 1:
            listing = ", ".join("0x" + i.hex() for i in ids)
            fail(None, self.ledger.address, AuditCheck.RUN,
                 f"the ledger holds {len(ids)} runs whose genesis is {'in this store' if here else 'anywhere'} "
                 f"({listing}); name the one to audit")
            return None
        run = self.ledger.run_of(ids[0])
        if run is None:
            fail(None, "0x" + ids[0].hex(), AuditCheck.RUN, "RunCreated was emitted but runOf does not know the run")
            return None
        return ids[0], run

    def check_genesis(self, run_id: bytes, run: RunRecord) -> Loaded | None:
        """The genesis manifest, θ⁽⁰⁾ and the config against the run's on-chain facts; reads ``config``."""
        fail = self.findings.fail
        genesis_cid = CID(Codec.JSON, run.genesis_manifest)
        if run_id != run.genesis_manifest:
            fail(0, str(genesis_cid), AuditCheck.RUN_ID,
                 f"runId 0x{run_id.hex()} is not the genesis manifest's digest 0x{run.genesis_manifest.hex()}")
        manifest = self.findings.read_manifest(0, genesis_cid)
        if manifest is None:
            return None
        if manifest.round != 0 or manifest.parent is not None or manifest.participants:
            fail(0, str(genesis_cid), AuditCheck.GENESIS,
                 f"the genesis manifest must be round 0 with no parent and no participants; it is round "
                 f"{manifest.round}, parent {manifest.parent}, {len(manifest.participants)} participant(s)")
        params = self.findings.read(0, manifest.params, "θ⁽⁰⁾ (genesis params)")
        outer = self.findings.read(0, manifest.outer_state, "the genesis outer state")
        config_bytes = self.findings.read(0, manifest.config, "the run config")
        if cid_digest(manifest.params) != run.genesis_checkpoint:
            fail(0, manifest.params, AuditCheck.GENESIS_CHECKPOINT,
                 f"the chain's genesis checkpoint 0x{run.genesis_checkpoint.hex()} is not the digest of "
                 f"the genesis params {manifest.params}")
        if cid_digest(manifest.config) != run.config_digest:
            fail(0, manifest.config, AuditCheck.CONFIG,
                 f"the chain's configDigest 0x{run.config_digest.hex()} is not the genesis config {manifest.config}")
        if config_bytes is not None:
            try:
                self.config = RunConfig.from_json(self.findings.store.get_json(manifest.config))
            except (StoreError, ConfigError, ValueError) as exc:
                fail(0, manifest.config, AuditCheck.CONFIG, f"the run config does not parse: {exc}")
        pinned = self.config.model.init_params if self.config is not None else ""
        if pinned and manifest.params != pinned:
            fail(0, manifest.params, AuditCheck.GENESIS_CHECKPOINT,
                 f"the genesis params {manifest.params} are not the weights the config pins (model.init_params "
                 f"{pinned})")
        if params is not None:
            try:
                self.layout = layout_of(decode_params(params))
            except WireError as exc:
                fail(0, manifest.params, AuditCheck.GENESIS, f"the genesis params do not decode: {exc}")
        self.manifests[0] = manifest
        return Loaded(genesis_cid, manifest, params, outer)

    def check_round(self, record: RoundRecord, parent: Loaded | None,
                    genesis: Loaded | None) -> tuple[Loaded, dict[str, UpdateSource]] | None:
        """A recorded round's manifest and the objects it names; the round and its stored updates (by
        worker, opened from their records: those that could be read), or None when the manifest
        cannot be read. The updates are not kept in ``Loaded``: the next round needs only the params
        and outer state. A round that keeps no full checkpoint (trainer.runstore.checkpoints) has its params
        and outer state read only when present: the re-derivation fills them in."""
        r = record.round
        cid = CID(Codec.JSON, record.manifest_digest)
        manifest = self.findings.read_manifest(r, cid)
        if manifest is None:
            return None
        self._check_links(r, cid, manifest, parent, genesis)
        self.manifests[r] = manifest
        self._check_inner_steps(r, cid, manifest)
        self.manifests.pop(r - 2, None)  # round r+1 needs round r−1's, no earlier one
        params = outer = None
        store = self.findings.store
        if self.config is None or is_full_checkpoint(self.config.rounds, r) or store.has(manifest.params):
            params = self.findings.read(r, manifest.params, f"θ⁽{r}⁾ (params of round {r})")
        if self.config is None or is_full_checkpoint(self.config.rounds, r) or store.has(manifest.outer_state):
            outer = self.findings.read(r, manifest.outer_state, f"the outer state of round {r}")
        self.findings.read(r, manifest.config, "the run config")
        updates: dict[str, UpdateSource] = {}
        for p in manifest.participants:
            update = self._open_update(r, p.worker, p.update)
            if update is not None:
                updates[p.worker] = update
        if cid_digest(manifest.params) != record.checkpoint:
            self.findings.fail(r, manifest.params, AuditCheck.CHECKPOINT,
                               f"the chain's checkpoint 0x{record.checkpoint.hex()} is not the digest of the "
                               f"manifest's params {manifest.params}")
        if parent is not None and cid_digest(parent.manifest.params) != record.parent_checkpoint:
            self.findings.fail(r, parent.manifest.params, AuditCheck.PARENT_CHECKPOINT,
                               f"the chain's parent checkpoint {hex_or_none(record.parent_checkpoint)} is not "
                               f"the digest of round {r - 1}'s params {parent.manifest.params}")
        return Loaded(cid, manifest, params, outer), updates

    def _check_inner_steps(self, r: int, cid: CID, manifest: Manifest) -> None:
        """Every participant trained H_r steps and H_r·batch·block tokens, H_r re-derived from round
        r−2's stored downlink header (trainer.rounds.schedule) as the coordinator derived it."""
        if self.config is None or self.layout is None:
            return
        try:
            steps = stored_inner_steps(self.config, r, self.manifests, self.findings.store, self.layout)
        except KeyError:  # round r−2's manifest could not be read: that is its own failure
            return
        except (StoreError, WireError, CompressionError) as exc:
            header = self.manifests[r - 2].downlink
            self.findings.fail(r, header.header if header is not None else str(cid), AuditCheck.INNER_STEPS,
                               f"round {r - 2}'s downlink codec header, which fixes round {r}'s inner steps: "
                               f"{str(exc)[:300]}")
            return
        tokens = round_tokens(self.config, steps)
        for p in manifest.participants:
            if p.inner_steps != steps or p.tokens != tokens:
                self.findings.fail(r, str(cid), AuditCheck.INNER_STEPS,
                                   f"participant {p.worker} is recorded with {p.inner_steps} inner steps and "
                                   f"{p.tokens} tokens; round {r} trains {steps} steps, {tokens} tokens")

    def _open_update(self, r: int, worker: str, cid: str) -> UpdateSource | None:
        """A participant's update record and the pushed bytes it names, opened as on arrival
        (trainer.runstore.update_record); None after an ``object`` or ``update-record`` failure."""
        if self.findings.read(r, cid, f"the update record of participant {worker}") is None:
            return None
        if self.config is None or self.layout is None:
            return None
        try:
            return open_update(self.findings.store, cid, self.layout, self.config.model)
        except StoreError as exc:
            self.findings.fail(r, cid, AuditCheck.OBJECT, f"an object the update record of {worker} names: {exc}")
        except RecordError as exc:
            self.findings.fail(r, cid, AuditCheck.UPDATE_RECORD, f"the update record of {worker}: {exc}")
        return None

    def _check_links(self, r: int, cid: CID, manifest: Manifest, parent: Loaded | None,
                     genesis: Loaded | None) -> None:
        """The manifest says the round it was recorded as, links to the previous round's manifest,
        and names the run's config and run."""
        fail = self.findings.fail
        if manifest.round != r:
            fail(r, str(cid), AuditCheck.MANIFEST_ROUND, f"the manifest recorded as round {r} says round {manifest.round}")
        if parent is not None and manifest.parent != str(parent.cid):
            fail(r, str(cid), AuditCheck.PARENT,
                 f"the manifest names parent {manifest.parent}, but round {r - 1}'s manifest on chain is {parent.cid}")
        elif parent is None:
            fail(r, str(cid), AuditCheck.PARENT,
                 f"round {r - 1}'s manifest cannot be read, so this round's parent link cannot be followed")
        if genesis is not None:
            if manifest.config != genesis.manifest.config:
                fail(r, str(cid), AuditCheck.CONFIG,
                     f"the manifest names config {manifest.config}, the run's is {genesis.manifest.config}")
            if manifest.run_id != genesis.manifest.run_id:
                fail(r, str(cid), AuditCheck.CONFIG,
                     f"the manifest names run {manifest.run_id!r}, the genesis {genesis.manifest.run_id!r}")


def check_unrecorded(findings: Findings, run_name: str, last: CID, last_round: int, max_unrecorded: int) -> None:
    """How far the store's lineage goes past the ledger's last round: the longest chain of the
    run's manifests in the store whose parent links lead to ``last``. Up to ``max_unrecorded``
    rounds are a warning (a ledger catching up), more an ``unrecorded`` failure."""
    children = _manifests_by_parent(findings.store, run_name)
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
    if depth > max_unrecorded:
        findings.fail(None, str(tip), AuditCheck.UNRECORDED, f"{message}; at most {max_unrecorded} allowed")
    else:
        findings.warn(message)


_MAX_MANIFEST_BYTES = 4 << 20  # larger objects in a store are tensors, not manifests


def _manifests_by_parent(store: Store, run_name: str) -> dict[str, list[CID]]:
    """The run's manifests in the store, by their parent's CID (sorted, so the result is the same
    on every machine). Objects that are not small JSON manifests of this run are skipped."""
    children: dict[str, list[CID]] = defaultdict(list)
    for hex_digest in store:
        cid = CID(Codec.JSON, bytes.fromhex(hex_digest))
        try:
            data = store.read_small_json(cid, _MAX_MANIFEST_BYTES)
            if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA:
                continue
            manifest = Manifest.from_json(data)
        except (OSError, StoreError, ManifestError, ValueError):
            continue
        if manifest.run_id == run_name and manifest.parent is not None:
            children[manifest.parent].append(cid)
    return {parent: sorted(kids, key=str) for parent, kids in children.items()}
