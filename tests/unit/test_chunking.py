"""Bulk transfers: a tensor larger than gRPC's 4 MiB limit travels in chunks of at most 1 MiB."""

import math

import pytest
import torch

from proto import CHUNK_BYTES, MAX_MESSAGE_BYTES, pb
from trainer.codec.wire import WireError, chunked, decode_params, encode_params, reassemble, sha256_hex


def test_tensor_over_4mib_round_trips_in_1mib_chunks() -> None:
    big = torch.randn(1200, 1000)  # 4.8 MB of float32
    payload = encode_params({"big": big, "small": torch.ones(3)})
    assert len(payload) > MAX_MESSAGE_BYTES
    pieces = list(chunked(payload))
    assert len(pieces) == math.ceil(len(payload) / CHUNK_BYTES)
    assert all(len(p) <= CHUNK_BYTES for p in pieces)
    # every message on the wire stays below grpc's default receive limit
    assert max(pb.UpdateChunk(data=p).ByteSize() for p in pieces) < MAX_MESSAGE_BYTES
    joined = reassemble(iter(pieces), len(payload), sha256_hex(payload), what="test")
    decoded = decode_params(joined)
    assert torch.equal(decoded["big"], big)


def test_reassemble_refuses_a_wrong_digest() -> None:
    payload = b"x" * 3000
    pieces = list(chunked(payload, 1000))
    pieces[1] = b"y" * 1000
    with pytest.raises(WireError, match="digest mismatch"):
        reassemble(iter(pieces), len(payload), sha256_hex(payload), what="update")


@pytest.mark.parametrize("size", [2999, 3001])
def test_reassemble_refuses_a_wrong_length(size: int) -> None:
    payload = b"x" * 3000
    with pytest.raises(WireError, match="declared"):
        reassemble(chunked(payload, 1000), size, sha256_hex(payload), what="update")


def test_reassemble_refuses_an_oversize_chunk() -> None:
    payload = b"x" * (CHUNK_BYTES + 1)
    with pytest.raises(WireError, match="exceeds"):
        reassemble(iter([payload]), len(payload), sha256_hex(payload), what="update")


def test_decode_refuses_garbage() -> None:
    with pytest.raises(WireError, match="safetensors"):
        decode_params(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")


def test_encoding_is_byte_identical_across_processes() -> None:
    # A checkpoint's CID must not depend on which process wrote it (hash-map order, say).
    import subprocess
    import sys

    script = (
        "import torch; from trainer.codec.wire import encode_params, sha256_hex;"
        "g = torch.Generator().manual_seed(7);"
        "print(sha256_hex(encode_params({n: torch.randn(4, 5, generator=g) for n in 'zyxabc'})))"
    )
    digests = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              check=True).stdout.strip() for _ in range(3)}
    assert len(digests) == 1, digests
