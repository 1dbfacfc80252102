"""The ledger outbox: ledger writes kept on disk, and re-sent whenever the chain lacks them.

This is what makes "no finished round is lost because the chain was down, or came back behind"
true. The coordinator never writes to the chain from its training path; it enqueues (one atomic
JSON file per write, in order) and a settlement thread flushes.

An item's life:

    queued     ``outbox/NNNNNN-<kind>.json``: sent on the next flush unless the chain already has it;
    sent       still queued, until the ledger shows the round at a depth of ``confirmations``
               blocks (head − its block + 1 ≥ N; a run counts as deep once it exists);
    confirmed  moved to ``outbox/confirmed/``, and kept there for the life of the run directory.

Every flush first asks the chain where the run stands. A chain that comes back behind what was
confirmed (a reorg deeper than N, a node restored from an older state file, a fresh chain at the
same address) shows an older ``lastRound``, or no run at all: the confirmed items past that point
move back to the queue, keeping their order, and are sent again, each once. A chain whose record
of an item differs from it (another genesis, another round r) is a conflict no retry can fix:
``RecordConflict`` (a ``ChainError``) names both.

Flushing is idempotent. Before sending an item it asks the chain whether the write is already
there (a crash can fall between a receipt and the file's move): a run that exists with the same
genesis, or a round whose recorded checkpoint and manifest equal the item's, is recognised, not
sent twice.

Admissions. The rounds depend on what came before them on chain: the run's creation (an item
like the rounds) and each worker's admission, without which ``recordRound`` refuses the worker's
reports. The coordinator admits a worker at once, at its Join (settlement.gate), after verifying its
evidence and storing the admission record; once ``admitWorker`` is mined, the admission is kept here
as a confirmed ``admit`` item (``archive_admission``: the worker's key, its measurement and the
digest of the record of the evidence that admitted it, nothing else). A chain that comes back behind
without it (``workerOf`` shows the key never admitted) gets it again, in its place among the rounds,
from that copy: never an admission the coordinator did not verify. What only the registry's owner
can write (the measurement allowlist, the coordinator's verifier role) is not the coordinator's to
re-send: an admission the restored registry refuses for want of them stays queued, with the rounds
after it, and is logged until the owner writes them again (``dilocox chain allow``).

Files: ``NNNNNN-create_run.json``, ``NNNNNN-admit.json`` and ``NNNNNN-round.json``, processed in the
order of ``NNNNNN``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attestation import checksum_address
from attestation.report import ReportError, SignedReport
from storage_client import hex32, strict_json, unhex32, write_atomic

from .chain import ChainError, ChainUnavailable, TxReverted
from .ledger import Ledger, Registry
from .records import RoundRecord

__all__ = ["SCHEMA", "Outbox", "OutboxError", "RecordConflict"]

log = logging.getLogger("dilocox.settlement")

SCHEMA = "dilocox.outbox/v2"
_NAME = re.compile(r"^(\d{6,})-(create_run|admit|round)\.json$")
_REPEAT_LOG_S = 60.0  # the same failure is logged again at most this often


class OutboxError(ValueError):
    """An outbox item that cannot be read back (it stays on disk for a person to look at)."""


class RecordConflict(ChainError):
    """The chain holds a different record than a queued write (another genesis, another round r):
    no retry can fix it, so the flush raises instead of waiting."""


def _unhex32(item: dict[str, Any], name: str) -> bytes:
    """A 32-byte field of an outbox item read back from disk (OutboxError naming the file)."""
    try:
        return unhex32(item.get(name), name)
    except ValueError as exc:
        raise OutboxError(f"outbox item {item.get('file')}: {exc}") from None


def _short(value: bytes) -> str:
    return "0x" + value.hex()


def _as_recorded(recorded: RoundRecord | None) -> str:
    """How the ledger shows a round it counts as recorded, for a ``RecordConflict``."""
    if recorded is None:
        return "no RoundRecorded event"
    return f"checkpoint {_short(recorded.checkpoint)} and manifest {_short(recorded.manifest_digest)}"


def _create_run(ledger: Ledger, item: dict[str, Any]) -> bool:
    """Send ``createRun`` unless the run exists; True once the run is on the ledger (a run is not
    depth-checked: every flush looks for it again, in ``_requeue_lost``)."""
    run_id = _unhex32(item, "run_id")
    genesis = _unhex32(item, "genesis_checkpoint")
    run = ledger.run_of(run_id)
    if run is not None:
        if run.genesis_checkpoint != genesis:
            raise RecordConflict(f"run {_short(run_id)} exists on the ledger with genesis checkpoint "
                                 f"{_short(run.genesis_checkpoint)}, but the outbox item {item['file']} has "
                                 f"{_short(genesis)}")
        if run.coordinator != ledger.chain.address:
            log.warning("run %s exists on the ledger with coordinator %s, not this account %s; it cannot "
                        "record rounds", _short(run_id), run.coordinator, ledger.chain.address)
        return True
    window = item.get("challenge_window", 0)
    if type(window) is not int or not 0 <= window < 2**32:
        raise OutboxError(f"outbox item {item['file']}: challenge_window is not a uint32")
    receipt = ledger.create_run(run_id, genesis, _unhex32(item, "config_digest"),
                                _unhex32(item, "genesis_manifest"), window)
    log.info("run %s created on the ledger in block %d", _short(run_id), receipt["blockNumber"])
    return True


def _admitted(registry: Registry, item: dict[str, Any]) -> bool:
    """The registry knows an ``admit`` item's key as admitted (now, or once and since revoked)."""
    try:
        worker = checksum_address(item.get("worker"))
    except (ValueError, TypeError) as exc:
        raise OutboxError(f"outbox item {item['file']}: worker: {exc}") from None
    return registry.worker_of(worker).admitted_at != 0


