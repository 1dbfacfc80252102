"""A worker's committed inner states, kept on its own disk to reveal when an auditor challenges one.

With ``rounds.state_reveal = "on_challenge"`` (DiLoCoX's default) a push carries the update and σ,
the sha256 of the inner state its round started from (AdamW's moments and step, the error feedback:
trainer.runtime.inner.inner_state_bytes), and nothing else: σ is under the push's signature, the
manifest and every report. The state's bytes stay with the worker, which keeps them here:

    keep(r, state)   before round r's push: the bytes whose sha256 is σ_r, written to a
                     content-addressed store of the worker's own (``<dir>/store``, a run store's
                     layout) a tensor at a time (never the whole file in memory), and r → σ_r in
                     ``<dir>/rounds.json`` (replaced atomically)
    prune(r)         once round r counted: every state that only rounds ≤ r − R name is removed
                     (R = ``rounds.reveal_rounds``)

So the disk holds at most R + 1 states (each three float32 copies of the model and a header), whatever
the run's length, and every state a counted round of the last R committed to. A refused push keeps its
state (a lost reply may have counted it, and the next round starts from the same σ: one file). A
fresh state is never kept (an auditor starts there without asking).

Reveal: the directory is a store, so its states are served by CID by the project's trustless gateway
(``dilocox worker --reveal-port``, while the worker runs; ``dilocox store serve --run <dir>`` during
the challenge window after it stopped), and whoever fetches one verifies it against σ (the gateway
re-hashes what it sends, the fetcher re-hashes what it gets: storage_client.remote). An auditor that
asks for a state a worker does not reveal within ``rounds.reveal_deadline_s`` names the worker
(audit.reveal).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from storage_client import MissingObjectError, ObjectStore, open_store, strict_json
from trainer.config import RoundConfig
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import NO_STATE, Committed, StateBytes, StateUploads, state_cid
from trainer.worker.client import WorkerError

log = logging.getLogger("dilocox.worker")

INDEX = "rounds.json"
GATEWAY_URL = "gateway.url"  # where a worker serving its states wrote the gateway's address
# The folder of a run directory that holds, one folder each, the retention stores of workers that ran
# beside it (a local cluster, the demo): an audit of that directory asks them first (audit.reveal).
RETAINED_DIR = "retained"
_MAX_INDEX_BYTES = 1 << 20


class RetentionError(WorkerError):
    """A committed state that could not be kept (the disk is full, the directory is not writable): the
    worker cannot push a round it could not reveal."""


class Retention:
    """The committed inner states of a worker's last ``keep_rounds`` counted rounds, in ``root``."""

    def __init__(self, root: Path, keep_rounds: int) -> None:
        self.root, self.keep_rounds = Path(root), keep_rounds
        self.store: ObjectStore = open_store(self.root)
        self.rounds: dict[int, str] = self._load()

    def _load(self) -> dict[int, str]:
        """The index a previous process of this worker left (a restarted worker reveals what it kept)."""
        path = self.root / INDEX
        try:
            if path.stat().st_size > _MAX_INDEX_BYTES:
                raise RetentionError(f"{path}: over {_MAX_INDEX_BYTES} bytes, not a retention index")
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise RetentionError(f"{path}: cannot be read as a retention index: {str(exc)[:200]}") from None
        if not isinstance(raw, dict) or not all(
                isinstance(k, str) and k.isdigit() and isinstance(v, str) and len(v) == 64 for k, v in raw.items()):
            raise RetentionError(f"{path}: not a retention index (round -> sha256 hex)")
        return {int(k): v for k, v in raw.items()}

    def _save(self) -> None:
        path = self.root / INDEX
        tmp = path.with_suffix(".tmp")
        tmp.write_text(strict_json({str(r): d for r, d in sorted(self.rounds.items())}), encoding="utf-8")
        os.replace(tmp, path)

    def keep(self, round_: int, committed: Committed) -> None:
        """Keep the state round ``round_`` starts from (nothing for a fresh one); RetentionError when it
        cannot be written."""
        if committed.fresh:
            return
        try:
            if not self.store.has(state_cid(committed.digest)):
                cid = self.store.put_chunks(committed.stream().chunks())
                if cid.digest.hex() != committed.digest:  # the digest rule and the bytes disagree: a bug, said
                    self.store.remove(cid)
                    raise RetentionError(f"round {round_}: the kept state hashes to {cid.digest.hex()[:16]}…, "
                                         f"not its commitment {committed.digest[:16]}…")
            self.rounds[round_] = committed.digest
            self._save()
        except OSError as exc:
            raise RetentionError(f"round {round_}: cannot keep the committed inner state in {self.root}: "
                                 f"{str(exc)[:200]}") from None

    def prune(self, counted_round: int) -> list[str]:
        """Forget the rounds ≤ ``counted_round`` − R and remove the states no kept round names; the
        digests removed."""
        horizon = counted_round - self.keep_rounds
        old = {r for r in self.rounds if r <= horizon}
        if not old:
            return []
        kept = {d for r, d in self.rounds.items() if r not in old}
        gone = sorted({self.rounds[r] for r in old} - kept)
        for r in old:
            del self.rounds[r]
        self._save()
        for digest in gone:
            try:
                self.store.remove(state_cid(digest))
            except MissingObjectError:  # removed by hand: nothing left to free
                pass
        return gone

    def has(self, digest: str) -> bool:
        return digest != FRESH_STATE and self.store.has(state_cid(digest))

    @property
    def bytes_on_disk(self) -> int:
        return sum(self.store.size(state_cid(d)) for d in set(self.rounds.values()) if self.store.has(state_cid(d)))


