"""Bounded resources for the coordinator's gRPC service: what any one peer can cost it.

Every request is checked here before the coordinator's state machine sees it:

    fields      every string, bytes and repeated field of every request message has a bound
                (``FIELD_LIMITS``, else ``DEFAULT_STRING``/``DEFAULT_BYTES``/``DEFAULT_REPEATED``),
                found by walking the message's descriptor, so a field added to the .proto later is
                bounded too. Worker ids must match ``WORKER_ID`` and phases be one of ``proto.HEARTBEAT_PHASES``.
    arrival     every call's request message must arrive within the server's arrival allowance
                (trainer.coordinator.service.ARRIVAL_S); until it has, a call holds a coroutine of
                the server's event loop and nothing else: no thread, no slot, no log line.
    streams     ``StreamBudget``: PushUpdate and FetchGlobal streams are held per worker id (an
                authenticated one), a few of each kind per id and none shared among ids, so no
                number of other ids can take an id's push or its fetch; the registry bounds how
                many ids there are (trainer.coordinator.registry).
    progress    ``Progress``: a stream that moves data keeps a least pace (bytes a second after a
                grace) and never goes ``idle_s`` without a message, or it is cut; a long-poll's
                wait for a round is not counted (nothing moves, and it costs a coroutine).
    connections ``ConnectionCap``: calls in flight on at most ``per_host`` connections of one host.
    rate        ``TokenBucket`` per key (a connection, or "*" for everyone), for Challenge and Join.
    echo        ``clip`` quotes at most ``ECHO_CHARS`` of anything a caller sent.
    log lines   ``LogBudget``, the one budget of every refusal's log line: a refused message costs at
                most one line, and no more than ``per_minute`` lines a minute for each kind of fault
                from each party, ``all_per_minute`` from all of them, never a traceback.

The other side of the wire, what a worker allows the coordinator it pinned (trainer.worker.client):

    payload     a global state is at most ``dense_payload_limit`` of the run's parameter count: 4
                bytes per fp32 value plus ``FRAMING_MARGIN`` (the coordinator bounds a push alike,
                trainer.coordinator.checks.check_form).
    intervals   what the coordinator dictates is held to [floor, ceiling] (``bounded``): heartbeats
                to [``HEARTBEAT_FLOOR_S``, ``HEARTBEAT_CEILING_S``], the long-poll asked for to
                [``FETCH_WAIT_FLOOR_S``, ``FETCH_WAIT_CEILING_S``].
    retries     ``Backoff``: with d_k = min(ceiling, floor · 2^k), the k-th retry waits a time drawn
                uniformly from [max(floor, d_k / 2), d_k] (jitter: workers that failed together do
                not retry together; never less than the floor).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

from google.protobuf.message import Message

from proto import HEARTBEAT_PHASES

log = logging.getLogger("dilocox.limits")

ECHO_CHARS = 64
WORKER_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")

DEFAULT_STRING = 128        # characters: ids, CIDs, digests, encodings
DEFAULT_BYTES = 256         # nonces, signatures, tokens
DEFAULT_REPEATED = 4096     # tensors in a layout, dimensions of a shape
# Fields that are larger by nature, by (message name, field name).
FIELD_LIMITS: dict[tuple[str, str], int] = {
    ("JoinRequest", "evidence"): 256 << 10,             # a TDX quote with its certificate chain, as hex
    ("UpdateHeader", "compression_header"): 4 << 20,     # one entry per tensor
    ("UpdateChunk", "data"): 1 << 20,                    # proto.CHUNK_BYTES
    ("SubmitReportRequest", "signed_report"): 16 << 10,
    ("TensorSpec", "name"): 256,
    ("TensorSpec", "shape"): 8,
}


class FieldError(ValueError):
    """A request field over its bound or of the wrong form; the message names the field only."""


def clip(text: object, limit: int = ECHO_CHARS) -> str:
    """``repr`` of caller-supplied text, cut to ``limit`` characters with the full length named."""
    s = str(text)
    if len(s) <= limit:
        return repr(s)
    return f"{s[:limit]!r}… ({len(s)} characters)"


def check_fields(message: Message, path: str = "") -> None:
    """Refuse any string, bytes or repeated field of ``message`` (recursively) over its bound."""
    name = message.DESCRIPTOR.name
    for fd, value in message.ListFields():
        where = f"{path}{name}.{fd.name}"
        limit = FIELD_LIMITS.get((name, fd.name))
        repeated = fd.is_repeated
        if repeated:
            bound = limit if limit is not None and fd.type not in (fd.TYPE_STRING, fd.TYPE_BYTES) else DEFAULT_REPEATED
            if len(value) > bound:
                raise FieldError(f"{where} has {len(value)} entries, more than {bound}")
            items = value
        else:
            items = (value,)
        for item in items:
            if fd.type == fd.TYPE_MESSAGE:
                check_fields(item, f"{where}/")
            elif fd.type == fd.TYPE_STRING:
                bound = limit or DEFAULT_STRING
                if len(item) > bound:
                    raise FieldError(f"{where} is {len(item)} characters, more than {bound}")
            elif fd.type == fd.TYPE_BYTES:
                bound = limit or DEFAULT_BYTES
                if len(item) > bound:
                    raise FieldError(f"{where} is {len(item)} bytes, more than {bound}")


def check_worker_id(worker_id: str) -> None:
    if not WORKER_ID.fullmatch(worker_id):
        raise FieldError(f"worker id {clip(worker_id)} must match {WORKER_ID.pattern}")


def check_phase(phase: int) -> None:
    if phase not in HEARTBEAT_PHASES:
        raise FieldError(f"phase {phase} is not one a worker may send: "
                         f"{', '.join(f'{p.value} ({p.name})' for p in sorted(HEARTBEAT_PHASES))}")


# ----------------------------------------------------------------------------------- rate


@dataclass
class TokenBucket:
    """``rate`` events a second per key, bursts of ``burst``; at most ``max_keys`` keys remembered
    (the least recently used go first, so a flood of new keys cannot grow memory)."""

    rate: float
    burst: float
    max_keys: int = 4096
    clock: Callable[[], float] = time.monotonic
    _buckets: OrderedDict[str, tuple[float, float]] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def allow(self, key: str) -> bool:
        now = self.clock()
        with self._lock:
            tokens, then = self._buckets.pop(key, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[key] = (tokens - 1.0 if allowed else tokens, now)
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
            return allowed


class LogBudget:
    """The one budget of every refusal's log line: at most ``per_minute`` lines a minute for each
    kind of fault from each party (a peer's host, or an authenticated worker's id), and at most
    ``all_per_minute`` a minute for each kind from all parties together (so N parties, or one with
    N addresses, cost no more). A line over either budget is counted against its party; the next
    line let through for that kind and party says how many were not logged. At most ``max_keys``
    (kind, party) windows are remembered, the least recently used going first: a flood of new
    parties cannot grow memory, only lose the count of suppressed lines of the oldest."""

    EVERYONE = "*"

    def __init__(self, logger: logging.Logger, per_minute: int = 10, clock: Callable[[], float] = time.monotonic,
                 *, all_per_minute: int = 120, max_keys: int = 4096) -> None:
        self.logger = logger
        self.per_minute = per_minute
        self.all_per_minute = all_per_minute
        self.max_keys = max_keys
        self.clock = clock
        self._lock = threading.Lock()
        # (kind, party) -> [window start, lines let through in it, lines suppressed since the last one]
        self._window: OrderedDict[tuple[str, str], list[float]] = OrderedDict()

    def warning(self, kind: str, message: str, *args: object, party: str = EVERYONE) -> None:
        self.log(logging.WARNING, kind, party, message, *args)

    def log(self, level: int, kind: str, party: str, message: str, *args: object) -> None:
        """Log ``message % args`` at ``level`` if ``party`` and everyone have budget left for ``kind``."""
        now = self.clock()
        with self._lock:
            mine = self._current((kind, party), now)
            everyone = mine if party == self.EVERYONE else self._current((kind, self.EVERYONE), now)
            if mine[1] >= self.per_minute or everyone[1] >= self.all_per_minute:
                mine[2] += 1
                return
            suppressed = int(mine[2])
            mine[1] += 1
            mine[2] = 0
            if everyone is not mine:
                everyone[1] += 1
        if suppressed:
            message += f" ({suppressed} more like it from {clip(party)} not logged)"
        self.logger.log(level, message, *args)

    def _current(self, key: tuple[str, str], now: float) -> list[float]:
        """``key``'s window, restarted when a minute has passed (its suppressed count is kept)."""
        window = self._window.pop(key, None) or [now, 0, 0]
        if now - window[0] >= 60.0:
            window[0], window[1] = now, 0
        self._window[key] = window
        while len(self._window) > self.max_keys:
            self._window.popitem(last=False)
        return window


