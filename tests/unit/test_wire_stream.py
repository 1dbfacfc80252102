"""A checkpoint written a tensor at a time (trainer.codec.wire.params_chunks) is the bytes safetensors
writes whole (encode_params), so its CID, which the manifest and the chain commit to, is unchanged;
and the store keeps it under that CID without holding it whole (ObjectStore.put_chunks)."""

from __future__ import annotations

import pytest
import torch

from storage_client import CID, ObjectStore
from trainer.codec import wire
from trainer.codec.wire import cid_of_chunks, encode_params, params_chunks


def layouts() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {"layers.0.attn.weight": torch.randn(48, 40, generator=g), "layers.0.attn.bias": torch.randn(40, generator=g),
                  "layers.10.mlp-up": torch.randn(7, 3, 5, generator=g), "Layers.2_x": torch.randn(1, generator=g)},
        "outer": {f"momentum.w{i}": torch.randn(9, generator=g) for i in range(12)}
        | {f"downlink_error.w{i}": torch.randn(3, 3, generator=g) for i in range(12)},
        "odd": {"a": torch.randn(3, generator=g), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
                "view": torch.randn(6, 8, generator=g).T},  # a non-contiguous tensor
        "fallback-dtype": {"a": torch.randn(3, generator=g), "b": torch.randn(4, generator=g).double()},
        "fallback-name": {"a b": torch.randn(3, generator=g)},
        "empty": {},
    }


@pytest.mark.parametrize("label", sorted(layouts()))
def test_streamed_bytes_are_safetensors_bytes(label: str, monkeypatch: pytest.MonkeyPatch) -> None:
    params = layouts()[label]
    whole = encode_params(params)
    streamed = not label.startswith(("fallback", "empty"))
    assert (len(list(params_chunks(params))) > 1) == streamed  # header and data apart, or whole
    for piece in (8 << 20, 12):  # also pieces that split tensors
        monkeypatch.setattr(wire, "_STREAMED_PIECE", piece)
        assert b"".join(params_chunks(params)) == whole
        assert cid_of_chunks(params_chunks(params)) == CID.of(whole)


def test_the_store_keeps_streamed_bytes_under_their_cid(tmp_path) -> None:
    store = ObjectStore(tmp_path)
    params = layouts()["model"]
    cid = store.put_chunks(params_chunks(params))
    assert cid == CID.of(encode_params(params)) and store.get(cid) == encode_params(params)
    assert store.put_chunks(params_chunks(params)) == cid  # again: a no-op
    store.path_of(cid).write_bytes(b"corrupt")
    assert store.put_chunks(params_chunks(params)) == cid and store.get(cid) == encode_params(params)
    assert not [p for p in store.objects.rglob("*") if p.is_file() and p.name.startswith(".")]  # no temporaries