def open_retention(root: Path, keep_rounds: int, reveal_address: tuple[str, int] | None) -> Retention:
    """A worker's retention store, and its states served by CID on ``reveal_address`` (host, port; 0: a
    free port, written to ``<root>/gateway.url``) when given; RetentionError saying why it cannot be."""
    retention = Retention(root, keep_rounds)
    if reveal_address is None:
        return retention
    from storage_client.gateway import start_gateway

    host, port = reveal_address
    try:
        server, _ = start_gateway(retention.store, host, port)
        (retention.root / GATEWAY_URL).write_text(server.url + "\n", encoding="utf-8")
    except OSError as exc:
        raise RetentionError(f"cannot serve reveals on {host[:100]}:{port}: {exc.strerror or exc}") from None
    log.info("committed inner states kept in %s, revealed by CID at %s/ipfs/<cid>", root, server.url)
    return retention


class CommittedStates:
    """How a worker's committed inner states reach an auditor, by the run's ``rounds.state_reveal``:
    kept here and revealed on challenge (nothing sent with a push), or uploaded with a push when due
    (trainer.runtime.state_commit.StateUploads)."""

    def __init__(self, rounds: RoundConfig, root: Path, reveal_address: tuple[str, int] | None) -> None:
        self.rounds = rounds
        self.uploads = StateUploads()
        self.retention = (open_retention(root, rounds.reveal_rounds, reveal_address)
                          if rounds.state_reveal == "on_challenge" else None)

    def for_push(self, round_: int, committed: Committed | None) -> StateBytes:
        """What the push of ``round_`` carries of the state it started from: nothing when it is kept to
        reveal (kept now, before the push names it: RetentionError when it cannot be), else the
        bytes when due."""
        if self.retention is None:
            return self.uploads.upload(self.rounds.state_every, round_, committed)
        if committed is not None:
            self.retention.keep(round_, committed)
        return NO_STATE

    def counted(self, round_: int) -> None:
        """The push of ``round_`` was taken whole."""
        if self.retention is None:
            self.uploads.counted()
        else:
            self.retention.prune(round_)
