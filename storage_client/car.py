"""CARv1 (Content Addressable aRchive, https://ipld.io/specs/transport/car/carv1/): blocks named by
their CIDs in one stream, the form IPFS tools move and import content in.

Layout (every length an unsigned LEB128 varint, storage_client.cid):

    varint(len(header)) | header | section*
    header  = DAG-CBOR {"roots": [CID], "version": 1}   (keys in DAG-CBOR order: shorter first)
    section = varint(len(cid) + len(block)) | cid bytes | block bytes

A CID in DAG-CBOR is tag 42 over a byte string of 0x00 (the identity multibase prefix) and the
binary CID. ``encode_car`` writes exactly this header (one byte form, so the same round gives the
same file everywhere). ``read_car`` reads any CARv1 whose header is a map of ``roots`` and
``version`` and whose blocks use our CIDs (CIDv1, sha2-256, raw or JSON), verifies every block
against its CID and refuses, naming what is wrong, a truncated stream, a header or block over its
bound, a duplicate or mismatched block: it is a reader of hostile files.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from .backend import StoreError
from .cid import CID, InvalidCIDError, decode_varint, encode_varint

CAR_VERSION = 1
MAX_CAR_HEADER_BYTES = 4096  # a header with a few roots; anything bigger is not ours to parse
MAX_CAR_BLOCK_BYTES = 1 << 30  # one section: a checkpoint of up to 1 GiB
MAX_CAR_ROOTS = 16
_CID_TAG = 42  # DAG-CBOR's tag for a CID


class CarError(StoreError):
    """A CAR stream that is malformed, truncated, over a bound, or holds a block that does not hash to
    its CID."""


def _cbor_head(major: int, value: int) -> bytes:
    """A CBOR item head: major type and argument, shortest form (DAG-CBOR requires it)."""
    if value < 24:
        return bytes([major << 5 | value])
    for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes([major << 5 | info]) + value.to_bytes(width, "big")
    raise ValueError(f"CBOR argument {value} too large")


def _cbor_text(text: str) -> bytes:
    raw = text.encode()
    return _cbor_head(3, len(raw)) + raw


def encode_header(roots: Iterable[CID]) -> bytes:
    """The DAG-CBOR CARv1 header naming ``roots``."""
    roots = list(roots)
    out = bytearray(_cbor_head(5, 2))  # a map of two keys: "roots" sorts before "version" (shorter first)
    out += _cbor_text("roots") + _cbor_head(4, len(roots))
    for root in roots:
        link = b"\x00" + root.to_bytes()
        out += _cbor_head(6, _CID_TAG) + _cbor_head(2, len(link)) + link
    out += _cbor_text("version") + _cbor_head(0, CAR_VERSION)
    return bytes(out)


def encode_car(roots: Iterable[CID], blocks: Iterable[tuple[CID, bytes]]) -> Iterator[bytes]:
    """A CARv1 as a stream of byte strings: the header, then one section per block (each block is the
    caller's, verified when it was read from a store)."""
    header = encode_header(roots)
    yield encode_varint(len(header)) + header
    for cid, data in blocks:
        binary = cid.to_bytes()
        yield encode_varint(len(binary) + len(data)) + binary
        yield data


class _CborReader:
    """The CBOR subset a CARv1 header uses (maps, text, arrays, tag 42 over bytes, small unsigned
    ints), read from a bounded buffer; anything else is refused."""

    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def _take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise CarError("CAR header: truncated CBOR")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def head(self) -> tuple[int, int]:
        first = self._take(1)[0]
        major, info = first >> 5, first & 0x1F
        if info < 24:
            return major, info
        widths = {24: 1, 25: 2, 26: 4, 27: 8}
        if info not in widths:
            raise CarError("CAR header: indefinite-length or reserved CBOR item")
        return major, int.from_bytes(self._take(widths[info]), "big")

    def item(self, depth: int = 0) -> object:
        if depth > 4:
            raise CarError("CAR header: CBOR nested too deep")
        major, value = self.head()
        if major == 0:
            return value
        if major in (2, 3):
            if value > MAX_CAR_HEADER_BYTES:
                raise CarError("CAR header: CBOR string over its bound")
            raw = self._take(value)
            if major == 2:
                return raw
            try:
                return raw.decode()
            except UnicodeDecodeError:
                raise CarError("CAR header: CBOR text is not UTF-8") from None
        if major == 4:
            if value > MAX_CAR_ROOTS:
                raise CarError(f"CAR header: more than {MAX_CAR_ROOTS} roots")
            return [self.item(depth + 1) for _ in range(value)]
        if major == 5:
            if value > 8:
                raise CarError("CAR header: a map of more than 8 keys")
            return {self._key(depth): self.item(depth + 1) for _ in range(value)}
        if major == 6 and value == _CID_TAG:
            link = self.item(depth + 1)
            if not isinstance(link, bytes) or link[:1] != b"\x00":
                raise CarError("CAR header: a CID link that is not 0x00-prefixed bytes")
            return cid_from_bytes(link[1:])
        raise CarError(f"CAR header: unsupported CBOR item (major type {major})")

    def _key(self, depth: int) -> str:
        key = self.item(depth + 1)
        if not isinstance(key, str):
            raise CarError("CAR header: a map key that is not text")
        return key


def cid_from_bytes(binary: bytes) -> CID:
    """A binary CID of ours (CIDv1, sha2-256), through its text form's full validation."""
    import base64

    text = "b" + base64.b32encode(binary).decode("ascii").rstrip("=").lower()
    try:
        return CID.parse(text)
    except InvalidCIDError as exc:
        raise CarError(f"CAR: {str(exc)[:200]}") from None


def decode_header(header: bytes) -> list[CID]:
    """The roots of a CARv1 header (CarError when it is not one)."""
    reader = _CborReader(header)
    value = reader.item()
    if reader.pos != len(header):
        raise CarError("CAR header: trailing bytes after the header map")
    if not isinstance(value, dict) or set(value) != {"roots", "version"}:
        raise CarError("CAR header: not a map of exactly 'roots' and 'version'")
    if value["version"] != CAR_VERSION:
        raise CarError(f"CAR header: version {str(value['version'])[:20]}, only {CAR_VERSION} is read")
    roots = value["roots"]
    if not isinstance(roots, list) or not roots or not all(isinstance(r, CID) for r in roots):
        raise CarError("CAR header: roots must be a non-empty list of CIDs")
    return roots


def _read_exact(stream: BinaryIO, n: int, what: str) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise CarError(f"CAR truncated in {what}: {len(data)} of {n} bytes")
    return data


def _read_varint(stream: BinaryIO, what: str) -> int | None:
    """The next varint, or None at a clean end of stream (only before a section)."""
    raw = bytearray()
    while True:
        byte = stream.read(1)
        if not byte:
            if raw:
                raise CarError(f"CAR truncated in {what}'s length")
            return None
        raw += byte
        if not byte[0] & 0x80:
            break
        if len(raw) >= 9:
            raise CarError(f"CAR: {what}'s length varint is too long")
    try:
        return decode_varint(bytes(raw))[0]
    except ValueError as exc:
        raise CarError(f"CAR: {what}'s length: {exc}") from None


@dataclass(frozen=True)
class Car:
    """A CARv1 read whole: its roots and its blocks in file order, each verified."""

    roots: list[CID]
    blocks: list[tuple[CID, bytes]]


def read_car(stream: BinaryIO, max_block_bytes: int = MAX_CAR_BLOCK_BYTES, max_blocks: int = 1 << 20) -> Car:
    """Read and verify a CARv1 from ``stream`` (CarError naming the first thing wrong)."""
    size = _read_varint(stream, "the header")
    if size is None:
        raise CarError("CAR is empty")
    if not 0 < size <= MAX_CAR_HEADER_BYTES:
        raise CarError(f"CAR header length {size} is out of bounds (1..{MAX_CAR_HEADER_BYTES})")
    roots = decode_header(_read_exact(stream, size, "the header"))
    blocks: list[tuple[CID, bytes]] = []
    seen: set[CID] = set()
    while (length := _read_varint(stream, f"section {len(blocks)}")) is not None:
        if len(blocks) >= max_blocks:
            raise CarError(f"CAR holds more than {max_blocks} blocks")
        if not 36 <= length <= max_block_bytes + 64:
            raise CarError(f"CAR section {len(blocks)} length {length} is out of bounds")
        section = _read_exact(stream, length, f"section {len(blocks)}")
        cid, data = _split_section(section, len(blocks))
        if hashlib.sha256(data).digest() != cid.digest:
            raise CarError(f"CAR block {cid} does not hash to its CID")
        if cid in seen:
            raise CarError(f"CAR holds block {cid} twice")
        seen.add(cid)
        blocks.append((cid, data))
    return Car(roots, blocks)


def _split_section(section: bytes, index: int) -> tuple[CID, bytes]:
    """A section's CID and block: the CID's length comes from its own varint header."""
    try:
        pos = 0
        for _ in range(3):  # version, codec, multihash code
            _, pos = decode_varint(section, pos)
        digest_length, pos = decode_varint(section, pos)
    except ValueError as exc:
        raise CarError(f"CAR section {index}: bad CID header ({exc})") from None
    end = pos + digest_length
    if digest_length > 64 or end > len(section):
        raise CarError(f"CAR section {index}: CID longer than its section")
    return cid_from_bytes(section[:end]), section[end:]
