"""Re-checking the work: ``dilocox audit --replay K`` re-runs sampled contributions and re-scores
the checkpoints they built.

The re-derivation (audit.rederive) proves that a checkpoint is what the stored updates give; this
module checks that an update is what its worker's declared work gives. For a contribution of
worker w to round r (a manifest participant: its update Δ, data shard s, committed inner state σ):

    θ_start  = θ⁽ʳ⁻¹⁾                               round r-1's stored parameters
    AdamW    = fresh                                 when σ = FRESH_STATE (trainer.runtime.inner)
             = the stored state named σ              when the store holds it (rounds.state_every:
                                                      trainer.runtime.state_commit; checked, then loaded)
             = the state after w's previous counted   otherwise: replayed first, back to w's last
               contribution                            fresh start or stored state (the worker's
                                                      "chain": at most K rounds with state_every = K)
    batches  = round_batches(shard s, seed, s, r, H_r) trainer.data.corpus: fixed by the config and, with
                                                      inner.adaptive_steps, round r−2's stored
                                                      downlink header (trainer.rounds.schedule)
    Δ'       = θ_start − θ_H_r                       H_r AdamW steps, trainer.runtime.inner.InnerLoop
    d        = ‖Δ' − Δ‖₂ / ‖Δ‖₂                      refused when d > its tolerance (below)

With a compressed uplink the stored update is Â = decompress(C(Δ + e)), e the worker's error
feedback (part of its committed state, fresh = 0). The replay rebuilds e along the chain too:

    A'       = Δ' + β·e'                             β: compression.error_decay (1: plain feedback)
    U        = best rank-k approximation of A'       k: the ranks Â has (trainer.codec.lowrank.rank_of;
                                                     the worker's policy chose them); U = A' for
                                                     tensors sent dense
    q        = ‖decompress(C(A')) − U‖₂ / ‖U‖₂        the codec's own error at this point
    d        = ‖Â − U‖₂ / ‖U‖₂ − q                   the distance beyond the codec's error
    e'       ← fl32(A' − Â)                          as the worker's e ← A − Â

(comparing Â with decompress(C(A')) directly would measure the int4 quantiser: a replay a
thousandth off flips quantisation levels and lands several percent away).

Re-score: the held-out loss of θ⁽ʳ⁾ of each sampled round is recomputed on the run's evaluation
batches (trainer.data.corpus.eval_batches) and must lie within EVAL_TOLERANCE of the manifest's
``eval_loss_e6`` (which every report restates).

Kernels and tolerance (audit.replay_env). An honest worker's Δ and the replay's differ only by
floating-point rounding, which on a CPU is decided by torch's ATen CPU capability (whose kernels
fuse multiply-adds and reduce in their own order) and the intra-op thread count; every
CPU worker records both with each contribution (the participant's ``kernels``,
trainer.runtime.kernels). Each worker's chain is replayed in a child process running its recorded
kernels wherever this CPU can run them: there an honest contribution re-derives exactly (d = 0 on
every contribution of the demo run, under every auditor capability and thread count), and
REPLAY_TOLERANCE = EXACT_TOLERANCE = 1e-6. Elsewhere (kernels not recorded or not runnable here)
the chain is replayed in the auditor's own kernels and the n-th contribution of a chain is held to
``fallback_tolerance(n)``, derived from the honest distances measured across kernels, which grow
along a chain (docs/verification.md, "Replay tolerance"); where those leave the tolerance no
margin (the demo: past the fifth contribution of a chain) the row is "inconclusive" (a warning),
never an accusation. Each row names the kernels that replayed
it and the tolerance it was held to.

Overlapped rounds (rounds.overlap): round r of a worker whose round r−1 counted starts from stored
objects, computed as the worker computes it (``Replayer._start``, with the worker's own
trainer.rounds.outer.delayed_start / eager_start):

    delayed  s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Δ̂ᵢ⁽ʳ⁻¹⁾
    eager    s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − ((θ⁽ʳ⁻³⁾ − θ⁽ʳ⁻²⁾) + c (Δ̂ᵢ⁽ʳ⁻¹⁾ − Δ̂ᵢ⁽ʳ⁻²⁾)),  c = eager_weight
             (θ⁽ʳ⁻²⁾ − c Δ̂ᵢ⁽ʳ⁻¹⁾ when round r−1 (re)started the worker's loop: its inner
             state fresh, or the worker's round r−2 did not count)

An overlapped worker whose update of a round does not count drops the round it trained on it,
rewinds its inner state to before the uncounted round and starts over from the newest global state
(trainer.worker.loops.overlapped): a round with a fresh committed state, or after one of the
worker's that did not count, starts from θ⁽ʳ⁻¹⁾, and an eager start right after such a restart has
no history. So a worker's chain replays across a refused push, and an honest straggler's first
counted round (after uncounted ones) starts fresh.

A worker of several pipeline stages commits the same digest of its stages' states together
(trainer.worker.role); its contribution (an update record of P > 1 slices) is replayed in one
process with the stages' arithmetic (trainer.runtime.staged: the same microbatches and clipping,
bit-exact on one thread). A worker that is an island of N data-parallel replicas
(trainer.runtime.island; ``data_parallel`` = N in its kernels) is replayed the same way, each
replica's slice of every batch in turn and their gradients summed in rank order, bit for bit.

What cannot be replayed is said, not passed: a worker of several pipeline stages in a run from
before they committed an inner state (``state`` null). Those contributions are not sampled; each is
a row "not replayed" with its reason (in the JSON and the human output, by worker and round) and the
audit warns of them by name.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch

from storage_client import Kernels, Manifest, Participant, Store, from_e6
from trainer.codec import (
    CodecHeader,
    CompressionError,
    PinnedRankPolicy,
    accumulate,
    codec_of,
    compress,
    decompress,
    matrix_codec,
)
from trainer.codec.wire import Layout, Params, WireError, decode_params, layout_of
from trainer.config import RunConfig
from trainer.data.corpus import CorpusError, eval_batches, round_batches
from trainer.data.dataset import Dataset, run_dataset
from trainer.model.gpt import build_model
from trainer.model.params import load_params, params_of
from trainer.progress import Progress
from trainer.rounds.outer import delayed_start, eager_start, eager_weight
from trainer.rounds.schedule import stored_inner_steps
from trainer.rounds.update_source import dense
from trainer.runstore.checkpoints import checkpoint_at
from trainer.runstore.update_record import open_update, parse_record
from trainer.runtime.inner import FRESH_STATE, InnerLoop, evaluate, load_optimizer_state
from trainer.runtime.state_commit import (
    decode_inner_state,
    previous_in_window,
    split_inner_state,
    state_cid,
    state_due,
    state_stored,
    window_contributions,
)
from trainer.runtime.island import Island
from trainer.runtime.staged import WORKER_MICROBATCHES, StagedArithmetic, staged_arithmetic

from .reveal import Challenges, RevealOutcome
from .replay_env import EXACT_TOLERANCE, ChildError, judge, kernels_label, replay_in, split_by_kernels

# ‖Δ' − Δ‖ / ‖Δ‖ an honest contribution replayed in its worker's kernels stays within (it is 0;
# audit.replay_env); replayed in other kernels, audit.replay_env.fallback_tolerance.
REPLAY_TOLERANCE = EXACT_TOLERANCE
# nats: a re-scored held-out loss may differ from the manifest's by this much (reduction order).
EVAL_TOLERANCE = 1e-3


class ReplayError(ValueError):
    """A replay that cannot be carried out (not a verdict on the worker)."""


@dataclass
class ReplayRow:
    """One replayed contribution. ``sampled``: drawn by the auditor; the others were replayed on the
    way, to rebuild a sampled one's AdamW state, and are checked all the same."""

    round: int
    worker: str
    sampled: bool
    distance: float | None  # ‖Δ' − Δ‖ / ‖Δ‖; None when not replayed
    status: str  # "ok", "MISMATCH", "inconclusive" (past what the fallback tolerance knows) or "not replayed"
    note: str = ""
    kernels: str = ""  # what replayed it: the worker's kernels, or the auditor's (audit.replay_env)
    tolerance: float | None = None  # what the distance was held to

    def to_json(self) -> dict:
        return {"round": self.round, "worker": self.worker, "sampled": self.sampled,
                "distance": self.distance, "status": self.status, "note": self.note, "kernels": self.kernels,
                "tolerance": self.tolerance}