# ----------------------------------------------------------------------------------- streams


class Exhausted(Exception):
    """A budget of this caller (or of its host) is spent; the message says which."""


class Stalled(Exception):
    """A call that did not keep its pace: its request did not arrive in time, or its stream did
    not move data fast enough (``Progress``); the message says which."""


class StreamBudget:
    """Streams a worker id holds at once, by kind (module docstring, "streams"): a budget of each
    id's own, so that nothing any other id does (or any number of them) can take an id's push or
    fetch. Used from the server's event loop only; a ``with`` of ``hold`` gives the stream back."""

    def __init__(self, per_worker: dict[str, int]) -> None:
        self.per_worker = dict(per_worker)
        self._held: dict[tuple[str, str], int] = {}

    @contextlib.contextmanager
    def hold(self, kind: str, worker: str) -> Iterator[None]:
        key = (kind, worker)
        held = self._held.get(key, 0)
        if held >= self.per_worker[kind]:
            raise Exhausted(f"worker {worker!r} already holds {held} {kind} stream(s), its limit; "
                            f"retry once one ends")
        self._held[key] = held + 1
        try:
            yield
        finally:
            left = self._held.pop(key) - 1
            if left:
                self._held[key] = left

    def held(self, kind: str | None = None) -> int:
        return sum(n for (k, _), n in self._held.items() if kind is None or k == kind)


