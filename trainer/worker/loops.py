"""The worker's round loops: synchronous (DiLoCo) and with DiLoCoX's one-step-delay overlap.

    synchronous   s⁽ʳ⁾ = θ⁽ʳ⁻¹⁾                        wait for the round before to close, then train
    overlapped    train round r at once; push Δ⁽ʳ⁻¹⁾ / fetch θ⁽ʳ⁻¹⁾ meanwhile, from s⁽ʳ⁾ (r ≥ 2):
      delayed     s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Δ̂ᵢ⁽ʳ⁻¹⁾
      eager       s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Ũᵢ⁽ʳ⁻¹⁾,   Ũᵢ⁽ʳ⁻¹⁾ = U⁽ʳ⁻²⁾ + c (Δ̂ᵢ⁽ʳ⁻¹⁾ − Δ̂ᵢ⁽ʳ⁻²⁾)
    both          Δᵢ⁽ʳ⁾ = s⁽ʳ⁾ − θᵢ⁽ʳ'ᴴ⁾ after H inner steps;  θ⁽ʳ⁾ = Outer(θ⁽ʳ⁻¹⁾, mean Δ⁽ʳ⁾)

With overlap the global update reaches a worker one round late: round r's start cannot include the
outer step θ⁽ʳ⁻²⁾ → θ⁽ʳ⁻¹⁾, still in flight. ``rounds.overlap_start`` chooses what stands in for it:

* **delayed**: the worker's own last pseudo-gradient, applied whole, as it was transmitted (Δ̂ᵢ,
  the coordinator's reconstruction of its push; Δ̂ = Δ when updates travel dense), so that the
  start is a function of stored objects: the auditor's replay rebuilds it from θ⁽ʳ⁻²⁾ and the
  worker's update record of round r−1 (trainer.rounds.outer.delayed_start, audit.replay).
* **eager** (Kale, Douillard, Donchev, "Eager Updates For Overlapped Communication and Computation
  in DiLoCo", arXiv:2502.12996): a proxy of the outer step in flight. The paper mixes the worker's
  current outer gradient with the other workers' delayed ones, ḡ ≈ Δ̄⁽ʳ⁻²⁾ + (Δᵢ⁽ʳ⁻¹⁾ − Δᵢ⁽ʳ⁻²⁾)/W.
  A worker here holds the global states, not the coordinator's momentum, so the proxy is stated on
  the displacement the outer step applies, U⁽ᵗ⁾ = θ⁽ᵗ⁻¹⁾ − θ⁽ᵗ⁾ (U⁽⁰⁾ = 0): the last displacement,
  plus the worker's change of Δ at the weight a fresh outer gradient gets in that step,
  c = η_out (1 + μ) / W with Nesterov (η_out / W without), W = ``rounds.expected_workers``. Δ̂ᵢ is
  what the worker transmitted (the coordinator's reconstruction of its push; Δ̂ᵢ⁽⁰⁾ = 0), so every
  term of the start is in the run's store. When θ⁽ʳ⁻¹⁾ lands, the next start is built on it: the
  correction is the difference between the proxy and the step that was actually taken.

The coordinator's arithmetic is the same in every mode, so checkpoints, reports and the audit do
not change. Reports never wait on training: a worker signs and submits its report of round r as
soon as it holds θ⁽ʳ⁾ and has checked it, in the overlapped loop from the exchange thread while
round r+1 trains (trainer.worker.reporter checks θ⁽ʳ⁾ on a model of its own), because the coordinator
records round r ``--report-timeout`` after publishing θ⁽ʳ⁾ with whatever reports it holds then.
A worker dropped from a round (too late, or refused) logs why and starts the next round from the
latest global checkpoint; overlapped, the round it trained meanwhile on the dropped one is dropped
too, and its inner state rewound to before the dropped round (trainer.worker.role.Worker.rewind), so
that its state moves only through counted rounds, as a synchronous worker's does, and the audit's
replay rebuilds every counted round (a first counted round after uncounted ones starts fresh).
When every live worker's push of a round was refused, the coordinator stops the run and the
workers' wait for it ends with the coordinator's line (WorkerError).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from trainer.codec.uplink import merged
from trainer.codec.wire import Params
from trainer.config import RunConfig
from trainer.rounds.outer import delayed_start, eager_start, eager_weight
from trainer.runtime.pipeline import PipelineError
from trainer.worker.client import Checkpoint

if TYPE_CHECKING:  # the role drives these loops; they only call back into it
    from trainer.worker.role import RoundWork, Worker

log = logging.getLogger("dilocox.worker")


def synchronous(worker: Worker) -> int:
    """Fetch θ⁽ʳ⁻¹⁾, train round r, push Δ⁽ʳ⁾, report round r once θ⁽ʳ⁾ is in hand; repeat."""
    min_round, pushed = 0, None
    while True:
        checkpoint = worker.client.fetch(min_round)
        worker.reporter.report(pushed, checkpoint)
        if checkpoint.finished:
            return worker.finished(checkpoint)
        r = checkpoint.round + 1
        started = time.monotonic()
        try:
            work = worker.train(r, checkpoint.params)
        except PipelineError as exc:
            min_round, pushed = worker.abandon(r, exc), None  # it closes without us
            continue
        trained = time.monotonic() - started
        pushed = worker.push(r, work, checkpoint.params_cid)
        worker.round_done(r, work, trained, time.monotonic() - started - trained)
        # Round r's Δ, Δ̂ and start state are done with: not held through the next fetch and round.
        del work
        min_round = r


def _exchange(worker: Worker, round_: int, work: RoundWork, base_cid: str,
              parent_cid: str) -> tuple[Checkpoint, bool]:
    """Push Δ⁽ʳ⁾ (trained from ``base_cid``; the round's parent is ``parent_cid``), fetch θ⁽ʳ⁾ (or
    whatever is newer), check it and report round r at once: the part that overlaps compute. The
    report cannot wait for the round being trained: the coordinator records round r
    ``--report-timeout`` after publishing θ⁽ʳ⁾, with the reports it holds by then. Returns the
    checkpoint and whether the coordinator holds the push (False: refused)."""
    pushed = worker.push(round_, work, base_cid, parent_cid)
    checkpoint = worker.client.fetch(round_)
    worker.reporter.report(pushed, checkpoint)
    return checkpoint, pushed is not None


class OverlapStart:
    """Where an overlapped worker's next round starts (see the module docstring); ``rebase`` once
    per round, after θ⁽ʳ⁻¹⁾ has landed, with that round's work."""

    def __init__(self, config: RunConfig) -> None:
        self.eager = config.rounds.overlap_start == "eager"
        self.weight = eager_weight(config.outer, config.rounds.expected_workers)
        self.reset()

    def reset(self) -> None:
        """Forget the history: the next start is taken as the first of a run."""
        self._history: tuple[Params, Params] | None = None  # θ⁽ʳ⁻²⁾ and Δ̂ᵢ⁽ʳ⁻¹⁾ of the last rebase

    def rebase(self, newest: Params, work: RoundWork) -> Params:
        """s⁽ʳ⁺¹⁾ from θ⁽ʳ⁻¹⁾ = ``newest`` and round r's ``work``."""
        sent = merged(work.slices)
        if not self.eager:
            return delayed_start(newest, sent)
        start = eager_start(newest, sent, self.weight, self._history)
        self._history = (newest, sent)
        return start


