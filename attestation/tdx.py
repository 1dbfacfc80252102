"""Intel TDX: the quote v4 layout, the configfs-tsm provider, and optional DCAP verification.

Quote v4 layout (all integers little-endian), as published by Intel and summarised in
DESIGN.md "Trust: what is known":

    offset  size  field
    header (48 bytes)
         0     2  version                      must be 4
         2     2  attestation key type         must be 2 (ECDSA-256 with P-256)
         4     4  TEE type                     must be 0x81 (TDX)
         8     2  reserved
        10     2  reserved
        12    16  QE vendor id
        28    20  user data
    TD report body (584 bytes, TDX 1.0), offsets below are relative to its start at 48
         0    16  TEE_TCB_SVN
        16    48  MRSEAM
        64    48  MRSIGNERSEAM
       112     8  SEAMATTRIBUTES
       120     8  TDATTRIBUTES                 bit 0 = TUD.DEBUG
       128     8  XFAM
       136    48  MRTD
       184    48  MRCONFIGID
       232    48  MROWNER
       280    48  MROWNERCONFIG
       328    48  RTMR0
       376    48  RTMR1
       424    48  RTMR2
       472    48  RTMR3
       520    64  REPORTDATA
    then at 632:  u32 signature data length N, and N bytes of signature data (the quote's ECDSA
    signature over header || body, the attestation key and the QE certification data). The quote
    must end exactly there.

`parse_quote` reads that layout and refuses anything else, naming the field and its offset. It does
not check the signature: `dcap_verify` does that with the optional PyPI package `dcap-qvl` and
Intel collateral the caller supplies (this project downloads nothing at run time).

`TdxProvider` asks the kernel for a quote through configfs-tsm (Linux >= 6.7, CONFIG_TSM_REPORTS):
make a fresh directory under /sys/kernel/config/tsm/report, check its `provider` says `tdx_guest`,
write the 64 bytes of REPORTDATA to `inblob`, read the quote from `outblob`, remove the directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import AttestationError, AttestationUnavailable, EvidenceError

if TYPE_CHECKING:  # pragma: no cover
    from .evidence import Evidence

QUOTE_VERSION = 4
ATT_KEY_TYPE_ECDSA_P256 = 2
TEE_TYPE_TDX = 0x81

HEADER_SIZE = 48
BODY_SIZE = 584
BODY_OFFSET = HEADER_SIZE
SIG_LEN_OFFSET = HEADER_SIZE + BODY_SIZE  # 632
SIG_DATA_OFFSET = SIG_LEN_OFFSET + 4  # 636
MIN_QUOTE_SIZE = SIG_DATA_OFFSET + 1  # at least one byte of signature data
MAX_QUOTE_SIZE = 1 << 20  # real quotes with their certificate chain are a few KiB

TD_ATTRIBUTES_DEBUG = 1 << 0  # TUD.DEBUG

_HEADER = struct.Struct("<HHIHH16s20s")
# TEE_TCB_SVN, MRSEAM, MRSIGNERSEAM, SEAMATTRIBUTES, TDATTRIBUTES, XFAM, MRTD, MRCONFIGID, MROWNER,
# MROWNERCONFIG, RTMR0..3, REPORTDATA
_BODY = struct.Struct("<16s48s48s8sQ8s48s48s48s48s48s48s48s48s64s")
assert _HEADER.size == HEADER_SIZE and _BODY.size == BODY_SIZE

# (name, offset in the quote, size) for every fixed-size field, to name what is wrong where.
BODY_FIELDS: tuple[tuple[str, int, int], ...] = tuple(
    (name, BODY_OFFSET + off, size)
    for name, off, size in (
        ("tee_tcb_svn", 0, 16),
        ("mrseam", 16, 48),
        ("mrsignerseam", 64, 48),
        ("seam_attributes", 112, 8),
        ("td_attributes", 120, 8),
        ("xfam", 128, 8),
        ("mrtd", 136, 48),
        ("mrconfigid", 184, 48),
        ("mrowner", 232, 48),
        ("mrownerconfig", 280, 48),
        ("rtmr0", 328, 48),
        ("rtmr1", 376, 48),
        ("rtmr2", 424, 48),
        ("rtmr3", 472, 48),
        ("report_data", 520, 64),
    )
)

DEFAULT_TSM_PATH = Path("/sys/kernel/config/tsm/report")
COLLATERAL_ENV = "DILOCOX_DCAP_COLLATERAL"


class TdxQuoteError(EvidenceError):
    """A byte string that is not a TDX quote v4 as this project reads it."""


@dataclass(frozen=True)
class TdxQuote:
    """A parsed TDX quote v4. `raw` is the exact bytes it was parsed from."""

    version: int
    att_key_type: int
    tee_type: int
    reserved1: int
    reserved2: int
    qe_vendor_id: bytes
    user_data: bytes
    tee_tcb_svn: bytes
    mrseam: bytes
    mrsignerseam: bytes
    seam_attributes: bytes
    td_attributes: int
    xfam: bytes
    mrtd: bytes
    mrconfigid: bytes
    mrowner: bytes
    mrownerconfig: bytes
    rtmr0: bytes
    rtmr1: bytes
    rtmr2: bytes
    rtmr3: bytes
    report_data: bytes
    signature_data: bytes
    raw: bytes

    @property
    def debug(self) -> bool:
        """True when the TD was launched with TUD.DEBUG: its memory is open to the host."""
        return bool(self.td_attributes & TD_ATTRIBUTES_DEBUG)

    @property
    def rtmrs(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (self.rtmr0, self.rtmr1, self.rtmr2, self.rtmr3)

    @property
    def signed_region(self) -> bytes:
        """Header || TD report body: what the quoting enclave's attestation key signs."""
        return self.raw[:SIG_LEN_OFFSET]

    def details(self) -> dict[str, str]:
        """The measured fields as hex strings, for logs and VerifiedEvidence.details."""
        return {
            "qe_vendor_id": self.qe_vendor_id.hex(),
            "tee_tcb_svn": self.tee_tcb_svn.hex(),
            "mrseam": self.mrseam.hex(),
            "mrsignerseam": self.mrsignerseam.hex(),
            "seam_attributes": self.seam_attributes.hex(),
            "td_attributes": struct.pack("<Q", self.td_attributes).hex(),
            "xfam": self.xfam.hex(),
            "mrtd": self.mrtd.hex(),
            "mrconfigid": self.mrconfigid.hex(),
            "mrowner": self.mrowner.hex(),
            "mrownerconfig": self.mrownerconfig.hex(),
            "rtmr0": self.rtmr0.hex(),
            "rtmr1": self.rtmr1.hex(),
            "rtmr2": self.rtmr2.hex(),
            "rtmr3": self.rtmr3.hex(),
            "report_data": self.report_data.hex(),
        }


