"""Bytes on the wire: tensor payloads, their layouts and digests, and 1 MiB chunking.

A payload is a safetensors file: self-describing, parsed without executing anything (never
pickle), and byte-deterministic for the same tensors, so its sha256 is at once the digest in the
transfer header and the content identifier of the stored object.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from proto import CHUNK_BYTES
from storage_client import CID, Codec, DilocoxError, JSONBoundsError, loads_bounded

Params = dict[str, torch.Tensor]
# name -> (dtype, shape): what a payload must contain, checked before its bytes are trusted.
Layout = dict[str, tuple[str, tuple[int, ...]]]


class WireError(DilocoxError, ValueError):
    """Bytes that do not decode into what their header promised."""


MAX_HEADER_JSON = 4 << 20  # a codec header: one entry per tensor, within one gRPC message


def json_object(text: str | bytes, what: str) -> dict:
    """A header field that must hold a JSON object (``what`` names it in the error); its size and
    nesting are bounded before it is parsed (storage_client.loads_bounded)."""
    try:
        obj = loads_bounded(text, max_bytes=MAX_HEADER_JSON, what=what)
    except JSONBoundsError as exc:
        raise WireError(str(exc)) from exc
    if not isinstance(obj, dict):
        raise WireError(f"{what} must be a JSON object")
    return obj


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(params: Params) -> Layout:
    return {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in params.items()}


def encode_params(params: Params) -> bytes:
    """Safetensors bytes, identical in every process for the same tensors.

    No ``__metadata__``: safetensors writes a metadata map in hash-map order, which differs from
    process to process, and a checkpoint's hash must depend on its tensors alone (run and round
    live in the manifest instead).
    """
    return st_save({name: t.contiguous() for name, t in params.items()})


_STREAMED_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,512}")  # JSON-escaped the same by every serialiser
_STREAMED_PIECE = 8 << 20  # bytes of one tensor's data handed out at a time


def streamable(layout: Layout) -> bool:
    """Whether params of ``layout`` are written a tensor at a time (``params_chunks``,
    ``ParamsPayload``): float32 tensors with plain names (every checkpoint and outer state), on a
    little-endian machine (safetensors data is little-endian)."""
    return bool(layout) and sys.byteorder == "little" and all(
        dtype == "float32" and _STREAMED_NAME.fullmatch(name) for name, (dtype, _) in layout.items())


def _header(layout: Layout) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """safetensors' header of a ``streamable`` layout, its 8-byte length first, and where each
    tensor's data lies in the file: the JSON object of each tensor's dtype, shape and data offsets
    in name order, padded with spaces to a multiple of 8 bytes."""
    entries, slots, offset = [], {}, 0
    for name in sorted(layout):
        shape = layout[name][1]
        size = 4 * math.prod(shape)
        entries.append(f'"{name}":{{"dtype":"F32","shape":[{",".join(map(str, shape))}],'
                       f'"data_offsets":[{offset},{offset + size}]}}')
        slots[name] = (offset, size)
        offset += size
    header = ("{" + ",".join(entries) + "}").encode()
    header += b" " * (-len(header) % 8)
    start = 8 + len(header)
    return len(header).to_bytes(8, "little") + header, {n: (start + o, size) for n, (o, size) in slots.items()}


def _file_size(header: bytes, slots: dict[str, tuple[int, int]]) -> int:
    """Bytes of the file ``_header``'s header and data slots make."""
    return len(header) + sum(size for _, size in slots.values())


