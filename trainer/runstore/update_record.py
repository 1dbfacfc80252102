"""A worker's update as the store keeps it: the bytes that crossed the wire, named by one record.

A worker of P pipeline stages pushes P slices (trainer.codec.uplink), each a payload (dense safetensors,
or low-rank + int4 with a codec header). The store keeps each payload's exact bytes (RAW) and each
codec header's exact bytes as sent (RAW), and one update record (JSON, canonical), whose CID is the
manifest participant's ``update`` and whose digest the worker's signed report restates:

    {"schema": "dilocox.update/v1",
     "slices": [{"stage": s, "num_stages": P, "encoding": "dense_f32" | "lowrank_int4",
                 "payload": <RAW CID of the payload bytes>,
                 "header": <RAW CID of the codec header bytes, or null when dense>}, ...]}

with the slices in stage order. Each pushed slice is signed by its worker's admitted key over
attestation.signing.update_digest(run, round, stage, P, sha256(payload)) (the sha256 is the payload's
RAW CID digest), and the record keeps that signature with the slice (schema v2):

    {"schema": "dilocox.update/v2",
     "slices": [{..., "signature": <130 hex digits: the 65-byte r‖s‖v push signature, or null>}, ...]}

so that the audit can check, for every participant of every round, reported or not, that an
admitted key of the run signed the update that was averaged (audit.push_signatures). A record
without any signature (a run without a trust layer, or one stored before signatures were kept) is
written as v1, byte for byte as before; both are read. What identifies an update's *bytes* is its
record without signatures (``identity_cid``): a byte-identical payload replayed by anyone, in any
round, has the same identity whatever signs it (the coordinator's replay refusal).

A whole update's record has all P slices; an accepted stage slice
waiting for its siblings (the coordinator's journal) has a record of its one slice. Worker and
coordinator build the record from the same bytes, so they agree on its digest without either
decoding anything; a byte-identical re-push gives the same record (replay detection).

``open_update`` is the one way back from a record to the update: each slice's payload is checked
against its stage's layout and decoded exactly as on arrival (trainer.rounds.aggregation.checked_update's
decoding: ``CompressedPayload`` kept compact, or the dense tensors), so Δ̂ᵢ re-derives bit for bit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Sequence

from proto import Encoding
from storage_client import CID, Codec, Store, canonical_json, loads_bounded
from storage_client.cid import InvalidCIDError
from trainer.codec import CompressedPayload, CompressionError
from trainer.codec.uplink import Slice
from trainer.codec.wire import MAX_HEADER_JSON, Layout, WireError, json_object
from trainer.config import ModelConfig
from trainer.model import stages
from trainer.rounds.aggregation import InvalidUpdate, decode_update
from trainer.rounds.update_source import DenseUpdate, MergedUpdate, UpdateSource

SCHEMA_V1 = "dilocox.update/v1"  # no signatures
SCHEMA = "dilocox.update/v2"  # each slice keeps its push signature
SIGNATURE_BYTES = 65
ENCODINGS = {Encoding.DENSE_F32: "dense_f32", Encoding.LOWRANK_INT4: "lowrank_int4"}
_BY_NAME = {name: enc for enc, name in ENCODINGS.items()}
MAX_RECORD_BYTES = 1 << 20  # a record names at most n_layer slices of ~250 bytes each
PAYLOAD_SLACK = 1 << 20  # beyond a dense float32 slice's tensor bytes: safetensors' JSON header


class RecordError(ValueError):
    """A stored update record, or a payload it names, that does not fit the run (named, not echoed)."""


@dataclass(frozen=True)
class SliceRef:
    """One slice of a record: where its stored bytes are."""

    stage: int
    num_stages: int
    encoding: Encoding  # DENSE_F32 or LOWRANK_INT4
    payload: str  # RAW CID of the payload bytes as pushed
    header: str | None  # RAW CID of the codec header bytes as pushed; None when dense
    signature: str | None = None  # hex of the worker's 65-byte push signature; None where none was sent

    @property
    def payload_sha256(self) -> str:
        """The hex sha256 of the payload bytes: what the push header declared and its signature covers."""
        return CID.parse(self.payload).hex

    def to_json(self, signed: bool) -> dict[str, Any]:
        out = {"stage": self.stage, "num_stages": self.num_stages, "encoding": ENCODINGS[self.encoding],
               "payload": self.payload, "header": self.header}
        return {**out, "signature": self.signature} if signed else out


def slice_ref(stage: int, num_stages: int, encoding: int, payload: bytes, header: bytes | None,
              signature: bytes = b"") -> SliceRef:
    """The reference to a slice whose payload (and codec header, when compressed) are these bytes,
    pushed with ``signature`` (empty: none; otherwise it must be 65 bytes)."""
    enc = Encoding(encoding)
    if enc not in ENCODINGS:
        raise RecordError(f"encoding {enc.name} is not a push encoding")
    if signature and len(signature) != SIGNATURE_BYTES:
        raise RecordError(f"a push signature must be {SIGNATURE_BYTES} bytes r||s||v, got {len(signature)}")
    return SliceRef(stage, num_stages, enc, str(CID.of(payload)),
                    str(CID.of(header)) if enc == Encoding.LOWRANK_INT4 else None,
                    signature.hex() if signature else None)


def record_bytes(refs: Sequence[SliceRef]) -> bytes:
    """The record's canonical JSON, slices in stage order (one byte form whatever the push order):
    v2 with each slice's signature when any slice has one, else v1."""
    ordered = sorted(refs, key=lambda r: r.stage)
    signed = any(r.signature is not None for r in ordered)
    return canonical_json({"schema": SCHEMA if signed else SCHEMA_V1,
                           "slices": [r.to_json(signed) for r in ordered]})