@dataclass
class RescoreRow:
    round: int
    reported: float  # the manifest's eval loss, which every report restates
    recomputed: float
    ok: bool

    def to_json(self) -> dict:
        return {"round": self.round, "reported": self.reported, "recomputed": self.recomputed, "ok": self.ok}


@dataclass
class ReplayOutcome:
    rows: list[ReplayRow]
    rescored: list[RescoreRow]
    seed: int
    steps: int  # inner steps replayed in all
    checked_steps: int  # inner steps of the sampled contributions
    seconds: float
    problems: list[tuple[int | None, str, str]]  # (round, object, message): what stopped a replay
    reveal: RevealOutcome | None = None  # the challenges of a run whose states are revealed on challenge

    @property
    def not_replayed(self) -> dict[str, list[int]]:
        """The contributions that could not be replayed (and were not sampled): worker → rounds."""
        out: dict[str, list[int]] = defaultdict(list)
        for row in sorted(self.rows, key=lambda row: (row.worker, row.round)):
            if row.status == "not replayed":
                out[row.worker].append(row.round)
        return dict(out)

    def not_replayed_line(self) -> str | None:
        """One line naming every contribution that could not be replayed, by worker and round, with
        the reasons; None when every one could be."""
        named = self.not_replayed
        if not named:
            return None
        reasons = sorted({row.note for row in self.rows if row.status == "not replayed"})
        count = sum(len(rounds) for rounds in named.values())
        return (f"{count} contribution(s) could not be replayed and were not sampled: "
                + "; ".join(f"{worker} round(s) {', '.join(map(str, rounds))}" for worker, rounds in named.items())
                + f" ({'; '.join(reasons)})")

    def to_json(self) -> dict:
        return {"seed": self.seed, "steps": self.steps, "checked_steps": self.checked_steps,
                "seconds": round(self.seconds, 3), "contributions": [r.to_json() for r in self.rows],
                "not_replayed": self.not_replayed, "rescored": [r.to_json() for r in self.rescored],
                "reveal": self.reveal.to_json() if self.reveal is not None else None}