def _data(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def streamed_layout(head: bytes, size: int, max_header: int) -> tuple[Layout, dict[str, tuple[int, int]]]:
    """The layout and data slots of a file of ``size`` bytes whose first bytes are ``head`` (at least
    its 8-byte header length and the header), refusing (WireError, never quoting the input) any file
    that is not exactly what ``params_chunks`` writes for its layout: float32 tensors with plain
    names, the canonical header (``_header``), and data filling the rest of the file. The inverse
    of ``_header`` for a reader that takes the tensors one at a time from a file (an inner state
    three times the model) instead of the whole bytes; a header over ``max_header`` is refused
    unparsed."""
    if len(head) < 8:
        raise WireError("not a safetensors file: shorter than its 8-byte header length")
    n = int.from_bytes(head[:8], "little")
    if n > max_header or 8 + n > min(size, len(head)):
        raise WireError(f"safetensors header of {n} bytes: more than the {max_header} allowed or the file holds")
    try:
        obj = loads_bounded(head[8:8 + n], max_bytes=max_header, what="safetensors header")
    except JSONBoundsError as exc:
        raise WireError(str(exc)) from None
    if not isinstance(obj, dict) or not obj:
        raise WireError("safetensors header is not an object of tensors")
    layout: Layout = {}
    for name, entry in obj.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if (not isinstance(shape, list) or len(shape) > 8
                or not all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
            raise WireError("safetensors header: an entry without a plain shape")
        layout[name] = ("float32", tuple(shape))
    if not streamable(layout):
        raise WireError("safetensors file: not float32 tensors with plain names")
    canonical, slots = _header(layout)
    if bytes(head[:8 + n]) != canonical:
        raise WireError("safetensors header is not the canonical one of its tensors (dtypes, order, offsets, padding)")
    if size != _file_size(canonical, slots):
        raise WireError(f"safetensors file of {size} bytes: its header describes {_file_size(canonical, slots)}")
    return layout, slots


def serialized_size(params: Params) -> int:
    """``len(encode_params(params))`` without making the bytes (for a ``streamable`` layout)."""
    layout = layout_of(params)
    if not streamable(layout):
        return len(encode_params(params))
    return _file_size(*_header(layout))


def params_chunks(params: Params) -> Iterator[bytes]:
    """``encode_params(params)`` as consecutive byte strings, made one tensor (and at most 8 MiB of it)
    at a time, so that a checkpoint is hashed and written without its whole serialisation in memory
    (trainer.coordinator.publish): safetensors' header (``_header``), then the tensors' data in name
    order. A layout that is not ``streamable`` goes through ``encode_params`` whole
    (tests/unit/test_wire_stream.py pins the bytes)."""
    if not streamable(layout_of(params)):
        yield encode_params(params)
        return
    yield _header(layout_of(params))[0]
    for name in sorted(params):
        data = _data(params[name])
        for start in range(0, data.numel(), _STREAMED_PIECE):
            yield data[start:start + _STREAMED_PIECE].numpy().tobytes()


class ParamsPayload:
    """``encode_params`` of a ``streamable`` layout's params, filled a tensor at a time into one
    buffer; each tensor is then read back as a view of its bytes there, so a holder of both the
    params and their serialisation (the coordinator, which serves θ's bytes and computes with θ)
    holds them once. The views share the buffer: nobody may write into them (``bind_params``'s
    rule already)."""

    def __init__(self, layout: Layout) -> None:
        if not streamable(layout):
            raise ValueError("only float32 params with plain names are laid out tensor by tensor")
        self.layout = layout
        header, self.slots = _header(layout)
        self.header_len = len(header)
        self.buffer = bytearray(_file_size(header, self.slots))
        self.buffer[:len(header)] = header
        self.filled: set[str] = set()

    @classmethod
    def of(cls, payload: bytes, layout: Layout) -> tuple[bytearray, Params]:
        """An existing serialisation of ``layout`` (``encode_params``' bytes), copied once into a
        buffer, and the params as views of it."""
        holder = cls(layout)
        if len(payload) != len(holder.buffer) or payload[:holder.header_len] != holder.buffer[:holder.header_len]:
            raise WireError("the payload is not the safetensors serialisation of the layout")
        holder.buffer[:] = payload
        return holder.buffer, {name: holder.view(name) for name in sorted(layout)}

    def view(self, name: str) -> torch.Tensor:
        start, size = self.slots[name]
        shape = self.layout[name][1]
        if not size:
            return torch.zeros(shape)
        return torch.frombuffer(self.buffer, dtype=torch.float32, count=size // 4, offset=start).view(shape)

    def put(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """Write ``t`` into its slot; returns the view that stands for it."""
        if (dtype_name(t.dtype), tuple(t.shape)) != self.layout[name]:
            raise ValueError(f"tensor {name}: {dtype_name(t.dtype)}{list(t.shape)} is not its slot's")
        view = self.view(name)
        view.copy_(t)
        self.filled.add(name)
        return view

    def payload(self) -> bytearray:
        """The serialisation, once every tensor was put."""
        missing = sorted(set(self.layout) - self.filled)
        if missing:
            raise ValueError(f"tensors never put: {missing[:3]}")
        return self.buffer


def cid_of_chunks(chunks: Iterable[bytes]) -> CID:
    """The RAW CID of the bytes ``chunks`` join to, without joining them."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
    return CID(Codec.RAW, digest.digest())


def decode_params(data: bytes | bytearray) -> Params:
    try:
        return st_load(data if isinstance(data, bytes) else bytes(data))  # safetensors reads bytes only
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise WireError(f"payload is not a valid safetensors file: {exc}") from exc


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chunked(data: bytes, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Consecutive slices of at most ``size`` bytes (none for empty data)."""
    if size <= 0:
        raise ValueError("chunk size must be positive")
    view = memoryview(data)
    for offset in range(0, len(data), size):
        yield bytes(view[offset : offset + size])


class Reassembly:
    """A payload joined one chunk at a time, refusing oversize chunks, a wrong total length and a
    wrong digest; the digest is taken as the chunks arrive, and the first byte past the declared
    ``size`` is refused. Where the bytes go is ``_keep``'s business (here a buffer in memory;
    trainer.runstore.spool writes them to a file)."""

    def __init__(self, size: int, sha256: str, *, what: str) -> None:
        self.size, self.sha256, self.what = size, sha256, what
        self.received = 0
        self.buffer = bytearray()
        self.digest = hashlib.sha256()

    def add(self, chunk: bytes) -> None:
        if len(chunk) > CHUNK_BYTES:
            raise WireError(f"{self.what}: chunk of {len(chunk)} bytes exceeds {CHUNK_BYTES}")
        if self.received + len(chunk) > self.size:
            raise WireError(f"{self.what}: more than the declared {self.size} bytes arrived")
        self._keep(chunk)
        self.digest.update(chunk)
        self.received += len(chunk)

    def _keep(self, chunk: bytes) -> None:
        self.buffer += chunk

    def check_whole(self) -> None:
        """Every declared byte arrived, and they hash to the declared digest (WireError otherwise)."""
        if self.received != self.size:
            raise WireError(f"{self.what}: {self.received} bytes arrived, header declared {self.size}")
        actual = self.digest.hexdigest()
        if actual != self.sha256:
            raise WireError(f"{self.what}: digest mismatch: header says sha256 {self.sha256}, bytes hash to {actual}")

    def payload(self) -> bytes:
        self.check_whole()
        return bytes(self.buffer)


def reassemble(chunks: Iterable[bytes], size: int, sha256: str, *, what: str) -> bytes:
    """The payload of ``chunks`` (``Reassembly``'s checks), read no further than the first refusal."""
    joined = Reassembly(size, sha256, what=what)
    for chunk in chunks:
        joined.add(chunk)
    return joined.payload()