def record_cid(refs: Sequence[SliceRef]) -> CID:
    return CID.of(record_bytes(refs), Codec.JSON)


def identity_cid(refs: Sequence[SliceRef]) -> str:
    """What names the pushed bytes whoever signed them: the record's CID without its signatures
    (the v1 record of the same slices)."""
    return str(record_cid([dataclasses.replace(r, signature=None) for r in refs]))


def stored_identity(store: Store, cid: str) -> str:
    """``identity_cid`` of the stored record ``cid``; ``cid`` itself when the record cannot be read
    (a v1 record is its own identity, and an unreadable one is refused wherever it is opened)."""
    try:
        return identity_cid(parse_record(store.get(cid)))
    except (OSError, ValueError):  # StoreError and RecordError are ValueErrors
        return cid


def record_of_slices(slices: Sequence[Slice], signatures: Sequence[bytes] = ()) -> bytes:
    """A worker's record of the slices it pushed, each with the signature it was pushed with (in
    the order of ``slices``; none when the worker has no key): the bytes the coordinator stores."""
    signed = list(signatures) or [b""] * len(slices)
    return record_bytes([slice_ref(s.stage, s.num_stages, s.encoding, s.payload, s.codec_header_bytes, signature)
                         for s, signature in zip(slices, signed, strict=True)])


def store_slice(store: Store, ref: SliceRef, payload: bytes, header: bytes | None) -> None:
    """Keep a slice's pushed bytes (the payload, and its codec header when compressed)."""
    store.put(payload)
    if ref.header is not None and header is not None:
        store.put(header)


def parse_record(data: bytes) -> list[SliceRef]:
    """A stored record's slices, every field checked (RecordError names the one that is wrong)."""
    try:
        obj = loads_bounded(data, max_bytes=MAX_RECORD_BYTES, what="update record")
    except ValueError as exc:
        raise RecordError(str(exc)) from None
    if not isinstance(obj, dict) or set(obj) != {"schema", "slices"} or obj["schema"] not in (SCHEMA, SCHEMA_V1):
        raise RecordError(f"an update record must be {{schema: {SCHEMA!r} or {SCHEMA_V1!r}, slices}}")
    slices = obj["slices"]
    if not isinstance(slices, list) or not slices:
        raise RecordError("an update record's slices must be a non-empty list")
    refs = [_parse_slice(i, raw, obj["schema"] == SCHEMA) for i, raw in enumerate(slices)]
    stages = [r.stage for r in refs]
    if stages != sorted(set(stages)) or len({r.num_stages for r in refs}) != 1:
        raise RecordError("an update record's slices must be distinct stages, in order, of one stage count")
    return refs


