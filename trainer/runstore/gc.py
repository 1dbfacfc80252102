"""Which objects of a run's store the run still needs, and removing the rest (``dilocox gc``).

Reachability is a walk over CIDs from the run's roots:

    roots   HEAD's manifest; every CID and committed inner state named in <run>/pending (the open
            round's journal of accepted updates and stage slices); every admission record in the
            store (JSON objects of schema ``dilocox.admission/*``: the ledger names them by digest,
            so nothing in the run does)
    edges   a JSON object in the store names every CID (text) anywhere in it that the store holds:
            a manifest its parent, config, params, outer state, downlink payload and header and its
            participants' update records; an update record its payloads and codec headers
            (trainer.runstore.update_record); an admission record its evidence; a config whatever it pins;
            and a manifest its participants' committed inner states, named by digest (``state``: stored
            once per worker per window of ``rounds.state_every`` rounds, trainer.runtime.state_commit)

RAW objects (tensors, payloads, evidence) name nothing. What no walk reaches (a refused or abandoned
push, a manifest HEAD never moved to) is unreferenced, and only that is removed; a coordinator
holding the run refuses gc, and gc holds the run's lock while it works, so none starts meanwhile.

Objects are read through the Store door (storage_client.backend), so only intact bytes are walked,
and an object the walk reaches whose bytes are corrupt refuses gc. Removing is the local store's
(``ObjectStore.remove``): gc works on a run directory on this machine.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterator

from storage_client import CID, Codec, CorruptObjectError, MissingObjectError, StoreError
from storage_client.cid import InvalidCIDError
from trainer.runstore.run_dir import RunDir

MAX_WALKED_JSON = 64 << 20  # a JSON object larger than this is not one the run writes: not walked
ADMISSION_PREFIX = "dilocox.admission/"


@dataclass(frozen=True)
class Collected:
    kept: int  # objects reachable
    removed: int  # objects unreferenced (removed, or that would be on a dry run)
    freed_bytes: int


def _cids_in(value: Any) -> Iterator[CID]:
    """Every string anywhere in a JSON value that is CID text."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str) and item.startswith("b") and 40 < len(item) < 128:
            try:
                yield CID.parse(item)
            except InvalidCIDError:
                pass


def _json_of(run_dir: RunDir, hex_digest: str, needed: bool) -> Any:
    """A stored object parsed as JSON, or None when it is not a (small enough) JSON object.

    A ``needed`` object (one the walk reached) whose bytes do not hash to its name refuses gc: what
    it references cannot be known, so nothing may be removed on its account."""
    cid = CID(Codec.JSON, bytes.fromhex(hex_digest))
    try:
        return run_dir.store.read_small_json(cid, MAX_WALKED_JSON)
    except CorruptObjectError:
        if needed:
            raise ValueError(f"object {cid} is corrupt, so what it keeps is unknown: gc refused") from None
        return None
    except (OSError, ValueError, StoreError):
        return None


def _roots(run_dir: RunDir, present: set[str]) -> list[str]:
    roots: list[str] = []
    head = run_dir.head()
    if head is not None:
        roots.append(head.hex)
    pending = run_dir.path / "pending"
    for journal in sorted(pending.glob("*.json")) if pending.is_dir() else []:
        try:
            journalled = json.loads(journal.read_text(encoding="utf-8"))
            # The open round's accepted pushes: their records, and the inner states they carried (not
            # named by any manifest yet; rounds.state_every: once per worker per window of K rounds).
            roots.extend(c.hex for c in _cids_in(journalled))
            roots.extend(state for state in _states_in(journalled) if state in present)
        except (OSError, ValueError):
            raise ValueError(f"journal {journal} cannot be read, so what it keeps is unknown: gc refused") from None
    for hex_digest in sorted(present):
        obj = _json_of(run_dir, hex_digest, needed=False)
        if isinstance(obj, dict) and str(obj.get("schema", "")).startswith(ADMISSION_PREFIX):
            roots.append(hex_digest)
    return roots


def reachable(run_dir: RunDir) -> set[str]:
    """The sha256 hex of every stored object the run needs (module docstring)."""
    present = set(run_dir.store)
    seen: set[str] = set()
    stack = [r for r in _roots(run_dir, present) if r in present]
    while stack:
        hex_digest = stack.pop()
        if hex_digest in seen:
            continue
        seen.add(hex_digest)
        obj = _json_of(run_dir, hex_digest, needed=True)
        if obj is not None:
            stack.extend(c.hex for c in _cids_in(obj) if c.hex in present and c.hex not in seen)
            stack.extend(state for state in _states_in(obj) if state in present and state not in seen)
    return seen


def _states_in(value: Any) -> Iterator[str]:
    """The committed inner states named by digest (hex) anywhere in a JSON value, as the ``state`` of
    an object: a manifest's participants, the pending journal's accepted updates and stage slices."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("state"), str):
                yield item["state"]
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def collect(run_dir: RunDir, dry_run: bool = False) -> Collected:
    """Remove (unless ``dry_run``) every stored object ``reachable`` does not return. The caller
    holds the run's lock (trainer.coordinator.server.lock_run_dir)."""
    if run_dir.head() is None:
        raise ValueError(f"{run_dir.path} holds no run (no HEAD): nothing to collect against")
    keep = reachable(run_dir)
    removed = freed = 0
    for hex_digest in list(run_dir.store):
        if hex_digest in keep:
            continue
        cid = CID(Codec.RAW, bytes.fromhex(hex_digest))
        try:
            size = run_dir.store.size(cid)
            if not dry_run:
                run_dir.store.remove(cid)  # removing is the local store's, not the Store door's
        except MissingObjectError:
            continue
        removed, freed = removed + 1, freed + size
    return Collected(len(keep), removed, freed)
