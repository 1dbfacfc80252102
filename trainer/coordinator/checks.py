"""The checks a push passes before a payload byte is read, and the rules an accepted one must keep.

Refusal order matters, and is the order of :func:`check_round`, :func:`check_base` and
:func:`check_form` as trainer.coordinator.machine calls them: a stale or duplicate push is reported
as such even if its contents are also wrong. Each check raises a :class:`trainer.net.refusal.Refusal`
with its typed reason; none of them knows the transport.
"""

from __future__ import annotations

import math
import re
from typing import Mapping

from proto import PROTOCOL_VERSION, PUSH_ENCODINGS
from storage_client import (
    CID,
    KERNEL_CAPABILITIES,
    MAX_DATA_PARALLEL,
    MAX_KERNEL_THREADS,
    Kernels,
    Manifest,
    ManifestError,
    Participant,
    Store,
)
from trainer.codec.wire import Layout
from trainer.config import ModelConfig, RunConfig
from trainer.coordinator.state import JournalEntry, OpenRound, StageSlices, UpdateHeader
from trainer.model import stages
from trainer.runtime.island import Island
from trainer.runtime.staged import WORKER_MICROBATCHES
from trainer.net.limits import clip, dense_payload_limit
from trainer.net.refusal import Reason, Refusal
from trainer.rounds.aggregation import InvalidUpdate, check_layout
from trainer.rounds.schedule import round_tokens
from trainer.runstore.spool import Spool
from trainer.runstore.update_record import SIGNATURE_BYTES
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import (
    MAX_STORED_PER_WINDOW,
    StateError,
    check_state_file,
    previous_in_window,
    state_due,
    state_limit,
    state_stored,
    window_contributions,
)

# The declared train loss is a mean cross-entropy (≥ 0); this bounds it only to what the ledger's
# fixed-point fields can hold (storage_client.to_e6), as any honest value is.
MAX_TRAIN_LOSS = 1e6
_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


