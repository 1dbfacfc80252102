"""The worker's round loops: synchronous (DiLoCo) and with DiLoCoX's one-step-delay overlap.

    synchronous   s⁽ʳ⁾ = θ⁽ʳ⁻¹⁾                      wait for the round before to close, then train
    overlapped    s⁽ʳ⁾ = θ⁽ʳ⁻²⁾ − Δᵢ⁽ʳ⁻¹⁾  (r ≥ 2)    train at once; push Δ⁽ʳ⁻¹⁾ / fetch θ⁽ʳ⁻¹⁾ meanwhile
    both          Δᵢ⁽ʳ⁾ = s⁽ʳ⁾ − θᵢ⁽ʳ'ᴴ⁾ after H inner steps;  θ⁽ʳ⁾ = Outer(θ⁽ʳ⁻¹⁾, mean Δ⁽ʳ⁾)

With overlap the global update reaches a worker one round late: round r builds on θ⁽ʳ⁻²⁾ plus the
worker's own last round, instead of θ⁽ʳ⁻¹⁾. The coordinator's arithmetic is the same in both modes,
so checkpoints, reports and the audit do not change. A worker dropped from a round (too late, or
refused) logs why and starts the next round from the latest global checkpoint.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from trainer.pipeline import PipelineError
from trainer.worker.client import Checkpoint

if TYPE_CHECKING:  # the role drives these loops; they only call back into it
    from trainer.worker.role import Pushed, RoundWork, Worker

log = logging.getLogger("dilocox.worker")


def synchronous(worker: Worker) -> int:
    """Fetch θ⁽ʳ⁻¹⁾, train round r, push Δ⁽ʳ⁾, report round r once θ⁽ʳ⁾ is in hand; repeat."""
    min_round, pushed = 0, None
    while True:
        checkpoint = worker.client.fetch(min_round)
        worker.report(pushed, checkpoint)
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
        min_round = r


def _exchange(worker: Worker, round_: int, work: RoundWork, base_cid: str) -> tuple[Pushed | None, Checkpoint]:
    """Push Δ⁽ʳ⁾, then fetch θ⁽ʳ⁾ (or whatever is newer): the part that overlaps compute."""
    pushed = worker.push(round_, work, base_cid)
    return pushed, worker.client.fetch(round_)


def overlapped(worker: Worker) -> int:
    """While round r trains, the exchange of round r-1 (push Δ⁽ʳ⁻¹⁾, fetch θ⁽ʳ⁻¹⁾) runs in a
    background thread; round r started from θ⁽ʳ⁻²⁾ − Δ⁽ʳ⁻¹⁾, the newest global this worker held
    plus its own last round. A worker that finds itself behind (dropped, or the run moved on)
    starts over synchronously from the newest global."""
    held = worker.client.fetch(0)
    if held.finished:
        return worker.finished(held)
    r, start, base = held.round + 1, held.params, held.params_cid
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
                continue
            trained = time.monotonic() - started
            if inflight is not None:
                pushed, held = inflight.result()
                worker.report(pushed, held)
                if held.finished or held.round != r - 1:
                    # Behind the run: this round's work builds on a stale base; start over.
                    log.warning("round %d: the run is at round %d; restarting from it", r, held.round)
                    if held.finished:
                        return worker.finished(held)
                    r, start, base, inflight = held.round + 1, held.params, held.params_cid, None
                    continue
            inflight = exchange.submit(_exchange, worker, r, work, base)
            worker.round_done(r, work, trained, time.monotonic() - started - trained)
            # s⁽ʳ⁺¹⁾ = θ⁽ʳ⁻¹⁾ − Δ⁽ʳ⁾: newest global held, plus this round's own progress.
            start = {k: held.params[k] - work.result.pseudo_gradient[k] for k in held.params}
            base = held.params_cid
            r += 1
        assert inflight is not None
        pushed, checkpoint = inflight.result()
        worker.report(pushed, checkpoint)
        while not checkpoint.finished:
            checkpoint = worker.client.fetch(checkpoint.round + 1)
        return worker.finished(checkpoint)
