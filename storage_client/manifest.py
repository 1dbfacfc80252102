"""Per-round manifests: the hash-chained lineage of a training run.

A manifest records one global checkpoint: which parameters and outer optimiser
state it produced, which config it ran under, who contributed which update and
who dropped out. It is stored as canonical JSON (Codec.JSON), so its CID is the
round's identity, and it names its parent manifest's CID. Following parents from
any head therefore walks a tamper-evident chain back to genesis (round 0):
changing any past round changes every CID after it.

Validation is strict and lives in the constructors, so every Manifest object in
memory is well formed, whether built in code or loaded from bytes written by
someone else. Ordering is part of validity: participants and traffic must be
sorted by worker and `dropped` must be sorted, so one logical record has one
byte form. The plain constructors refuse unsorted input rather than sorting
silently; `Manifest.new` is the convenience builder that sorts for you.

Losses are stored as fixed-point ints (x 1e6, see `to_e6`) because canonical
JSON refuses floats.

Participants (schema v3) also name the data `shard` their update was trained
on and `state`, the sha256 of the worker's inner state (AdamW moments and step,
and its error-feedback buffer when the uplink is compressed) at the start of the
round, or null where it is not committed: what `dilocox audit --replay` needs to
re-run the contribution.

Participants' `update` (schema v4) is the JSON CID of the worker's update
record, which names the bytes of its pushed payloads (trainer.runstore.update_record),
no longer a RAW dense reconstruction.

Participants' `kernels` (schema v5) name what decided the floating point of the worker's inner
loop, `{"capability": <ATen CPU capability>, "threads": <intra-op threads>}` (trainer.runtime.kernels),
or null where none is recorded (a worker on an accelerator, or whose pipeline stages disagreed): the
kernel environment `dilocox audit --replay` re-runs the contribution in, bit for bit
(audit.replay_env). Both are hostile input: the capability is one of KERNEL_CAPABILITIES, the
threads 1..MAX_KERNEL_THREADS. A worker that is a data-parallel island of N > 1 ranks
(trainer.runtime.island) adds `"data_parallel": N` (2..MAX_DATA_PARALLEL): its ranks each computed the
gradient of their slice of every batch and averaged them in rank order, which the replay re-derives;
the key is absent for one process, so a run without islands has the same bytes as before.

Traffic (schema v2). `bytes_up` / `bytes_down` are the round's total wire bytes
from the workers to the coordinator and back. Each participant records both directions of
its own contribution: `bytes_sent`, the wire bytes of the accepted update, and
`bytes_received`, the wire bytes of the FetchGlobal stream that delivered the
global state the update was computed from (0 where the fetch was not counted).
`traffic` lists every worker that moved bytes in the round (participants,
dropped or refused), sorted by worker, with its `up` and `down` bytes; when it
is non-empty its sums must equal `bytes_up` and `bytes_down`. `downlink` names
the compressed global update of the round (`payload`: RAW CID of the
compressed bytes, `header`: JSON CID of its codec header), or is null when the
global update travelled dense; genesis (round 0) always has null.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from .backend import Store
from .canonical import digest_json
from .cid import CID, Codec, InvalidCIDError

SCHEMA = "dilocox.manifest/v5"
E6 = 1_000_000

_PARTICIPANT_KEYS = {
    "worker",
    "update",
    "train_loss_e6",
    "tokens",
    "inner_steps",
    "bytes_sent",
    "bytes_received",
    "shard",
    "state",
    "kernels",
}

_KERNELS_KEYS = {"capability", "threads"}
_KERNELS_OPTIONAL = {"data_parallel"}  # present only for N > 1: one process keeps the schema-v5 bytes
# torch.backends.cpu.get_cpu_capability(), in lower case: the ATen CPU capabilities a worker may name
# (x86's three, lowest first, then ARM's, POWER's and s390's), and the most intra-op threads.
KERNEL_CAPABILITIES = ("default", "avx2", "avx512", "sve128", "sve256", "sve512", "vsx", "zvector")
MAX_KERNEL_THREADS = 1024
MAX_DATA_PARALLEL = 4096  # data-parallel ranks of one worker (trainer.runtime.island)

_DOWNLINK_KEYS = {"payload", "header"}

_TRAFFIC_KEYS = {"worker", "up", "down"}

_MANIFEST_KEYS = {
    "schema",
    "run_id",
    "round",
    "parent",
    "config",
    "params",
    "outer_state",
    "participants",
    "dropped",
    "eval_loss_e6",
    "bytes_up",
    "bytes_down",
    "downlink",
    "traffic",
}


class ManifestError(ValueError):
    """A manifest, or a chain of them, is malformed."""


def to_e6(x: float) -> int:
    """Fixed-point encode: round(x * 1e6). NaN and infinities have no int form."""
    x = float(x)  # also accepts numpy/torch scalars
    if not math.isfinite(x):
        raise ValueError(f"cannot encode non-finite value {x!r} as fixed-point e6")
    return round(x * E6)


def from_e6(n: int) -> float:
    """Inverse of `to_e6` (up to the rounding it applied)."""
    return n / E6


# ---------------------------------------------------------------------------
# field checks: each names the field path so a bad record is easy to locate


def _check_int(field: str, value: Any, minimum: int | None = None) -> None:
    # bool is an int subclass in Python but not a number in the record.
    if type(value) is not int:
        raise ManifestError(f"manifest field {field!r}: expected int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ManifestError(f"manifest field {field!r}: must be >= {minimum}, got {value}")


def _check_str(field: str, value: Any) -> None:
    if not isinstance(value, str):
        raise ManifestError(f"manifest field {field!r}: expected str, got {type(value).__name__}")
    if not value:
        raise ManifestError(f"manifest field {field!r}: must not be empty")


def _check_cid(field: str, value: Any, codec: Codec) -> None:
    _check_str(field, value)
    try:
        cid = CID.parse(value)
    except InvalidCIDError as e:
        raise ManifestError(f"manifest field {field!r}: {e}") from None
    if cid.codec != codec:
        raise ManifestError(
            f"manifest field {field!r}: CID {value} has codec {cid.codec.name}, "
            f"expected {codec.name}"
        )


def _check_keys(field: str, obj: Any, expected: set[str]) -> None:
    if not isinstance(obj, dict):
        raise ManifestError(f"manifest field {field!r}: expected object, got {type(obj).__name__}")
    missing = sorted(expected - obj.keys())
    if missing:
        raise ManifestError(f"manifest field {field!r}: missing keys {missing}")
    unknown = sorted(obj.keys() - expected, key=repr)
    if unknown:
        raise ManifestError(f"manifest field {field!r}: unknown keys {unknown}")


def _check_list(field: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise ManifestError(f"manifest field {field!r}: expected list, got {type(value).__name__}")


def _check_sorted_unique(field: str, items: list[str], what: str) -> None:
    for i in range(1, len(items)):
        if items[i - 1] == items[i]:
            raise ManifestError(f"manifest field {field!r}: duplicate {what} {items[i]!r}")
        if items[i - 1] > items[i]:
            raise ManifestError(
                f"manifest field {field!r}: not sorted by {what} "
                f"({items[i - 1]!r} comes before {items[i]!r})"
            )


# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """What decided the floating point of a worker's inner loop (schema v5): the ATen CPU capability
    its kernels dispatched to and its intra-op thread count (trainer.runtime.kernels), and for a
    data-parallel island the number of ranks whose gradients it averaged (trainer.runtime.island)."""

    capability: str
    threads: int
    data_parallel: int = 1

    def __post_init__(self) -> None:
        _validate_kernels(self.to_json(), at="kernels")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"capability": self.capability, "threads": self.threads}
        if self.data_parallel != 1:
            out["data_parallel"] = self.data_parallel
        return out

    @classmethod
    def from_json(cls, obj: Any, at: str = "kernels") -> Kernels:
        _validate_kernels(obj, at)
        return cls(**obj)

    def __str__(self) -> str:
        ranks = f", {self.data_parallel} data-parallel ranks" if self.data_parallel != 1 else ""
        return f"{self.capability}, {self.threads} thread{'s' if self.threads != 1 else ''}{ranks}"


def _validate_kernels(obj: Any, at: str) -> None:
    _check_keys(at, obj, _KERNELS_KEYS | (_KERNELS_OPTIONAL & obj.keys() if isinstance(obj, dict) else set()))
    if obj["capability"] not in KERNEL_CAPABILITIES:  # an allowlist: nothing unbounded is echoed
        raise ManifestError(f"manifest field {at + '.capability'!r}: expected one of {list(KERNEL_CAPABILITIES)}")
    _check_int(f"{at}.threads", obj["threads"], minimum=1)
    if obj["threads"] > MAX_KERNEL_THREADS:
        raise ManifestError(f"manifest field {at + '.threads'!r}: must be <= {MAX_KERNEL_THREADS}")
    if "data_parallel" in obj:
        _check_int(f"{at}.data_parallel", obj["data_parallel"], minimum=2)
        if obj["data_parallel"] > MAX_DATA_PARALLEL:
            raise ManifestError(f"manifest field {at + '.data_parallel'!r}: must be <= {MAX_DATA_PARALLEL}")


@dataclass(frozen=True)
class Participant:
    """One worker's contribution to a round."""

    worker: str
    update: str  # CID text of the worker's update record (JSON, trainer.runstore.update_record; schema v4)
    train_loss_e6: int  # mean inner-loop loss x 1e6, rounded
    tokens: int
    inner_steps: int
    bytes_sent: int  # wire bytes of the accepted update
    # wire bytes of the FetchGlobal stream that delivered the global state this worker's update was
    # computed from (0 when not counted)
    bytes_received: int = 0
    shard: int = 0  # the data shard the update was trained on (trainer.data.corpus.Corpus.shard)
    # sha256 (hex) of the worker's inner state at the start of the round (trainer.inner_state), or
    # None where it is not committed (a worker of several pipeline stages, before they committed one)
    state: str | None = None
    # what decided the floating point of its inner loop (schema v5), or None where none is recorded
    kernels: Kernels | None = None

    def __post_init__(self) -> None:
        if isinstance(self.kernels, dict):  # Participant(**p.to_json()): the JSON form, parsed
            object.__setattr__(self, "kernels", Kernels.from_json(self.kernels, "participant.kernels"))
        _validate_participant(self.to_json(), at="participant")

    def to_json(self) -> dict[str, Any]:
        return {
            "worker": self.worker,
            "update": self.update,
            "train_loss_e6": self.train_loss_e6,
            "tokens": self.tokens,
            "inner_steps": self.inner_steps,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "shard": self.shard,
            "state": self.state,
            "kernels": None if self.kernels is None else self.kernels.to_json(),
        }

    @classmethod
    def from_json(cls, obj: Any, at: str = "participant") -> Participant:
        """Strictly parse one participant; `at` is the field path used in errors."""
        # Validate here first so errors name the real path, e.g. participants[2].tokens.
        _validate_participant(obj, at)
        kernels = None if obj["kernels"] is None else Kernels.from_json(obj["kernels"], f"{at}.kernels")
        return cls(**{**obj, "kernels": kernels})


