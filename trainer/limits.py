"""Bounded resources for the coordinator's gRPC service: what any one peer can cost it.

Every request is checked here before the coordinator's state machine sees it:

    fields      every string, bytes and repeated field of every request message has a bound
                (``FIELD_LIMITS``, else ``DEFAULT_STRING``/``DEFAULT_BYTES``/``DEFAULT_REPEATED``),
                found by walking the message's descriptor, so a field added to the .proto later is
                bounded too. Worker ids must match ``WORKER_ID`` and phases be one of ``proto.HEARTBEAT_PHASES``.
    slots       calls that can hold a server thread for long (PushUpdate, FetchGlobal, Join) take a
                slot: at most ``per_caller`` at once per caller (an authenticated worker, or the
                peer address for calls made before a Join) and ``total`` in all; the server's
                thread pool is larger than ``total``, so health, Status and the short calls always
                find a thread. Beyond a limit a call is refused at once with RESOURCE_EXHAUSTED.
    idle        a slot's call that makes no progress (no message received or sent) for its
                allowance is cancelled by one reaper thread; a long-poll's wait is allowed for.
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

import logging
import math
import random
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

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


# ----------------------------------------------------------------------------------- slots


class Exhausted(Exception):
    """No slot is free for this caller, or none at all; the message says which limit."""


@dataclass
class _Call:
    caller: str
    cancel: Callable[[], None]
    allowance_s: float
    last: float


class CallSlots:
    """Concurrency limits per caller and in total, and the idle reaper (module docstring)."""

    def __init__(self, *, total: int, per_caller: int, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.per_caller = per_caller
        self.idle_s = idle_s
        self.clock = clock
        self._lock = threading.Lock()
        self._calls: dict[int, _Call] = {}
        self._per_caller: dict[str, int] = {}
        self._next_id = 0
        self.budget = LogBudget(log)
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="idle-reaper", daemon=True)
        self._reaper.start()

    def acquire(self, caller: str, cancel: Callable[[], None]) -> Slot:
        with self._lock:
            if len(self._calls) >= self.total:
                raise Exhausted(f"the coordinator is serving {self.total} streams, its limit; retry shortly")
            held = self._per_caller.get(caller, 0)
            if held >= self.per_caller:
                raise Exhausted(f"this caller already holds {held} streams, the limit per caller")
            self._next_id += 1
            self._calls[self._next_id] = _Call(caller, cancel, self.idle_s, self.clock())
            self._per_caller[caller] = held + 1
            return Slot(self, self._next_id)

    def in_use(self) -> int:
        with self._lock:
            return len(self._calls)

    def _touch(self, call_id: int, allowance_s: float | None) -> None:
        with self._lock:
            call = self._calls.get(call_id)
            if call is not None:
                call.last = self.clock()
                call.allowance_s = self.idle_s if allowance_s is None else allowance_s + self.idle_s

    def _release(self, call_id: int) -> None:
        with self._lock:
            call = self._calls.pop(call_id, None)
            if call is None:
                return
            left = self._per_caller[call.caller] - 1
            if left:
                self._per_caller[call.caller] = left
            else:
                del self._per_caller[call.caller]

    def _reap(self) -> None:
        while not self._stop.wait(min(0.5, self.idle_s / 4)):
            now = self.clock()
            with self._lock:
                idle = [(i, c) for i, c in self._calls.items() if now - c.last > c.allowance_s]
            for call_id, call in idle:
                self.budget.warning("idle", "cancelled a stream of %s: no progress for %.0fs", call.caller,
                                    now - call.last, party=call.caller)
                self._release(call_id)
                try:
                    call.cancel()
                except Exception as exc:  # a call that ended meanwhile: nothing left to cancel
                    log.debug("cancel of an idle stream failed: %s", exc)

    def close(self) -> None:
        self._stop.set()


@dataclass
class Slot:
    """One call's hold on a slot: ``progress()`` on every message, ``waiting(s)`` before a wait
    of up to ``s`` seconds that is not idleness, ``release()`` (or ``with``) when the call ends."""

    slots: CallSlots
    call_id: int

    def progress(self) -> None:
        self.slots._touch(self.call_id, None)

    def waiting(self, seconds: float) -> None:
        self.slots._touch(self.call_id, seconds)

    def release(self) -> None:
        self.slots._release(self.call_id)

    def __enter__(self) -> Slot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


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