def overlapped(worker: Worker) -> int:
    """While round r trains, the exchange of round r-1 (push Δ⁽ʳ⁻¹⁾, fetch θ⁽ʳ⁻¹⁾, check it, sign
    and submit the report of round r-1) runs in a background thread; round r started from θ⁽ʳ⁻²⁾,
    the newest global this worker held, moved by what stands in for the step in flight
    (:class:`OverlapStart`). A worker that finds itself behind (dropped, or the run moved on)
    starts over synchronously from the newest global."""
    held = worker.client.fetch(0)
    if held.finished:
        return worker.finished(held)
    r, start, base = held.round + 1, held.params, held.params_cid
    rule = OverlapStart(worker.config)
    log.info("overlapped rounds, %s start: the next round starts from the newest global state %s",
             worker.config.rounds.overlap_start,
             f"moved by a proxy of the outer step in flight (c = {rule.weight:.4g})" if rule.eager
             else "plus this worker's own last pseudo-gradient")
    inflight: Future | None = None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="exchange") as exchange:
        while r <= worker.config.rounds.rounds:
            started = time.monotonic()
            try:
                work = worker.train(r, start)
            except PipelineError as exc:
                # Start over from the round's checkpoint once it closes without us (see Worker.abandon).
                held = worker.client.fetch(worker.abandon(r, exc, inflight))
                if held.finished:
                    return worker.finished(held)
                r, start, base, inflight = held.round + 1, held.params, held.params_cid, None
                rule.reset()
                continue
            trained = time.monotonic() - started
            if inflight is not None:
                held, counted = inflight.result()  # round r-1, reported by the exchange
                if not counted or held.finished or held.round != r - 1:
                    # Round r-1's push was refused (this round built on it), or the run moved on (this
                    # round builds on a stale base): the inner state goes back to before the first
                    # round that does not count (Worker.rewind), and the worker starts over.
                    worker.rewind(sent if not counted else work, dropped=work)
                    log.warning("round %d: %s; starting over from round %d's checkpoint", r,
                                f"round {r - 1}'s push was refused" if not counted else
                                f"the run is at round {held.round}", held.round)
                    if held.finished:
                        return worker.finished(held)
                    r, start, base, inflight = held.round + 1, held.params, held.params_cid, None
                    rule.reset()
                    continue
            inflight = exchange.submit(_exchange, worker, r, work, base, held.params_cid)
            sent = work
            worker.round_done(r, work, trained, time.monotonic() - started - trained)
            start = rule.rebase(held.params, work)  # s⁽ʳ⁺¹⁾ from θ⁽ʳ⁻¹⁾ and round r
            base = held.params_cid
            r += 1
        assert inflight is not None
        checkpoint, _ = inflight.result()
        while not checkpoint.finished:
            checkpoint = worker.client.fetch(checkpoint.round + 1)
        return worker.finished(checkpoint)
