"""The on-disk state of one run, laid out so that a restarted coordinator loses nothing finished.

    <run>/store/objects/..      content-addressed objects: configs, checkpoints, updates, manifests
    <run>/HEAD                  CID of the latest round's manifest (the run's tip)
    <run>/workers.json          worker id -> data shard, so a worker keeps its shard across restarts
    <run>/pending/round-N.json  updates accepted for the open round N (their bytes are in the store)
    <run>/pending/reports-N.json  signed reports of round N, until the round is queued for the ledger
    <run>/settlement.json       what has been handed to the ledger outbox (run created, last round)
    <run>/outbox/               ledger writes not yet confirmed on chain (settlement.Outbox)
    <run>/chain/                deployment.json, the local chain's state, keys of a local demo
    <run>/coordinator.addr      host:port the coordinator is listening on, once it listens
    <run>/signing.key           the key that signs global states when the run has no ledger (0600)
    <run>/tls/                  the coordinator's self-signed certificate and key (trainer.net.tls)
    <run>/rounds.jsonl          one summary line per published round, for people and the demo
    <run>/logs/                 process logs written by ``dilocox demo``
    <run>/scratch/              inner states of pushes still arriving (trainer.runstore.spool), emptied at start

Everything is written atomically (temp file, fsync, rename), and HEAD moves only after every object
its manifest names is in the store, so a crash at any instant leaves either the old tip or the new.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from attestation import WorkerKey
from storage_client import CID, ObjectStore, open_store, strict_json, write_atomic


class RunDirError(ValueError):
    """A state file of the run that cannot be used; the message names the file."""


ROUNDS_LOG = "rounds.jsonl"  # one summary line per published round (``dilocox plot`` reads it)


def _reason(exc: BaseException) -> str:
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return text.splitlines()[0][:200]


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.store: ObjectStore = open_store(self.path)

    @property
    def address_file(self) -> Path:
        return self.path / "coordinator.addr"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    @property
    def scratch(self) -> Path:
        return self.path / "scratch"

    def head(self) -> CID | None:
        path = self.path / "HEAD"
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise RunDirError(f"state file {path} is unreadable: {_reason(exc)}") from None
        try:
            return CID.parse(text)
        except Exception as exc:  # noqa: BLE001 - any parse failure means a damaged file
            raise RunDirError(f"state file {path} does not hold a manifest CID ({_reason(exc)}); "
                              f"the run's tip is damaged") from None

    def set_head(self, cid: CID) -> None:
        write_atomic(self.path / "HEAD", f"{cid}\n".encode("ascii"))

    def workers(self) -> dict[str, int]:
        path = self.path / "workers.json"
        shards = self._read_json(path, {})
        for worker, shard in shards.items():
            if type(shard) is not int or shard < 0:
                raise RunDirError(f"state file {path} is damaged: worker {worker[:64]!r} has shard {shard!r}, "
                                  f"not an integer >= 0")
        return shards

    def save_workers(self, shards: dict[str, int]) -> None:
        self._write_json(self.path / "workers.json", shards)

    @staticmethod
    def _pending_name(round_: int, kind: str) -> str:
        return f"pending/{kind}-{round_:06d}.json"

    def pending(self, round_: int, kind: str = "round") -> dict[str, dict[str, Any]]:
        name = self._pending_name(round_, kind)
        entries = self.load(name, {})
        if not all(isinstance(v, dict) for v in entries.values()):
            raise RunDirError(f"state file {self.path / name} is damaged: every entry must be a JSON object")
        return entries

    def save_pending(self, round_: int, entries: dict[str, dict[str, Any]], kind: str = "round") -> None:
        self.save(self._pending_name(round_, kind), entries)

    def clear_pending(self, round_: int, kind: str = "round") -> None:
        (self.path / self._pending_name(round_, kind)).unlink(missing_ok=True)

    @property
    def rounds_log(self) -> Path:
        return self.path / ROUNDS_LOG

    def log_round(self, summary: dict[str, Any]) -> None:
        """Append a round's summary (the manifest stays the record; this is its readable trace)."""
        with open(self.rounds_log, "a", encoding="utf-8") as f:
            f.write(strict_json(summary, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def logged_rounds(self) -> list[dict[str, Any]]:
        try:
            lines = self.rounds_log.read_text(encoding="utf-8").splitlines()
        except FileNotFoundError:
            return []
        # A line cut short by a crash mid-append is skipped, not fatal.
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    def load(self, name: str, default: Any) -> Any:
        """A small JSON state file of the run, by relative name."""
        return self._read_json(self.path / name, default)

    def save(self, name: str, obj: Any) -> None:
        (self.path / name).parent.mkdir(parents=True, exist_ok=True)
        self._write_json(self.path / name, obj)

    def signing_key(self) -> WorkerKey:
        """The run's own signing key (for runs without a ledger account), created on first use."""
        path = self.path / "signing.key"
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            key = os.urandom(32)
            write_atomic(path, key.hex().encode("ascii"), mode=0o600)
            return WorkerKey(key)
        except (OSError, ValueError) as exc:
            raise RunDirError(f"key file {path} is unreadable: {_reason(exc)}") from None
        try:
            return WorkerKey(bytes.fromhex(text))
        except Exception as exc:  # noqa: BLE001 - not hex, or not a valid secp256k1 key
            raise RunDirError(f"key file {path} does not hold a hex private key ({_reason(exc)})") from None

    def write_address(self, address: str) -> None:
        write_atomic(self.address_file, address.encode("ascii"))

    @staticmethod
    def _read_json(path: Path, default: Any) -> Any:
        """The JSON in ``path``, or ``default`` when there is no such file.

        A file that cannot be read, is not JSON (say, cut short), or is not of the default's shape
        (a JSON object where the default is a dict, holding at least the default's keys with values of
        the same types) raises RunDirError naming the file: it is the run's state, and guessing
        would lose or repeat work.
        """
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return default
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RunDirError(f"state file {path} is damaged or unreadable ({_reason(exc)}); restore it "
                              f"or move it away") from None
        if isinstance(default, dict):
            if not isinstance(obj, dict):
                raise RunDirError(f"state file {path} is damaged: it holds a JSON {type(obj).__name__}, "
                                  f"not an object")
            for key, value in default.items():
                if key not in obj or not isinstance(obj[key], type(value)):
                    raise RunDirError(f"state file {path} is damaged: {key!r} is missing or not a "
                                      f"{type(value).__name__}")
        return obj

    @staticmethod
    def _write_json(path: Path, obj: Any) -> None:
        write_atomic(path, (strict_json(obj, indent=1, sort_keys=True) + "\n").encode("utf-8"))
