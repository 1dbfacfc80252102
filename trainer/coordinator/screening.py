"""Screening by effect (``rounds.screen_margin`` > 0), before an update is counted.

    accept Δᵢ  ⇔  L(θ − Δᵢ; B) ≤ L(θ; B) + margin

θ the round's start checkpoint, B ``data.eval_batches`` batches the coordinator draws from the
held-out split with a private random seed once a round, so workers cannot tune to them. Not part of
the re-derivation: a refused update is in no manifest.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import torch

from trainer.codec.wire import Params
from trainer.config import RunConfig
from trainer.coordinator.state import GlobalState
from trainer.data.corpus import sample_batch
from trainer.model.gpt import build_model
from trainer.model.params import load_params
from trainer.net.refusal import Reason, Refusal
from trainer.rounds.update_source import UpdateSource, source_of
from trainer.runtime.inner import evaluate

log = logging.getLogger("dilocox.coordinator")


@dataclass
class _RoundBatches:
    round: int
    start_loss: float
    batches: list


class Screen:
    """Thread-safe; holds a model of its own so screening never touches the evaluation model."""

    def __init__(self, config: RunConfig, eval_tokens: torch.Tensor) -> None:
        self.config = config
        self.margin = config.rounds.screen_margin
        self.eval_tokens = eval_tokens
        self.model = build_model(config.model, config.seed) if self.margin > 0 else None
        self._lock = threading.Lock()
        self._current: _RoundBatches | None = None

    def check(self, start: GlobalState, round_: int, update: Params | UpdateSource) -> float:
        """Refuse ``update`` if it raises the held-out loss of ``start`` by more than the margin;
        returns the loss change (0.0 when screening is off)."""
        if self.model is None:
            return 0.0
        cfg = self.config
        started = time.perf_counter()
        with self._lock, torch.no_grad():
            if self._current is None or self._current.round != start.round:
                generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
                batches = [sample_batch(self.eval_tokens, cfg.inner.batch_size, cfg.model.block_size, generator)
                           for _ in range(cfg.data.eval_batches)]
                load_params(self.model, start.params)
                self._current = _RoundBatches(start.round, evaluate(self.model, batches), batches)
            before, batches = self._current.start_loss, self._current.batches
            source = source_of(update)  # one tensor of the update decoded at a time
            load_params(self.model, {name: p - source.tensor(name) for name, p in start.params.items()})
            after = evaluate(self.model, batches)
        log.info("round %d: screened an update in %.3fs: held-out loss %.4f -> %.4f", round_,
                 time.perf_counter() - started, before, after)
        if not after <= before + self.margin:  # NaN too
            raise Refusal(Reason.SCREENED_OUT,
                          f"screened on held-out batches drawn for round {round_}, the update raises the loss of "
                          f"the round's start from {before:.4f} to {after:.4f}, more than the margin {self.margin:g}")
        return after - before
