"""The framing every codec kind shares: one header and one payload per update, checked whole before
any tensor is rebuilt, one tensor at a time.

Wire format
-----------
An update travels as a safetensors payload (``trainer.codec.wire.encode_params``: byte-deterministic)
and a JSON-able header. For each tensor ``name`` and each part of its kind (trainer.codec.registry:
``P`` and ``Q`` for ``lowrank-int4``, ``W`` for ``int4`` and ``int8``, ``I`` and ``V`` for
``topk-int4``) the payload holds ``<name>.<part>.q`` (uint8 packed nibbles for int4, int8 for
int8) and, for a part with scales, ``<name>.<part>.scale`` (float32). The header is

    {"format": "dilocox-lowrank-int4/1",
     "tensors": [{"name", "shape", "dtype", "kind", "rank", "group_size",
                  "parts": {part: {"shape", "packed_len", "num_scales"}}, …kind's own fields}, …]}

sorted by name, with each kind's part shapes, packed lengths and scale counts given by its
``parts`` (trainer.codec.base).

``decompress`` parses the header into a :class:`CodecHeader` (``CodecHeader.parse``) and checks the
payload against it (``validate``) before it reconstructs any tensor, and raises ``CompressionError``
naming the tensor and the field at the first failure:
  1. header: the format tag; names exactly those of the expected layout (none unknown, missing
     or repeated); dtype and shape equal to the expected dense tensor's; a known kind, allowed
     for that shape (int8 for ndim ≤ 1, a matrix kind otherwise); group_size ≥ 1; an integer rank
     and the kind's own fields as the kind allows them; parts exactly the kind's;
  2. payload: a safetensors file with exactly the entries the header implies, each 1-D of the
     implied dtype (uint8 / int8 / float32) and length; every scale finite and ≥ 0; then the
     kind's own checks (the padding nibble of an odd int4 count zero; top-k positions canonical).

Determinism: decompression is a deterministic function of the payload bytes on any machine: each
kind's ``decode`` uses only elementwise IEEE-754 float64 operations, followed by one rounding to
the dense dtype, so every replica decompressing the same bytes gets bit-identical tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import torch

from trainer.codec.base import TensorEntry, fail, is_int
from trainer.codec.kinds import CompressionError
from trainer.codec.policy import AdaptiveRankPolicy
from trainer.codec.settings import CompressionConfig
from trainer.codec.quant import SCALE_BYTES
from trainer.codec.registry import CODEC_TOPK, CODECS, codec_of, matrix_codec, vector_codec
from trainer.codec.wire import Layout, Params, WireError, decode_params, dtype_name, encode_params

FORMAT = "dilocox-lowrank-int4/1"

_FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}


def _int_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(is_int(k) and k >= 0 for k in x)


def _parse_entry(obj: Any, expected: Layout) -> TensorEntry:
    """An entry read off the wire, checked field by field against the expected dense layout
    (rule 1 of the module docstring); CompressionError names the tensor and field."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("name"), str):
        raise CompressionError("header: a tensor entry without a string name")
    name = obj["name"]
    if name not in expected:
        raise fail(name, "name", "unknown tensor (not in the expected layout)")
    want_dtype, want_shape = expected[name][0], tuple(expected[name][1])
    if want_dtype not in _FLOAT_DTYPES:
        raise fail(name, "dtype", f"expected layout says {want_dtype}, not a floating dtype")
    if obj.get("dtype") != want_dtype:
        raise fail(name, "dtype", f"{obj.get('dtype')!r}, expected {want_dtype}")
    if not _int_list(obj.get("shape")) or tuple(obj["shape"]) != want_shape:
        raise fail(name, "shape", f"{obj.get('shape')!r}, expected {list(want_shape)}")
    kind, group, rank = obj.get("kind"), obj.get("group_size"), obj.get("rank")
    if not isinstance(kind, str) or kind not in CODECS:
        raise fail(name, "kind", f"{kind!r} is not one of {[str(k) for k in CODECS]}")
    codec = codec_of(kind)
    if codec.for_vectors != (len(want_shape) <= 1):
        raise fail(name, "kind", f"{kind} is not used for a {len(want_shape)}-D tensor")
    if not is_int(group) or group < 1:
        raise fail(name, "group_size", f"{group!r} is not a positive integer")
    if not is_int(rank):
        raise fail(name, "rank", f"{rank!r} is not an integer")
    fields = codec.header_fields(name, obj)
    expected_parts = codec.parts(name, want_shape, rank, group, fields)
    return TensorEntry(name, want_shape, want_dtype, codec.kind, rank, group,
                       _parse_parts(name, obj.get("parts"), expected_parts), fields)