def check_protocol(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise Refusal(Reason.PROTOCOL,
                      f"protocol version {version} is not supported: this coordinator speaks version "
                      f"{PROTOCOL_VERSION}; upgrade the worker")


def check_round(current: OpenRound, finished: bool, run_id: str, worker_id: str, round_: int, stage: int = 0,
                num_stages: int = 1) -> None:
    """The round is the open one, and the worker has not delivered this (slice of its) update yet."""
    if finished:
        raise Refusal(Reason.FINISHED, f"run {run_id!r} has finished all rounds")
    if round_ < current.number or (round_ == current.number and current.closing):
        raise Refusal(Reason.STALE_ROUND, f"stale round {round_}: it has closed; the open round is "
                                          f"{current.number + (1 if current.closing else 0)}")
    if round_ > current.number:
        raise Refusal(Reason.ROUND_NOT_OPEN, f"round {round_} is not open yet; the open round is {current.number}")
    if worker_id in current.accepted:
        raise Refusal(Reason.DUPLICATE, f"worker {worker_id!r} already pushed an update for round {round_} "
                                        f"({current.accepted[worker_id].entry.cid})")
    part = current.partial.get(worker_id)
    if part is None:
        return
    if part.num_stages != num_stages:
        raise Refusal(Reason.MALFORMED, f"worker {worker_id!r} pushed round {round_} as {part.num_stages} stage "
                                        f"slices, this one says {num_stages}")
    if stage in part.slices:
        raise Refusal(Reason.DUPLICATE, f"worker {worker_id!r} already pushed stage {stage} of {num_stages} for "
                                        f"round {round_} ({part.slices[stage].entry.cid})")
    if part.completing:
        raise Refusal(Reason.DUPLICATE, f"worker {worker_id!r}'s update for round {round_} is being stored")


def check_base(h: UpdateHeader, start_cid: str, bases: set[str]) -> None:
    """The update names the checkpoint it was computed from, and that is one the round allows."""
    if not h.base_params_cid:
        raise Refusal(Reason.WRONG_BASE,
                      f"update for round {h.round} names no base_params_cid: an update must say which checkpoint "
                      f"it was computed from (the round starts from {start_cid})")
    if h.base_params_cid not in bases:
        raise Refusal(Reason.WRONG_BASE, f"update for round {h.round} was computed from {clip(h.base_params_cid)}, "
                                         f"but the round starts from {start_cid}")


def check_digest_form(h: UpdateHeader) -> None:
    if h.encoding not in PUSH_ENCODINGS:
        raise Refusal(Reason.MALFORMED, f"unsupported update encoding {h.encoding}; supported: "
                                        f"{', '.join(f'{e.value} ({e.name})' for e in PUSH_ENCODINGS)}")
    if not _SHA256_HEX.match(h.payload_sha256):
        raise Refusal(Reason.MALFORMED, f"payload_sha256 {clip(h.payload_sha256)} is not 64 lowercase hex digits")
    if h.signature and len(h.signature) != SIGNATURE_BYTES:
        # Kept with the update's record (trainer.runstore.update_record), so bounded even without a trust layer.
        raise Refusal(Reason.MALFORMED, f"the push signature is {len(h.signature)} bytes; it must be "
                                        f"{SIGNATURE_BYTES} (r||s||v) or absent")


def stage_layout(layout: Layout, model: ModelConfig, stage: int, num_stages: int) -> Layout:
    """The tensors of stage ``stage`` of ``num_stages`` (trainer.model.stages' split of the model)."""
    if not 1 <= num_stages <= model.n_layer:
        raise Refusal(Reason.MALFORMED, f"num_stages {num_stages}: this run's model of {model.n_layer} layer(s) "
                                        f"splits into 1 to {model.n_layer} pipeline stages")
    if not stage < num_stages:
        raise Refusal(Reason.MALFORMED, f"stage {stage} out of range for {num_stages} stages")
    return stages.stage_layout(layout, model, stage, num_stages)


def check_form(h: UpdateHeader, expected: Layout, config: RunConfig, inner_steps: int) -> Layout:
    """Size, metrics, claims and declared layout of a push whose round, base and signature passed;
    ``inner_steps`` is the round's H_r (trainer.rounds.schedule); returns the declared layout the payload
    must then match.

    The declared train loss (the mean cross-entropy of the H inner steps from the round's start) is
    held only to what no honest run can break: a finite number ≥ 0. No band around the start's
    held-out loss L0 is honest at every H: training can drive the mean far below L0 (a shard
    overfitted at H = 500 gave 0.39 against L0 = 2.28), and the shard is another distribution than
    the held-out set, and a high learning rate can diverge, so neither can it be bounded above by
    L0. The loss is a claim the worker signs into its report, not something the coordinator can
    check from the update; only re-running the round verifies it (the audit's replay,
    audit.replay, re-runs the inner steps to the update's digest, but does not yet compare the
    claimed loss)."""
    limit = dense_payload_limit(sum(math.prod(shape) for _, shape in expected.values()))
    if h.payload_size > limit:
        raise Refusal(Reason.MALFORMED, f"payload of {h.payload_size} bytes exceeds the {limit} a dense update can need")
    if not (math.isfinite(h.train_loss) and 0.0 <= h.train_loss < MAX_TRAIN_LOSS):
        raise Refusal(Reason.BAD_CLAIM, f"claimed train_loss {h.train_loss:.4g} is not a mean cross-entropy: it must "
                                        f"be a finite number in [0, {MAX_TRAIN_LOSS:g})")
    if h.inner_steps < 1:
        raise Refusal(Reason.BAD_CLAIM, f"implausible metrics: inner_steps {h.inner_steps}")
    # Tokens and steps are not the worker's to claim: the config and the stored downlink fix them.
    tokens = round_tokens(config, inner_steps)
    if h.tokens != tokens or h.inner_steps != inner_steps:
        raise Refusal(Reason.BAD_CLAIM,
                      f"claimed tokens {h.tokens}, inner_steps {h.inner_steps}; this run's round {h.round} is "
                      f"{inner_steps} inner steps of {config.inner.batch_size}x{config.model.block_size} "
                      f"tokens: tokens {tokens}, inner_steps {inner_steps}")
    declared = {name: (dtype, shape) for name, dtype, shape in h.tensors}
    if len(declared) != len(h.tensors):
        raise Refusal(Reason.MALFORMED, "header names a tensor twice")
    try:
        check_layout(declared, expected)
    except InvalidUpdate as exc:
        where = f"stage {h.stage} of {h.num_stages}: " if h.num_stages > 1 else ""
        raise Refusal(Reason.MALFORMED, where + str(exc)) from exc
    if not _SHA256_HEX.match(h.inner_state_sha256):
        # What the update grew from besides θ: without it no auditor can replay the round. A worker
        # of several stages names its one commitment in every slice (check_sibling: the same).
        raise Refusal(Reason.MALFORMED,
                      f"inner_state_sha256 {clip(h.inner_state_sha256)} is not 64 lowercase hex digits: a "
                      f"worker commits to the inner state each round starts from, in every stage slice")
    kernels = pushed_kernels(h)
    if kernels is not None and kernels.data_parallel > 1:
        try:  # an island's replicas each take an equal slice of every batch (trainer.runtime.island)
            Island(kernels.data_parallel, max(1, h.num_stages)).check_batch(config.inner.batch_size,
                                                                             WORKER_MICROBATCHES)
        except ValueError as exc:
            raise Refusal(Reason.BAD_CLAIM, f"data_parallel {kernels.data_parallel}: {exc}") from None
    return declared


def state_window(manifests: Mapping[int, tuple[CID, Manifest]], worker_id: str, round_: int,
                 state_every: int) -> list[tuple[int, Participant]]:
    """``worker_id``'s counted contributions in ``round_``'s window before it, from the published
    manifests (trainer.runtime.state_commit.window_contributions: at most K − 1 looked up)."""
    def counted(r: int) -> Participant | None:
        published = manifests.get(r)
        if published is None:
            return None
        return next((p for p in published[1].participants if p.worker == worker_id), None)
    return window_contributions(state_every, round_, counted)


def check_state_upload(h: UpdateHeader, layout: Layout, config: RunConfig, window: list[tuple[int, Participant]],
                       store: Store) -> None:
    """The inner state's bytes come in stage 0's slice, never for a fresh state, within ``state_limit``
    (trainer.runtime.state_commit): required when the worker's ``window`` (its counted contributions
    of the window so far, ``state_window``) says due; sent unasked, taken while its window holds
    fewer than MAX_STORED_PER_WINDOW stored states; never else. A run whose states are revealed on
    challenge (``rounds.state_reveal``) takes none: its workers keep them (trainer.worker.retention)."""
    if config.rounds.state_reveal == "on_challenge":
        if h.inner_state_size:
            raise Refusal(Reason.MALFORMED, f"inner_state_size {h.inner_state_size}: this run's inner states are "
                                            f"revealed on challenge (rounds.state_reveal), never pushed")
        return
    every = config.rounds.state_every
    can_carry = h.stage == 0 and h.inner_state_sha256 != FRESH_STATE
    due = can_carry and state_due(every, h.round, previous_in_window(window))
    if due and not h.inner_state_size:
        raise Refusal(Reason.MALFORMED,
                      f"round {h.round}: this run stores each worker's inner state at its first counted round of "
                      f"each window of {every} rounds (rounds.state_every), so the push must carry it "
                      f"(inner_state_size 0)")
    if h.inner_state_size and not can_carry:
        raise Refusal(Reason.MALFORMED, f"inner_state_size {h.inner_state_size}: round {h.round} stage {h.stage} "
                                        f"carries no inner state (stage 0 carries a state that is not fresh)")
    if h.inner_state_size and not due and sum(state_stored(store, p) for _, p in window) >= MAX_STORED_PER_WINDOW:
        raise Refusal(Reason.MALFORMED, f"inner_state_size {h.inner_state_size}: this worker's contributions to "
                                        f"rounds {h.round - h.round % every}..{h.round - 1} already stored "
                                        f"{MAX_STORED_PER_WINDOW} inner states, the most a window of "
                                        f"rounds.state_every {every} rounds takes")
    limit = state_limit(layout)
    if h.inner_state_size > limit:
        raise Refusal(Reason.MALFORMED, f"inner state of {h.inner_state_size} bytes exceeds the {limit} a "
                                        f"worker's state can need")


def pushed_kernels(h: UpdateHeader) -> Kernels | None:
    """What the push says decided its inner loop's floating point (trainer.runtime.kernels): both
    fields or neither (a worker on an accelerator, or whose stages disagreed); a capability from
    storage_client.KERNEL_CAPABILITIES and 1..MAX_KERNEL_THREADS threads, else refused. A worker of
    several stages names its stages' one kernels in every slice (check_sibling: the same)."""
    if not h.cpu_capability and not h.intra_op_threads:
        if h.data_parallel > 1:
            raise Refusal(Reason.MALFORMED, f"data_parallel {h.data_parallel} without kernels: the ranks are named "
                                            f"only with the kernels they ran")
        return None
    try:
        return Kernels(h.cpu_capability, h.intra_op_threads, max(1, h.data_parallel))
    except ManifestError:
        raise Refusal(Reason.MALFORMED,
                      f"cpu_capability {clip(h.cpu_capability)} with intra_op_threads {h.intra_op_threads} and "
                      f"data_parallel {h.data_parallel}: expected one of {list(KERNEL_CAPABILITIES)} with "
                      f"1..{MAX_KERNEL_THREADS} threads and 1..{MAX_DATA_PARALLEL} ranks") from None


def check_sibling(h: UpdateHeader, entry: JournalEntry, part: StageSlices) -> None:
    """A worker's stage slices come from one inner loop: the same metrics, base and kernels."""
    for stage, other in part.slices.items():
        for key in ("train_loss_e6", "tokens", "inner_steps", "base_params_cid", "state", "kernels"):
            if getattr(other.entry, key) != getattr(entry, key):
                raise Refusal(Reason.BAD_CLAIM,
                              f"stage {h.stage} of {h.num_stages} says {key} {getattr(entry, key)!r}, but stage "
                              f"{stage} of the same round said {getattr(other.entry, key)!r}")


def check_replay(accepted_cids: dict[str, tuple[int, str]], cid: str) -> None:
    """Refuse an update byte-identical to one already accepted in this run."""
    seen = accepted_cids.get(cid)
    if seen is not None:
        raise Refusal(Reason.REPLAYED, f"update {cid} is byte-identical to the update {seen[1]} had accepted in "
                                       f"round {seen[0]}: a replayed update is refused")


def check_state_spool(state: Spool, layout: Layout, config: RunConfig) -> None:
    """The inner state a push carried, spooled whole and its digest checked as it arrived, is one a
    worker of this run's model could hold (trainer.runtime.state_commit.check_state_file, a tensor
    at a time from the spool's file); MALFORMED otherwise."""
    with state.in_use() as path:
        assert path is not None, "a finished spool of a non-empty state has its file"
        try:
            check_state_file(path, state.size, layout, config.compression.enabled, config.inner.optimizer)
        except StateError as exc:
            raise Refusal(Reason.MALFORMED, str(exc)) from None