def _counted(manifest: Manifest | None, worker: str) -> Participant | None:
    """``worker``'s participation in a round, or None."""
    return None if manifest is None else next((p for p in manifest.participants if p.worker == worker), None)


def unreplayable_reason(config: RunConfig, manifests: Mapping[int, Manifest], round_: int,
                        worker: str) -> str | None:
    """Why a contribution cannot be replayed from the store and the config alone, or None.

    Every start is built from stored objects (``Replayer._start``): an overlapped worker whose round
    did not count drops the round it trained on it and starts over from the newest global state with
    its inner state rewound (trainer.worker.loops.overlapped), so no start follows an update that is
    not stored. What remains is a worker of several pipeline stages in a run from before they committed
    an inner state: such a contribution is named in the replay's rows and warned of (audit.recompute)."""
    participant = _counted(manifests[round_], worker)
    if participant.state is None:
        return "the worker ran several pipeline stages and committed no inner state (a run from before they did)"
    return None


class Replayer:
    """Replays contributions of one run from its verified manifests (round → manifest)."""

    def __init__(self, store: Store, config: RunConfig, manifests: Mapping[int, Manifest],
                 worker_kernels: bool = True, exact: bool = False,
                 reveal_sources: Sequence[tuple[str, Store]] = ()) -> None:
        """``worker_kernels``: replay each worker's chain in the kernels it recorded, in a child process,
        where this CPU can (audit.replay_env); otherwise in this process. ``exact``: this process runs
        the workers' kernels (a replay child), so the distances are held to EXACT_TOLERANCE.
        ``reveal_sources``: where ``replay`` asks for committed states in a run that reveals them on
        challenge (audit.reveal); what they reveal is kept until ``close``."""
        self.store, self.config, self.manifests = store, config, dict(manifests)
        self.challenges = Challenges(reveal_sources, config.rounds.reveal_deadline_s)
        self.worker_kernels, self.exact = worker_kernels, exact
        self.fallback: dict[str, str] = {}  # worker -> why its chain is replayed in this process's kernels
        self.problems: list[tuple[int | None, str, str]] = []
        self._corpus = None
        self.steps: dict[int, int] = {}  # round -> H_r, re-derived (inner_steps)

    # -- what to replay ----------------------------------------------------------------------------

    def contributions(self) -> list[tuple[int, str]]:
        return [(r, p.worker) for r, m in sorted(self.manifests.items()) if r > 0 for p in m.participants]

    def sample(self, k: int, seed: int) -> tuple[list[tuple[int, str]], list[ReplayRow]]:
        """K contributions drawn uniformly from the replayable ones (``random.Random(seed)``), and a
        row for every contribution that cannot be replayed."""
        replayable, skipped = [], []
        for r, worker in self.contributions():
            reason = unreplayable_reason(self.config, self.manifests, r, worker)
            if reason is None:
                replayable.append((r, worker))
            else:
                skipped.append(ReplayRow(r, worker, False, None, "not replayed", reason))
        picked = random.Random(seed).sample(replayable, min(k, len(replayable)))
        return sorted(picked), skipped

    @property
    def revealed_on_challenge(self) -> bool:
        """Whether the run's workers keep their committed states and reveal them when asked (audit.reveal)."""
        return self.config.rounds.state_reveal == "on_challenge"

    def chain(self, round_: int, worker: str) -> list[int]:
        """The rounds to replay, in order, to rebuild ``worker``'s AdamW state for ``round_``: back to
        its last contribution that committed a fresh state, or whose committed state is stored
        (``rounds.state_every``: at most K rounds back). A run whose states are revealed on challenge
        replays each contribution from its own committed state: the chain is the round alone."""
        if self.revealed_on_challenge:
            return [round_]
        rounds = [r for r, m in sorted(self.manifests.items())
                  if 0 < r <= round_ and any(p.worker == worker for p in m.participants)]
        out: list[int] = []
        for r in reversed(rounds):
            out.append(r)
            p = self._participant(r, worker)
            if p.state == FRESH_STATE or state_stored(self.store, p):
                return out[::-1]
        return out[::-1]  # no fresh start: the first one is refused in replay()

    def _participant(self, round_: int, worker: str):
        return {p.worker: p for p in self.manifests[round_].participants}[worker]

    # -- replaying ---------------------------------------------------------------------------------

    @property
    def corpus_loaded(self) -> bool:
        return self._corpus is not None

    def _load_corpus(self) -> Dataset:
        """The run's tokens (trainer.data.dataset: the corpus, or the prepared files checked against the
        pinned index in the store)."""
        if self._corpus is None:
            dataset = run_dataset(self.config, self.store)
            dataset.eval_tokens()  # verified now, so that a missing held-out file is a replay problem
            self._corpus = dataset
        return self._corpus

    def _params(self, round_: int, what: str) -> Params | None:
        if round_ not in self.manifests:
            self.problems.append((round_, f"round {round_}", f"{what}: the round's manifest could not be read"))
            return None
        cid = self.manifests[round_].params
        try:
            if self.store.has(cid):
                return decode_params(self.store.get(cid))
            # A round without a stored checkpoint (rounds.checkpoint_every): rebuilt from the newest one.
            chain = [(self.manifests[q].cid, self.manifests[q]) for q in range(round_ + 1)]
            return checkpoint_at(self.store, chain, round_, self.config).params
        except (OSError, ValueError, WireError, KeyError) as exc:  # StoreError, CheckpointError: ValueError
            self.problems.append((round_, cid, f"{what} cannot be read: {str(exc)[:300]}"))
            return None

    def _start(self, round_: int, worker: str) -> Params | None:
        """Where ``worker`` started ``round_``: θ⁽ʳ⁻¹⁾, or for an overlapped round after a counted one
        the worker's own start rule on stored objects (trainer.rounds.outer): delayed, θ⁽ʳ⁻²⁾ − Δ̂ᵢ⁽ʳ⁻¹⁾;
        eager, θ⁽ʳ⁻²⁾ − Ũᵢ⁽ʳ⁻¹⁾ with the history (θ⁽ʳ⁻³⁾, Δ̂ᵢ⁽ʳ⁻²⁾) unless round r−1 (re)started the
        worker's loop (fresh, or after a round r−2 of the worker's that did not count). A round with a
        fresh state (re)started the loop itself: θ⁽ʳ⁻¹⁾ (trainer.worker.loops.overlapped)."""
        previous = _counted(self.manifests.get(round_ - 1), worker)
        fresh = self._participant(round_, worker).state == FRESH_STATE  # the worker's loop (re)started here
        if not (self.config.rounds.overlap and round_ >= 2 and previous is not None) or fresh:
            return self._params(round_ - 1, f"θ⁽{round_ - 1}⁾")
        base = self._params(round_ - 2, f"θ⁽{round_ - 2}⁾")
        sent = self._sent(round_ - 1, worker, previous, base)
        if base is None or sent is None:
            return None
        if self.config.rounds.overlap_start != "eager":
            return delayed_start(base, sent)
        history = None
        counted_before = _counted(self.manifests.get(round_ - 2), worker)
        if previous.state != FRESH_STATE and counted_before is not None:  # else round r−1 (re)started the loop
            before = self._params(round_ - 3, f"θ⁽{round_ - 3}⁾")
            sent_before = self._sent(round_ - 2, worker, counted_before, base)
            if before is None or sent_before is None:
                return None
            history = (before, sent_before)
        weight = eager_weight(self.config.outer, self.config.rounds.expected_workers)
        return eager_start(base, sent, weight, history)

    def _sent(self, round_: int, worker: str, participant: Participant | None,
              like: Params | None) -> Params | None:
        """Δ̂ᵢ of ``round_`` as stored (the worker's counted update, dense), or None (and a problem)."""
        if participant is None or like is None:
            return None
        try:
            return dense(open_update(self.store, participant.update, layout_of(like), self.config.model))
        except (OSError, ValueError, WireError) as exc:
            self.problems.append((round_, participant.update, f"the update of {worker} cannot be read: {exc}"))
            return None

    def inner_steps(self, round_: int, layout: Layout) -> int | None:
        """H_r re-derived from round r−2's stored downlink header (trainer.rounds.schedule), as the workers
        trained and the coordinator checked; None (and a problem) when it cannot be read."""
        if round_ not in self.steps:
            try:
                self.steps[round_] = stored_inner_steps(self.config, round_, self.manifests, self.store, layout)
            except KeyError:
                self.problems.append((round_, f"round {round_ - 2}", "the inner steps of the round cannot be "
                                      "derived: round r-2's manifest could not be read"))
                return None
            except (OSError, ValueError) as exc:  # StoreError, WireError, CompressionError: ValueError
                self.problems.append((round_, self.manifests[round_ - 2].downlink.header,
                                      f"round {round_ - 2}'s downlink codec header: {str(exc)[:300]}"))
                return None
        return self.steps[round_]

    def challenge(self, targets: Iterable[tuple[int, str]]) -> None:
        """In a run that reveals states on challenge, ask the reveal sources for the committed states of
        ``targets`` the store lacks (audit.reveal); the replay then reads them beside the store."""
        if self.revealed_on_challenge and self.challenges.outcome is None:
            self.store = self.challenges.ask(self.store, [self._participant(r, w).state or "" for r, w in targets])

    def close(self) -> None:
        """Remove the states revealed to this replay."""
        self.challenges.close()

    def replay(self, targets: Iterable[tuple[int, str]]) -> tuple[list[ReplayRow], int]:
        """Every target, with the chains they need (each worker's rounds replayed once, in order);
        returns the rows and the inner steps replayed. The committed states they start from are
        challenged first where the run reveals them on challenge."""
        sampled = set(targets)
        self.challenge(sampled)
        by_worker: dict[str, set[int]] = defaultdict(set)
        for r, worker in sampled:
            by_worker[worker].update(self.chain(r, worker))
        for worker, chain in sorted(by_worker.items()):
            if not self.revealed_on_challenge:
                self.problems.extend(missing_states(self.store, self.config, self.manifests, worker, sorted(chain)))
        rows: list[ReplayRow] = []
        if self._corpus_or_problem() is None:
            return [], 0
        exact, own, self.fallback = split_by_kernels(self.manifests, by_worker, self.worker_kernels)
        steps = sum(_replay_in_child(self, kernels, chains, sampled, rows) for kernels, chains in exact.items())
        steps += self.replay_chains(own, sampled, rows)
        return sorted(rows, key=lambda row: (row.round, row.worker)), steps

    def _corpus_or_problem(self) -> Dataset | None:
        try:
            return self._load_corpus()
        except CorpusError as exc:
            self.problems.append((None, self.config.data.tokens or self.config.data.corpus,
                                  f"the run's tokens are not available to replay on: {exc}"))
            return None

    def replay_chains(self, chains: Mapping[str, list[int]], sampled: set[tuple[int, str]],
                      rows: list[ReplayRow]) -> int:
        """Each worker's chain of rounds replayed in this process, in order; returns the inner steps."""
        corpus = self._corpus_or_problem()
        planned = sum(len(rounds) for rounds in chains.values())
        if corpus is None or not planned:
            return 0
        steps = 0
        # Counted in inner steps, planned at H each until a round's own H_r is derived.
        with Progress(f"audit replay ({len(sampled)} sampled, {planned} with their chains)",
                      planned * self.config.inner.steps, unit="steps", rate_unit="tokens") as progress:
            for worker in sorted(chains):
                steps += self._replay_worker(worker, chains[worker], sampled, corpus, rows, progress)
        return steps

    def _replay_worker(self, worker: str, rounds: list[int], sampled: set[tuple[int, str]], corpus: Dataset,
                       rows: list[ReplayRow], progress: Progress) -> int:
        """``worker``'s chain of ``rounds`` replayed in order (one AdamW state carried along), a row
        for each; returns the inner steps replayed."""
        cfg = self.config
        model = build_model(cfg.model, cfg.seed)
        inner: InnerLoop | None = None
        previous: int | None = None
        errors: Params = {}  # the worker's error feedback e, rebuilt along the chain
        steps = position = 0  # position: the contribution's place in its chain, 1 at a fresh start
        kernels = kernels_label(self.exact, self.fallback.get(worker, ""))
        for r in rounds:
            p = self._participant(r, worker)
            position += 1
            continues = inner is not None and previous is not None and self._consecutive(worker, previous, r)
            if p.state == FRESH_STATE:
                inner, errors, position = InnerLoop(model, cfg.inner), {}, 1
            elif self.revealed_on_challenge and not state_stored(self.store, p):  # asked for, so owed
                rows.append(unrevealed_row(self.config, self.manifests, r, worker, (r, worker) in sampled))
                inner = None
                progress.add_total(-cfg.inner.steps)
                continue
            elif not continues or state_stored(self.store, p):
                try:
                    loaded = committed_state(self.store, self.config, p, model)
                except ReplayError as exc:
                    self.problems.append((r, p.state or "", f"{worker}: {exc}"))
                    inner = None
                    progress.add_total(-cfg.inner.steps)
                    continue
                # The chain (re)starts at a stored state (position 1: joined chains stay in the horizon), or stops.
                inner, errors = loaded if loaded is not None else (None, errors)
                position = 1 if loaded is not None else position
            if inner is None:
                rows.append(ReplayRow(r, worker, (r, worker) in sampled, None, "MISMATCH",
                                      "the committed inner state is not fresh, and no counted contribution "
                                      "of this worker before it was replayed to continue from"))
                inner = None
                progress.add_total(-cfg.inner.steps)
                continue
            inputs = self._inputs(r, worker, p, corpus)
            if inputs is None:
                inner = None
                progress.add_total(-cfg.inner.steps)
                continue
            start, stored, round_steps, batches = inputs
            progress.add_total(round_steps - cfg.inner.steps)
            try:
                staged = staged_of(self.store, self.config, p)
            except ReplayError as exc:
                self.problems.append((r, p.update, f"{worker}: {exc}"))
                inner = None
                continue
            result = inner.run(start, batches, progress, staged)
            steps += result.steps
            if cfg.compression.enabled:
                try:
                    errors, distance = recompressed(self.config, result.pseudo_gradient, errors, stored)
                except ReplayError as exc:
                    self.problems.append((r, p.update, f"{worker}: {exc}"))
                    inner = None
                    continue
            else:
                distance = relative_distance(result.pseudo_gradient, stored)
            status, note, tolerance = judge(distance, position, self.exact)
            rows.append(ReplayRow(r, worker, (r, worker) in sampled, distance, status, note, kernels, tolerance))
            previous = r
        return steps

    def _inputs(self, r: int, worker: str, p: Participant, corpus: Dataset
                ) -> tuple[Params, Params, int, Iterable[tuple[torch.Tensor, torch.Tensor]]] | None:
        """What ``worker``'s contribution to round ``r`` is replayed from: its start, its stored
        update, H_r and its batches; None (and a problem) when one of them cannot be read."""
        cfg = self.config
        start = self._start(r, worker)
        if start is None:
            return None
        try:
            stored = dense(open_update(self.store, p.update, layout_of(start), cfg.model))
        except (OSError, ValueError, WireError) as exc:  # RecordError is a ValueError
            self.problems.append((r, p.update, f"the update of {worker} cannot be read: {exc}"))
            return None
        try:
            shard_tokens = corpus.slot_tokens(p.shard)
        except CorpusError as exc:
            self.problems.append((r, f"shard {p.shard}", f"{worker}'s shard cannot be read: {exc}"))
            return None
        round_steps = self.inner_steps(r, layout_of(start))
        if round_steps is None:
            return None
        batches = round_batches(shard_tokens, seed=cfg.seed, shard_index=p.shard, round_=r, steps=round_steps,
                                batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size)
        return start, stored, round_steps, batches

    def _consecutive(self, worker: str, earlier: int, later: int) -> bool:
        """``earlier`` is ``worker``'s last counted contribution before ``later``."""
        return all(not any(p.worker == worker for p in self.manifests[r].participants)
                   for r in range(earlier + 1, later) if r in self.manifests)


