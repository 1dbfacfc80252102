"""Every codec kind encodes fixed-seed updates to exactly the bytes recorded before the codec was
split into trainer/codec/ (main 7db5bee): payload sha256, header, decoded tensors, error buffers and
the size functions (tests/unit/codec_golden_cases.py makes them; tests/unit/data/codec_golden.json
holds them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.codec_golden_cases import CONFIGS, record
from trainer.codec import CODECS

GOLDEN = json.loads((Path(__file__).parent / "data" / "codec_golden.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def now() -> dict:
    return record()


def test_every_kind_is_covered() -> None:
    kinds = {t["kind"] for label in GOLDEN for r in GOLDEN[label]["rounds"] for t in r["header"]["tensors"]}
    assert kinds == {str(kind) for kind in CODECS}


@pytest.mark.parametrize("label", sorted(CONFIGS))
def test_encodings_are_byte_for_byte_those_recorded(now: dict, label: str) -> None:
    for i, (got, want) in enumerate(zip(now[label]["rounds"], GOLDEN[label]["rounds"], strict=True)):
        assert got["header"] == want["header"], f"{label} round {i}: header"
        assert got["payload_sha256"] == want["payload_sha256"], f"{label} round {i}: payload"
        assert got["decoded_sha256"] == want["decoded_sha256"], f"{label} round {i}: decoded tensors"
        assert got["errors_sha256"] == want["errors_sha256"], f"{label} round {i}: error buffers"
        assert got["compressed_size"] == want["compressed_size"]
    for size in ("predicted_size", "predicted_size_rank3", "density_matching_bytes"):
        assert now[label][size] == GOLDEN[label][size], f"{label}: {size}"
