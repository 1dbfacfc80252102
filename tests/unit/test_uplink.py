"""trainer.codec.uplink: a worker's slices and its error feedback, which nothing refused may lose."""

from __future__ import annotations

import torch

from proto import Encoding
from trainer.codec import CompressionConfig, decompress
from trainer.codec.uplink import Uplink, encode_slice, merged, new_compressor
from trainer.codec.wire import encode_params, layout_of

CONFIG = CompressionConfig(enabled=True, min_rank=1, max_rank=2)


def delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(24, 16, generator=g) * 1e-3, "b": torch.randn(16, generator=g) * 1e-3}


def test_dense_slice_is_the_tensors_themselves() -> None:
    d = delta(0)
    piece = Uplink(CompressionConfig(enabled=False), 1).encode(d)
    assert (piece.stage, piece.num_stages, piece.encoding) == (0, 1, Encoding.DENSE_F32)
    assert piece.payload == encode_params(d) and piece.transmitted is d and piece.decision is None
    assert merged([piece]) == d


def test_compressed_slice_is_what_the_coordinator_rebuilds() -> None:
    piece = Uplink(CONFIG, 1).encode(delta(1))
    assert piece.encoding == Encoding.LOWRANK_INT4 and piece.decision is not None
    rebuilt = decompress(piece.payload, piece.codec_header, layout_of(delta(1)))
    assert all(torch.equal(rebuilt[n], piece.transmitted[n]) for n in rebuilt)


def test_refused_rounds_lose_nothing() -> None:
    """Σ of what the coordinator counted + the final error = Σ Δ, with round 2 refused."""
    uplink = Uplink(CONFIG, 1)
    counted = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in delta(0).items()}
    total = {n: torch.zeros_like(t, dtype=torch.float64) for n, t in delta(0).items()}
    for round_ in range(1, 6):
        d = delta(round_)
        for n in total:
            total[n] += d[n].double()
        piece = uplink.encode(d)
        if round_ == 2:
            uplink.carry_back([piece])
            continue
        for n in counted:
            counted[n] += piece.transmitted[n].double()
    error = uplink.compressors[0].errors
    for n in total:
        assert torch.allclose(counted[n] + error[n].double(), total[n], atol=1e-8), n
    # The carried-back round made the residual larger than compression alone would leave it.
    assert uplink.compressors[0].policy.round == 5


def test_stage_state_round_trip_equals_compressing_in_process() -> None:
    """A stage process gets the worker's state, compresses, and hands the state back: the same
    bytes and the same error as compressing in the worker; a carry-back that arrives while the
    stage works is kept for the round after."""
    staged, local = Uplink(CONFIG, 2), Uplink(CONFIG, 2)
    slices = [{"w": delta(3)["w"]}, {"b": delta(3)["b"]}]
    states = staged.states()
    assert states is not None and len(states) == 2
    pieces, back = [], []
    for s, (part, state) in enumerate(zip(slices, states)):
        compressor = new_compressor(CONFIG, state)  # what run_round does in stage s
        pieces.append(encode_slice(part, s, 2, compressor))
        back.append(compressor.state_dict())
    staged.carry_back([pieces[1]])  # a refusal lands before the stage's answer
    staged.update(back)
    expected = [encode_slice(part, s, 2, local.compressors[s]) for s, part in enumerate(slices)]
    assert [p.payload for p in pieces] == [p.payload for p in expected]
    assert torch.equal(staged.compressors[0].errors["w"], local.compressors[0].errors["w"])
    states = staged.states()  # folds the carried slice into stage 1's error
    assert states is not None
    want = local.compressors[1].errors["b"].double() + pieces[1].transmitted["b"].double()
    assert torch.allclose(states[1]["error/b"].double(), want, atol=1e-12)