def recompressed(config: RunConfig, delta: Params, errors: Params, stored: Params) -> tuple[Params, float]:
    """With a compressed uplink the stored update is Â = decompress(C(Δ + e)). The replay forms
    A' = Δ' + e' and, at the ranks Â has (the codec's ``replay_ranks``: the worker's policy chose
    them), each kind's ``replay_target`` U (trainer.codec.base: the best low-rank approximation
    for lowrank-int4, float64 SVD, no quantisation; U = A' for the dense kinds),
    and puts A' through the same codec, Â' = decompress(C(A')). Comparing Â with Â' directly
    would measure the quantiser, not the worker: a replay a thousandth off flips int4 levels
    and lands several percent away. So the replay asks how far Â is from U beyond the codec's
    own error at that point, q = ‖Â' − U‖ / ‖U‖:

        d = ‖Â − U‖ / ‖U‖ − q

    and carries e' ← fl32(A' − Â) on, as the worker carried its own e ← A − Â (A' = Δ' + β·e',
    β the uplink's error decay, trainer.codec.feedback.accumulate). With the top-k
    codec (trainer.codec.topk) U is A' on its own top-k positions, unquantised."""
    cfg = config.compression
    ranks = matrix_codec(cfg.codec).replay_ranks(stored)
    try:
        payload, header = compress(delta, dict(errors), PinnedRankPolicy(cfg, ranks), decay=cfg.error_decay)
        recompressed = decompress(payload, header, layout_of(stored))
        parsed = CodecHeader.parse(header, layout_of(stored))
    except CompressionError as exc:
        raise ReplayError(f"the replayed update cannot be re-compressed: {exc}") from None
    accumulated = {name: accumulate(d, errors.get(name), cfg.error_decay) for name, d in delta.items()}
    best: Params = {}
    for name, a in accumulated.items():
        entry = parsed.entry(name)
        best[name] = codec_of(entry.kind).replay_target(a, entry)
    scale = _norm({n: t for n, t in best.items()})
    codec_error = _norm({n: recompressed[n].double() - best[n] for n in best}) / scale if scale else math.inf
    off = _norm({n: stored[n].double() - best[n] for n in best}) / scale if scale else math.inf
    carried = {name: (a - stored[name].double()).float() for name, a in accumulated.items()}
    return carried, max(0.0, off - codec_error)