def _validate_participant(obj: Any, at: str) -> None:
    _check_keys(at, obj, _PARTICIPANT_KEYS)
    _check_str(f"{at}.worker", obj["worker"])
    _check_cid(f"{at}.update", obj["update"], Codec.JSON)
    _check_int(f"{at}.train_loss_e6", obj["train_loss_e6"])
    _check_int(f"{at}.tokens", obj["tokens"], minimum=0)
    _check_int(f"{at}.inner_steps", obj["inner_steps"], minimum=0)
    _check_int(f"{at}.shard", obj["shard"], minimum=0)
    state = obj["state"]
    if state is not None and not (isinstance(state, str) and len(state) == 64
                                  and all(c in "0123456789abcdef" for c in state)):
        raise ManifestError(f"manifest field {at + '.state'!r}: expected null or 64 lowercase hex digits")
    _check_int(f"{at}.bytes_sent", obj["bytes_sent"], minimum=0)
    _check_int(f"{at}.bytes_received", obj["bytes_received"], minimum=0)
    if obj["kernels"] is not None:
        _validate_kernels(obj["kernels"], f"{at}.kernels")


@dataclass(frozen=True)
class Downlink:
    """The compressed global update of a round, as it travelled to the workers."""

    payload: str  # CID text of the compressed global update bytes (RAW)
    header: str  # CID text of its codec header (JSON)

    def __post_init__(self) -> None:
        _validate_downlink(self.to_json(), at="downlink")

    def to_json(self) -> dict[str, Any]:
        return {"payload": self.payload, "header": self.header}

    @classmethod
    def from_json(cls, obj: Any, at: str = "downlink") -> Downlink:
        """Strictly parse a downlink record; `at` is the field path used in errors."""
        _validate_downlink(obj, at)
        return cls(**obj)


