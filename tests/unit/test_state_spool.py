"""A push's inner state on the coordinator (issue 30): spooled to the run's scratch folder as it
arrives (trainer.runstore.spool), refused as ``Reassembly`` refuses, and checked a tensor at a time
from the file (trainer.runtime.state_commit.check_state_file) with the verdicts of the whole-bytes
check, only the canonical safetensors form of its tensors being accepted."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from proto import CHUNK_BYTES
from trainer.codec.wire import WireError, chunked, encode_params, layout_of
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runstore.spool import Spool, empty_scratch
from trainer.runtime.inner import inner_state_bytes
from trainer.runtime.state_commit import StateError, check_state_file, decode_inner_state

from tests.unit.test_state_commit import MODEL, trained_state


def spooled(folder: Path, data: bytes) -> Spool:
    spool = Spool(folder, len(data), hashlib.sha256(data).hexdigest(), what="inner state")
    for piece in chunked(data):
        spool.add(piece)
    spool.finish()
    return spool


def verdict(folder: Path, data: bytes) -> str:
    """'ok' or the StateError message of the file check; the whole-bytes check must agree on 'ok'."""
    spool = spooled(folder, data)
    layout = layout_of(params_of(build_model(MODEL, 3)))
    try:
        assert spool.path is not None
        check_state_file(spool.path, spool.size, layout, compressed=True)
        decode_inner_state(data, layout, compressed=True)  # what the bytes check says of the same
        return "ok"
    except StateError as exc:
        return str(exc)
    finally:
        spool.discard()


def test_an_honest_state_passes_and_its_bytes_come_back_whole(tmp_path: Path) -> None:
    adamw, errors = trained_state()
    data = bytes(inner_state_bytes(adamw, errors))
    spool = spooled(tmp_path / "scratch", data)
    assert spool.path is not None and spool.path.parent == tmp_path / "scratch"
    assert b"".join(spool.chunks()) == data
    spool.discard()
    assert not list((tmp_path / "scratch").iterdir())
    assert verdict(tmp_path, data) == "ok"


def _with_header(header: dict, data: bytes) -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def test_what_is_not_a_state_is_refused_by_name(tmp_path: Path) -> None:
    adamw, errors = trained_state()
    data = bytes(inner_state_bytes(adamw, errors))
    name = next(iter(sorted({**adamw, **errors})))
    nan = {**adamw, **errors}
    nan[name] = torch.full_like(nan[name], float("nan"))
    assert "is not finite" in verdict(tmp_path, encode_params(nan))
    assert "no worker's state holds" in verdict(tmp_path, encode_params({**adamw, **errors, "extra.x": torch.zeros(1)}))
    assert "describes" in verdict(tmp_path, data + b"\0")  # a byte the header does not account for
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    first = sorted(header)[0]
    half = {**header, first: {**header[first], "dtype": "F16"}}
    assert "canonical" in verdict(tmp_path, _with_header(half, data[8 + n:]))
    metadata = {"__metadata__": {"format": "pt"}, **header}
    assert "inner state: safetensors" in verdict(tmp_path, _with_header(metadata, data[8 + n:]))
    assert "more than the" in verdict(tmp_path, (1 << 40).to_bytes(8, "little") + data[8:])
    assert "not an object" in verdict(tmp_path, _with_header({}, b""))


def test_a_spool_refuses_what_reassembly_refuses_and_makes_no_file_for_nothing(tmp_path: Path) -> None:
    data = b"state bytes"
    with pytest.raises(WireError, match="exceeds"):
        Spool(tmp_path, 10 * CHUNK_BYTES, "0" * 64, what="s").add(b"x" * (CHUNK_BYTES + 1))
    spool = Spool(tmp_path, len(data), hashlib.sha256(data).hexdigest(), what="s")
    with pytest.raises(WireError, match="more than the declared"):
        spool.add(data + b"!")
    spool.add(data[:-1])
    with pytest.raises(WireError, match="arrived, header declared"):
        spool.finish()
    spool.discard()
    wrong = Spool(tmp_path, len(data), "0" * 64, what="s")
    wrong.add(data)
    with pytest.raises(WireError, match="digest mismatch"):
        wrong.finish()
    wrong.discard()
    Spool(tmp_path / "never", 0, "0" * 64, what="s").discard()
    assert not (tmp_path / "never").exists() and not list(tmp_path.iterdir())
    (tmp_path / "left").mkdir()
    (tmp_path / "left" / "spool-x").write_bytes(b"a crash's leftover")
    empty_scratch(tmp_path / "left")
    assert not (tmp_path / "left").exists()


def test_a_discard_while_a_thread_reads_waits_for_it_and_a_later_reader_is_refused(tmp_path: Path) -> None:
    """A push cancelled while its state is checked or stored in a worker thread: the call's
    ``discard`` leaves the file to that reader and removes it once the reader is done; a reader
    that starts after the discard is refused instead of storing nothing under the commitment."""
    data = b"x" * 100
    spool = spooled(tmp_path, data)
    with spool.in_use() as path:
        spool.discard()
        assert path is not None and path.exists()
        assert b"".join(spool.chunks()) == data
    assert not list(tmp_path.iterdir())
    with pytest.raises(OSError, match="discarded"):
        with spool.in_use():
            pass
