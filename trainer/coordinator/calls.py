"""How a call gets to the coordinator's state machine, and all it may cost on the way there.

The server is asynchronous (grpc.aio, trainer.coordinator.server): a call that has not yet
arrived whole, proved who it acts for and made progress holds a coroutine of one event loop, and
nothing scarce. Every method, unary ones included, is served as a request stream, so that its
request message is awaited here with a deadline rather than by gRPC for as long as the caller
likes. A call passes, in order:

  1. connections  calls in flight on at most ``CONNECTIONS_PER_HOST`` connections of one host
                  (trainer.net.limits.ConnectionCap); refused at once beyond.
  2. arrival      its first message within ``ARRIVAL_S`` (``CallGate.arrival``), or it is ended
                  (DEADLINE_EXCEEDED) with at most one budgeted line.
  3. decoding     a message that does not decode is refused (INVALID_ARGUMENT): the deserializer
                  returns ``MALFORMED`` instead of raising, so gRPC never logs a traceback.
  4. identity     a call acting for a worker carries its id and the session token of its latest
                  Join in its metadata (``CallGate.worker``); anything else is UNAUTHENTICATED
                  and changes nothing.
  5. budgets      per worker id (trainer.net.limits.StreamBudget) for streams, per connection and in
                  all (TokenBucket) for Challenge, Join and Status, and a pace for every stream
                  that moves data (trainer.net.limits.Progress).

Only then does a call take a thread, from one of three pools so that no kind of caller waits on
another's: ``WORKERS`` (calls of authenticated workers: heartbeats, reports, the checks of a fetch
or a push), ``HEAVY`` (verifying a Join's evidence, decoding and storing a push) and ``PUBLIC``
(Status and Challenge, which anyone may call). ``CallGate.call`` turns what went wrong into a
status code (a trainer.net.refusal.Refusal by ``STATUS_OF``; a caller gone mid-call, ``PeerGone``,
is CANCELLED) and at most one line of the one
per-party log budget (trainer.net.limits.LogBudget); a bug is INTERNAL, its traceback only at debug.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, TypeVar

import grpc

from proto import METADATA_SESSION, METADATA_WORKER
from trainer.net.limits import (
    ConnectionCap,
    Exhausted,
    FieldError,
    LogBudget,
    Progress,
    Stalled,
    TokenBucket,
    check_worker_id,
    clip,
)
from trainer.net.refusal import Reason, Refusal

log = logging.getLogger("dilocox.service")
T = TypeVar("T")

ARRIVAL_S = 10.0                 # a call's request message arrives within this, or the call ends
CONNECTIONS_PER_HOST = 64
MIN_PACE = 256 << 10             # bytes a second a stream moving data keeps after its grace
WORKERS, HEAVY, PUBLIC = "workers", "heavy", "public"
THREADS = {WORKERS: 8, HEAVY: 8, PUBLIC: 2}

_CODE = grpc.StatusCode
# Every refusal reason's status code: the one place the round logic's reasons meet gRPC.
STATUS_OF: dict[Reason, grpc.StatusCode] = {
    Reason.MALFORMED: _CODE.INVALID_ARGUMENT, Reason.BAD_CLAIM: _CODE.INVALID_ARGUMENT,
    Reason.REPLAYED: _CODE.INVALID_ARGUMENT, Reason.SCREENED_OUT: _CODE.INVALID_ARGUMENT,
    Reason.PROTOCOL: _CODE.FAILED_PRECONDITION, Reason.WRONG_RUN: _CODE.FAILED_PRECONDITION,
    Reason.FINISHED: _CODE.FAILED_PRECONDITION, Reason.STALE_ROUND: _CODE.FAILED_PRECONDITION,
    Reason.ROUND_NOT_OPEN: _CODE.FAILED_PRECONDITION, Reason.WRONG_BASE: _CODE.FAILED_PRECONDITION,
    Reason.NOT_PUBLISHED: _CODE.FAILED_PRECONDITION, Reason.NOT_PARTICIPANT: _CODE.FAILED_PRECONDITION,
    Reason.NO_LEDGER: _CODE.FAILED_PRECONDITION, Reason.BAD_NONCE: _CODE.FAILED_PRECONDITION,
    Reason.HALTED: _CODE.FAILED_PRECONDITION,
    Reason.NO_SESSION: _CODE.UNAUTHENTICATED, Reason.BAD_SIGNATURE: _CODE.UNAUTHENTICATED,
    Reason.NO_EVIDENCE: _CODE.UNAUTHENTICATED, Reason.UNKNOWN_WORKER: _CODE.PERMISSION_DENIED,
    Reason.NOT_ADMITTED: _CODE.PERMISSION_DENIED, Reason.DUPLICATE: _CODE.ALREADY_EXISTS,
    Reason.ID_HELD: _CODE.ALREADY_EXISTS, Reason.REGISTRY_FULL: _CODE.RESOURCE_EXHAUSTED,
    Reason.CHAIN_UNAVAILABLE: _CODE.UNAVAILABLE,
}


class PeerGone(Exception):
    """The caller went away mid-call (it cancelled, or its connection closed): nothing to answer."""


# What the caller did wrong, by exception: (log budget kind, verb of its line, status code).
_CALLER_FAULT: dict[type[Exception], tuple[str, str, grpc.StatusCode]] = {
    FieldError: ("field", "refused", grpc.StatusCode.INVALID_ARGUMENT),
    Exhausted: ("exhausted", "refused", grpc.StatusCode.RESOURCE_EXHAUSTED),
    Stalled: ("stalled", "ended", grpc.StatusCode.DEADLINE_EXCEEDED),
    PeerGone: ("gone", "ended", grpc.StatusCode.CANCELLED),
}
_CALLER_FAULTS = tuple(_CALLER_FAULT)


class _Malformed:
    """What a request that does not decode arrives as (module docstring, step 3)."""

    def __repr__(self) -> str:
        return "MALFORMED"


MALFORMED = _Malformed()


def parser(message_type: type) -> Callable[[bytes], object]:
    def parse(data: bytes) -> object:
        try:
            return message_type.FromString(data)
        except Exception:  # DecodeError, or worse on hostile bytes: never let gRPC log a traceback
            return MALFORMED
    return parse


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """"ipv4:127.0.0.1:5123" → "ipv4:127.0.0.1": the caller's host, the party of its log lines."""
    return context.peer().rsplit(":", 1)[0]