def _validate_downlink(obj: Any, at: str) -> None:
    _check_keys(at, obj, _DOWNLINK_KEYS)
    _check_cid(f"{at}.payload", obj["payload"], Codec.RAW)
    _check_cid(f"{at}.header", obj["header"], Codec.JSON)


@dataclass(frozen=True)
class Traffic:
    """The wire bytes one worker moved in a round: `up` to the coordinator, `down` from it."""

    worker: str
    up: int
    down: int

    def __post_init__(self) -> None:
        _validate_traffic(self.to_json(), at="traffic")

    def to_json(self) -> dict[str, Any]:
        return {"worker": self.worker, "up": self.up, "down": self.down}

    @classmethod
    def from_json(cls, obj: Any, at: str = "traffic") -> Traffic:
        """Strictly parse one traffic entry; `at` is the field path used in errors."""
        _validate_traffic(obj, at)
        return cls(**obj)


def _validate_traffic(obj: Any, at: str) -> None:
    _check_keys(at, obj, _TRAFFIC_KEYS)
    _check_str(f"{at}.worker", obj["worker"])
    _check_int(f"{at}.up", obj["up"], minimum=0)
    _check_int(f"{at}.down", obj["down"], minimum=0)


@dataclass(frozen=True)
class Manifest:
    """The record of one global checkpoint; see the module docstring."""

    run_id: str
    round: int
    parent: str | None  # CID text of the previous manifest; None only for round 0
    config: str  # CID text of the run config (JSON)
    params: str  # CID text of the global parameters safetensors (RAW)
    outer_state: str  # CID text of the outer optimiser state safetensors (RAW)
    participants: tuple[Participant, ...]  # sorted by worker, unique
    dropped: tuple[str, ...]  # sorted, unique worker ids expected but absent
    eval_loss_e6: int
    bytes_up: int
    bytes_down: int
    downlink: Downlink | None = None  # the compressed global update; None when it travelled dense
    traffic: tuple[Traffic, ...] = ()  # sorted by worker, unique; sums are bytes_up / bytes_down

    def __post_init__(self) -> None:
        # Freeze sequences (a list would make the record mutable); never reorder them.
        _check_list("participants", self.participants)
        _check_list("dropped", self.dropped)
        _check_list("traffic", self.traffic)
        object.__setattr__(self, "participants", tuple(self.participants))
        object.__setattr__(self, "dropped", tuple(self.dropped))
        object.__setattr__(self, "traffic", tuple(self.traffic))

        _check_str("run_id", self.run_id)
        _check_int("round", self.round, minimum=0)
        if self.round == 0:
            if self.parent is not None:
                raise ManifestError("manifest field 'parent': must be null for round 0")
        else:
            if self.parent is None:
                raise ManifestError(f"manifest field 'parent': required for round {self.round}")
            _check_cid("parent", self.parent, Codec.JSON)
        _check_cid("config", self.config, Codec.JSON)
        _check_cid("params", self.params, Codec.RAW)
        _check_cid("outer_state", self.outer_state, Codec.RAW)
        _check_int("eval_loss_e6", self.eval_loss_e6)
        _check_int("bytes_up", self.bytes_up, minimum=0)
        _check_int("bytes_down", self.bytes_down, minimum=0)

        workers: list[str] = []
        for i, p in enumerate(self.participants):
            if not isinstance(p, Participant):
                raise ManifestError(
                    f"manifest field 'participants[{i}]': expected Participant, "
                    f"got {type(p).__name__}"
                )
            workers.append(p.worker)
        _check_sorted_unique("participants", workers, what="worker")

        for i, w in enumerate(self.dropped):
            _check_str(f"dropped[{i}]", w)
        _check_sorted_unique("dropped", list(self.dropped), what="worker id")
        both = sorted(set(workers) & set(self.dropped))
        if both:
            raise ManifestError(f"manifest field 'dropped': workers {both} are also participants")

        if self.downlink is not None:
            if not isinstance(self.downlink, Downlink):
                raise ManifestError(
                    f"manifest field 'downlink': expected Downlink or null, "
                    f"got {type(self.downlink).__name__}"
                )
            if self.round == 0:
                raise ManifestError("manifest field 'downlink': must be null for round 0")

        movers: list[str] = []
        for i, t in enumerate(self.traffic):
            if not isinstance(t, Traffic):
                raise ManifestError(
                    f"manifest field 'traffic[{i}]': expected Traffic, got {type(t).__name__}"
                )
            movers.append(t.worker)
        _check_sorted_unique("traffic", movers, what="worker")
        if self.traffic:
            up = sum(t.up for t in self.traffic)
            down = sum(t.down for t in self.traffic)
            if up != self.bytes_up:
                raise ManifestError(
                    f"manifest field 'traffic': up bytes sum to {up}, bytes_up is {self.bytes_up}"
                )
            if down != self.bytes_down:
                raise ManifestError(
                    f"manifest field 'traffic': down bytes sum to {down}, "
                    f"bytes_down is {self.bytes_down}"
                )

    @classmethod
    def new(
        cls,
        *,
        run_id: str,
        round: int,
        parent: CID | str | None,
        config: CID | str,
        params: CID | str,
        outer_state: CID | str,
        participants: Iterable[Participant],
        dropped: Iterable[str],
        eval_loss_e6: int,
        bytes_up: int,
        bytes_down: int,
        downlink: Downlink | None = None,
        traffic: Iterable[Traffic] = (),
    ) -> Manifest:
        """Build a manifest, sorting participants, dropped and traffic and accepting CID objects."""
        return cls(
            run_id=run_id,
            round=round,
            parent=None if parent is None else str(parent),
            config=str(config),
            params=str(params),
            outer_state=str(outer_state),
            participants=tuple(sorted(participants, key=lambda p: p.worker)),
            dropped=tuple(sorted(dropped)),
            eval_loss_e6=eval_loss_e6,
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            downlink=downlink,
            traffic=tuple(sorted(traffic, key=lambda t: t.worker)),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "run_id": self.run_id,
            "round": self.round,
            "parent": self.parent,
            "config": self.config,
            "params": self.params,
            "outer_state": self.outer_state,
            "participants": [p.to_json() for p in self.participants],
            "dropped": list(self.dropped),
            "eval_loss_e6": self.eval_loss_e6,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "downlink": None if self.downlink is None else self.downlink.to_json(),
            "traffic": [t.to_json() for t in self.traffic],
        }

    @classmethod
    def from_json(cls, obj: Any) -> Manifest:
        """Strictly parse a decoded manifest; raise ManifestError naming the bad field."""
        if isinstance(obj, dict) and "schema" in obj and obj["schema"] != SCHEMA:
            raise ManifestError(
                f"manifest field 'schema': expected {SCHEMA!r}, got {obj['schema']!r}"
            )
        _check_keys("$", obj, _MANIFEST_KEYS)
        _check_list("participants", obj["participants"])
        participants = tuple(
            Participant.from_json(p, at=f"participants[{i}]")
            for i, p in enumerate(obj["participants"])
        )
        _check_list("dropped", obj["dropped"])
        downlink = None if obj["downlink"] is None else Downlink.from_json(obj["downlink"])
        _check_list("traffic", obj["traffic"])
        traffic = tuple(
            Traffic.from_json(t, at=f"traffic[{i}]") for i, t in enumerate(obj["traffic"])
        )
        return cls(
            run_id=obj["run_id"],
            round=obj["round"],
            parent=obj["parent"],
            config=obj["config"],
            params=obj["params"],
            outer_state=obj["outer_state"],
            participants=participants,
            dropped=tuple(obj["dropped"]),
            eval_loss_e6=obj["eval_loss_e6"],
            bytes_up=obj["bytes_up"],
            bytes_down=obj["bytes_down"],
            downlink=downlink,
            traffic=traffic,
        )

    @property
    def cid(self) -> CID:
        """The CID this manifest has (or would have) in any store."""
        return digest_json(self.to_json())

    def store(self, store: Store) -> CID:
        """Write the manifest to `store`; its CID identifies the round."""
        return store.put_json(self.to_json())

    @classmethod
    def load(cls, store: Store, cid: CID | str) -> Manifest:
        """Read and validate a manifest; store errors (missing, corrupt) propagate."""
        return cls.from_json(store.get_json(cid))


def lineage(store: Store, head: CID | str) -> list[tuple[CID, Manifest]]:
    """Walk parent links from `head` to genesis; return [(cid, manifest)] genesis first.

    Every link is checked: the parent must be exactly one round earlier and belong
    to the same run. Rounds strictly decrease, so the walk always terminates.
    """
    cid = head if isinstance(head, CID) else CID.parse(head)
    manifest = Manifest.load(store, cid)
    chain = [(cid, manifest)]
    while manifest.parent is not None:
        parent_cid = CID.parse(manifest.parent)
        parent = Manifest.load(store, parent_cid)
        if parent.round != manifest.round - 1:
            raise ManifestError(
                f"broken lineage: manifest {cid} (round {manifest.round}) names parent "
                f"{parent_cid} with round {parent.round}, expected {manifest.round - 1}"
            )
        if parent.run_id != manifest.run_id:
            raise ManifestError(
                f"broken lineage: manifest {cid} (run {manifest.run_id!r}) names parent "
                f"{parent_cid} from run {parent.run_id!r}"
            )
        cid, manifest = parent_cid, parent
        chain.append((cid, manifest))
    chain.reverse()
    return chain
