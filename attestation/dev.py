"""The development provider: a software stand-in for a TEE that PROVES NOTHING.

Where no TEE exists (a laptop, CI, this project's demo) workers still need evidence of the same
shape so the rest of the trust path (admission, signed reports, ledger, audit) can run. This module
makes it, and says at every turn that it proves nothing:

- The quote has the TDX v4 layout (same parser): TEE type 0x81, QE vendor id b"dilocox-dev-only",
  MRTD = the code measurement (REPORTDATA[32:64]) followed by 16 zero bytes, RTMR0..3 zero,
  REPORTDATA = the 64 bytes asked for, and as signature data the ASCII text of `WARNING`.
- The whole quote is signed with a local "development root" secp256k1 key:
  signature = sign(sha256(b"dilocox/dev-quote/v1" || quote)), 65 bytes r||s||v. The domain prefix
  keeps the root's signatures from meaning anything in another protocol.
- Verifiers trust a dev root by its address (Policy.dev_roots) and only with Policy.allow_dev=True.
  The allowlisted measurement of dev evidence is the code measurement itself.

Anyone holding the root key can produce any evidence at all; nothing here was measured or isolated
by hardware.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from pathlib import Path
from typing import Any

from eth_account import Account

from .errors import AttestationError, EvidenceError
from .evidence import Evidence, Provider
from .keys import SignatureError, recover_address
from .tdx import TD_ATTRIBUTES_DEBUG, build_quote_v4

log = logging.getLogger("dilocox.attestation.dev")

WARNING = (
    "DEV ATTESTATION PROVIDER: this evidence PROVES NOTHING. It is made and signed in software by "
    "a local development key; no hardware measured or isolated this process. Accept it only for "
    "development (Policy(allow_dev=True))."
)

# QE vendor id written into dev quotes, so a dev quote cannot pass as a TDX one.
DEV_QE_VENDOR_ID = b"dilocox-dev-only"
DEV_SIGNING_DOMAIN = b"dilocox/dev-quote/v1"
ROOT_KEY_FILE = "dev-root.key"
ROOT_ADDRESS_FILE = "dev-root.address"


def dev_quote_digest(quote: bytes) -> bytes:
    """What the development root signs: sha256(b"dilocox/dev-quote/v1" || quote)."""
    return hashlib.sha256(DEV_SIGNING_DOMAIN + bytes(quote)).digest()


def recover_dev_signer(evidence: Evidence) -> str:
    """The address of the development root that signed dev evidence (EvidenceError if none)."""
    if evidence.provider != Provider.DEV or evidence.dev_signature is None:
        raise EvidenceError("only dev evidence carries a development root signature")
    try:
        return recover_address(dev_quote_digest(evidence.quote), evidence.dev_signature)
    except SignatureError as exc:
        raise EvidenceError(f"dev evidence signature is malformed: {exc}") from None


class DevRoot:
    """The development root key. It lives in `<dir>/dev-root.key` (hex, mode 0600, never logged);
    its public address is also written to `<dir>/dev-root.address` for verifiers to trust."""

    __slots__ = ("_address", "_key", "path")

    def __init__(self, private_key: bytes, path: Path | None = None) -> None:
        if len(private_key) != 32:
            raise ValueError("a development root key is 32 bytes")
        self._key = bytes(private_key)
        self._address = Account.from_key(self._key).address
        self.path = path

    @classmethod
    def load_or_create(cls, directory: str | os.PathLike[str]) -> DevRoot:
        """Load the root from `directory`, creating the directory (0700) and key (0600) if absent.

        Creation is atomic (written to a temporary file, then linked into place), so processes
        starting together agree on one root. A key file readable by group or others is refused.
        """
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = directory / ROOT_KEY_FILE
        if not path.exists():
            cls._create(path)
        root = cls(cls._read(path), path)
        address_file = directory / ROOT_ADDRESS_FILE
        try:
            current = address_file.read_text().strip()
        except OSError:
            current = None
        if current != root.address:
            tmp = directory / f".{ROOT_ADDRESS_FILE}.{os.getpid()}.tmp"
            tmp.write_text(root.address + "\n")
            os.replace(tmp, address_file)
        log.info("development root %s loaded from %s (dev evidence PROVES NOTHING)", root.address, directory)
        return root

    @staticmethod
    def _create(path: Path) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        key = bytes(Account.create(os.urandom(32)).key)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(key.hex() + "\n")
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails if another process created the root first: use theirs
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _read(path: Path) -> bytes:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise AttestationError(
                f"development root key {path} has mode {mode:04o}; it must be readable by its "
                f"owner only (chmod 600 {path})"
            )
        text = path.read_text().strip()
        try:
            key = bytes.fromhex(text)
        except ValueError:
            key = b""
        if len(key) != 32:
            raise AttestationError(f"development root key {path} is not 32 bytes of hex")
        return key

    @property
    def address(self) -> str:
        """The root's checksummed address: what Policy.dev_roots lists."""
        return self._address

    def sign_quote(self, quote: bytes) -> bytes:
        """Sign a dev quote: 65 bytes r||s||v over `dev_quote_digest(quote)`."""
        return bytes(Account.unsafe_sign_hash(dev_quote_digest(quote), self._key).signature)

    def __repr__(self) -> str:
        return f"DevRoot(address={self._address}, PROVES NOTHING)"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("DevRoot cannot be pickled; load it from its directory instead")


class DevProvider:
    """Evidence of the TDX shape, made in software and signed by a DevRoot. PROVES NOTHING.

    `debug=True` sets the quote's TUD.DEBUG bit, to exercise policies that refuse debug TDs.
    """

    name = "dev"
    proves_nothing = True

    def __init__(self, root: DevRoot | str | os.PathLike[str], *, debug: bool = False) -> None:
        self.root = root if isinstance(root, DevRoot) else DevRoot.load_or_create(root)
        self.debug = debug
        log.warning("%s (root %s)", WARNING, self.root.address)

    def __repr__(self) -> str:
        return f"DevProvider(root={self.root.address}, PROVES NOTHING)"

    def quote(self, report_data: bytes) -> bytes:
        """A TDX-v4-shaped quote over `report_data` (64 bytes). Unsigned; see `evidence`."""
        if not isinstance(report_data, (bytes, bytearray)) or len(report_data) != 64:
            raise ValueError("report_data must be 64 bytes")
        report_data = bytes(report_data)
        return build_quote_v4(
            report_data=report_data,
            mrtd=report_data[32:64] + bytes(16),
            td_attributes=TD_ATTRIBUTES_DEBUG if self.debug else 0,
            qe_vendor_id=DEV_QE_VENDOR_ID,
            signature_data=WARNING.encode("ascii"),
        )

    def evidence(self, report_data: bytes) -> Evidence:
        """Dev evidence over `report_data`, signed by the development root. PROVES NOTHING."""
        quote = self.quote(report_data)
        log.warning("producing dev evidence: %s", WARNING)
        return Evidence(provider="dev", quote=quote, dev_signature=self.root.sign_quote(quote))
