"""Evaluation shared between the coordinator and the workers: each held-out batch evaluated once.

The coordinator evaluates each new checkpoint θ⁽ʳ⁾ on the run's B = ``data.eval_batches`` held-out
batches (trainer.data.corpus.eval_batches) and sends the per-batch losses ℓ₀ … ℓ_{B−1} (nats per token,
×1e6 as integers) with the global state (GlobalHeader.eval_losses_e6); the manifest's
``eval_loss_e6`` is to_e6(mean of the ℓⱼ). A worker about to sign its report of round r checks

    1. B claims, each an integer in [0, MAX_EVAL_LOSS_E6];
    2. |Σⱼ claimⱼ / B − manifest eval_loss_e6| ≤ EVAL_TOLERANCE_E6;
    3. its own share: for every batch j ≡ s (mod W), s its shard slot and W = rounds.expected_workers,
       |to_e6(ℓⱼ(θ⁽ʳ⁾)) − claimⱼ| ≤ EVAL_TOLERANCE_E6, recomputed on its own CPU,

and refuses to sign on any mismatch. The W workers of a full round together re-evaluate every
batch once, where each used to evaluate all B: a round's evaluation costs B batches on the
coordinator and about B / W on each worker instead of B everywhere.
"""

from __future__ import annotations

from typing import Sequence

EVAL_TOLERANCE_E6 = 1000  # a worker's own evaluation may differ from the coordinator's by 1e-3 nats
MAX_EVAL_LOSS_E6 = 10**12  # 1e6 nats per token: far beyond any real model's loss, and bounded
MAX_EVAL_BATCHES = 10_000  # = the bound of data.eval_batches (trainer.config)


def eval_share(count: int, workers: int, slot: int) -> list[int]:
    """The held-out batches a worker of shard ``slot`` re-evaluates: j ≡ slot (mod workers)."""
    return list(range(slot, count, workers)) if 0 <= slot < workers else []


def shared_evaluation_problem(claims: Sequence[int], count: int, manifest_e6: int, own: dict[int, int],
                              tolerance_e6: int = EVAL_TOLERANCE_E6) -> str | None:
    """What is wrong with a checkpoint's claimed per-batch losses (see the module docstring), or
    None when they hold: ``own`` maps the batches this worker evaluated to its to_e6 losses."""
    if len(claims) != count:
        return f"{len(claims)} per-batch eval losses were sent, the run evaluates {count} batches"
    bad = next((j for j, c in enumerate(claims) if not 0 <= c <= MAX_EVAL_LOSS_E6), None)
    if bad is not None:
        return f"the per-batch eval loss of batch {bad} is out of range [0, {MAX_EVAL_LOSS_E6 / 1e6:g}] nats"
    mean = sum(claims) / count
    if abs(mean - manifest_e6) > tolerance_e6:
        return (f"the per-batch eval losses average {mean / 1e6:.6f}, the manifest says "
                f"{manifest_e6 / 1e6:.6f}")
    for j, loss in sorted(own.items()):
        if not 0 <= j < count:
            return f"batch {j} is not one of the run's {count} held-out batches"
        if abs(loss - claims[j]) > tolerance_e6:
            return (f"held-out batch {j} evaluates to {loss / 1e6:.6f} here, the coordinator "
                    f"claims {claims[j] / 1e6:.6f}")
    return None
