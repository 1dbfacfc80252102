"""Intel TDX: the quote v4 and v5 layouts, and the configfs-tsm provider.

All integers are little-endian. Both versions share the 48-byte header:

    offset  size  field
         0     2  version                      4 or 5
         2     2  attestation key type         must be 2 (ECDSA-256 with P-256)
         4     4  TEE type                     must be 0x81 (TDX)
         8     2  reserved (QE SVN)
        10     2  reserved (PCE SVN)
        12    16  QE vendor id
        28    20  user data

Quote v4 (TDX 1.0):

        48   584  TD report body (TD report 1.0, below)
       632     4  signature data length N
       636     N  signature data

Quote v5 (TDX 1.5):

        48     2  body type                    2 = TD report 1.0 (584 bytes),
                                               3 = TD report 1.5 (648 bytes)
        50     4  body size                    must be the size of that body type
        54  size  TD report body
   54+size     4  signature data length N
   58+size     N  signature data

TD report body, offsets relative to its start (48 in v4, 54 in v5):

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
    TD report 1.5 only:
       584    16  TEE_TCB_SVN2
       600    48  MRSERVICETD

The signature data holds the quote's ECDSA signature over the signed region (header, the v5 body
descriptor, and the body), the attestation key and the QE certification data. Real quote buffers
carry padding after it (zeros, or anything: 70 zero bytes in dcap-qvl's sample, 39 bytes of text
in go-tdx-guest's production sample), so `parse_quote` reads by the declared lengths, ignores what
follows the declared signature data, and keeps in `TdxQuote.raw` only the quote itself. Anything
else that disagrees with the layout is refused, naming the field and its offset. Body types 1 (SGX)
and 4 (TD report 1.5 with extensions) are refused as unsupported.

`parse_quote` checks no signature: `attestation.dcap` verifies every TDX quote with dcap-qvl.

`TdxProvider` asks the kernel for a quote through configfs-tsm (Linux >= 6.7, CONFIG_TSM_REPORTS):
make a fresh directory under /sys/kernel/config/tsm/report, check its `provider` says `tdx_guest`,
write the 64 bytes of REPORTDATA to `inblob`, read the quote from `outblob`, remove the directory.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import AttestationError, AttestationUnavailable, EvidenceError

if TYPE_CHECKING:  # pragma: no cover
    from .evidence import Evidence

QUOTE_V4 = 4
QUOTE_V5 = 5
QUOTE_VERSION = QUOTE_V4  # the version build_quote_v4 writes
ATT_KEY_TYPE_ECDSA_P256 = 2
TEE_TYPE_TDX = 0x81

HEADER_SIZE = 48
BODY_SIZE = 584  # TD report 1.0
BODY15_SIZE = 648  # TD report 1.5
BODY_TYPE_TD10 = 2
BODY_TYPE_TD15 = 3
BODY_TYPES: dict[int, tuple[str, int]] = {
    BODY_TYPE_TD10: ("TD report 1.0", BODY_SIZE),
    BODY_TYPE_TD15: ("TD report 1.5", BODY15_SIZE),
}
V5_DESCRIPTOR_OFFSET = HEADER_SIZE  # u16 body type, u32 body size
V5_DESCRIPTOR_SIZE = 6
V5_BODY_OFFSET = HEADER_SIZE + V5_DESCRIPTOR_SIZE  # 54

# Quote v4 offsets (build_quote_v4 writes this layout).
BODY_OFFSET = HEADER_SIZE
SIG_LEN_OFFSET = HEADER_SIZE + BODY_SIZE  # 632
SIG_DATA_OFFSET = SIG_LEN_OFFSET + 4  # 636
MIN_QUOTE_SIZE = SIG_DATA_OFFSET + 1  # at least one byte of signature data
MAX_QUOTE_SIZE = 1 << 20  # real quotes with their certificate chain are a few KiB

TD_ATTRIBUTES_DEBUG = 1 << 0  # TUD.DEBUG

_HEADER = struct.Struct("<HHIHH16s20s")
_V5_DESCRIPTOR = struct.Struct("<HI")
# TEE_TCB_SVN, MRSEAM, MRSIGNERSEAM, SEAMATTRIBUTES, TDATTRIBUTES, XFAM, MRTD, MRCONFIGID, MROWNER,
# MROWNERCONFIG, RTMR0..3, REPORTDATA
_BODY = struct.Struct("<16s48s48s8sQ8s48s48s48s48s48s48s48s48s64s")
_BODY15_EXTRA = struct.Struct("<16s48s")  # TEE_TCB_SVN2, MRSERVICETD
assert _HEADER.size == HEADER_SIZE and _BODY.size == BODY_SIZE
assert _V5_DESCRIPTOR.size == V5_DESCRIPTOR_SIZE and _BODY.size + _BODY15_EXTRA.size == BODY15_SIZE

# (name, offset in the body, size) for every fixed-size field of a TD report.
TD_REPORT_FIELDS: tuple[tuple[str, int, int], ...] = (
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
    ("tee_tcb_svn2", 584, 16),  # TD report 1.5 only
    ("mrservicetd", 600, 48),  # TD report 1.5 only
)
# The same with offsets in a v4 quote.
BODY_FIELDS: tuple[tuple[str, int, int], ...] = tuple(
    (name, BODY_OFFSET + off, size) for name, off, size in TD_REPORT_FIELDS if off < BODY_SIZE
)

DEFAULT_TSM_PATH = Path("/sys/kernel/config/tsm/report")


class TdxQuoteError(EvidenceError):
    """A byte string that is not a TDX quote v4 or v5 as this project reads it."""


@dataclass(frozen=True)
class TdxQuote:
    """A parsed TDX quote (v4 or v5). `raw` is the quote's bytes up to the end of its declared
    signature data: any padding that followed in the buffer it was parsed from is not in it.

    `body_type` is None for v4 (whose body is always TD report 1.0); `tee_tcb_svn2` and
    `mrservicetd` are None unless the body is a TD report 1.5.
    """

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
    body_type: int | None = None
    tee_tcb_svn2: bytes | None = None
    mrservicetd: bytes | None = None

    @property
    def debug(self) -> bool:
        """True when the TD was launched with TUD.DEBUG: its memory is open to the host."""
        return bool(self.td_attributes & TD_ATTRIBUTES_DEBUG)

    @property
    def rtmrs(self) -> tuple[bytes, bytes, bytes, bytes]:
        return (self.rtmr0, self.rtmr1, self.rtmr2, self.rtmr3)

    @property
    def body_offset(self) -> int:
        """Where the TD report body starts: 48 in v4, 54 in v5."""
        return BODY_OFFSET if self.version == QUOTE_V4 else V5_BODY_OFFSET

    @property
    def signed_region(self) -> bytes:
        """Header || (v5: body type and size) || TD report body: what the quoting enclave's
        attestation key signs. It ends where the 4-byte signature data length begins."""
        return self.raw[: len(self.raw) - 4 - len(self.signature_data)]

    def details(self) -> dict[str, str]:
        """The quote's version and measured fields as strings (hex for bytes), for logs and
        VerifiedEvidence.details."""
        out = {
            "quote_version": str(self.version),
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
        if self.body_type is not None:
            out["body_type"] = str(self.body_type)
        if self.tee_tcb_svn2 is not None:
            out["tee_tcb_svn2"] = self.tee_tcb_svn2.hex()
        if self.mrservicetd is not None:
            out["mrservicetd"] = self.mrservicetd.hex()
        return out


def _body_layout(data: bytes, version: int) -> tuple[int | None, int, int]:
    """(body type or None for v4, body offset, body size), checking the v5 body descriptor."""
    n = len(data)
    if version == QUOTE_V4:
        return None, BODY_OFFSET, BODY_SIZE
    if n < V5_BODY_OFFSET:
        raise TdxQuoteError(
            f"TDX quote v5 is {n} bytes: too short for the {V5_DESCRIPTOR_SIZE}-byte body type and "
            f"size at offset {V5_DESCRIPTOR_OFFSET}"
        )
    body_type, body_size = _V5_DESCRIPTOR.unpack_from(data, V5_DESCRIPTOR_OFFSET)
    if body_type not in BODY_TYPES:
        known = ", ".join(f"{t} ({name})" for t, (name, _) in BODY_TYPES.items())
        raise TdxQuoteError(
            f"TDX quote v5: body type at offset {V5_DESCRIPTOR_OFFSET} is {body_type}, expected "
            f"{known}; 1 is an SGX enclave report, 4 a TD report 1.5 with extensions (unsupported)"
        )
    name, expected_size = BODY_TYPES[body_type]
    if body_size != expected_size:
        raise TdxQuoteError(
            f"TDX quote v5: body size at offset {V5_DESCRIPTOR_OFFSET + 2} is {body_size}, but body "
            f"type {body_type} ({name}) at offset {V5_DESCRIPTOR_OFFSET} is {expected_size} bytes"
        )
    return body_type, V5_BODY_OFFSET, body_size


def _check_header(version: int, key_type: int, tee_type: int) -> None:
    """A v4 or v5 TDX quote signed with an ECDSA-256-with-P-256 attestation key."""
    if version not in (QUOTE_V4, QUOTE_V5):
        raise TdxQuoteError(
            f"TDX quote header: version at offset 0 is {version}, expected {QUOTE_V4} or {QUOTE_V5}"
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


def parse_quote(data: bytes) -> TdxQuote:
    """Parse a TDX quote v4 or v5 by its declared lengths (module docstring), ignoring any padding
    after the declared signature data; refuse anything short or inconsistent, by field and offset."""
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
    _check_header(version, key_type, tee_type)
    body_type, body_offset, body_size = _body_layout(data, version)
    sig_len_offset = body_offset + body_size
    sig_data_offset = sig_len_offset + 4
    if n < sig_len_offset:
        raise TdxQuoteError(
            f"TDX quote is {n} bytes: the {body_size}-byte TD report body at offset "
            f"{body_offset} needs {sig_len_offset}"
        )
    if n < sig_data_offset:
        raise TdxQuoteError(
            f"TDX quote is {n} bytes: the 4-byte signature data length at offset "
            f"{sig_len_offset} needs {sig_data_offset}"
        )
    (sig_len,) = struct.unpack_from("<I", data, sig_len_offset)
    following = n - sig_data_offset
    if sig_len == 0:
        raise TdxQuoteError(
            f"TDX quote: signature data length at offset {sig_len_offset} is 0; a quote "
            "without signature data proves nothing"
        )
    if sig_len > following:
        raise TdxQuoteError(
            f"TDX quote is short: signature data length at offset {sig_len_offset} says "
            f"{sig_len} bytes, but only {following} bytes follow at offset {sig_data_offset}"
        )
    end = sig_data_offset + sig_len  # what follows is buffer padding, not part of the quote
    (svn, mrseam, mrsignerseam, seam_attr, td_attr, xfam, mrtd, cfgid, owner, ownercfg,
     r0, r1, r2, r3, report_data) = _BODY.unpack_from(data, body_offset)
    tee_tcb_svn2 = mrservicetd = None
    if body_type == BODY_TYPE_TD15:
        tee_tcb_svn2, mrservicetd = _BODY15_EXTRA.unpack_from(data, body_offset + BODY_SIZE)
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
        signature_data=data[sig_data_offset:end],
        raw=data[:end],
        body_type=body_type,
        tee_tcb_svn2=tee_tcb_svn2,
        mrservicetd=mrservicetd,
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
        """Ask the TDX module for a quote over these 64 bytes of REPORTDATA; return its bytes up to
        the end of the declared signature data (the outblob's padding is dropped)."""
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
        return parsed.raw  # without the buffer's padding after the signature data

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
