"""The compressed downlink: replicas rebuild θ⁽ʳ⁾ bit for bit, nothing dropped is lost, the audit
re-derives it, and a worker whose push was refused carries its whole update forward."""

import pytest
import torch

from audit.rederive import RederiveError, rederive
from trainer.codec import AdaptiveRankPolicy, CompressionConfig, ErrorFeedbackCompressor, decompress
from trainer.codec.downlink import DownlinkCompressor, apply_update, decode_update, global_update
from trainer.codec.wire import decode_params, encode_params, layout_of
from trainer.config import OuterConfig
from trainer.rounds.aggregation import PLAIN_MEAN, aggregate
from trainer.rounds.outer import downlink_error_of, momentum_of, outer_state_of, outer_step, zero_momentum
from trainer.rounds.transition import OuterState, Transition, round_transition


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(48, 32, generator=g), "b": torch.randn(32, generator=g)}


def _compressor(rank: int = 4) -> DownlinkCompressor:
    return DownlinkCompressor(AdaptiveRankPolicy(CompressionConfig(enabled=True, min_rank=rank, max_rank=rank)))


def _round(parent: OuterState, updates: dict, downlink: DownlinkCompressor) -> Transition:
    return round_transition(parent, updates, outer=OuterConfig(), rounds=PLAIN_MEAN, downlink=downlink)


def _updates(like: dict, scale: float, generator: torch.Generator, workers=("a", "b")) -> dict:
    return {w: {k: scale * torch.randn(v.shape, generator=generator) for k, v in like.items()} for w in workers}


def test_replica_rebuilds_published_parameters_bit_for_bit() -> None:
    previous = _params(0)
    parent = OuterState(previous, zero_momentum(previous))
    downlink = _compressor()
    updates = _updates(previous, 0.01, torch.Generator().manual_seed(9))
    result = _round(parent, updates, downlink)
    assert result.downlink is not None
    payload, header = result.downlink.payload, result.downlink.header
    replica = apply_update(previous, decode_update(payload, header, layout_of(previous)))
    assert encode_params(replica) == result.state.params_bytes()
    assert downlink.last_decision.mean_rank == 4
    assert len(payload) * 5 < len(encode_params(previous))
    # What was not sent is exactly what is carried: e = fl32(u + 0 − û), u = θ⁽ʳ⁻¹⁾ − θ̃⁽ʳ⁾.
    target, _ = outer_step(OuterConfig(), previous, parent.momentum, aggregate(updates, PLAIN_MEAN).delta)
    sent = decompress(payload, header, layout_of(previous))
    u = global_update(previous, target)
    for k in u:
        assert torch.equal(result.state.downlink_error[k], (u[k].double() - sent[k].double()).float())


def test_error_feedback_keeps_the_sum_of_what_was_applied_on_track() -> None:
    """Σ û⁽ʳ⁾ = Σ u⁽ʳ⁾ − e⁽ᴿ⁾: the gap is the final error, bounded, not growing with R."""
    g = torch.Generator().manual_seed(1)
    state = OuterState(_params(2), zero_momentum(_params(2)))
    downlink = _compressor(rank=2)
    total_true = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.params.items()}
    total_sent = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in state.params.items()}
    gaps = []
    for _ in range(40):
        updates = _updates(state.params, 0.05, g)
        result = _round(state, updates, downlink)
        target, _ = outer_step(OuterConfig(), state.params, state.momentum, aggregate(updates, PLAIN_MEAN).delta)
        for k in state.params:
            total_true[k] += (state.params[k] - target[k]).double()
            total_sent[k] += (state.params[k] - result.state.params[k]).double()
        state = result.state
        gaps.append(float(torch.linalg.vector_norm(total_true["w"] - total_sent["w"])))
        assert torch.allclose(total_true["w"] - total_sent["w"], state.downlink_error["w"].double(), atol=1e-4)
    assert max(gaps[20:]) < 3 * max(gaps[:20])  # bounded: error feedback, not a random walk


def test_audit_rederives_a_compressed_round_and_names_a_tampered_one() -> None:
    cfg = OuterConfig()
    previous = _params(3)
    momentum = zero_momentum(previous)
    updates = _updates(previous, 0.01, torch.Generator().manual_seed(3))
    result = _round(OuterState(previous, momentum), updates, _compressor())
    assert result.downlink is not None
    payload, header = result.downlink.payload, dict(result.downlink.header)
    stored = {w: encode_params(u) for w, u in updates.items()}

    derived = rederive(cfg, encode_params(previous), encode_params(outer_state_of(momentum)), stored,
                       (payload, header))
    assert derived.params == result.state.params_bytes()
    assert derived.outer_state == result.state.outer_state_bytes()
    state = decode_params(derived.outer_state)
    assert set(momentum_of(state)) == set(downlink_error_of(state)) == set(previous)

    bad = dict(header, tensors=[dict(header["tensors"][1], rank=5), header["tensors"][0]])
    with pytest.raises(RederiveError, match="compressed global update"):
        rederive(cfg, encode_params(previous), encode_params(outer_state_of(momentum)), stored, (payload, bad))
    # A carried error with no compressed downlink this round is inconsistent.
    with pytest.raises(RederiveError, match="downlink error"):
        rederive(cfg, encode_params(previous),
                 encode_params(outer_state_of(momentum, result.state.downlink_error)), stored)


def test_refused_push_carries_its_whole_update_into_the_next_round() -> None:
    compressor = ErrorFeedbackCompressor(AdaptiveRankPolicy(CompressionConfig(enabled=True, min_rank=2, max_rank=2)))
    delta = _params(4)
    payload, header, _ = compressor.compress(delta)
    sent = decompress(payload, header, layout_of(delta))
    compressor.carry_back(sent)
    for k, v in delta.items():  # e = A = Δ + 0, up to float32 rounding of the sum
        assert torch.allclose(compressor.errors[k], v, atol=1e-6)
