"""Where an object is hashed: content identifiers (CIDs) for everything the platform stores.

Every checkpoint, update and manifest is named by the hash of its bytes, so a
name can be checked against the data it names. We use the standard CIDv1 form
(multiformats) rather than a bare hex digest so the identifiers interoperate
with IPFS-style tooling and carry the codec, telling a reader whether the bytes
are opaque (RAW) or canonical JSON.

Binary layout:  varint(1) | varint(codec) | 0x12 0x20 | sha256 digest (32 bytes)
Text layout:    'b' + lowercase RFC 4648 base32 of the binary, no padding.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from enum import IntEnum

CID_VERSION = 1
SHA2_256 = 0x12  # multihash function code
SHA2_256_LENGTH = 32
BASE32_PREFIX = "b"  # multibase prefix for lowercase base32, no padding

_BASE32_ALPHABET = frozenset("abcdefghijklmnopqrstuvwxyz234567")
_MAX_VARINT_BYTES = 9  # multiformats caps varints at 63 bits / 9 bytes


class Codec(IntEnum):
    """Multicodec code saying how to interpret the hashed bytes."""

    RAW = 0x55  # opaque bytes: checkpoints, updates
    JSON = 0x0200  # canonical JSON: manifests, run config


class InvalidCIDError(ValueError):
    """Raised when CID text is malformed or uses something we do not support."""


def encode_varint(n: int) -> bytes:
    """Unsigned LEB128: 7 bits per byte, low bits first, high bit = 'more follows'."""
    if n < 0:
        raise ValueError(f"varint must be non-negative, got {n}")
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode_varint(buf: bytes, offset: int = 0) -> tuple[int, int]:
    """Decode one unsigned LEB128 varint at `offset`; return (value, next offset).

    Non-minimal encodings (e.g. 0x81 0x00 for 1) are rejected, as the multiformats
    spec requires, so each value has exactly one byte form and one CID text.
    """
    value = 0
    for i in range(_MAX_VARINT_BYTES):
        pos = offset + i
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if byte == 0 and i > 0:
                raise ValueError("non-minimal varint encoding")
            return value, pos + 1
    raise ValueError(f"varint longer than {_MAX_VARINT_BYTES} bytes")


@dataclass(frozen=True)
class CID:
    """A CIDv1 whose multihash is sha2-256."""

    codec: Codec
    digest: bytes

    def __post_init__(self) -> None:
        # Coerce plain ints to the enum so equality and hashing are uniform.
        object.__setattr__(self, "codec", Codec(self.codec))
        if not isinstance(self.digest, bytes) or len(self.digest) != SHA2_256_LENGTH:
            raise ValueError(f"CID digest must be {SHA2_256_LENGTH} bytes of sha256")

    @classmethod
    def of(cls, data: bytes, codec: Codec = Codec.RAW) -> CID:
        """The CID of `data` interpreted with `codec`."""
        return cls(codec, hashlib.sha256(data).digest())

    @property
    def hex(self) -> str:
        """The sha256 digest as lowercase hex (what `sha256sum` prints)."""
        return self.digest.hex()

    def to_bytes(self) -> bytes:
        """The binary CID."""
        return (
            encode_varint(CID_VERSION)
            + encode_varint(self.codec)
            + encode_varint(SHA2_256)
            + encode_varint(SHA2_256_LENGTH)
            + self.digest
        )

    def encode(self) -> str:
        """The multibase base32 text form, e.g. 'bafkrei...' for RAW."""
        text = base64.b32encode(self.to_bytes()).decode("ascii")
        return BASE32_PREFIX + text.rstrip("=").lower()

    def __str__(self) -> str:
        return self.encode()

    @classmethod
    def parse(cls, text: str) -> CID:
        """Parse and fully validate CID text; raise InvalidCIDError if anything is off."""

        def fail(why: str) -> InvalidCIDError:
            return InvalidCIDError(f"invalid CID {text!r}: {why}")

        if not isinstance(text, str):
            raise fail(f"expected str, got {type(text).__name__}")
        if not text:
            raise fail("empty string")
        if text[0] != BASE32_PREFIX:
            raise fail(f"multibase prefix must be {BASE32_PREFIX!r} (base32), got {text[0]!r}")
        body = text[1:]
        bad = sorted(set(body) - _BASE32_ALPHABET)
        if bad:
            raise fail(f"characters outside the lowercase base32 alphabet: {''.join(bad)!r}")
        try:
            raw = base64.b32decode(body.upper() + "=" * (-len(body) % 8))
        except binascii.Error as e:
            raise fail(f"bad base32 length or padding ({e})") from None
        # Base32 can smuggle non-zero pad bits; re-encoding catches that, so
        # each CID has exactly one accepted text form.
        if base64.b32encode(raw).decode("ascii").rstrip("=").lower() != body:
            raise fail("non-canonical base32 (non-zero trailing bits)")

        try:
            version, pos = decode_varint(raw, 0)
            codec, pos = decode_varint(raw, pos)
            hash_code, pos = decode_varint(raw, pos)
            length, pos = decode_varint(raw, pos)
        except ValueError as e:
            raise fail(f"bad varint header ({e})") from None
        if version != CID_VERSION:
            raise fail(f"unsupported CID version {version}, only {CID_VERSION} is supported")
        try:
            codec = Codec(codec)
        except ValueError:
            known = ", ".join(f"{c.name}=0x{c.value:x}" for c in Codec)
            raise fail(f"unknown codec 0x{codec:x} (known: {known})") from None
        if hash_code != SHA2_256:
            raise fail(f"multihash code 0x{hash_code:x} is not sha2-256 (0x{SHA2_256:x})")
        if length != SHA2_256_LENGTH:
            raise fail(f"digest length {length} is not {SHA2_256_LENGTH}")
        digest = raw[pos:]
        if len(digest) < SHA2_256_LENGTH:
            raise fail(f"digest truncated: {len(digest)} of {SHA2_256_LENGTH} bytes")
        if len(digest) > SHA2_256_LENGTH:
            raise fail(f"{len(digest) - SHA2_256_LENGTH} trailing bytes after the digest")
        return cls(codec, digest)