def parse_quote(data: bytes) -> TdxQuote:
    """Parse a TDX quote v4, refusing anything short, long or inconsistent, by field and offset."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TdxQuoteError(f"TDX quote must be bytes, not {type(data).__name__}")
    data = bytes(data)
    n = len(data)
    if n > MAX_QUOTE_SIZE:
        raise TdxQuoteError(f"TDX quote is {n} bytes, more than the {MAX_QUOTE_SIZE}-byte limit")
    if n < HEADER_SIZE:
        raise TdxQuoteError(
            f"TDX quote is {n} bytes: too short for the {HEADER_SIZE}-byte header (offset 0)"
        )
    version, key_type, tee_type, res1, res2, vendor, user = _HEADER.unpack_from(data, 0)
    if version != QUOTE_VERSION:
        raise TdxQuoteError(
            f"TDX quote header: version at offset 0 is {version}, expected {QUOTE_VERSION}"
        )
    if key_type != ATT_KEY_TYPE_ECDSA_P256:
        raise TdxQuoteError(
            f"TDX quote header: attestation key type at offset 2 is {key_type}, expected "
            f"{ATT_KEY_TYPE_ECDSA_P256} (ECDSA-256-with-P-256)"
        )
    if tee_type != TEE_TYPE_TDX:
        raise TdxQuoteError(
            f"TDX quote header: TEE type at offset 4 is {tee_type:#x}, expected "
            f"{TEE_TYPE_TDX:#x} (TDX; 0x0 would be SGX)"
        )
    if n < SIG_LEN_OFFSET:
        raise TdxQuoteError(
            f"TDX quote is {n} bytes: the {BODY_SIZE}-byte TD report body at offset "
            f"{BODY_OFFSET} needs {SIG_LEN_OFFSET}"
        )
    if n < SIG_DATA_OFFSET:
        raise TdxQuoteError(
            f"TDX quote is {n} bytes: the 4-byte signature data length at offset "
            f"{SIG_LEN_OFFSET} needs {SIG_DATA_OFFSET}"
        )
    (sig_len,) = struct.unpack_from("<I", data, SIG_LEN_OFFSET)
    following = n - SIG_DATA_OFFSET
    if sig_len == 0:
        raise TdxQuoteError(
            f"TDX quote: signature data length at offset {SIG_LEN_OFFSET} is 0; a quote "
            "without signature data proves nothing"
        )
    if sig_len != following:
        what = "short" if sig_len > following else "long"
        raise TdxQuoteError(
            f"TDX quote is {what}: signature data length at offset {SIG_LEN_OFFSET} says "
            f"{sig_len} bytes, but {following} bytes follow at offset {SIG_DATA_OFFSET}"
        )
    body = _BODY.unpack_from(data, BODY_OFFSET)
    (svn, mrseam, mrsignerseam, seam_attr, td_attr, xfam, mrtd, cfgid, owner, ownercfg,
     r0, r1, r2, r3, report_data) = body
    return TdxQuote(
        version=version,
        att_key_type=key_type,
        tee_type=tee_type,
        reserved1=res1,
        reserved2=res2,
        qe_vendor_id=vendor,
        user_data=user,
        tee_tcb_svn=svn,
        mrseam=mrseam,
        mrsignerseam=mrsignerseam,
        seam_attributes=seam_attr,
        td_attributes=td_attr,
        xfam=xfam,
        mrtd=mrtd,
        mrconfigid=cfgid,
        mrowner=owner,
        mrownerconfig=ownercfg,
        rtmr0=r0,
        rtmr1=r1,
        rtmr2=r2,
        rtmr3=r3,
        report_data=report_data,
        signature_data=data[SIG_DATA_OFFSET:],
        raw=data,
    )


def _fixed(name: str, value: bytes, size: int) -> bytes:
    if not isinstance(value, (bytes, bytearray)) or len(value) != size:
        got = len(value) if isinstance(value, (bytes, bytearray)) else type(value).__name__
        raise ValueError(f"{name} must be {size} bytes, got {got}")
    return bytes(value)


def build_quote_v4(
    *,
    report_data: bytes,
    mrtd: bytes = bytes(48),
    rtmrs: tuple[bytes, bytes, bytes, bytes] = (bytes(48),) * 4,
    td_attributes: int = 0,
    signature_data: bytes = b"\x00",
    qe_vendor_id: bytes = bytes(16),
    user_data: bytes = bytes(20),
    tee_tcb_svn: bytes = bytes(16),
    mrseam: bytes = bytes(48),
    mrsignerseam: bytes = bytes(48),
    seam_attributes: bytes = bytes(8),
    xfam: bytes = bytes(8),
    mrconfigid: bytes = bytes(48),
    mrowner: bytes = bytes(48),
    mrownerconfig: bytes = bytes(48),
) -> bytes:
    """Write a quote in the v4 layout. It carries no valid Intel signature: it is for the dev
    provider and for tests, which also build quotes independently to check this and the parser."""
    if len(rtmrs) != 4:
        raise ValueError(f"rtmrs must be 4 values, got {len(rtmrs)}")
    if not 0 <= td_attributes < 1 << 64:
        raise ValueError("td_attributes must fit in 64 bits")
    header = _HEADER.pack(
        QUOTE_VERSION,
        ATT_KEY_TYPE_ECDSA_P256,
        TEE_TYPE_TDX,
        0,
        0,
        _fixed("qe_vendor_id", qe_vendor_id, 16),
        _fixed("user_data", user_data, 20),
    )
    body = _BODY.pack(
        _fixed("tee_tcb_svn", tee_tcb_svn, 16),
        _fixed("mrseam", mrseam, 48),
        _fixed("mrsignerseam", mrsignerseam, 48),
        _fixed("seam_attributes", seam_attributes, 8),
        td_attributes,
        _fixed("xfam", xfam, 8),
        _fixed("mrtd", mrtd, 48),
        _fixed("mrconfigid", mrconfigid, 48),
        _fixed("mrowner", mrowner, 48),
        _fixed("mrownerconfig", mrownerconfig, 48),
        *(_fixed(f"rtmr{i}", r, 48) for i, r in enumerate(rtmrs)),
        _fixed("report_data", report_data, 64),
    )
    sig = bytes(signature_data)
    if not sig:
        raise ValueError("signature_data must not be empty")
    return header + body + struct.pack("<I", len(sig)) + sig


def measurement_of(quote: TdxQuote) -> bytes:
    """The allowlisted measurement of a TDX quote: sha256(MRTD || RTMR0 || RTMR1 || RTMR2 || RTMR3)."""
    return hashlib.sha256(quote.mrtd + quote.rtmr0 + quote.rtmr1 + quote.rtmr2 + quote.rtmr3).digest()


# ---------------------------------------------------------------------------------------------
# configfs-tsm provider


def _missing_message(path: Path) -> str:
    return (
        f"configfs-tsm is missing at {path}: this machine offers no TEE quote interface (it is not "
        "a TDX guest, the kernel lacks CONFIG_TSM_REPORTS, or configfs is not mounted at "
        "/sys/kernel/config). For development there is the 'dev' provider, which PROVES NOTHING."
    )


class TdxProvider:
    """TDX quotes from Linux configfs-tsm.

    `mkdir` and `rmdir` are the calls that create and remove the report entry. On real configfs the
    kernel fills a new entry with its attribute files (`provider`, `inblob`, `outblob`,
    `generation`, ...) and removes them on rmdir; tests pass hooks that do the same to a plain
    directory tree.
    """

    name = "tdx"

    def __init__(
        self,
        tsm_path: str | os.PathLike[str] = DEFAULT_TSM_PATH,
        *,
        mkdir: Callable[[Path], None] = os.mkdir,
        rmdir: Callable[[Path], None] = os.rmdir,
    ) -> None:
        self.tsm_path = Path(tsm_path)
        self._mkdir = mkdir
        self._rmdir = rmdir

    def __repr__(self) -> str:
        return f"TdxProvider(tsm_path={str(self.tsm_path)!r})"

    def check_available(self) -> None:
        """Raise AttestationUnavailable unless configfs-tsm exists at `tsm_path`."""
        if not self.tsm_path.is_dir():
            raise AttestationUnavailable(_missing_message(self.tsm_path))

    def quote(self, report_data: bytes) -> bytes:
        """Ask the TDX module for a quote over these 64 bytes of REPORTDATA; return its bytes."""
        report_data = _fixed("report_data", report_data, 64)
        self.check_available()
        entry = self.tsm_path / f"dilocox-{os.getpid()}-{secrets.token_hex(6)}"
        try:
            self._mkdir(entry)
        except FileNotFoundError:
            raise AttestationUnavailable(_missing_message(self.tsm_path)) from None
        except PermissionError as exc:
            raise AttestationUnavailable(
                f"configfs-tsm at {self.tsm_path} refused to create a report entry ({exc}); "
                "quote generation needs root or write access to that directory"
            ) from None
        except OSError as exc:
            raise AttestationError(f"configfs-tsm: cannot create {entry}: {exc}") from exc
        try:
            raw = self._generate(entry, report_data)
        finally:
            try:
                self._rmdir(entry)
            except OSError:
                pass  # the kernel reclaims nothing sensitive; a stale entry is harmless
        try:
            parsed = parse_quote(raw)
        except TdxQuoteError as exc:
            raise AttestationError(f"configfs-tsm returned something that is not a quote: {exc}") from exc
        if parsed.report_data != report_data:
            raise AttestationError(
                "configfs-tsm returned a quote whose REPORTDATA is not what was written "
                f"(wrote {report_data.hex()}, got {parsed.report_data.hex()})"
            )
        return raw

    def _generate(self, entry: Path, report_data: bytes) -> bytes:
        try:
            provider = (entry / "provider").read_text().strip()
        except OSError as exc:
            raise AttestationError(f"configfs-tsm: cannot read {entry / 'provider'}: {exc}") from exc
        if provider != "tdx_guest":
            raise AttestationUnavailable(
                f"configfs-tsm at {self.tsm_path} is provided by {provider!r}, not 'tdx_guest'; "
                "only TDX quotes are supported"
            )
        try:
            with open(entry / "inblob", "wb", buffering=0) as f:
                f.write(report_data)  # one write: configfs takes the blob in a single store
            before = self._generation(entry)
            raw = (entry / "outblob").read_bytes()
            after = self._generation(entry)
        except OSError as exc:
            raise AttestationError(f"configfs-tsm: quote generation failed in {entry}: {exc}") from exc
        if before != after:
            raise AttestationError(
                f"configfs-tsm: {entry} changed while its quote was read (generation {before} -> "
                f"{after}); another writer raced this one"
            )
        if not raw:
            raise AttestationError(f"configfs-tsm: {entry / 'outblob'} is empty")
        return raw

    @staticmethod
    def _generation(entry: Path) -> str | None:
        path = entry / "generation"
        return path.read_text().strip() if path.exists() else None

    def evidence(self, report_data: bytes) -> Evidence:
        from .evidence import Evidence

        return Evidence(provider="tdx", quote=self.quote(report_data))


# ---------------------------------------------------------------------------------------------
# DCAP verification (optional dependency)


@dataclass(frozen=True)
class DcapResult:
    """What dcap-qvl said about a quote whose signature chain it verified."""

    status: str
    advisory_ids: tuple[str, ...]


def dcap_available() -> bool:
    """Whether the optional PyPI package dcap-qvl can be imported."""
    try:
        import dcap_qvl  # noqa: F401
    except ImportError:
        return False
    return True


def load_collateral(collateral: Any = None) -> Any:
    """Turn collateral into what dcap_qvl.verify takes, or None when there is none.

    Accepts a dcap_qvl QuoteCollateralV3 object (returned as is), JSON text or bytes, a dict, or a
    path to a JSON file. With None, the path in $DILOCOX_DCAP_COLLATERAL is used if set.
    """
    import dcap_qvl

    if collateral is None:
        env = os.environ.get(COLLATERAL_ENV)
        if not env:
            return None
        collateral = Path(env)
    if isinstance(collateral, os.PathLike):
        try:
            collateral = Path(collateral).read_text()
        except OSError as exc:
            raise EvidenceError(f"cannot read DCAP collateral {collateral}: {exc}") from exc
    if isinstance(collateral, dict):
        collateral = json.dumps(collateral)
    if isinstance(collateral, (bytes, bytearray)):
        collateral = bytes(collateral).decode("utf-8")
    if isinstance(collateral, str):
        try:
            return dcap_qvl.QuoteCollateralV3.from_json(collateral)
        except Exception as exc:  # the binding raises its own error types
            raise EvidenceError(f"DCAP collateral is not valid QuoteCollateralV3 JSON: {exc}") from exc
    return collateral


def dcap_verify(quote: bytes, collateral: Any, *, now: int | None = None) -> DcapResult:
    """Verify a quote's signature chain (QE signature, PCK certificate chain, TCB info, CRLs) with
    dcap-qvl against `collateral`. Raises AttestationUnavailable when dcap-qvl is not installed and
    EvidenceError when verification fails."""
    try:
        import dcap_qvl
    except ImportError:
        raise AttestationUnavailable(
            "the PyPI package dcap-qvl is not installed, so TDX quote signatures cannot be checked"
        ) from None
    coll = load_collateral(collateral)
    if coll is None:
        raise AttestationUnavailable(
            "no DCAP collateral was supplied (pass collateral= or set "
            f"${COLLATERAL_ENV}); this project fetches nothing from the network"
        )
    when = int(time.time()) if now is None else int(now)
    try:
        result = dcap_qvl.verify(bytes(quote), coll, when)
    except Exception as exc:  # the binding raises ValueError/RuntimeError depending on version
        raise EvidenceError(f"dcap-qvl refused the quote: {exc}") from exc
    status = getattr(result, "status", None)
    advisories = getattr(result, "advisory_ids", None)
    if status is None and hasattr(result, "to_json"):
        try:
            obj = json.loads(result.to_json())
        except (TypeError, ValueError):
            obj = {}
        status = obj.get("status")
        advisories = obj.get("advisory_ids", advisories)
    if not isinstance(status, str):
        raise EvidenceError(f"dcap-qvl returned no TCB status ({type(result).__name__})")
    return DcapResult(status=status, advisory_ids=tuple(str(a) for a in (advisories or ())))
