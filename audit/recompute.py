"""The work recomputed: checkpoints from the stored updates, sampled updates from their inputs.

Checks ``rederive`` (genesis momentum is zero; each round's params and outer state are what its
stored updates give, clipped and averaged by the config's rule and applied by the outer step, with
the compressed downlink when the config compresses: audit.rederive), and with ``--replay K``
``replay`` and ``rescore`` (sampled contributions re-run and their rounds re-scored: audit.replay).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from storage_client import Manifest, Store
from trainer.config import RunConfig
from trainer.rounds.update_source import UpdateSource
from trainer.runstore.round_inputs import ClipHistory

from .checks import AuditCheck
from .findings import Findings, cid_digest
from .lineage import Loaded
from .rederive import (
    RederivedCheckpoint,
    RederiveError,
    genesis_outer_state,
    rederive,
)
from .replay import EVAL_TOLERANCE, REPLAY_TOLERANCE, replay_run


class Recomputation:
    """Recomputes a run's rounds with ``config`` (None when the run config could not be read)."""

    def __init__(self, findings: Findings, config: RunConfig | None) -> None:
        self.findings = findings
        self.config = config
        # ρ̃ of each round's stored updates (trainer.runstore.round_inputs), the clip history of the next K rounds.
        self.clip_history = ClipHistory(config.rounds) if config is not None else None

    def check_genesis(self, genesis: Loaded) -> None:
        """The genesis outer state is zero momentum for every parameter of θ⁽⁰⁾."""
        if genesis.params is None or genesis.outer_state is None:
            return  # already an ``object`` failure
        manifest = genesis.manifest
        try:
            expected = genesis_outer_state(genesis.params)
        except RederiveError as exc:
            self.findings.fail(0, manifest.params, AuditCheck.REDERIVE, str(exc))
            return
        if hashlib.sha256(expected).digest() != cid_digest(manifest.outer_state):
            self.findings.fail(0, manifest.outer_state, AuditCheck.REDERIVE,
                               "the genesis outer state is not zero momentum for every parameter")

    def check_round(self, r: int, loaded: Loaded, parent: Loaded | None, updates: dict[str, UpdateSource]) -> None:
        """Round r re-derived from its parent and its stored updates; its ρ̃ kept for the next rounds.
        A round without its stored checkpoint (rounds.checkpoint_every) takes the re-derived bytes
        once they hash to the manifest's CIDs, so the next round re-derives from them."""
        derived = self._check_rederive(r, loaded.manifest, parent, updates)
        if derived is not None:
            if loaded.params is None and derived.params_digest == cid_digest(loaded.manifest.params):
                loaded.params = derived.params
            if loaded.outer_state is None and derived.outer_state_digest == cid_digest(loaded.manifest.outer_state):
                loaded.outer_state = derived.outer_state
        self._keep_norms(r, loaded.manifest, updates)

    def _keep_norms(self, r: int, manifest: Manifest, updates: dict[str, UpdateSource]) -> None:
        """Round r's ρ̃ (trainer.rounds.aggregation.updates_round_norm of its stored updates), part of the clip
        threshold of the next K rounds; unknown when an update is unavailable or unreadable."""
        if self.clip_history is not None:
            self.clip_history.keep_updates(r, updates if len(updates) == len(manifest.participants) else None)

    def _history(self, r: int) -> list[float] | None:
        """ρ̃ of rounds max(1, r-K)..r-1, or None when one of them is unknown."""
        assert self.clip_history is not None
        return self.clip_history.history(r)

    def _check_rederive(self, r: int, manifest: Manifest, parent: Loaded | None,
                        updates: dict[str, UpdateSource]) -> RederivedCheckpoint | None:
        fail = self.findings.fail
        if self.config is not None and self.config.rounds.clip_multiple > 0 and self._history(r) is None:
            fail(r, str(manifest.params), AuditCheck.REDERIVE,
                 f"cannot re-derive the round: the clip threshold takes the norms of the previous "
                 f"{self.config.rounds.clip_history_rounds} round(s)' updates, and one of them is unavailable")
            return None
        if self.config is None or parent is None or parent.params is None or parent.outer_state is None \
                or len(updates) != len(manifest.participants):
            fail(r, str(manifest.params), AuditCheck.REDERIVE,
                 "cannot re-derive the round: the config, the parent's params or outer state, or an update "
                 "is unavailable (see the failures above)")
            return None
        readable, downlink = self._downlink(r, manifest)
        if not readable:
            return None
        try:
            derived = rederive(self.config.outer, parent.params, parent.outer_state, updates, downlink,
                               rounds=self.config.rounds, history=self._history(r) or ())
        except RederiveError as exc:
            fail(r, str(manifest.params), AuditCheck.REDERIVE, str(exc))
            return None
        if derived.params_digest != cid_digest(manifest.params):
            fail(r, manifest.params, AuditCheck.REDERIVE,
                 f"aggregate of the {len(updates)} stored update(s) + outer step from round {r - 1} gives params "
                 f"sha256 {derived.params_digest.hex()}, the manifest names {manifest.params}")
        if derived.outer_state_digest != cid_digest(manifest.outer_state):
            fail(r, manifest.outer_state, AuditCheck.REDERIVE,
                 f"the re-derived outer state hashes to {derived.outer_state_digest.hex()}, the manifest "
                 f"names {manifest.outer_state}")
        return derived

    def _downlink(self, r: int, manifest: Manifest) -> tuple[bool, tuple[bytes, dict[str, Any]] | None]:
        """Whether the round's downlink is as the config says, and its (payload, codec header) when it
        compresses; False after recording why the round cannot be re-derived."""
        assert self.config is not None
        fail = self.findings.fail
        if (manifest.downlink is not None) != self.config.compression.enabled:
            fail(r, str(manifest.params), AuditCheck.REDERIVE,
                 f"the config {'compresses' if self.config.compression.enabled else 'does not compress'} "
                 f"the global update, but the manifest {'names a' if manifest.downlink else 'has no'} "
                 "compressed downlink object")
            return False, None
        if manifest.downlink is None:
            return True, None
        sent = self.findings.read(r, manifest.downlink.payload, f"the compressed global update of round {r}")
        header = self.findings.read(r, manifest.downlink.header, f"the codec header of round {r}'s global update")
        if sent is None or header is None:
            fail(r, str(manifest.params), AuditCheck.REDERIVE, "cannot re-derive the round: its compressed global update is "
                                                      "unavailable")
            return False, None
        try:
            return True, (sent, json.loads(header))
        except ValueError as exc:
            fail(r, manifest.downlink.header, AuditCheck.REDERIVE, f"the codec header is not JSON: {exc}")
            return False, None

    def check_replay(self, manifests: dict[int, Manifest], k: int, seed: int,
                     excused: Mapping[str, int] | None = None,
                     reveal_sources: Sequence[tuple[str, Store]] = ()) -> None:
        """``--replay K``: K sampled contributions re-run from their parent checkpoint, shard and
        committed state, and their rounds re-scored (audit.replay). ``excused``: per worker id, the first
        round whose receipted update the coordinator did not use (audit.receipts); a later mismatch of
        that worker is the coordinator's (RECEIPT_WITHHELD), not the worker's (REPLAY)."""
        fail = self.findings.fail
        if self.config is None:
            fail(None, "replay", AuditCheck.REPLAY, "the run config could not be read, so nothing can be replayed")
            return
        outcome = replay_run(self.findings.store, self.config, manifests, k, seed, reveal_sources)
        self.findings.result.replay = outcome
        skipped = outcome.not_replayed_line()
        if skipped is not None:  # said by worker and round, never skipped silently (audit.replay)
            self.findings.warn(skipped)
        for round_, obj, message in outcome.problems:
            fail(round_, obj, AuditCheck.REPLAY, message)
        for row in outcome.rows:
            if row.status == "inconclusive":  # the run's fault (state_every bounds every chain), not the worker's
                participant = {p.worker: p for p in manifests[row.round].participants}[row.worker]
                fail(row.round, participant.update, AuditCheck.REPLAY_HORIZON,
                     f"{row.worker}'s update is {row.distance:.3g} away from its replay in the {row.kernels} kernels, "
                     f"which does not decide it ({row.note}): the coordinator accepted a chain longer than the replay "
                     f"horizon, a state the run should have stored is missing")
            if row.status == "unrevealed":
                participant = {p.worker: p for p in manifests[row.round].participants}[row.worker]
                fail(row.round, participant.state or "", AuditCheck.REVEAL,
                     f"{row.worker} was asked for the inner state its round-{row.round} update grew from (sha256 "
                     f"{(participant.state or '')[:16]}…, committed in its push and its report) and {row.note}")
                continue
            if row.status != "MISMATCH":
                continue
            participant = {p.worker: p for p in manifests[row.round].participants}[row.worker]
            withheld = (excused or {}).get(row.worker)
            if withheld is not None and withheld < row.round:
                fail(row.round, participant.update, AuditCheck.RECEIPT_WITHHELD,
                     f"{row.worker}'s update does not replay ({row.note or f'{row.distance:.3g} away'}), but the "
                     f"coordinator did not use the update it receipted from {row.worker} in round {withheld}: the "
                     f"worker's state went on from what it sent; not this worker's fault")
                continue
            if row.distance is None:
                fail(row.round, participant.update, AuditCheck.REPLAY, f"{row.worker}'s update cannot be replayed: {row.note}")
            else:
                kernels, tolerance = row.kernels or "auditor's", row.tolerance or REPLAY_TOLERANCE
                fail(row.round, participant.update, AuditCheck.REPLAY,
                     f"{row.worker}'s update is {row.distance:.3g} away (relative L2) from what "
                     f"{participant.inner_steps} inner steps on shard {participant.shard} from round "
                     f"{row.round - 1}'s checkpoint give, replayed in the {kernels} kernels; an honest "
                     f"replay there is within {tolerance:g}")
        for score in outcome.rescored:
            if not score.ok:
                fail(score.round, manifests[score.round].params, AuditCheck.RESCORE,
                     f"the held-out loss of round {score.round}'s checkpoint is {score.recomputed:.6f}, the "
                     f"manifest and its reports say {score.reported:.6f} (tolerance {EVAL_TOLERANCE:g})")