def unrevealed_row(config: RunConfig, manifests: Mapping[int, Manifest], r: int, worker: str,
                   sampled: bool) -> ReplayRow:
    """The row of a contribution whose committed state was asked for and not revealed (audit.reveal):
    its worker is named while the round is within the newest ``rounds.reveal_rounds`` of the run (it
    had to keep the state), else the contribution is not replayed (it no longer had to)."""
    last, window = max(manifests), config.rounds.reveal_rounds
    if r > last - window:
        return ReplayRow(r, worker, sampled, None, "unrevealed",
                         f"its committed inner state was not revealed within {config.rounds.reveal_deadline_s:g}s "
                         f"(rounds.reveal_deadline_s)")
    return ReplayRow(r, worker, sampled, None, "not replayed",
                     f"its committed inner state was not revealed, and round {r} is more than {window} rounds "
                     f"(rounds.reveal_rounds) behind round {last}: its worker no longer had to keep it")


def rescore(replayer: Replayer, rounds: Iterable[int]) -> list[RescoreRow]:
    """The held-out loss of each of ``rounds``' checkpoints, recomputed on the run's evaluation
    batches and compared with its manifest's (EVAL_TOLERANCE)."""
    cfg = replayer.config
    corpus = replayer._load_corpus()
    batches = eval_batches(corpus.eval_tokens(), seed=cfg.seed, count=cfg.data.eval_batches,
                           batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size)
    model = build_model(cfg.model, cfg.seed)
    out = []
    targets = sorted(set(rounds))
    with Progress("audit re-scoring held-out loss", len(targets), unit="checkpoints") as progress:
        for r in targets:
            params = replayer._params(r, f"θ⁽{r}⁾")
            progress.advance()
            if params is None:
                continue
            load_params(model, params)
            recomputed = evaluate(model, batches)
            reported = from_e6(replayer.manifests[r].eval_loss_e6)
            out.append(RescoreRow(r, reported, recomputed, abs(recomputed - reported) <= EVAL_TOLERANCE))
    return out