def _parse_parts(name: str, parts: Any, expected: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(parts, Mapping) or sorted(parts) != sorted(expected):
        got = sorted(parts) if isinstance(parts, Mapping) else parts
        raise fail(name, "parts", f"{got!r}, expected {sorted(expected)}")
    for part, want in expected.items():
        spec = parts[part]
        if not isinstance(spec, Mapping):
            raise fail(name, part, "not a mapping")
        if not _int_list(spec.get("shape")) or tuple(spec["shape"]) != want.shape:
            raise fail(name, f"{part}.shape", f"{spec.get('shape')!r}, expected {list(want.shape)}")
        for fieldname in ("packed_len", "num_scales"):
            value = spec.get(fieldname)
            if not is_int(value) or value != getattr(want, fieldname):
                raise fail(name, f"{part}.{fieldname}", f"{value!r}, expected {getattr(want, fieldname)}")
    return expected


@dataclass(frozen=True)
class CodecHeader:
    """A compressed payload's header: every tensor's entry, sorted by name (its JSON form is what
    travels and is stored; ``parse`` is the one way back)."""

    tensors: tuple[TensorEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "tensors": [entry.to_json() for entry in self.tensors]}

    @classmethod
    def parse(cls, obj: Any, expected: Layout) -> CodecHeader:
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            got = obj.get("format") if isinstance(obj, Mapping) else type(obj).__name__
            raise CompressionError(f"header: format {got!r}, expected {FORMAT}")
        entries = obj.get("tensors")
        if not isinstance(entries, list):
            raise CompressionError("header: field tensors is not a list")
        parsed: dict[str, TensorEntry] = {}
        for raw in entries:
            entry = _parse_entry(raw, expected)
            if entry.name in parsed:
                raise fail(entry.name, "name", "appears twice in the header")
            parsed[entry.name] = entry
        missing = sorted(set(expected) - set(parsed))
        if missing:
            raise fail(missing[0], "name", f"missing from the header (missing: {missing})")
        return cls(tuple(parsed.values()))

    def entry(self, name: str) -> TensorEntry:
        return next(e for e in self.tensors if e.name == name)

    def payload_keys(self) -> dict[str, tuple[str, str, torch.dtype, int]]:
        """Every payload entry the header implies: key → (tensor, field, dtype, length)."""
        keys: dict[str, tuple[str, str, torch.dtype, int]] = {}
        for entry in self.tensors:
            q_dtype = torch.int8 if codec_of(entry.kind).bits == 8 else torch.uint8
            for part, spec in entry.parts.items():
                keys[f"{entry.name}.{part}.q"] = (entry.name, f"{part}.q", q_dtype, spec.packed_len)
                if spec.num_scales:  # top-k positions have none
                    keys[f"{entry.name}.{part}.scale"] = (entry.name, f"{part}.scale", torch.float32, spec.num_scales)
        if len(keys) != entry_count(self.tensors):
            raise CompressionError("header: tensor names collide once suffixed with .<part>.q / .<part>.scale")
        return keys


def entry_count(entries: Sequence[TensorEntry]) -> int:
    """Payload entries the tensors imply: a .q per part, and a .scale per part that has scales."""
    return sum(1 + (spec.num_scales > 0) for e in entries for spec in e.parts.values())


def validate(payload: bytes, header: CodecHeader) -> Params:
    """Check a payload against its parsed header (rule 2 of the module docstring); returns the
    decoded payload tensors (still packed)."""
    expected_keys = header.payload_keys()
    try:
        tensors = decode_params(payload)
    except WireError as exc:
        raise CompressionError(f"payload: {exc}") from exc
    unexpected = sorted(set(tensors) - set(expected_keys))
    if unexpected:
        raise CompressionError(f"payload: unexpected entries {unexpected}")
    for key, (name, fieldname, dtype, length) in expected_keys.items():
        t = tensors.get(key)
        if t is None:
            raise fail(name, fieldname, f"payload has no entry {key}")
        if t.dtype != dtype or tuple(t.shape) != (length,):
            raise fail(name, fieldname, f"payload holds {dtype_name(t.dtype)}{list(t.shape)}, "
                                        f"header implies {dtype_name(dtype)}[{length}]")
        if fieldname.endswith(".scale"):
            if not bool(torch.isfinite(t).all()):
                raise fail(name, fieldname, f"{int((~torch.isfinite(t)).sum())} non-finite scale(s)")
            if bool((t < 0).any()):
                raise fail(name, fieldname, "negative scale(s)")
    for entry in header.tensors:
        codec_of(entry.kind).validate(entry, tensors)
    return tensors


def _reconstruct(entry: TensorEntry, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | None = None) -> torch.Tensor:
    """The dense tensor an entry stands for, on the CPU; elementwise float64 ops only (see
    Determinism), on ``device`` where the kind's decode is arithmetic (the same bits anywhere)."""
    return codec_of(entry.kind).decode(entry, tensors, device).reshape(entry.shape).to(dtype)


def decompress(payload: bytes, header: Mapping[str, Any], expected_layout: Layout,
               device: torch.device | None = None) -> Params:
    """The dense tensors of a compressed update, after its header and payload were checked whole;
    rebuilt on ``device`` (a worker's GPU), returned on the CPU, the same bits as on the CPU."""
    parsed = CompressedPayload.parse(payload, header, expected_layout, device)
    return {name: parsed.tensor(name) for name in parsed.names()}


class CompressedPayload:
    """A compressed update checked whole (header and payload, as ``decompress`` checks them) and
    kept compact: its packed tensors, about the payload's size. ``tensor`` rebuilds one dense tensor
    at a time, bit for bit what ``decompress`` gives, so a holder of many updates never needs more
    than one dense tensor of each (trainer.rounds.aggregation's update sources)."""

    def __init__(self, header: CodecHeader, tensors: Params, device: torch.device | None = None) -> None:
        self.header = header
        self._packed = tensors
        self._entries = {entry.name: entry for entry in header.tensors}
        self.device = device  # where ``tensor`` rebuilds (trainer.codec.base.TensorCodec.decode)

    @classmethod
    def parse(cls, payload: bytes, header: Mapping[str, Any], expected_layout: Layout,
              device: torch.device | None = None) -> CompressedPayload:
        parsed = CodecHeader.parse(header, expected_layout)
        return cls(parsed, validate(payload, parsed), device)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def layout(self) -> Layout:
        return {name: (e.dtype, tuple(e.shape)) for name, e in sorted(self._entries.items())}

    def tensor(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        return _reconstruct(entry, self._packed, getattr(torch, entry.dtype), self.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._packed.values())


class CompressionStream:
    """Encode one tensor at a time, for a caller that holds only one tensor's A at once (the
    coordinator's downlink: trainer.codec.downlink), the decomposition and quantisation on ``device``
    (the worker's GPU when it has one; the payload and Â on the CPU). ``add`` each tensor in sorted name order, then
    ``finish``; ``abort`` leaves the policy as it was. The payload and header are byte for byte those
    ``compress`` (trainer.codec.feedback) gives for the same tensors, and each ``add`` returns the Â
    every replica rebuilds from them (the same ``_reconstruct`` on the same quantised tensors)."""

    def __init__(self, policy: AdaptiveRankPolicy, device: torch.device | None = None) -> None:
        self.policy = policy
        self.device = device or torch.device("cpu")  # where A's decomposition and quantisation run
        self.entries: list[TensorEntry] = []
        self.out: Params = {}
        self._last: str | None = None
        policy.begin_round()

    def add(self, name: str, t: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """Encode A = ``a`` (float64, error feedback already added) of the dense tensor ``t``;
        returns Â in ``t``'s dtype."""
        if self._last is not None and name <= self._last:
            raise CompressionError(f"tensor {name}: added out of sorted name order (after {self._last})")
        if not t.is_floating_point():
            raise CompressionError(f"tensor {name}: dtype {dtype_name(t.dtype)} is not floating point")
        if not bool(torch.isfinite(a).all()):
            raise CompressionError(f"tensor {name}: values are not all finite")
        self._last = name
        # int8 for vectors; matrices with the configured codec (the low-rank one may send int4).
        codec = vector_codec() if t.dim() <= 1 else matrix_codec(self.policy.config.codec)
        # The encoding is the encoder's business (only Â must be reproducible), so it may run on
        # the worker's GPU; Â is rebuilt from the payload entries, as every receiver does (on the
        # same device: the same bits as a receiver's CPU gets).
        on_device = a.to(self.device) if codec.encodes_on_device else a
        entry = codec.encode(name, t, on_device, self.policy, self.out)
        self.entries.append(entry)
        return _reconstruct(entry, self.out, t.dtype, self.device)

    def finish(self) -> tuple[bytes, dict[str, Any]]:
        if len(self.out) != entry_count(self.entries):
            self.policy.abort_round()
            raise CompressionError("tensor names collide once suffixed with .<part>.q / .<part>.scale")
        self.policy.finish_round()
        return encode_params(self.out), CodecHeader(tuple(self.entries)).to_json()

    def abort(self) -> None:
        self.policy.abort_round()


def predicted_size(layout: Layout, config: CompressionConfig, rank: int | None = None) -> int:
    """Bytes of tensor data (as ``compressed_size`` counts them) a payload of ``layout`` takes under
    ``config``: matrices with ``config.codec`` (the low-rank one at ``rank``, default
    ``config.max_rank``), vectors int8."""
    total = 0
    for _, (_, shape) in sorted(layout.items()):
        codec = vector_codec() if len(shape) <= 1 else matrix_codec(config.codec)
        total += codec.size(tuple(shape), config, rank)
    return total


def density_matching_bytes(layout: Layout, target_bytes: int, config: CompressionConfig) -> float:
    """The largest top-k density (k / chunk) whose payload for ``layout`` is at most ``target_bytes``:
    the two codecs compared at equal bytes."""
    lo, hi = 1, config.topk_chunk
    while lo < hi:  # the largest k per chunk that fits
        mid = (lo + hi + 1) // 2
        size = predicted_size(layout, replace(config, codec=CODEC_TOPK, topk_density=mid / config.topk_chunk))
        lo, hi = (mid, hi) if size <= target_bytes else (lo, mid - 1)
    return lo / config.topk_chunk


def compressed_size(header: Mapping[str, Any]) -> int:
    """Bytes of tensor data the header implies: packed values plus float32 scales.

    The payload adds a safetensors JSON header (about 100 bytes per entry) on top of this.
    """
    return sum(
        spec["packed_len"] + SCALE_BYTES * spec["num_scales"]
        for entry in header["tensors"] for spec in entry["parts"].values()
    )
