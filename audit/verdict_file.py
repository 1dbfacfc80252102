"""k-of-n verdicts: one auditor's signed verdicts in a file, and gathering k auditors' files into disputes.

``dilocox audit --dispute --sign-only --verdicts-out FILE`` writes what one auditor signs instead of
sending it (``write_verdicts``), as strict JSON:

    {"schema": "dilocox.verdicts/v1", "chain_id": N, "disputes": the disputes contract's address,
     "auditor": the signer's address,
     "verdicts": [{"verdict": attestation.verdict.Verdict.to_json(), "signature": "0x" + 65 bytes}, …]}

``read_verdicts`` parses a file as untrusted input (at most MAX_VERDICTS_FILE bytes and MAX_VERDICTS
verdicts, exactly these keys, each signature recovering to ``auditor`` in the file's EIP-712 domain);
a refusal is a ``VerdictFileError`` naming the file and what is wrong, never quoting it at length.

``gather`` is what ``dilocox settle dispute --verdicts F1 F2 …`` checks before it sends anything:
files of another chain, disputes contract or run, a second file of the same auditor, and auditors
the contract has not admitted are dropped with one line each; files that sign *different* verdicts
on one (round, party) disagree, and that dispute is not sent; a verdict signed by fewer auditors
than the run's threshold k is not sent. Each one left goes out with its signatures (the client sorts
them by signer, as the contract requires).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attestation import SignatureError, checksum_address, recover_address
from attestation.report import Domain
from attestation.verdict import Verdict, disputes_domain
from storage_client import canonical_json, loads_bounded, write_atomic

VERDICTS_SCHEMA = "dilocox.verdicts/v1"
MAX_VERDICTS = 4096  # a run's failures name at most a few per round
MAX_VERDICTS_FILE = 2 << 20  # MAX_VERDICTS entries of ~450 bytes
_FILE_KEYS = {"schema", "chain_id", "disputes", "auditor", "verdicts"}


class VerdictFileError(ValueError):
    """A verdicts file that is not one (the message names the file and the problem)."""


@dataclass(frozen=True)
class VerdictFile:
    """One auditor's signed verdicts, as read from ``path``: each signature recovers to ``auditor``."""

    path: str
    domain: Domain
    auditor: str
    signed: tuple[tuple[Verdict, bytes], ...]


def write_verdicts(path: Path, domain: Domain, auditor: str, signed: list[tuple[Verdict, bytes]]) -> None:
    """Write ``signed`` (verdict, signature) pairs of ``auditor`` in ``domain`` to ``path`` (atomically)."""
    document = {"schema": VERDICTS_SCHEMA, "chain_id": domain.chain_id, "disputes": domain.ledger,
                "auditor": auditor,
                "verdicts": [{"verdict": v.to_json(), "signature": "0x" + s.hex()} for v, s in signed]}
    write_atomic(Path(path), canonical_json(document) + b"\n")


