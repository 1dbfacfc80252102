"""What an audit has found so far, and reading the store so that a bad object is a finding.

Every check module records into one ``Findings``: a failure names round, object, check and what
was found (audit.result.Failure); a warning is kept once, however many rounds raise it. Reading
through ``read`` and ``read_manifest`` turns a missing, corrupt or unreadable object into an
``object`` (or ``manifest``) failure and returns None, so the checks go on with what could be read.
"""

from __future__ import annotations

from storage_client import (
    CID,
    CorruptObjectError,
    InvalidCIDError,
    Manifest,
    ManifestError,
    MissingObjectError,
    Store,
    StoreError,
)

from .checks import AuditCheck
from .result import AuditResult, Failure


def cid_digest(cid_text: str) -> bytes:
    """The sha256 a CID names: what the chain records of a stored object."""
    return CID.parse(cid_text).digest


class Findings:
    """The audit's result as it is being built, and the store it reads."""

    def __init__(self, result: AuditResult, store: Store) -> None:
        self.result = result
        self.store = store
        self._warned: set[str] = set()

    def fail(self, round_: int | None, obj: str, check: AuditCheck, message: str) -> None:
        self.result.failures.append(Failure(round_, obj, check, message))

    def warn(self, message: str) -> None:
        # The same warning raised by many rounds (an unrecorded lag, a shared registry) is said once.
        if message not in self._warned:
            self._warned.add(message)
            self.result.warnings.append(message)

    def read(self, round_: int, cid: CID | str, what: str) -> bytes | None:
        """The object's bytes, or None after recording why (missing, corrupt)."""
        try:
            return self.store.get(cid)
        except MissingObjectError:
            self.fail(round_, str(cid), AuditCheck.OBJECT, f"{what} is missing from the store")
        except CorruptObjectError as exc:
            self.fail(round_, str(cid), AuditCheck.OBJECT,
                      f"{what} does not re-hash to its CID: expected sha256 {exc.expected}, got {exc.actual}")
        except (StoreError, InvalidCIDError, ValueError) as exc:
            self.fail(round_, str(cid), AuditCheck.OBJECT, f"{what} cannot be read: {exc}")
        return None

    def read_manifest(self, round_: int, cid: CID) -> Manifest | None:
        """Round ``round_``'s manifest, or None after recording why it cannot be read or parsed."""
        try:
            return Manifest.from_json(self.store.get_json(cid))
        except MissingObjectError:
            self.fail(round_, str(cid), AuditCheck.OBJECT, f"the manifest of round {round_} is missing from the store")
        except CorruptObjectError as exc:
            self.fail(round_, str(cid), AuditCheck.OBJECT, f"the manifest of round {round_} does not re-hash to its CID: "
                                                  f"expected sha256 {exc.expected}, got {exc.actual}")
        except (StoreError, ManifestError) as exc:
            self.fail(round_, str(cid), AuditCheck.MANIFEST, f"the manifest of round {round_} is not a valid manifest: {exc}")
        return None
