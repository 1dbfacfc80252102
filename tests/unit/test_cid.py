"""Tests for storage_client.cid (CID text form, parsing, varints) and
storage_client.canonical (the canonical JSON bytes behind JSON-codec CIDs)."""

import base64
import hashlib

import pytest

from storage_client import (
    CID,
    Codec,
    InvalidCIDError,
    canonical_json,
    decode_varint,
    digest_json,
    encode_varint,
)


def _b32(raw: bytes) -> str:
    """Multibase base32 built independently of the code under test."""
    return "b" + base64.b32encode(raw).decode().rstrip("=").lower()


def test_hello_matches_independent_construction():
    digest = hashlib.sha256(b"hello").digest()
    expected = _b32(bytes([0x01, 0x55, 0x12, 0x20]) + digest)
    cid = CID.of(b"hello")
    assert cid.encode() == expected
    assert str(cid) == expected
    assert cid.hex == digest.hex()
    assert cid.codec is Codec.RAW


def test_json_codec_uses_two_byte_varint():
    digest = hashlib.sha256(b"{}").digest()
    # 0x0200 as LEB128 is 0x80 0x04.
    expected = _b32(bytes([0x01, 0x80, 0x04, 0x12, 0x20]) + digest)
    assert CID.of(b"{}", Codec.JSON).encode() == expected


@pytest.mark.parametrize("data", [b"", b"hello", bytes(range(256)) * 10])
def test_known_prefixes_and_round_trip(data):
    raw = CID.of(data)
    js = CID.of(data, Codec.JSON)
    assert raw.encode().startswith("bafkrei")
    assert js.encode().startswith("bagaaiera")
    for cid in (raw, js):
        assert CID.parse(cid.encode()) == cid
        assert len(cid.encode()) == len(str(cid))
    assert raw != js and raw.digest == js.digest


def test_cids_are_hashable_and_plain_int_codec_is_coerced():
    cid = CID(0x55, hashlib.sha256(b"x").digest())
    assert cid.codec is Codec.RAW
    assert {cid, CID.of(b"x")} == {cid}


def test_constructor_rejects_wrong_digest_length():
    with pytest.raises(ValueError):
        CID(Codec.RAW, b"\x00" * 31)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 0x0200, 2**32, 2**63 - 1])
def test_varint_round_trip(n):
    enc = encode_varint(n)
    assert decode_varint(enc) == (n, len(enc))
    assert decode_varint(b"\xff" + enc, 1) == (n, len(enc) + 1)


def test_varint_known_bytes_and_errors():
    assert encode_varint(0x55) == b"\x55"
    assert encode_varint(0x0200) == b"\x80\x04"
    assert encode_varint(300) == b"\xac\x02"
    with pytest.raises(ValueError):
        encode_varint(-1)
    with pytest.raises(ValueError, match="truncated"):
        decode_varint(b"\x80")
    with pytest.raises(ValueError, match="non-minimal"):
        decode_varint(b"\x81\x00")
    with pytest.raises(ValueError, match="longer"):
        decode_varint(b"\xff" * 10)


_GOOD = CID.of(b"hello")
_DIGEST = _GOOD.digest


def _bad(header: bytes, digest: bytes = _DIGEST) -> str:
    return _b32(header + digest)


@pytest.mark.parametrize(
    "text, why",
    [
        ("", "empty"),
        ("z" + _GOOD.encode()[1:], "multibase prefix"),
        (_GOOD.encode().upper(), "multibase prefix"),
        ("b" + _GOOD.encode()[1:].upper(), "alphabet"),
        (_GOOD.encode()[:-1] + "1", "alphabet"),
        (_GOOD.encode() + "=", "alphabet"),
        (_GOOD.encode()[:-1], "length or padding"),
        (_GOOD.encode()[:-1] + "r", "non-canonical"),
        (_bad(bytes([0x00, 0x55, 0x12, 0x20])), "version 0"),
        (_bad(bytes([0x02, 0x55, 0x12, 0x20])), "version 2"),
        (_bad(bytes([0x01, 0x70, 0x12, 0x20])), "unknown codec 0x70"),
        (_bad(bytes([0x01, 0x55, 0x13, 0x20])), "multihash code 0x13"),
        (_bad(bytes([0x01, 0x55, 0x12, 0x1F]), _DIGEST[:31]), "digest length 31"),
        (_bad(bytes([0x01, 0x55, 0x12, 0x20]), _DIGEST[:31]), "truncated"),
        (_bad(bytes([0x01, 0x55, 0x12, 0x20]), _DIGEST + b"\x00"), "trailing bytes"),
        (_bad(bytes([0x01, 0x81, 0x00, 0x12, 0x20])), "non-minimal"),
        (_b32(bytes([0x01, 0x55])), "varint"),
    ],
)
def test_parse_failures_are_specific(text, why):
    with pytest.raises(InvalidCIDError) as info:
        CID.parse(text)
    msg = str(info.value)
    assert why in msg
    assert repr(text) in msg  # the message names the offending text


def test_invalid_cid_error_is_value_error_and_non_str_rejected():
    assert issubclass(InvalidCIDError, ValueError)
    with pytest.raises(InvalidCIDError, match="expected str"):
        CID.parse(b"bafkrei")  # type: ignore[arg-type]


# --- canonical JSON ---


def test_canonical_exact_bytes():
    obj = {"b": [1, True, None], "a": {"y": "x", "x": -2}, "c": ("t", 0)}
    assert canonical_json(obj) == b'{"a":{"x":-2,"y":"x"},"b":[1,true,null],"c":["t",0]}'


def test_canonical_key_order_independent():
    a = {"z": 1, "a": {"k2": [1, 2], "k1": "v"}}
    b = {"a": {"k1": "v", "k2": [1, 2]}, "z": 1}
    assert canonical_json(a) == canonical_json(b)
    assert digest_json(a) == digest_json(b)
    assert digest_json(a) == CID.of(canonical_json(a), Codec.JSON)


def test_canonical_unicode_is_literal_utf8():
    obj = {"名前": ["héllo", {"emoji": "🙂"}]}
    out = canonical_json(obj)
    assert out == '{"名前":["héllo",{"emoji":"🙂"}]}'.encode("utf-8")
    assert b"\\u" not in out


def test_canonical_int_subclasses_print_as_numbers():
    assert canonical_json({"codec": Codec.JSON}) == b'{"codec":512}'


@pytest.mark.parametrize(
    "obj, path",
    [
        (1.5, "$"),
        ({"participants": [{"worker": "w", "loss": 0.25}]}, "$.participants[0].loss"),
        ([0, [1, float("nan")]], "$[1][1]"),
        ({"odd key": 1e-6}, '$["odd key"]'),
    ],
)
def test_canonical_refuses_floats_naming_path(obj, path):
    with pytest.raises(TypeError) as info:
        canonical_json(obj)
    assert "float" in str(info.value)
    assert f"at {path} " in str(info.value)


def test_canonical_refuses_non_str_keys_and_other_types():
    with pytest.raises(TypeError, match=r"non-str key 1 .* at \$\.a"):
        canonical_json({"a": {1: "x"}})
    with pytest.raises(TypeError, match=r"bytes at \$\[0\]"):
        canonical_json([b"raw"])
    with pytest.raises(TypeError, match=r"set at \$\.s"):
        canonical_json({"s": {1}})
    with pytest.raises(ValueError, match=r"lone surrogate"):
        canonical_json({"k": "\ud800"})