def _admit(ledger: Ledger, item: dict[str, Any]) -> bool:
    """Send ``admitWorker`` for a kept admission unless the registry has the key; True once it has."""
    registry = Registry(ledger.chain, ledger.registry_address())
    if _admitted(registry, item):
        return True
    receipt = registry.admit_worker(checksum_address(item["worker"]), _unhex32(item, "measurement"),
                                    _unhex32(item, "evidence_digest"))
    log.info("worker %s admitted again on the ledger's registry in block %d, on the evidence kept in record 0x%s",
             item["worker"], receipt["blockNumber"], _unhex32(item, "evidence_digest").hex())
    return True


def _lost_writes(lost: list[dict[str, Any]]) -> str:
    """What a chain that came back behind lacks, in words: the run, admissions, rounds."""
    rounds = [int(i["round"]) for i in lost if i["kind"] == "round"]
    admitted = sum(1 for i in lost if i["kind"] == "admit")
    return " and ".join(part for part in (
        "the run" if any(i["kind"] == "create_run" for i in lost) else "",
        f"{admitted} admission(s)" if admitted else "",
        f"rounds {rounds[0]}..{rounds[-1]}" if rounds else "") if part)


class Outbox:
    """A durable, ordered queue of ledger writes in ``directory``. Thread-safe.

    @param directory where the item files live (created on first enqueue); confirmed items move to
        ``directory/confirmed``
    @param confirmations N: a round is confirmed once the ledger shows it N blocks deep (1: in a block)
    """

    def __init__(self, directory: Path, confirmations: int = 1) -> None:
        if type(confirmations) is not int or not 1 <= confirmations <= 1024:
            raise ValueError(f"confirmations must be an integer in [1, 1024], got {confirmations!r}")
        self.directory = Path(directory)
        self.archive = self.directory / "confirmed"
        self.confirmations = confirmations
        self._files_lock = threading.Lock()  # item numbering and listing
        self._flush_lock = threading.Lock()  # one flush at a time
        self._last_seq = 0
        self._last_error: str | None = None
        self._last_error_at = 0.0

    def __repr__(self) -> str:
        return f"Outbox({self.directory})"

    # -- queueing ------------------------------------------------------------------------------------

    def enqueue_create_run(self, run_id: bytes, genesis_checkpoint: bytes, config_digest: bytes,
                           genesis_manifest: bytes, challenge_window: int = 0) -> Path:
        """Queue ``createRun``. Returns the item's file."""
        if type(challenge_window) is not int or not 0 <= challenge_window < 2**32:
            raise OutboxError(f"challenge_window must be a uint32, got {challenge_window!r}")
        return self._enqueue("create_run", {
            "run_id": hex32(run_id, "run_id"),
            "genesis_checkpoint": hex32(genesis_checkpoint, "genesis_checkpoint"),
            "config_digest": hex32(config_digest, "config_digest"),
            "genesis_manifest": hex32(genesis_manifest, "genesis_manifest"),
            "challenge_window": challenge_window,
        })

    def enqueue_round(self, run_id: bytes, round: int, parent: bytes, checkpoint: bytes, manifest_digest: bytes,
                      reports: Sequence[SignedReport | dict[str, Any]], unreported: Sequence[bytes] = ()) -> Path:
        """Queue ``recordRound``. Returns the item's file.

        @param reports the signed reports, as ``SignedReport`` or its ``to_json()`` form (checked here,
            so a malformed report is refused now rather than when the chain is asked)
        @param unreported the update digests of the participants that did not report (recorded on the
            coordinator's word, credited to nobody)
        """
        if type(round) is not int or round < 1:
            raise ValueError(f"round must be an integer >= 1, got {round!r}")
        signed = [r if isinstance(r, SignedReport) else SignedReport.from_json(r) for r in reports]
        vouched = sorted({hex32(u, "unreported update") for u in unreported})
        if len(vouched) != len(unreported):
            raise ValueError(f"round {round}: an unreported update is listed twice")
        if not signed and not vouched:
            raise ValueError(f"round {round} has no participants; the ledger needs a report or an unreported update")
        return self._enqueue("round", {
            "run_id": hex32(run_id, "run_id"), "round": round, "parent": hex32(parent, "parent"),
            "checkpoint": hex32(checkpoint, "checkpoint"),
            "manifest_digest": hex32(manifest_digest, "manifest_digest"),
            "reports": [s.to_json() for s in signed], "unreported": vouched,
        })

    def archive_admission(self, run_id: bytes, worker: str, measurement: bytes, evidence_digest: bytes) -> Path:
        """Keep an admission the coordinator verified and the chain has mined, as a confirmed ``admit``
        item (module docstring): re-sent, in its place, to a chain that comes back without it."""
        return self._enqueue("admit", {
            "run_id": hex32(run_id, "run_id"), "worker": checksum_address(worker),
            "measurement": hex32(measurement, "measurement"),
            "evidence_digest": hex32(evidence_digest, "evidence_digest"),
        }, folder=self.archive)

    def _enqueue(self, kind: str, body: dict[str, Any], folder: Path | None = None) -> Path:
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
            archived = self._list(self.archive)
            seq = max([self._last_seq, *(s for s, _ in existing), *(s for s, _ in archived[-1:])]) + 1
            self._last_seq = seq
            path = (folder or self.directory) / f"{seq:06d}-{kind}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, (strict_json(item, indent=1, sort_keys=True) + "\n").encode())
        return path

    # -- reading -------------------------------------------------------------------------------------

    def _list(self, folder: Path | None = None) -> list[tuple[int, Path]]:
        folder = self.directory if folder is None else folder
        if not folder.is_dir():
            return []
        items = []
        for path in folder.iterdir():
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
        if (not isinstance(item, dict) or item.get("schema") not in (SCHEMA, "dilocox.outbox/v1")
                or not path.name.endswith(f"-{item.get('kind')}.json")):
            raise OutboxError(f"outbox item {path} is not a {SCHEMA} item of the kind its name says")
        return {**item, "seq": seq, "file": str(path)}

    def pending(self) -> list[dict[str, Any]]:
        """The queued items (sent or not, not yet confirmed), oldest first: their JSON plus ``seq`` and
        ``file``."""
        with self._files_lock:
            return [self._read(path, seq) for seq, path in self._list()]

    def confirmed(self) -> list[dict[str, Any]]:
        """The confirmed items, oldest first (kept so a chain that comes back behind can be caught up)."""
        with self._files_lock:
            return [self._read(path, seq) for seq, path in self._list(self.archive)]

    def _archive(self, item: dict[str, Any]) -> None:
        with self._files_lock:
            path = Path(item["file"])
            self.archive.mkdir(parents=True, exist_ok=True)
            os.replace(path, self.archive / path.name)

    def _requeue(self, item: dict[str, Any]) -> None:
        with self._files_lock:
            path = Path(item["file"])
            os.replace(path, self.directory / path.name)

    # -- flushing ------------------------------------------------------------------------------------

    def flush(self, ledger: Ledger) -> list[int]:
        """Catch the chain up: re-queue what it lost, send what it lacks, confirm what is deep enough.

        Stops, leaving the rest queued, at the first item the chain cannot take now, and logs why in
        one error line (not again on every flush while the cause stays the same): an unreachable
        node, a revert (with the decoded error; later items depend on this one), or the node
        refusing the transaction (say, an account without funds).

        @param ledger the ledger client, sending as the run's coordinator
        @return the rounds confirmed by this flush (at depth ``confirmations`` on the ledger)
        @raise RecordConflict (a ChainError) when the chain holds a different record than an item
        @raise OutboxError when an item file cannot be read
        """
        done: list[int] = []
        with self._flush_lock:
            try:
                self._requeue_lost(ledger)
            except ChainUnavailable as exc:
                self._error(str(exc), f"ledger outbox: {exc}; {len(self._list())} write(s) stay queued in "
                            f"{self.directory} and are sent when the chain answers again")
                return done
            for item in self.pending():
                try:
                    if item["kind"] == "create_run":
                        deep = _create_run(ledger, item)
                    elif item["kind"] == "admit":
                        deep = _admit(ledger, item)
                    else:
                        deep = self._round(ledger, item)
                except ChainUnavailable as exc:
                    left = len(self._list())
                    self._error(str(exc), f"ledger outbox: {exc}; {left} write(s) stay queued in {self.directory} "
                                f"and are sent when the chain answers again")
                    return done
                except TxReverted as exc:
                    what = {"create_run": "createRun", "admit": f"admitWorker for {item.get('worker')}"}.get(
                        item["kind"], f"recordRound for round {item.get('round')}")
                    self._error(f"{what}: {exc}", f"ledger outbox: {what} was refused by the ledger: {exc}; "
                                f"{Path(item['file']).name} and the writes after it stay queued")
                    return done
                except RecordConflict:
                    raise
                except ChainError as exc:
                    self._error(str(exc), f"ledger outbox: {exc}; {Path(item['file']).name} and the writes after "
                                f"it stay queued")
                    return done
                if deep:
                    self._archive(item)
                    if item["kind"] == "round":
                        done.append(int(item["round"]))
            if self._last_error is not None:
                log.info("ledger outbox: the chain takes writes again; the queued writes are sent")
                self._last_error = None
        return done

    def _requeue_lost(self, ledger: Ledger) -> None:
        """Move confirmed items the chain no longer shows back to the queue (in their order).

        Reads only the newest confirmed items (rounds are confirmed in order), so a flush costs one
        or two chain reads however long the run."""
        with self._files_lock:
            archived = self._list(self.archive)
        if not archived:
            return
        newest = self._read(archived[-1][1], archived[-1][0])
        run_id = _unhex32(newest, "run_id")
        run = ledger.run_of(run_id)
        last = -1 if run is None else run.last_round  # -1: not even the run is there
        lost: list[dict[str, Any]] = []
        registry: Registry | None = None
        for seq, path in reversed(archived):
            item = self._read(path, seq)
            if item["kind"] == "admit":  # kept between rounds: looked at on the way back to the newest one kept
                registry = registry or Registry(ledger.chain, ledger.registry_address())
                if not _admitted(registry, item):
                    lost.append(item)
                continue
            if item["kind"] == "round" and int(item["round"]) > last or item["kind"] == "create_run" and last < 0:
                lost.append(item)
                continue
            if item["kind"] == "round":  # the newest round the chain still has must be ours
                recorded = ledger.round_of(run_id, int(item["round"]))
                if recorded is None or (recorded.checkpoint, recorded.manifest_digest) != (
                        _unhex32(item, "checkpoint"), _unhex32(item, "manifest_digest")):
                    raise RecordConflict(
                        f"round {item['round']} of run {_short(run_id)} is on the ledger with "
                        f"{_as_recorded(recorded)}, but the confirmed copy {path} has checkpoint "
                        f"{item['checkpoint']} and manifest {item['manifest_digest']}")
            break
        if not lost:
            return
        lost.reverse()
        what = _lost_writes(lost)
        where = "has no record of the run" if run is None else f"shows round {last} as its last"
        log.error("ledger outbox: the chain came back behind: it %s, but %s had been confirmed; re-sending "
                  "%d write(s) from %s, in order", where, what, len(lost), self.archive)
        for item in lost:
            self._requeue(item)

    def _depth(self, ledger: Ledger, block: int) -> int:
        return ledger.head_block() - block + 1 if block > 0 else 0

    def _error(self, key: str, message: str) -> None:
        """Log a failure once, not on every flush of a settlement loop (again after a while, or when
        the failure changes); ``key`` names the failure."""
        now = time.monotonic()
        if key != self._last_error or now - self._last_error_at >= _REPEAT_LOG_S:
            log.error("%s", message)
            self._last_error_at = now
        self._last_error = key

    def _round(self, ledger: Ledger, item: dict[str, Any]) -> bool:
        """Send ``recordRound`` unless the round is recorded; True once it is ``confirmations`` deep."""
        run_id = _unhex32(item, "run_id")
        round_ = item.get("round")
        if type(round_) is not int or round_ < 1:
            raise OutboxError(f"outbox item {item['file']}: round is not an integer >= 1")
        checkpoint = _unhex32(item, "checkpoint")
        manifest = _unhex32(item, "manifest_digest")
        run = ledger.run_of(run_id)
        if run is not None and run.last_round >= round_:
            recorded = ledger.round_of(run_id, round_)
            if recorded is None or (recorded.checkpoint, recorded.manifest_digest) != (checkpoint, manifest):
                raise RecordConflict(
                    f"round {round_} of run {_short(run_id)} is on the ledger with {_as_recorded(recorded)}, but "
                    f"the outbox item {item['file']} has checkpoint {_short(checkpoint)} and manifest "
                    f"{_short(manifest)}")
            depth = self._depth(ledger, recorded.block)
            if depth >= self.confirmations:
                log.info("round %d of run %s is on the ledger, %d block(s) deep (block %d)", round_,
                         _short(run_id), depth, recorded.block)
                return True
            return False
        try:
            reports = [SignedReport.from_json(r) for r in item.get("reports") or []]
            unreported = [_unhex32({"file": item["file"], "u": u}, "u") for u in item.get("unreported") or []]
        except (ReportError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise OutboxError(f"outbox item {item['file']}: {exc}") from None
        if run is not None and run.coordinator != ledger.chain.address:  # no retry makes it ours again
            raise RecordConflict(f"run {_short(run_id)} is coordinated by {run.coordinator} on the ledger now, not "
                                 f"this account {ledger.chain.address} (it was handed over): this coordinator no "
                                 f"longer records its rounds; round {round_} stays in {item['file']}")
        receipt = ledger.record_round(run_id, round_, _unhex32(item, "parent"), checkpoint, manifest, reports,
                                      unreported)
        log.info("round %d of run %s recorded on the ledger in block %d with %d report(s)%s (gas %d)", round_,
                 _short(run_id), receipt["blockNumber"], len(reports),
                 f" and {len(unreported)} unreported update(s)" if unreported else "", receipt["gasUsed"])
        return self.confirmations <= 1