def committed_state(store: Store, config: RunConfig, p: Participant,
                    model: torch.nn.Module) -> tuple[InnerLoop, Params] | None:
    """An inner loop and error feedback set to ``p``'s committed state when the store holds it (by
    CID: its digest is the commitment, checked as it is read; decoded by the wire codec and
    checked as a worker's state, trainer.runtime.state_commit), None when it does not;
    ReplayError when the stored object cannot be used."""
    if p.state is None or not store.has(state_cid(p.state)):
        return None
    try:
        state = decode_inner_state(store.get(state_cid(p.state)), layout_of(params_of(model)),
                                   config.compression.enabled, config.inner.optimizer)
    except (OSError, ValueError) as exc:  # StoreError, StateError: ValueError
        raise ReplayError(f"the stored committed inner state cannot be used: {str(exc)[:300]}") from None
    adamw, errors = split_inner_state(state)
    inner = InnerLoop(model, config.inner)
    load_optimizer_state(inner.model, inner.optimizer, adamw)
    return inner, errors


def missing_states(store: Store, config: RunConfig, manifests: Mapping[int, Manifest], worker: str,
                   rounds: Iterable[int]) -> list[tuple[int | None, str, str]]:
    """A problem for each of ``worker``'s ``rounds`` whose committed state ``rounds.state_every`` says
    was stored (trainer.runtime.state_commit.state_due: its first counted contribution in its window
    of K rounds; the coordinator refuses such a push without it) but the store lacks: the replay then
    goes further back, and the audit says so."""
    every = config.rounds.state_every
    out: list[tuple[int | None, str, str]] = []
    for r in rounds:
        p = _counted(manifests[r], worker)
        window = window_contributions(every, r, lambda q: _counted(manifests.get(q), worker))
        if (p is not None and state_due(every, r, previous_in_window(window)) and p.state not in (None, FRESH_STATE)
                and not store.has(state_cid(p.state))):
            out.append((r, p.state, f"{worker}'s inner state of round {r}, its first counted contribution in rounds "
                                    f"{r - r % every}..{r - r % every + every - 1} (rounds.state_every {every}), "
                                    f"is not in the store"))
    return out


