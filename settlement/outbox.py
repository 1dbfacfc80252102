"""The ledger outbox: ledger writes kept on disk until the chain has confirmed them.

This is what makes "no finished round is lost because the chain was down" true. The coordinator
never writes to the chain from its training path; it enqueues (one atomic JSON file per write, in
order) and a settlement thread flushes. A file is removed only after its transaction's receipt, so
a crash, a killed coordinator or a dead RPC node leaves the write queued for the next flush or the
next start.

Flushing is idempotent. Before sending an item it asks the chain whether the write is already
there (a crash can fall between the receipt and the file's removal): a run that exists with the
same genesis, or a round whose recorded checkpoint and manifest equal the item's, is recognised and
removed without a second transaction. A recorded round that differs is a conflict no retry can fix,
so it raises ``RecordConflict`` (a ``ChainError``) naming both.

Files: ``NNNNNN-create_run.json`` and ``NNNNNN-round.json``, processed in the order of ``NNNNNN``.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attestation.report import ReportError, SignedReport
from storage_client import write_atomic

from .chain import ChainError, ChainUnavailable, TxReverted
from .ledger import Ledger

__all__ = ["SCHEMA", "Outbox", "OutboxError", "RecordConflict"]

log = logging.getLogger("dilocox.settlement")

SCHEMA = "dilocox.outbox/v1"
_NAME = re.compile(r"^(\d{6,})-(create_run|round)\.json$")
_REPEAT_LOG_S = 60.0  # the same failure is logged again at most this often


class OutboxError(ValueError):
    """An outbox item that cannot be read back (it stays on disk for a person to look at)."""


class RecordConflict(ChainError):
    """The chain holds a different record than a queued write (another genesis, another round r):
    no retry can fix it, so the flush raises instead of waiting."""


def _hex32(name: str, value: bytes) -> str:
    if not isinstance(value, (bytes, bytearray)) or len(value) != 32:
        raise ValueError(f"{name} must be 32 bytes")
    return "0x" + bytes(value).hex()


def _unhex32(item: dict[str, Any], name: str) -> bytes:
    value = item.get(name)
    if not isinstance(value, str) or not value.startswith("0x") or len(value) != 66:
        raise OutboxError(f"outbox item {item.get('file')}: {name} is not 32 bytes of 0x-hex")
    try:
        return bytes.fromhex(value[2:])
    except ValueError:
        raise OutboxError(f"outbox item {item.get('file')}: {name} is not 32 bytes of 0x-hex") from None


def _short(value: bytes) -> str:
    return "0x" + value.hex()


class Outbox:
    """A durable, ordered queue of ledger writes in ``directory``. Thread-safe.

    @param directory where the item files live (created on first enqueue)
    """

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self._files_lock = threading.Lock()  # item numbering and listing
        self._flush_lock = threading.Lock()  # one flush at a time
        self._last_seq = 0
        self._last_error: str | None = None
        self._last_error_at = 0.0

    def __repr__(self) -> str:
        return f"Outbox({self.directory})"

    # -- queueing ------------------------------------------------------------------------------------

    def enqueue_create_run(self, run_id: bytes, genesis_checkpoint: bytes, config_digest: bytes,
                           genesis_manifest: bytes) -> Path:
        """Queue ``createRun``. Returns the item's file."""
        return self._enqueue("create_run", {
            "run_id": _hex32("run_id", run_id),
            "genesis_checkpoint": _hex32("genesis_checkpoint", genesis_checkpoint),
            "config_digest": _hex32("config_digest", config_digest),
            "genesis_manifest": _hex32("genesis_manifest", genesis_manifest),
        })

    def enqueue_round(self, run_id: bytes, round: int, parent: bytes, checkpoint: bytes, manifest_digest: bytes,
                      reports: Sequence[SignedReport | dict[str, Any]]) -> Path:
        """Queue ``recordRound``. Returns the item's file.

        @param reports the signed reports, as ``SignedReport`` or its ``to_json()`` form (checked here,
            so a malformed report is refused now rather than when the chain is asked)
        """
        if type(round) is not int or round < 1:
            raise ValueError(f"round must be an integer >= 1, got {round!r}")
        signed = [r if isinstance(r, SignedReport) else SignedReport.from_json(r) for r in reports]
        if not signed:
            raise ValueError(f"round {round} has no reports; the ledger needs at least one")
        return self._enqueue("round", {
            "run_id": _hex32("run_id", run_id), "round": round, "parent": _hex32("parent", parent),
            "checkpoint": _hex32("checkpoint", checkpoint),
            "manifest_digest": _hex32("manifest_digest", manifest_digest),
            "reports": [s.to_json() for s in signed],
        })

    def _enqueue(self, kind: str, body: dict[str, Any]) -> Path:
        item = {"schema": SCHEMA, "kind": kind, **body}
        with self._files_lock:
            existing = self._list()
            for seq, path in existing:
                # The same write queued twice (e.g. re-queued after a restart) is kept once. An
                # unreadable file is left for flush to report; it does not block new writes.
                try:
                    same = self._read(path, seq) == {**item, "seq": seq, "file": str(path)}
                except OutboxError:
                    same = False
                if same:
                    return path
            seq = max([self._last_seq, *(s for s, _ in existing)]) + 1
            self._last_seq = seq
            path = self.directory / f"{seq:06d}-{kind}.json"
            write_atomic(path, (json.dumps(item, indent=1, sort_keys=True) + "\n").encode())
        return path

    # -- reading -------------------------------------------------------------------------------------

    def _list(self) -> list[tuple[int, Path]]:
        if not self.directory.is_dir():
            return []
        items = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                items.append((int(match.group(1)), path))
        return sorted(items)

    @staticmethod
    def _read(path: Path, seq: int) -> dict[str, Any]:
        try:
            item = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise OutboxError(f"outbox item {path} is unreadable: {exc}") from None
        if (not isinstance(item, dict) or item.get("schema") != SCHEMA
                or not path.name.endswith(f"-{item.get('kind')}.json")):
            raise OutboxError(f"outbox item {path} is not a {SCHEMA} item of the kind its name says")
        return {**item, "seq": seq, "file": str(path)}

    def pending(self) -> list[dict[str, Any]]:
        """The queued items, oldest first: their JSON plus ``seq`` and ``file``."""
        with self._files_lock:
            return [self._read(path, seq) for seq, path in self._list()]

    # -- flushing ------------------------------------------------------------------------------------

    def flush(self, ledger: Ledger) -> list[int]:
        """Send the queued writes, in order, each only if the chain does not have it yet.

        Stops, leaving the rest queued, at the first item the chain cannot take now, and logs why in
        one error line (not again on every flush while the cause stays the same): an unreachable
        node, a revert (with the decoded error; later items depend on this one), or the node
        refusing the transaction (say, an account without funds).

        @param ledger the ledger client, sending as the run's coordinator
        @return the rounds confirmed on chain by this flush (sent now, or found already recorded)
        @raise RecordConflict (a ChainError) when the chain holds a different record than an item
        @raise OutboxError when an item file cannot be read
        """
        done: list[int] = []
        with self._flush_lock:
            for item in self.pending():
                try:
                    if item["kind"] == "create_run":
                        self._create_run(ledger, item)
                    else:
                        self._round(ledger, item)
                        done.append(int(item["round"]))
                except ChainUnavailable as exc:
                    left = len(self._list())
                    self._error(str(exc), f"ledger outbox: {exc}; {left} write(s) stay queued in {self.directory} "
                                f"and are sent when the chain answers again")
                    return done
                except TxReverted as exc:
                    what = "createRun" if item["kind"] == "create_run" else f"recordRound for round {item['round']}"
                    self._error(f"{what}: {exc}", f"ledger outbox: {what} was refused by the ledger: {exc}; "
                                f"{Path(item['file']).name} and the writes after it stay queued")
                    return done
                except RecordConflict:
                    raise
                except ChainError as exc:
                    self._error(str(exc), f"ledger outbox: {exc}; {Path(item['file']).name} and the writes after "
                                f"it stay queued")
                    return done
                with self._files_lock:
                    Path(item["file"]).unlink(missing_ok=True)
            if self._last_error is not None:
                log.info("ledger outbox: the chain takes writes again; the queued writes are confirmed")
                self._last_error = None
        return done

    def _error(self, key: str, message: str) -> None:
        """Log a failure once, not on every flush of a settlement loop (again after a while, or when
        the failure changes); ``key`` names the failure."""
        now = time.monotonic()
        if key != self._last_error or now - self._last_error_at >= _REPEAT_LOG_S:
            log.error("%s", message)
            self._last_error_at = now
        self._last_error = key

    def _create_run(self, ledger: Ledger, item: dict[str, Any]) -> None:
        run_id = _unhex32(item, "run_id")
        genesis = _unhex32(item, "genesis_checkpoint")
        run = ledger.run_of(run_id)
        if run is not None:
            if run["genesisCheckpoint"] != genesis:
                raise RecordConflict(f"run {_short(run_id)} exists on the ledger with genesis checkpoint "
                                 f"{_short(run['genesisCheckpoint'])}, but the outbox item {item['file']} has "
                                 f"{_short(genesis)}")
            if run["coordinator"] != ledger.chain.address:
                log.warning("run %s exists on the ledger with coordinator %s, not this account %s; it cannot "
                            "record rounds", _short(run_id), run["coordinator"], ledger.chain.address)
            log.info("run %s is already on the ledger; nothing to send", _short(run_id))
            return
        receipt = ledger.create_run(run_id, genesis, _unhex32(item, "config_digest"),
                                    _unhex32(item, "genesis_manifest"))
        log.info("run %s created on the ledger in block %d", _short(run_id), receipt["blockNumber"])

    def _round(self, ledger: Ledger, item: dict[str, Any]) -> None:
        run_id = _unhex32(item, "run_id")
        round_ = item.get("round")
        if type(round_) is not int or round_ < 1:
            raise OutboxError(f"outbox item {item['file']}: round is not an integer >= 1")
        checkpoint = _unhex32(item, "checkpoint")
        manifest = _unhex32(item, "manifest_digest")
        run = ledger.run_of(run_id)
        if run is not None and run["lastRound"] >= round_:
            recorded = ledger.round_of(run_id, round_)
            if recorded["checkpoint"] != checkpoint or recorded["manifestDigest"] != manifest:
                raise RecordConflict(
                    f"round {round_} of run {_short(run_id)} is on the ledger with checkpoint "
                    f"{_short(recorded['checkpoint'])} and manifest {_short(recorded['manifestDigest'])}, but the "
                    f"outbox item {item['file']} has checkpoint {_short(checkpoint)} and manifest {_short(manifest)}")
            log.info("round %d of run %s is already on the ledger (block %d); not sent again", round_,
                     _short(run_id), recorded["recordedAt"])
            return
        try:
            reports = [SignedReport.from_json(r) for r in item.get("reports") or []]
        except (ReportError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise OutboxError(f"outbox item {item['file']}: {exc}") from None
        receipt = ledger.record_round(run_id, round_, _unhex32(item, "parent"), checkpoint, manifest, reports)
        log.info("round %d of run %s recorded on the ledger in block %d with %d report(s) (gas %d)", round_,
                 _short(run_id), receipt["blockNumber"], len(reports), receipt["gasUsed"])
