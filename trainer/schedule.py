"""How many inner steps each round trains: DiLoCoX's adaptive H.

DiLoCoX (arXiv:2506.21263) lowers the number of inner steps with the rank of what is sent, so that
communication (∝ rank) stays hidden behind compute (∝ H) while rounds get more frequent as fewer
bytes are needed. With H = ``inner.steps``, H_min = ``inner.min_steps``, r_max =
``compression.max_rank`` and C⁽ʳ⁻²⁾ the codec header of the compressed global update of round r−2
(trainer.downlink; stored, its manifest's ``downlink`` names it):

    H_r = H                                                  r ≤ 2, or inner.adaptive_steps off,
                                                             or round r−2's update travelled dense
    ρ_r = mean over the matrices t of C⁽ʳ⁻²⁾ of  min(rank_t, r_max) / r_max
          (a matrix sent dense, kind int4, counts as 1)
    H_r = clamp(round(H·ρ_r), H_min, H)                      round half up, exact rational arithmetic

and a round's tokens follow: H_r · batch_size · block_size.

Why r−2: with the one-step-delay overlap a worker starting round r holds the global update of round
r−2 but not that of r−1; taking r−2 in every mode gives one rule that the coordinator, every worker
and the auditor evaluate, from stored bytes, before the round starts. H_r is never a worker's claim:
the coordinator checks each push against it and the audit re-derives it from the store.
"""

from __future__ import annotations

from fractions import Fraction

from storage_client import Manifest, ObjectStore
from trainer.compression import KIND_INT8, KIND_LOWRANK, CodecHeader
from trainer.config import RunConfig
from trainer.wire import Layout, json_object


def rank_fraction(config: RunConfig, header: CodecHeader | None) -> Fraction:
    """ρ of the module docstring: 1 without a header (or without a matrix in it)."""
    if header is None:
        return Fraction(1)
    r_max = config.compression.max_rank
    shares = [Fraction(min(entry.rank, r_max), r_max) if entry.kind == KIND_LOWRANK else Fraction(1)
              for entry in header.tensors if entry.kind != KIND_INT8]
    return sum(shares, Fraction(0)) / len(shares) if shares else Fraction(1)


def inner_steps_for_round(config: RunConfig, round_: int, header: CodecHeader | None) -> int:
    """H_r of the module docstring; ``header`` is the codec header of round ``round_`` − 2's global
    update (None when there is none: round ≤ 2, or that update travelled dense)."""
    steps = config.inner.steps
    if not config.inner.adaptive_steps or round_ <= 2 or header is None:
        return steps
    scaled = steps * rank_fraction(config, header)
    nearest = int(scaled + Fraction(1, 2))  # floor(x + 1/2): round half up, exactly
    return max(config.inner.min_steps, min(steps, nearest))


def round_tokens(config: RunConfig, steps: int) -> int:
    """The tokens of one worker's round of ``steps`` inner steps."""
    return steps * config.inner.batch_size * config.model.block_size


def stored_downlink_header(store: ObjectStore, manifest: Manifest, layout: Layout) -> CodecHeader | None:
    """The codec header of ``manifest``'s compressed global update, read from ``store`` (bounded
    JSON) and checked against ``layout``; None when that round's update travelled dense. Raises
    ``trainer.wire.WireError`` or ``trainer.compression.CompressionError`` naming what is wrong."""
    if manifest.downlink is None:
        return None
    raw = json_object(store.get(manifest.downlink.header), f"round {manifest.round}'s downlink codec header")
    return CodecHeader.parse(raw, layout)