def staged_of(store: Store, config: RunConfig, p: Participant) -> StagedArithmetic | None:
    """How the worker computed its gradients: with P > 1 pipeline stages (its update record's
    slices) and/or N > 1 data-parallel replicas (its recorded kernels' ``data_parallel``,
    trainer.runtime.island), the island's arithmetic, computed in one process
    (trainer.runtime.staged: each replica's slice, the same microbatches, the replicas' gradients
    summed in rank order, the same clipping); None for a one-process worker. The record was read and
    checked whole by ``Replayer._inputs``, so only a store that changed since can fail here."""
    try:
        refs = parse_record(store.get(p.update))
    except (OSError, ValueError) as exc:  # StoreError, RecordError: ValueError
        raise ReplayError(f"its update record cannot be read: {str(exc)[:300]}") from None
    replicas = p.kernels.data_parallel if p.kernels is not None else 1
    try:
        Island(replicas, refs[0].num_stages).check_batch(config.inner.batch_size, WORKER_MICROBATCHES)
        return staged_arithmetic(config.model, refs[0].num_stages, replicas=replicas)
    except ValueError as exc:  # a split the model does not allow: a record no honest worker writes
        raise ReplayError(f"its {replicas} x {refs[0].num_stages} island cannot be replayed: {str(exc)[:200]}") from None