def read_verdicts(path: Path) -> VerdictFile:
    """Parse ``path`` (module docstring); VerdictFileError naming the file and what is wrong."""
    name = str(path)[:200]
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_VERDICTS_FILE + 1)
    except OSError as exc:
        raise VerdictFileError(f"{name}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    try:
        return _parse(name, loads_bounded(raw, max_bytes=MAX_VERDICTS_FILE, max_depth=4, what=name))
    except VerdictFileError:
        raise
    except (ValueError, TypeError) as exc:  # JSONBoundsError, bad fields, bad addresses
        raise VerdictFileError(f"{name}: {str(exc)[:200]}") from None


def _parse(name: str, obj: Any) -> VerdictFile:
    if not isinstance(obj, dict) or set(obj) != _FILE_KEYS or obj["schema"] != VERDICTS_SCHEMA:
        raise VerdictFileError(f"{name}: not a {VERDICTS_SCHEMA} object of exactly {sorted(_FILE_KEYS)}")
    chain_id, entries = obj["chain_id"], obj["verdicts"]
    if type(chain_id) is not int or not 0 < chain_id < 2**64:
        raise VerdictFileError(f"{name}: chain_id must be a positive integer")
    if not isinstance(entries, list) or not 0 < len(entries) <= MAX_VERDICTS:
        raise VerdictFileError(f"{name}: verdicts must be a list of 1 to {MAX_VERDICTS} signed verdicts")
    domain = disputes_domain(chain_id, checksum_address(obj["disputes"]))
    auditor = checksum_address(obj["auditor"])
    signed = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or set(entry) != {"verdict", "signature"}:
            raise VerdictFileError(f"{name}: verdict {i} is not an object of exactly verdict, signature")
        verdict, signature = Verdict.from_json(entry["verdict"]), entry["signature"]
        if not isinstance(signature, str) or len(signature) != 132 or not signature.startswith("0x"):
            raise VerdictFileError(f"{name}: verdict {i}'s signature must be 0x and 65 bytes of hex")
        sig = bytes.fromhex(signature[2:])
        try:
            signer = recover_address(verdict.digest(domain), sig)
        except SignatureError:
            signer = None
        if signer != auditor:
            raise VerdictFileError(f"{name}: verdict {i}'s signature is not {auditor}'s")
        if any(v == verdict for v, _ in signed):
            raise VerdictFileError(f"{name}: verdict {i} (round {verdict.round}, {verdict.party}) is listed twice")
        signed.append((verdict, sig))
    return VerdictFile(name, domain, auditor, tuple(signed))


@dataclass(frozen=True)
class Dispute:
    """A verdict ready to send: its signatures, one per distinct admitted auditor, and their signers."""

    verdict: Verdict
    signatures: tuple[bytes, ...]
    signers: tuple[str, ...]


def gather(files: list[VerdictFile], domain: Domain, run_id: bytes, threshold: int,
           admitted: Callable[[str], bool]) -> tuple[list[Dispute], list[str]]:
    """The disputes ``files`` support on ``run_id`` in ``domain`` with at least ``threshold`` signers
    each (``admitted(address)``: the contract admitted it), and one line per thing left out (module
    docstring), in the order the files and verdicts came."""
    lines: list[str] = []
    seen: set[str] = set()
    by_key: dict[tuple[int, str], dict[Verdict, list[tuple[str, bytes, str]]]] = {}
    for file in files:
        if file.domain.to_eip712() != domain.to_eip712():
            lines.append(f"{file.path}: signed for chain {file.domain.chain_id}, disputes "
                         f"{file.domain.ledger}, not this chain's contract: dropped")
        elif file.auditor in seen:
            lines.append(f"{file.path}: {file.auditor} signed another file given already: dropped (duplicate signer)")
        elif not admitted(file.auditor):
            lines.append(f"{file.path}: {file.auditor} is not an auditor admitted to the run: dropped")
        else:
            seen.add(file.auditor)
            for verdict, signature in file.signed:
                if verdict.run_id != run_id:
                    lines.append(f"{file.path}: round {verdict.round}, {verdict.party}: a verdict on another run "
                                 f"(0x{verdict.run_id.hex()[:12]}…): dropped")
                    continue
                by_key.setdefault((verdict.round, verdict.party), {}).setdefault(verdict, []).append(
                    (file.auditor, signature, file.path))
    disputes = []
    for (round_, party), variants in sorted(by_key.items()):
        if len(variants) > 1:
            said = "; ".join(f"{v.check_name} on 0x{v.evidence.hex()[:12]}… in {', '.join(p for _, _, p in s)}"
                             for v, s in variants.items())
            lines.append(f"round {round_}, {party}: the files disagree on the verdict ({said}): not sent")
            continue
        ((verdict, signed),) = variants.items()
        if len(signed) < threshold:
            lines.append(f"round {round_}, {party}: {verdict.check_name} is signed by {len(signed)} admitted "
                         f"auditor(s), the run needs {threshold}: not sent")
            continue
        disputes.append(Dispute(verdict, tuple(s for _, s, _ in signed), tuple(a for a, _, _ in signed)))
    return disputes, lines
