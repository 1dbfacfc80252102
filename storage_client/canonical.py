"""Canonical JSON: one byte string per value, so equal records hash equally.

Manifests and run configs are identified by the hash of their JSON, and may be
re-serialised by other implementations (other languages, other machines) that
must reproduce the same bytes. So we pin every free choice: keys sorted by
Unicode code point (Python's str order), no whitespace, UTF-8 text kept literal
rather than \\u-escaped, and a deliberately small value space. Floats are
refused outright because their text form differs between languages (1e-06 vs
1e-6 vs 0.000001); callers store fixed-point ints such as loss * 1e6 instead.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from .cid import CID, Codec


def _child_path(path: str, key: str) -> str:
    # Plain identifiers read naturally as $.a.b; anything else is quoted.
    if key.isidentifier():
        return f"{path}.{key}"
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def _check_str(s: str, path: str) -> None:
    # Lone surrogates are legal in a Python str but have no UTF-8 encoding.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"string at {path} is not valid Unicode (lone surrogate)") from None


def _normalize(obj: Any, path: str) -> Any:
    """Return a copy made only of dict/list/str/int/bool/None, or raise naming `path`."""
    if obj is None or isinstance(obj, bool):
        return obj
    if isinstance(obj, float):  # checked before int-like values; also catches numpy float64
        raise TypeError(f"float at {path} is not allowed in canonical JSON; use a fixed-point int")
    if isinstance(obj, int):
        return int(obj)  # drop subclasses such as IntEnum so they print as plain numbers
    if isinstance(obj, str):
        _check_str(obj, path)
        return str(obj)
    if isinstance(obj, (list, tuple)):
        return [_normalize(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"non-str key {k!r} ({type(k).__name__}) at {path} "
                    "is not allowed in canonical JSON"
                )
            _check_str(k, path)
            out[str(k)] = _normalize(v, _child_path(path, k))
        return out
    raise TypeError(f"{type(obj).__name__} at {path} is not allowed in canonical JSON")


def canonical_json(obj: Any) -> bytes:
    """Serialise `obj` to canonical JSON bytes (UTF-8, sorted keys, no spaces, no floats)."""
    text = json.dumps(
        _normalize(obj, "$"),
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
        allow_nan=False,
    )
    return text.encode("utf-8")


def strict_json(obj: Any, **options: Any) -> str:
    """``json.dumps`` that never writes NaN or Infinity (not JSON: strict parsers refuse them): a
    non-finite float becomes null. Every JSON file and line the project writes goes through here
    (or through ``canonical_json``, which refuses floats altogether)."""
    return json.dumps(_finite(obj), allow_nan=False, **options)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def digest_json(obj: Any) -> CID:
    """The JSON-codec CID of `obj`'s canonical bytes."""
    return CID.of(canonical_json(obj), Codec.JSON)


class JSONBoundsError(ValueError):
    """Untrusted JSON that is too large, too deep, or not JSON at all (the message is short)."""


_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
MAX_JSON_DEPTH = 32


def loads_bounded(data: bytes | str, *, max_bytes: int, max_depth: int = MAX_JSON_DEPTH, what: str = "JSON") -> Any:
    """Parse untrusted JSON after checking its size and nesting depth, without recursion.

    ``json.loads`` recurses once per nesting level, so deeply nested input ends in RecursionError
    rather than ValueError; the depth is therefore measured first on the bracket skeleton (strings
    removed by one regular expression), in C-speed passes. Every failure is a JSONBoundsError
    whose message never quotes the input.
    """
    if len(data) > max_bytes:
        raise JSONBoundsError(f"{what} is {len(data)} bytes, more than the {max_bytes} allowed")
    try:
        text = data.decode("utf-8") if isinstance(data, (bytes, bytearray)) else str(data)
    except UnicodeDecodeError:
        raise JSONBoundsError(f"{what} is not UTF-8") from None
    skeleton = _NOT_BRACKETS.sub("", _STRINGS.sub('""', text))
    depth = deepest = 0
    for ch in skeleton:  # only brackets are left: a few per JSON container
        depth += 1 if ch in "[{" else -1
        if depth > deepest:
            deepest = depth
            if deepest > max_depth:
                raise JSONBoundsError(f"{what} nests deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "malformed"
        raise JSONBoundsError(f"{what} is not JSON ({reason})") from None


def bytes32(value: Any, name: str = "value") -> bytes:
    """``value`` as 32 bytes (a digest, a run id, a measurement), or ValueError naming ``name``."""
    if not isinstance(value, (bytes, bytearray)) or len(value) != 32:
        got = f"{len(value)} bytes" if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise ValueError(f"{name} must be 32 bytes, got {got}")
    return bytes(value)


def hex32(value: bytes, name: str = "value") -> str:
    """A 32-byte value as it is written in JSON records: 0x + 64 hex digits."""
    return "0x" + bytes32(value, name).hex()


def unhex32(value: Any, name: str = "value") -> bytes:
    """The inverse of :func:`hex32`, for values read from disk or the network: ValueError naming
    ``name`` for anything but 0x followed by 64 hex digits."""
    if not isinstance(value, str) or not value.startswith("0x") or len(value) != 66:
        raise ValueError(f"{name} must be 0x followed by 64 hex digits, got {repr(value)[:80]}")
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise ValueError(f"{name} must be 0x followed by 64 hex digits, got {value[:80]!r}") from None


def hex_or_none(value: bytes | None) -> str | None:
    """Bytes as 0x-hex for a JSON report, None kept."""
    return None if value is None else "0x" + bytes(value).hex()