def _replay_in_child(replayer: Replayer, kernels: Kernels, chains: dict[str, list[int]],
                     sampled: set[tuple[int, str]], rows: list[ReplayRow]) -> int:
    """``chains`` replayed in a child process in their workers' ``kernels`` (audit.replay_env);
    returns the inner steps it replayed."""
    try:
        answer = replay_in(kernels, replayer.store, replayer.config, replayer.manifests, chains, sampled)
    except ChildError as exc:
        replayer.problems.append((None, "replay", str(exc)))
        return 0
    rows.extend(ReplayRow(**row) for row in answer["rows"])
    replayer.steps.update(answer["round_steps"])
    replayer.problems.extend(answer["problems"])
    return answer["steps"]


def _norm(tensors: Params) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for _, t in sorted(tensors.items())))


def relative_distance(replayed: Params, stored: Params) -> float:
    """‖a − b‖₂ / ‖b‖₂ over every tensor, in float64 (inf when the names or shapes differ)."""
    if set(replayed) != set(stored) or any(replayed[n].shape != stored[n].shape for n in stored):
        return math.inf
    diff = sum(float((replayed[n].double() - stored[n].double()).square().sum()) for n in sorted(stored))
    norm = sum(float(stored[n].double().square().sum()) for n in sorted(stored))
    return math.sqrt(diff) / math.sqrt(norm) if norm > 0 else math.inf


def replay_run(store: Store, config: RunConfig, manifests: Mapping[int, Manifest], k: int,
               seed: int, reveal_sources: Sequence[tuple[str, Store]] = ()) -> ReplayOutcome:
    """Sample ``k`` contributions with ``seed``, replay them (and their chains), re-score their rounds.
    In a run whose states are revealed on challenge, the sampled contributions' committed states are
    asked of ``reveal_sources`` (label, store) first (audit.reveal)."""
    started = time.perf_counter()
    replayer = Replayer(store, config, manifests, reveal_sources=reveal_sources)
    targets, skipped = replayer.sample(k, seed)
    try:
        rows, steps = replayer.replay(targets)
        rescored = rescore(replayer, (r for r, _ in targets)) if replayer.corpus_loaded else []
    finally:
        replayer.close()
    checked = sum(replayer.steps.get(r, config.inner.steps) for r, _ in targets)
    return ReplayOutcome(rows + skipped, rescored, seed, steps, checked,
                         time.perf_counter() - started, replayer.problems, replayer.challenges.outcome)
