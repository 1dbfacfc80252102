"""The worker's signing key and its binding into REPORTDATA (docs/trust.md "Worker identity").

A worker creates its secp256k1 key inside its attestation provider's process; the key is never
logged or written out (the one exception: a persistent auditor keeps its attested key in its own
directory, mode 0600, ``WorkerKey.save``, so that it is admitted once: audit.auditor). Evidence
binds the key's address to the measured environment through REPORTDATA:

    REPORTDATA[0:32]  = sha256(b"dilocox/worker-key/v1" || address (20) || runId (32) || nonce (32))
    REPORTDATA[32:64] = code measurement

Signatures are Ethereum-style 65 bytes r || s || v with v in {27, 28} and s in the lower half of the
curve order, which is what OpenZeppelin's ECDSA.tryRecover accepts.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from eth_account import Account
from eth_keys import keys as _eth_keys
from eth_keys.exceptions import BadSignature, ValidationError
from eth_utils import to_checksum_address

from storage_client import bytes32

WORKER_KEY_DOMAIN = b"dilocox/worker-key/v1"

SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
_HALF_N = SECP256K1_N // 2


class SignatureError(ValueError):
    """A signature that is malformed or does not recover to an address."""


def address_bytes(address: str | bytes) -> bytes:
    """An address as its 20 bytes; accepts 20 raw bytes or 0x-prefixed hex text (any case)."""
    if isinstance(address, (bytes, bytearray)):
        if len(address) != 20:
            raise ValueError(f"address must be 20 bytes, got {len(address)}")
        return bytes(address)
    if isinstance(address, str):
        text = address[2:] if address.startswith(("0x", "0X")) else None
        if text is None or len(text) != 40:
            raise ValueError(f"address must be 0x followed by 40 hex digits, got {address!r}")
        try:
            return bytes.fromhex(text)
        except ValueError:
            raise ValueError(f"address is not hex: {address!r}") from None
    raise TypeError(f"address must be str or bytes, not {type(address).__name__}")


def checksum_address(address: str | bytes) -> str:
    """The EIP-55 checksummed text form of an address."""
    return to_checksum_address(address_bytes(address))


def key_binding(address: str | bytes, run_id: bytes, nonce: bytes) -> bytes:
    """REPORTDATA[0:32]: sha256(b"dilocox/worker-key/v1" || address || runId || nonce)."""
    return hashlib.sha256(
        WORKER_KEY_DOMAIN
        + address_bytes(address)
        + bytes32(run_id, "run_id")
        + bytes32(nonce, "nonce")
    ).digest()


def report_data(address: str | bytes, run_id: bytes, nonce: bytes, code_measurement: bytes) -> bytes:
    """The 64 bytes of REPORTDATA that bind a worker key to a run, a join nonce and its code."""
    return key_binding(address, run_id, nonce) + bytes32(code_measurement, "code_measurement")


def recover_address(digest: bytes, signature: bytes) -> str:
    """The checksummed address that signed a 32-byte digest. Refuses malformed signatures, v other
    than 27/28, and high-s (malleable) signatures, as OpenZeppelin's ECDSA.tryRecover does."""
    digest = bytes32(digest, "digest")
    if not isinstance(signature, (bytes, bytearray)) or len(signature) != 65:
        got = len(signature) if isinstance(signature, (bytes, bytearray)) else type(signature).__name__
        raise SignatureError(f"signature must be 65 bytes r||s||v, got {got}")
    r = int.from_bytes(signature[0:32], "big")
    s = int.from_bytes(signature[32:64], "big")
    v = signature[64]
    if v not in (27, 28):
        raise SignatureError(f"signature v is {v}, expected 27 or 28")
    if not 0 < r < SECP256K1_N or not 0 < s <= _HALF_N:
        raise SignatureError("signature r or s is out of range (high-s signatures are malleable)")
    try:
        sig = _eth_keys.Signature(vrs=(v - 27, r, s))
        return sig.recover_public_key_from_msg_hash(digest).to_checksum_address()
    except (BadSignature, ValidationError, ValueError) as exc:
        raise SignatureError(f"signature does not recover to a public key: {exc}") from None


class WorkerKey:
    """A worker's secp256k1 signing key. It stays in this object: no repr, log, pickle or file
    shows it. Create one with `generate()` inside the process that attests."""

    __slots__ = ("_address", "_key")

    def __init__(self, private_key: bytes) -> None:
        private_key = bytes32(private_key, "private_key")
        account = Account.from_key(private_key)
        self._key = private_key
        self._address = account.address

    @classmethod
    def generate(cls) -> WorkerKey:
        """A fresh key from the OS's entropy."""
        account = Account.create(os.urandom(32))
        return cls(bytes(account.key))

    @property
    def address(self) -> str:
        """The key's EIP-55 checksummed address."""
        return self._address

    def sign_digest(self, digest: bytes) -> bytes:
        """Sign a 32-byte digest (for example an EIP-712 digest); 65 bytes r||s||v, v in {27, 28}."""
        signed = Account.unsafe_sign_hash(bytes32(digest, "digest"), self._key)
        return bytes(signed.signature)

    def save(self, path: Path) -> None:
        """Keep the key in ``path`` (0x + 64 hex digits, mode 0600), for an auditor that reuses its
        attested key (audit.auditor); it is never logged."""
        from storage_client import write_atomic

        write_atomic(Path(path), b"0x" + self._key.hex().encode() + b"\n", mode=0o600)

    def report_data(self, run_id: bytes, nonce: bytes, code_measurement: bytes) -> bytes:
        """REPORTDATA binding this key to a run, a join nonce and a code measurement."""
        return report_data(self._address, run_id, nonce, code_measurement)

    def __repr__(self) -> str:
        return f"WorkerKey(address={self._address})"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("WorkerKey cannot be pickled: the private key never leaves its process")

    def __copy__(self) -> WorkerKey:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerKey:
        return self
