"""The compressor's knobs, ``CompressionConfig``: the ``compression`` section of a run's configuration.

Apart from the codecs (trainer.codec.policy has the adaptive rank policy that reads them) so that a
configuration is read, checked and hashed without torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trainer.codec.registry import CHOICES, CODEC_LOWRANK, CODEC_TOPK
from trainer.config_fields import Range, setting

TOPK_MAX_CHUNK = 65_536  # the top-k codec's in-chunk positions are uint16 (trainer.codec.topk)


@dataclass(frozen=True)
class CompressionConfig:
    """Knobs of the compressor. Defaults: τ = 0.9, r ∈ [8, 64], W = 4 rounds, f = 2, g = 64.

    The rank floor matters more than τ: some updates put 90% of their energy in one direction (the
    output layer's, early on), and sending that direction alone starves the rest
    (docs/measurements.md has the figures).
    """

    # The ranges are checked with the rest of the run configuration (trainer.config), which gives
    # its refusals; __post_init__ below keeps the codec's own (narrower) preconditions.
    enabled: bool = setting(False, "compress updates; off: they travel dense fp32 (the DiLoCo baseline)")
    target_energy: float = setting(0.9, "τ: the energy of each update the chosen rank keeps",
                                   Range(0.0, 1.0, low_open=True))
    min_rank: int = setting(8, "the rank floor, <= max_rank", Range(1, 4096))
    max_rank: int = setting(64, "the rank ceiling", Range(1, 4096))
    window: int = setting(4, "W: rounds whose energy spectra are averaged", Range(1, 1000))
    max_rank_factor: float = setting(2.0, "f: the most the rank may grow in one round", Range(1.0, 1000.0))
    int4_group_size: int = setting(64, "values sharing one int4 scale", Range(1, 1 << 20))
    int8_group_size: int = setting(64, "values sharing one int8 scale", Range(1, 1 << 20))
    codec: str = setting(CODEC_LOWRANK, "the codec of matrices: one of CHOICES (trainer.codec.registry)")
    topk_density: float = setting(1 / 32, "the fraction of each matrix's entries the top-k codec sends",
                                  Range(0.0, 1.0, low_open=True))
    topk_chunk: int = setting(4096, "values per chunk, each chunk keeping its own top k", Range(1, TOPK_MAX_CHUNK))
    # SparseLoCo's β (trainer.codec.feedback): the uplink's error feedback forms A = Δ + β·e. 1 is
    # plain error feedback (Karimireddy et al.), what every run before the field had.
    error_decay: float = setting(1.0, "β: the worker's error feedback carries β·e into the next round",
                                 Range(0.0, 1.0), omitted_at_default=True)
    # SparseLoCo all-gathers the W sparse updates: every worker receives the whole average. The
    # coordinator's equivalent is a broadcast keeping W·k per chunk, which holds every position of the
    # average of W top-k updates; at k it re-selects, and what it drops waits in its downlink error.
    topk_downlink_union: bool = setting(False, "top-k: the broadcast keeps W·k per chunk (the whole average of W "
                                               "top-k updates) instead of k", omitted_at_default=True)

    def __post_init__(self) -> None:
        if not 0.0 < self.target_energy <= 1.0:
            raise ValueError(f"target_energy must lie in (0, 1], got {self.target_energy}")
        if not 1 <= self.min_rank <= self.max_rank:
            raise ValueError(f"need 1 <= min_rank <= max_rank, got {self.min_rank}, {self.max_rank}")
        if self.window < 1:
            raise ValueError(f"window must be at least 1, got {self.window}")
        if not self.max_rank_factor >= 1.0:
            raise ValueError(f"max_rank_factor must be >= 1, got {self.max_rank_factor}")
        for name in ("int4_group_size", "int8_group_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.codec not in CHOICES:
            raise ValueError(f"codec must be one of {', '.join(CHOICES)}, got {str(self.codec)[:40]!r}")
        if not 0.0 < self.topk_density <= 1.0:
            raise ValueError(f"topk_density must lie in (0, 1], got {self.topk_density}")
        if not 0.0 <= self.error_decay <= 1.0:
            raise ValueError(f"error_decay must lie in [0, 1], got {self.error_decay}")
        if not 1 <= self.topk_chunk <= TOPK_MAX_CHUNK:
            raise ValueError(f"topk_chunk must lie in [1, {TOPK_MAX_CHUNK}], got {self.topk_chunk}")

    def downlink(self, workers: int) -> CompressionConfig:
        """What the coordinator compresses the global update with: this configuration, but with
        ``topk_downlink_union`` the top-k density of W·k kept per chunk (k the uplink's), at most 1.
        How the broadcast is chosen is the coordinator's (the audit reads the stored one)."""
        if self.codec != CODEC_TOPK or not self.topk_downlink_union:
            return self
        k = max(1, min(self.topk_chunk, round(self.topk_density * self.topk_chunk)))  # topk.keep_per_chunk
        return replace(self, topk_density=min(1.0, workers * k / self.topk_chunk))