class Sessions:
    """Session tokens of joined workers: worker id → sha256(token). Thread-safe; bounded by the
    coordinator's worker registry (``retain``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[str, bytes] = {}

    def issue(self, worker_id: str) -> bytes:
        token = os.urandom(32)
        with self._lock:
            self._digests[worker_id] = hashlib.sha256(token).digest()
        return token

    def valid(self, worker_id: str, token: bytes) -> bool:
        with self._lock:
            digest = self._digests.get(worker_id)
        return digest is not None and hmac.compare_digest(digest, hashlib.sha256(token).digest())

    def retain(self, worker_ids: set[str]) -> None:
        with self._lock:
            self._digests = {w: d for w, d in self._digests.items() if w in worker_ids}


class CallGate:
    """Steps 1–5 of the module docstring, and the thread pools behind them."""

    def __init__(self, *, idle_s: float = 30.0) -> None:
        self.idle_s = idle_s
        self.sessions = Sessions()
        self.connections = ConnectionCap(CONNECTIONS_PER_HOST)
        self.budget = LogBudget(log)
        self.pools = {name: ThreadPoolExecutor(n, thread_name_prefix=f"rpc-{name}") for name, n in THREADS.items()}

    def close(self) -> None:
        for pool in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, pool: str, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on a thread of ``pool`` (the state machine blocks on its lock and disk)."""
        return await asyncio.get_running_loop().run_in_executor(self.pools[pool], fn, *args)

    async def call(self, context: grpc.aio.ServicerContext, rpc: str, body: Callable[[], Awaitable[T]]) -> T:
        """Run ``body`` inside the caller's connection budget; turn every refusal into its status
        code and at most one budgeted line, and anything else into INTERNAL."""
        peer, party = context.peer(), peer_host(context)
        try:
            with self.connections.hold(peer):
                return await body()
        except grpc.aio.AbortError:  # the body ended the call with its own status
            raise
        except Refusal as r:
            code, message = STATUS_OF[r.reason], r.message
            if code == grpc.StatusCode.UNAUTHENTICATED:  # someone acting for a worker it is not
                self.budget.warning("unauthenticated", "%s from %s refused: %s", rpc, party, message, party=party)
        except _CALLER_FAULTS as exc:
            kind, verb, code = next(v for k, v in _CALLER_FAULT.items() if isinstance(exc, k))
            self.budget.warning(kind, "%s from %s %s: %s", rpc, party, verb, exc, party=party)
            message = str(exc)
        except OSError as exc:  # the store's disk is full or failing: the caller may retry later
            self.budget.warning("storage", "%s failed to store: %s", rpc, clip(exc, 200))
            code, message = grpc.StatusCode.UNAVAILABLE, "the coordinator cannot store data right now; retry later"
        except Exception as exc:  # a bug, not the caller's fault: one line, the traceback only at debug
            self.budget.warning("internal", "%s failed: %s: %s", rpc, type(exc).__name__, clip(exc, 200), party=party)
            log.debug("%s failed", rpc, exc_info=True)
            code, message = grpc.StatusCode.INTERNAL, "internal error; the coordinator's log says more"
        await context.abort(code, message)
        raise AssertionError("unreachable")  # abort raises

    async def arrival(self, context: grpc.aio.ServicerContext, what: str) -> object:
        """The call's first message, decoded, within ``ARRIVAL_S`` or the idle allowance if that is
        shorter (steps 2 and 3)."""
        allowance = min(ARRIVAL_S, self.idle_s)
        try:
            message = await asyncio.wait_for(context.read(), allowance)
        except asyncio.TimeoutError:
            raise Stalled(f"the {what} message did not arrive within {allowance:.0f}s") from None
        except Exception as exc:  # the transport's error: the caller is gone
            raise PeerGone(f"the caller went away before its {what} message ({type(exc).__name__})") from None
        if message is grpc.aio.EOF:
            raise FieldError(f"the call carried no {what} message")
        if message is MALFORMED:
            raise FieldError(f"the {what} message does not decode")
        return message

    def pace(self) -> Progress:
        """The pace of a stream that starts moving data now (trainer.net.limits.Progress)."""
        return Progress(asyncio.get_running_loop().time(), grace_s=self.idle_s, min_rate=MIN_PACE, idle_s=self.idle_s)

    async def read(self, context: grpc.aio.ServicerContext, pace: Progress) -> object:
        """The stream's next message (``grpc.aio.EOF`` at its end), or Stalled once it falls behind."""
        loop = asyncio.get_running_loop()
        allowance = pace.allowance(loop.time())
        try:
            if allowance <= 0:
                raise asyncio.TimeoutError
            message = await asyncio.wait_for(context.read(), allowance)
        except asyncio.TimeoutError:
            raise Stalled(f"cut: {pace.describe(loop.time())}") from None
        except Exception as exc:  # the transport's error: the caller is gone
            raise PeerGone(f"the caller went away mid-stream ({type(exc).__name__})") from None
        if message is not grpc.aio.EOF and message is not MALFORMED:
            pace.moved(message.ByteSize(), loop.time())
        return message

    async def write(self, context: grpc.aio.ServicerContext, message: object, pace: Progress) -> None:
        """Send one message of a stream, or Stalled once the caller reads too slowly to keep the pace."""
        loop = asyncio.get_running_loop()
        allowance = pace.allowance(loop.time())
        try:
            if allowance <= 0:
                raise asyncio.TimeoutError
            await asyncio.wait_for(context.write(message), allowance)
        except asyncio.TimeoutError:
            raise Stalled(f"cut: {pace.describe(loop.time())}") from None
        except Exception as exc:  # the transport's error: the caller is gone
            raise PeerGone(f"the caller went away mid-stream ({type(exc).__name__})") from None
        pace.moved(message.ByteSize(), loop.time())

    def worker(self, context: grpc.aio.ServicerContext) -> str:
        """The worker a call acts for, proved by its session token (step 4)."""
        metadata = dict(context.invocation_metadata() or ())
        worker = metadata.get(METADATA_WORKER, "")
        token = metadata.get(METADATA_SESSION, b"")
        if not isinstance(worker, str) or not worker or not isinstance(token, bytes):
            raise Refusal(Reason.NO_SESSION,
                          f"this call acts for a worker: send {METADATA_WORKER} and {METADATA_SESSION} metadata "
                          f"(the session token of your Join)")
        check_worker_id(worker)
        if not self.sessions.valid(worker, token):
            raise Refusal(Reason.NO_SESSION, f"no session of worker {worker!r} has this token: Join again")
        return worker

    @staticmethod
    def same_worker(worker: str, claimed: str) -> None:
        """The worker a request names must be the one its session proved (``worker``)."""
        if claimed != worker:
            raise Refusal(Reason.NO_SESSION,
                          f"the request names worker {clip(claimed)}, but the session is {worker!r}'s")

    def session_token(self, context: grpc.aio.ServicerContext) -> bytes:
        token = dict(context.invocation_metadata() or ()).get(METADATA_SESSION, b"")
        return token if isinstance(token, bytes) else b""

    @staticmethod
    def rate(context: grpc.aio.ServicerContext, bucket: TokenBucket, everyone: TokenBucket, what: str) -> None:
        if not bucket.allow(context.peer()):
            raise Exhausted(f"too many {what} requests on this connection; retry in a few seconds")
        if not everyone.allow("*"):
            raise Exhausted(f"too many {what} requests from all callers; retry in a few seconds")