def _parse_slice(i: int, raw: Any, signed: bool) -> SliceRef:
    keys = {"stage", "num_stages", "encoding", "payload", "header"} | ({"signature"} if signed else set())
    if not isinstance(raw, dict) or set(raw) != keys:
        raise RecordError(f"update record slice {i} must have exactly {sorted(keys)}")
    stage, num_stages, encoding = raw["stage"], raw["num_stages"], raw["encoding"]
    if type(num_stages) is not int or type(stage) is not int or not 0 <= stage < num_stages:
        raise RecordError(f"update record slice {i}: stage and num_stages must be integers, 0 <= stage < num_stages")
    if encoding not in _BY_NAME:
        raise RecordError(f"update record slice {i}: encoding must be one of {sorted(_BY_NAME)}")
    enc = _BY_NAME[encoding]
    payload, header = _raw_cid(i, "payload", raw["payload"]), raw["header"]
    if enc == Encoding.LOWRANK_INT4:
        header = _raw_cid(i, "header", header)
    elif header is not None:
        raise RecordError(f"update record slice {i}: a dense slice has no codec header")
    signature = raw.get("signature")
    if signature is not None and not (isinstance(signature, str) and len(signature) == 2 * SIGNATURE_BYTES
                                      and _is_lower_hex(signature)):
        raise RecordError(f"update record slice {i}: signature must be null or {2 * SIGNATURE_BYTES} lowercase "
                          f"hex digits")
    return SliceRef(stage, num_stages, enc, payload, header, signature)


def _is_lower_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)


def _raw_cid(i: int, field: str, value: Any) -> str:
    try:
        cid = CID.parse(value) if isinstance(value, str) and len(value) < 128 else None
    except InvalidCIDError:
        cid = None
    if cid is None or cid.codec != Codec.RAW:
        raise RecordError(f"update record slice {i}: {field} must be a RAW CID")
    return str(cid)


def stage_layout(layout: Layout, model: ModelConfig, stage: int, num_stages: int) -> Layout:
    """The tensors of stage ``stage`` of ``num_stages`` (trainer.model.stages' split of the model)."""
    if not 1 <= num_stages <= model.n_layer or not 0 <= stage < num_stages:
        raise RecordError(f"stage {stage} of {num_stages}: this run's model of {model.n_layer} layer(s) splits "
                          f"into 1 to {model.n_layer} pipeline stages")
    return stages.stage_layout(layout, model, stage, num_stages)


def open_slice(payload: bytes, encoding: Encoding, header: bytes | None, layout: Layout) -> UpdateSource:
    """One slice's bytes decoded as on arrival against its stage's ``layout`` (sizes bounded first)."""
    limit = sum(4 * math.prod(shape) for _, shape in layout.values()) + PAYLOAD_SLACK
    if len(payload) > limit:
        raise RecordError(f"payload of {len(payload)} bytes exceeds the {limit} a dense slice can need")
    try:
        if encoding == Encoding.LOWRANK_INT4:
            if header is None or len(header) > MAX_HEADER_JSON:
                raise RecordError("a compressed slice needs its codec header (within the header size limit)")
            return CompressedPayload.parse(payload, json_object(header, "codec header"), layout)
        return DenseUpdate(decode_update(payload, layout))
    except (CompressionError, InvalidUpdate, WireError) as exc:
        raise RecordError(str(exc)) from None


def open_update(store: Store, cid: CID | str, layout: Layout, model: ModelConfig,
                whole: bool = True) -> UpdateSource:
    """The update (or, with ``whole=False``, the stage slice) a stored record names, as an
    UpdateSource decoded exactly as on arrival; ``layout`` is the model's. Raises RecordError naming
    what does not fit (a missing or corrupt object is a StoreError)."""
    record = CID.parse(str(cid))
    if record.codec != Codec.JSON:
        raise RecordError(f"update {record} is not a JSON record (codec {record.codec.name})")
    refs = parse_record(store.get(record))
    if whole and [r.stage for r in refs] != list(range(refs[0].num_stages)):
        raise RecordError(f"update record {record} does not hold all {refs[0].num_stages} stage slices")
    if not whole and len(refs) != 1:
        raise RecordError(f"stage record {record} must hold one slice")
    sources = []
    for ref in refs:
        payload = store.get(ref.payload)
        header = store.get(ref.header) if ref.header is not None else None
        sources.append(open_slice(payload, ref.encoding, header,
                                  stage_layout(layout, model, ref.stage, ref.num_stages)))
        del payload
    return sources[0] if len(sources) == 1 else MergedUpdate(sources)
