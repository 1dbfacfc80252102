"""Challenging workers for the committed inner states a replay needs, and naming those that do not reveal.

In a run whose states are revealed on challenge (``rounds.state_reveal = "on_challenge"``,
trainer.worker.retention) no push carries an inner state: each contribution names σ, the sha256 of
the state its round started from, under its push signature, the manifest and every report, and its
worker keeps the bytes. The replay then starts every sampled contribution from its own committed
state (no chain of earlier rounds: audit.replay), and asks for it first:

    for each sampled contribution (w, r, σ), σ not fresh and not already in the run's store:
        bytes(σ) = the first copy, from the reveal sources in order, whose sha256 is σ
                   (a worker's gateway or a mirror, by URL: storage_client.remote re-hashes every
                   block; a retention store on this machine, by directory: its reads re-hash too)
        asked again every REVEAL_POLL_S until D = rounds.reveal_deadline_s has passed
        none within D:  r > last − R  (R = rounds.reveal_rounds: the worker had to keep it)
                          → the contribution is "unrevealed": its worker is named (audit check
                            ``reveal``) and its credit disputed like a replay mismatch
                        otherwise → "not replayed" (the worker was no longer bound to keep it)

Revealed states go to this audit's own cache (a local store, removed afterwards), never into the run's
store, and the replay reads the run's store and the cache as one (``RevealedStore``), in this process
and in a replay child alike. A source is trusted for nothing but availability: a copy that does not hash
to σ is not taken, and the next source is asked. The bytes and seconds each challenge cost are counted
(``RevealOutcome``), so that what a challenge costs is measured, not estimated.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from storage_client import CID, Codec, MissingObjectError, ObjectStore, Store, StoreError
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import state_cid

REVEAL_POLL_S = 1.0  # seconds between two rounds of asking every source for what is still missing
_MAX_SOURCE_CHARS = 512


class RevealSourceError(ValueError):
    """A reveal source that is neither an http(s) URL nor a directory holding a store."""


def open_source(source: str, ca_file: str | None = None, max_bytes: int | None = None) -> Store:
    """A reveal source as a store: ``http(s)://…`` a trustless gateway (storage_client.remote), else a
    directory holding a store (a worker's retention folder, or a run directory)."""
    if len(source) > _MAX_SOURCE_CHARS:
        raise RevealSourceError(f"a reveal source of {len(source)} characters (at most {_MAX_SOURCE_CHARS})")
    if source.startswith(("http://", "https://")):
        from storage_client.remote import RemoteStore

        kwargs = {"max_bytes": max_bytes} if max_bytes is not None else {}
        return RemoteStore([source], ca_file=ca_file, retries=0, **kwargs)
    path = Path(source)
    if (path / "store").is_dir():
        path = path / "store"
    if not (path / "objects").is_dir():
        raise RevealSourceError(f"reveal source {source[:200]}: neither an http(s) URL nor a directory with a store")
    return ObjectStore(path)


def local_sources(run_dir: Path) -> list[str]:
    """The retention folders of the workers that ran beside ``run_dir`` (trainer.worker.retention.RETAINED_DIR)."""
    from trainer.worker.retention import RETAINED_DIR

    root = run_dir / RETAINED_DIR
    return [str(p) for p in sorted(root.iterdir()) if (p / "store").is_dir()] if root.is_dir() else []


def local_reveal_sources(run_dir: Path) -> list[tuple[str, Store]]:
    """``local_sources`` opened: what an audit of ``run_dir`` asks when it is given no source."""
    return [(source, open_source(source)) for source in local_sources(run_dir)]


class RevealedStore(Store):
    """The run's store and this audit's cache of revealed states, read as one (reads only)."""

    def __init__(self, run: Store, cache: ObjectStore) -> None:
        self.run, self.cache = run, cache

    @property
    def location(self) -> str:
        return f"{self.run.location} (+ revealed states in {self.cache.location})"

    def _holder(self, cid: CID | str) -> Store:
        return self.run if self.run.has(cid) else self.cache

    def put(self, data: bytes, codec: Codec = Codec.RAW) -> CID:
        raise StoreError("the audit's view of a run's store is read-only")

    def get(self, cid: CID | str) -> bytes:
        return self._holder(cid).get(cid)

    def has(self, cid: CID | str) -> bool:
        return self.run.has(cid) or self.cache.has(cid)

    def size(self, cid: CID | str) -> int:
        return self._holder(cid).size(cid)

    def __iter__(self) -> Iterator[str]:
        return iter(self.run)

    def read_small_json(self, cid: CID | str, max_bytes: int) -> Any | None:
        return self._holder(cid).read_small_json(cid, max_bytes)


@dataclass
class RevealOutcome:
    """What the challenges of one audit got: per digest, the source that revealed it, and what is missing."""

    revealed: dict[str, str] = field(default_factory=dict)  # σ → the source that revealed it
    missing: set[str] = field(default_factory=set)  # σ no source revealed within the deadline
    bytes: int = 0  # the revealed states' bytes (what the challenges cost the workers' links)
    seconds: float = 0.0  # from the first ask to the last answer or the deadline

    def to_json(self) -> dict:
        return {"revealed": dict(sorted(self.revealed.items())), "missing": sorted(self.missing),
                "bytes": self.bytes, "seconds": round(self.seconds, 3)}


def challenge(needed: Iterable[str], sources: Sequence[tuple[str, Store]], cache: ObjectStore,
              deadline_s: float, clock=time.monotonic, sleep=time.sleep) -> RevealOutcome:
    """Ask ``sources`` (label, store), in order, for every state of ``needed`` (sha256 hex) until each
    is revealed or ``deadline_s`` has passed; the revealed ones are put in ``cache``."""
    outcome = RevealOutcome()
    pending = sorted({d for d in needed if d and d != FRESH_STATE})
    started = clock()
    while pending:
        for digest in list(pending):
            cid = state_cid(digest)
            for label, source in sources:
                try:
                    data = source.get(cid)  # re-hashed by the store door: a copy that is not σ is refused
                except (MissingObjectError, StoreError, OSError):
                    continue
                if hashlib.sha256(data).hexdigest() != digest:  # and here, whatever the door
                    continue
                cache.put(data)
                outcome.revealed[digest], outcome.bytes = label, outcome.bytes + len(data)
                pending.remove(digest)
                break
        if not pending or clock() - started >= deadline_s:
            break
        sleep(min(REVEAL_POLL_S, max(0.0, deadline_s - (clock() - started))))
    outcome.missing = set(pending)
    outcome.seconds = clock() - started
    return outcome



class Challenges:
    """One replay's challenges: ``ask`` asks ``sources`` for the states a store lacks, once, into a cache
    of its own (removed by ``close``); ``outcome`` is what they got (None before ``ask``)."""

    def __init__(self, sources: Sequence[tuple[str, Store]], deadline_s: float) -> None:
        self.sources, self.deadline_s = tuple(sources), deadline_s
        self.outcome: RevealOutcome | None = None
        self._scratch: tempfile.TemporaryDirectory[str] | None = None

    def ask(self, store: Store, needed: Iterable[str]) -> Store:
        """``store`` with the states of ``needed`` it lacks, as far as they were revealed in time."""
        missing = [d for d in needed if d and d != FRESH_STATE and not store.has(state_cid(d))]
        self._scratch = tempfile.TemporaryDirectory(prefix="dilocox-revealed-")
        cache = ObjectStore(self._scratch.name)
        self.outcome = challenge(missing, self.sources, cache, self.deadline_s)
        return RevealedStore(store, cache)

    def close(self) -> None:
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch = None
