"""DCAP: every TDX quote is verified with dcap-qvl against Intel collateral, or refused.

A TDX quote proves something only once its signature chain is checked: anyone can copy a published
quote and rewrite its REPORTDATA. `dcap_verify` does that check with the PyPI package dcap-qvl (a
required dependency) and applies a TCB-status policy; there is no path that accepts a TDX quote
without it. What it runs, in order, each failure raising PolicyViolation("dcap", ...):

    collateral  from `DcapSettings.collateral_file` (the JSON that dcap-qvl's QuoteCollateralV3
                reads), or fetched from `DcapSettings.pccs_url` with `dcap_qvl.get_collateral`;
                neither configured is a refusal
    window      the collateral's validity window, from the issueDate / nextUpdate of its TCB info
                and QE identity, contains the verification time; outside it the refusal names the
                dates (dcap-qvl checks the same, and the CRLs' nextUpdate, without naming them)
    signature   `dcap_qvl.verify(quote, collateral, now)`: the PCK certificate chain to Intel's
                root (with CRLs), the QE report and its binding of the attestation key, and the
                quote's ECDSA signature over its header and TD report (REPORTDATA included); it
                also refuses debug TDs, TDs without SEPT_VE_DISABLE, a non-zero MRSERVICETD, and a
                platform whose TCB matches no level of the TCB info
    tcb status  the status dcap-qvl reports is in `DcapSettings.allowed_tcb_statuses`
                (only "UpToDate" unless others are named)

The verification time is unix seconds, the real clock unless the caller passes `now` (tests do:
published sample collateral is valid for a month).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import dcap_qvl

from storage_client import JSONBoundsError, loads_bounded

from .errors import PolicyViolation

# The TCB statuses dcap-qvl reports for a quote it accepts ("Revoked" it refuses itself).
TCB_STATUSES: tuple[str, ...] = (
    "UpToDate",
    "SWHardeningNeeded",
    "ConfigurationNeeded",
    "ConfigurationAndSWHardeningNeeded",
    "OutOfDate",
    "OutOfDateConfigurationNeeded",
)
DEFAULT_TCB_STATUSES: frozenset[str] = frozenset({"UpToDate"})
MAX_COLLATERAL_BYTES = 1 << 20  # Intel collateral is some 20 KiB
MAX_COLLATERAL_DEPTH = 8
DEFAULT_PCCS_TIMEOUT_S = 30.0
_MESSAGE_LIMIT = 160  # dcap-qvl's own words are quoted up to this many characters


def _utc(ts: int | float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _short(text: str, limit: int = _MESSAGE_LIMIT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass(frozen=True)
class DcapSettings:
    """Where a verifier gets Intel collateral, and which TCB statuses it accepts.

    collateral_file       a QuoteCollateralV3 JSON file, read at each verification (default None)
    pccs_url              a PCCS (or Intel PCS) to fetch collateral from per quote (default None);
                          at most one of the two; with neither, every TDX quote is refused
    allowed_tcb_statuses  dcap-qvl TCB statuses accepted (default {"UpToDate"}); any other must be
                          named here, from TCB_STATUSES
    pccs_timeout_s        how long a PCCS fetch may take (default 30 s)
    """

    collateral_file: Path | None = None
    pccs_url: str | None = None
    allowed_tcb_statuses: frozenset[str] = field(default_factory=lambda: DEFAULT_TCB_STATUSES)
    pccs_timeout_s: float = DEFAULT_PCCS_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.collateral_file is not None:
            object.__setattr__(self, "collateral_file", Path(self.collateral_file))
        if self.pccs_url is not None:
            url = str(self.pccs_url).strip()
            parts = urlsplit(url)
            if parts.scheme not in ("https", "http") or not parts.netloc:
                raise ValueError(f"pccs_url must be an http(s) URL, got {_short(url, 80)!r}")
            object.__setattr__(self, "pccs_url", url.rstrip("/"))
        if self.collateral_file is not None and self.pccs_url is not None:
            raise ValueError("give DCAP collateral as collateral_file or pccs_url, not both")
        if isinstance(self.allowed_tcb_statuses, str):
            raise TypeError("allowed_tcb_statuses must be a collection of statuses, not one string")
        statuses = frozenset(self.allowed_tcb_statuses)
        unknown = sorted(statuses - set(TCB_STATUSES))
        if unknown:
            raise ValueError(
                f"unknown TCB status(es) {', '.join(_short(s, 40) for s in unknown)}; known: "
                f"{', '.join(TCB_STATUSES)} (Revoked is always refused)"
            )
        if not statuses:
            raise ValueError("allowed_tcb_statuses is empty: no TDX quote could ever be accepted")
        object.__setattr__(self, "allowed_tcb_statuses", statuses)
        if not self.pccs_timeout_s > 0:
            raise ValueError("pccs_timeout_s must be positive")

    @property
    def source(self) -> str | None:
        """Where collateral comes from, in words; None when nothing is configured."""
        if self.collateral_file is not None:
            return f"collateral file {self.collateral_file}"
        if self.pccs_url is not None:
            return f"PCCS {self.pccs_url}"
        return None


@dataclass(frozen=True)
class CollateralWindow:
    """When collateral is valid: from the latest issueDate to the earliest nextUpdate of its TCB
    info and QE identity (unix seconds)."""

    issued: int
    next_update: int

    def describe(self) -> str:
        return f"issued {_utc(self.issued)}, next update {_utc(self.next_update)}"


@dataclass(frozen=True)
class DcapResult:
    """What dcap-qvl concluded about a quote whose signature chain it verified."""

    status: str
    advisory_ids: tuple[str, ...]
    collateral_source: str
    collateral_window: CollateralWindow
    verified_at: int


def _refuse(message: str) -> PolicyViolation:
    return PolicyViolation("dcap", message)


def _run(factory: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    """Run a coroutine to completion from synchronous code, also where this thread already runs
    an event loop (then on a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def _read_collateral_file(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_COLLATERAL_BYTES + 1)
    except OSError as exc:
        raise _refuse(f"cannot read the DCAP collateral file {path}: {exc.strerror or exc}") from None
    try:
        loads_bounded(data, max_bytes=MAX_COLLATERAL_BYTES, max_depth=MAX_COLLATERAL_DEPTH,
                      what=f"DCAP collateral file {path}")
        return dcap_qvl.QuoteCollateralV3.from_json(data.decode("utf-8"))
    except JSONBoundsError as exc:
        raise _refuse(str(exc)) from None
    except (ValueError, TypeError) as exc:
        raise _refuse(f"DCAP collateral file {path} is not QuoteCollateralV3 JSON: {_short(str(exc))}") from None


def _fetch_collateral(url: str, quote: bytes, timeout_s: float) -> Any:
    async def fetch() -> Any:
        return await asyncio.wait_for(dcap_qvl.get_collateral(url, quote), timeout_s)

    try:
        return _run(fetch)
    except (asyncio.TimeoutError, TimeoutError):
        raise _refuse(f"PCCS {url} did not deliver collateral within {timeout_s:g}s") from None
    except Exception as exc:  # the binding raises ValueError for every fetch failure
        raise _refuse(f"cannot fetch collateral from PCCS {url}: {_short(str(exc))}") from None


def load_collateral(settings: DcapSettings, quote: bytes) -> Any:
    """The dcap_qvl.QuoteCollateralV3 for `quote` from where `settings` says (PolicyViolation
    "dcap" when none is configured or it cannot be had)."""
    if settings.collateral_file is not None:
        return _read_collateral_file(settings.collateral_file)
    if settings.pccs_url is not None:
        return _fetch_collateral(settings.pccs_url, quote, settings.pccs_timeout_s)
    raise _refuse(
        "no DCAP collateral is configured (DcapSettings.collateral_file or pccs_url), so this TDX "
        "quote cannot be verified; unverified TDX evidence is never accepted"
    )


def _dates(text: str, what: str) -> tuple[int, int]:
    try:
        obj = loads_bounded(text, max_bytes=MAX_COLLATERAL_BYTES, max_depth=MAX_COLLATERAL_DEPTH, what=what)
        issued = datetime.fromisoformat(obj["issueDate"])
        next_update = datetime.fromisoformat(obj["nextUpdate"])
    except (ValueError, TypeError, KeyError) as exc:
        raise _refuse(
            f"the collateral's {what} has no readable issueDate and nextUpdate ({_short(str(exc), 80)})"
        ) from None
    if issued.tzinfo is None or next_update.tzinfo is None:
        raise _refuse(f"the collateral's {what} dates carry no time zone")
    return int(issued.timestamp()), int(next_update.timestamp())


def collateral_window(collateral: Any) -> CollateralWindow:
    """The validity window of a QuoteCollateralV3 (its TCB info's and QE identity's dates)."""
    tcb = _dates(collateral.tcb_info, "TCB info")
    qe = _dates(collateral.qe_identity, "QE identity")
    return CollateralWindow(issued=max(tcb[0], qe[0]), next_update=min(tcb[1], qe[1]))


_CRL_EXPIRED = re.compile(r"CrlExpired \{ time: UnixTime\((\d+)\), next_update: UnixTime\((\d+)\) \}")


def _explain(error: str, window: CollateralWindow, now: int) -> str:
    """A short message for a dcap-qvl refusal that names the check; dcap-qvl's own first line is
    quoted (bounded), the quote never."""
    said = _short(error.removeprefix("Verification failed: ").splitlines()[0] if error else "no reason")
    crl = _CRL_EXPIRED.search(error)
    if crl:
        return (f"the DCAP collateral expired: its CRL's next update was {_utc(int(crl.group(2)))}, before the "
                f"verification time {_utc(now)} (TCB info and QE identity {window.describe()}); fetch fresh "
                "collateral (a PCCS)")
    if any(s in error for s in ("TCBInfo expired", "QE Identity expired", "issue date is in the future",
                                "CrlExpired", "CrlNotValidYet")):
        return (f"the DCAP collateral is outside its validity window at {_utc(now)} ({window.describe()}; "
                f"dcap-qvl: {said})")
    if "CertExpired" in error or "CertNotValidYet" in error:
        return (f"a certificate of the quote's or the collateral's chain is not valid at {_utc(now)} "
                f"(dcap-qvl: {said})")
    if "ISV enclave report signature is invalid" in error:
        return ("the quote's signature does not verify: its header and TD report (REPORTDATA included) were "
                f"not signed by its attestation key (dcap-qvl: {said})")
    if "qe_report" in error or "QE report" in error:
        return ("the quote's signature does not verify: the quoting enclave's report does not vouch for its "
                f"attestation key (dcap-qvl: {said})")
    if "quote_collateral" in error:
        return f"the collateral's signature does not verify (dcap-qvl: {said})"
    if "No matching TCB level" in error:
        return ("TCB status: no TCB level in the collateral matches this platform, so it has no status any "
                f"policy could allow; its TCB is older than every level Intel lists (dcap-qvl: {said})")
    if "TCB status is invalid" in error:
        return f"TCB status: the platform's TCB is revoked, which is never allowed (dcap-qvl: {said})"
    if "Debug mode" in error:
        return f"the TD was launched with TUD.DEBUG, which dcap-qvl always refuses (dcap-qvl: {said})"
    if "Fmspc mismatch" in error:
        return f"the collateral is for another platform (FMSPC) than the quote's (dcap-qvl: {said})"
    if "certificate" in error.lower() or "cert" in error:
        return f"the quote's PCK certificate chain does not verify to Intel's root (dcap-qvl: {said})"
    return f"dcap-qvl refused the quote: {said}"


def _check_time(now: int | None) -> int:
    if now is None:
        return int(time.time())
    if isinstance(now, bool) or not isinstance(now, int) or now < 0:
        raise ValueError(f"now must be unix seconds (a non-negative int), not {now!r}")
    return now


def dcap_verify(quote: bytes, settings: DcapSettings, *, now: int | None = None) -> DcapResult:
    """Verify a TDX quote with dcap-qvl against the collateral `settings` names, at `now` (unix
    seconds; the real clock by default), and apply its TCB-status policy. Every refusal is
    PolicyViolation("dcap", message naming what failed)."""
    when = _check_time(now)
    quote = bytes(quote)
    collateral = load_collateral(settings, quote)
    source = settings.source or "collateral"
    window = collateral_window(collateral)
    if when < window.issued:
        raise _refuse(f"the DCAP collateral ({source}) is not valid yet at {_utc(when)}: {window.describe()}")
    if when > window.next_update:
        raise _refuse(
            f"the DCAP collateral ({source}) expired on {_utc(window.next_update)}, before the verification "
            f"time {_utc(when)} (its validity window: {window.describe()}); fetch fresh collateral (a PCCS)"
        )
    try:
        report = dcap_qvl.verify(quote, collateral, when)
    except Exception as exc:  # the binding raises ValueError("Verification failed: ...")
        raise _refuse(_explain(str(exc), window, when)) from None
    except BaseException as exc:  # a Rust panic surfaces as pyo3's PanicException (a BaseException)
        if type(exc).__name__ != "PanicException":
            raise
        raise _refuse(f"dcap-qvl failed on this quote: {_short(str(exc))}") from None
    status = str(report.status)
    advisories = tuple(str(a) for a in report.advisory_ids)
    if status not in settings.allowed_tcb_statuses:
        raise _refuse(
            f"TCB status {_short(status, 40)!r} is not allowed (allowed: "
            f"{', '.join(sorted(settings.allowed_tcb_statuses))}); advisories: "
            f"{_short(', '.join(advisories), 120) or 'none'}"
        )
    return DcapResult(status=status, advisory_ids=advisories, collateral_source=source,
                      collateral_window=window, verified_at=when)