class ConnectionCap:
    """At most ``per_host`` connections of one host with calls in flight (module docstring,
    "connections"); a call on a further connection of that host is refused at once. A connection
    is a peer string "ipv4:10.0.0.1:51234"; its host, "ipv4:10.0.0.1". Event loop only."""

    def __init__(self, per_host: int) -> None:
        self.per_host = per_host
        self._calls: dict[str, dict[str, int]] = {}  # host -> connection -> calls in flight

    @contextlib.contextmanager
    def hold(self, peer: str) -> Iterator[None]:
        host = peer.rsplit(":", 1)[0]
        connections = self._calls.setdefault(host, {})
        if peer not in connections and len(connections) >= self.per_host:
            raise Exhausted(f"this host has calls in flight on {len(connections)} connections, the limit; "
                            f"use fewer connections")
        connections[peer] = connections.get(peer, 0) + 1
        try:
            yield
        finally:
            left = connections.pop(peer) - 1
            if left:
                connections[peer] = left
            elif not connections:
                self._calls.pop(host, None)

    def connections(self, host: str) -> int:
        return len(self._calls.get(host, {}))


@dataclass
class Progress:
    """The pace a stream must keep once it began moving data (module docstring, "progress"): by
    t seconds after ``started``, at least min_rate · (t − grace_s) bytes moved, and never more
    than ``idle_s`` without a message. ``allowance(now)`` is how long the stream may now wait
    for its next message before it is cut; ``moved(n, now)`` counts a message of n bytes."""

    started: float
    grace_s: float
    min_rate: float        # bytes a second
    idle_s: float
    bytes: int = 0
    last: float = field(init=False)

    def __post_init__(self) -> None:
        self.last = self.started

    def moved(self, nbytes: int, now: float) -> None:
        self.bytes += nbytes
        self.last = now

    def allowance(self, now: float) -> float:
        behind_at = self.started + self.grace_s + self.bytes / self.min_rate  # when the rate is broken
        return min(self.last + self.idle_s, behind_at) - now

    def describe(self, now: float) -> str:
        return (f"{self.bytes} bytes in {now - self.started:.1f}s, below the least pace of "
                f"{self.min_rate / 1024:.0f} KiB/s after {self.grace_s:.0f}s, or {self.idle_s:.0f}s without a message")


# ----------------------------------------------------------------------------------- the worker's side

FRAMING_MARGIN = 1 << 20     # bytes beyond the tensors' own: the safetensors header naming each tensor
# The run config's own range of rounds.heartbeat_interval_s (trainer.config): no honest run is held
# back, and a coordinator asking for more often (it asked for 0: 2,137 a second) gets 20 a second.
HEARTBEAT_FLOOR_S = 0.05
HEARTBEAT_CEILING_S = 60.0
FETCH_WAIT_FLOOR_S = 0.5
FETCH_WAIT_CEILING_S = 30.0  # the coordinator holds a long-poll at most this long anyway
RETRY_FLOOR_S = 0.2
RETRY_CEILING_S = 5.0


def dense_payload_limit(values: int) -> int:
    """The most bytes a dense fp32 state of ``values`` numbers can need on the wire."""
    return 4 * values + FRAMING_MARGIN


def bounded(seconds: float, floor: float, ceiling: float) -> float:
    """``seconds`` held to [floor, ceiling]; NaN (no number at all) is the floor."""
    return floor if math.isnan(seconds) else min(max(seconds, floor), ceiling)


class Backoff:
    """Growing, jittered waits between retries (module docstring); ``reset`` after a success.
    ``wait(already_s)`` counts the time the failed attempt itself took toward the wait, so a
    long-poll the coordinator held for its whole wait is asked again at once."""

    def __init__(self, floor: float = RETRY_FLOOR_S, ceiling: float = RETRY_CEILING_S, *,
                 sleep: Callable[[float], None] = time.sleep, uniform: Callable[[], float] = random.random) -> None:
        self.floor, self.ceiling, self.sleep, self.uniform = floor, ceiling, sleep, uniform
        self.retries = 0

    def next_delay(self) -> float:
        full = min(self.ceiling, self.floor * 2.0 ** min(self.retries, 64))
        self.retries += 1
        return max(self.floor, full * (0.5 + 0.5 * self.uniform()))

    def wait(self, already_s: float = 0.0) -> None:
        delay = self.next_delay() - already_s
        if delay > 0:
            self.sleep(delay)

    def reset(self) -> None:
        self.retries = 0
