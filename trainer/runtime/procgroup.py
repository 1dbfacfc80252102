"""Local process groups: W child processes in one gloo process group on 127.0.0.1, supervised.

The one supervisor of local processes that train together: pipeline stages (trainer.runtime.pipeline) and
the AllReduce baseline's ranks (benchmarks.allreduce). The parent holds the rendezvous
``TCPStore`` (an OS-chosen port on 127.0.0.1) and a results queue; each child joins the group
(:func:`join_group`: its torch threads, gloo bound to the loopback interface so nothing leaves the
host, the group's timeout on rendezvous and every collective) and answers each job ``seq`` with one
message: an :class:`Answer` (its payload plain dicts and numpy arrays, never tensors: :func:`answer`)
or a :class:`Failure` (:func:`report_error`), after which the child leaves. The queues join a parent
to its own children only, so nothing received from the network is unpickled.

:meth:`LocalGroup.collect` waits for every rank's answer to ``seq`` while watching the children:
a child that exits without answering is named first (its peers' failures follow from it),
otherwise the first rank to report an error, with the ranks still silent and its traceback; a
``deadline_s`` bounds the wait. :meth:`LocalGroup.close` asks idle children to leave, then
terminates and kills what is left.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn, Sequence

import torch
import torch.distributed as dist

from trainer.progress import Progress


@dataclass(frozen=True)
class Answer:
    """A child's result for job ``seq`` (seq 0: the process group stands)."""

    rank: int
    seq: int
    payload: Any


@dataclass(frozen=True)
class Failure:
    """A child's failure while on job ``seq``: one line, and the traceback for the log."""

    rank: int
    seq: int
    message: str
    trace: str


@dataclass(frozen=True)
class Member:
    """What a child needs to join its group."""

    rank: int
    world_size: int
    port: int  # of the parent's TCPStore
    timeout_s: float
    threads: int


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def join_group(member: Member, error: type[Exception], who: str, backend: str = "gloo") -> None:
    """In a child: set its threads and join the group (gloo; nccl for tensors on CUDA, with the
    child's GPU already set); ``error`` (naming ``who``) if the rendezvous fails within the timeout."""
    torch.set_num_threads(member.threads)
    interface = _loopback_interface()
    if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # nothing leaves the host
    timeout = timedelta(seconds=member.timeout_s)
    store = dist.TCPStore("127.0.0.1", member.port, member.world_size, is_master=False, timeout=timeout)
    try:
        dist.init_process_group(backend, store=store, rank=member.rank, world_size=member.world_size, timeout=timeout)
    except Exception as exc:
        raise error(f"{who}: process group rendezvous failed within {member.timeout_s:g} s: {exc}") from exc


def answer(results: Any, rank: int, seq: int, payload: Any) -> None:
    results.put(Answer(rank, seq, payload))


def report_error(results: Any, rank: int, seq: int, exc: BaseException) -> None:
    results.put(Failure(rank, seq, f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def leave_child(results: Any) -> NoReturn:
    """Flush what the child owes the parent, then leave without the interpreter's teardown:
    unloading torch takes seconds on a busy machine, and after a failure the process group may wait
    on dead peers (no destroy_process_group: exiting frees the sockets all the same)."""
    results.close()
    results.join_thread()
    os._exit(0)


def stop_processes(procs: Sequence[Any], grace_s: float = 5.0) -> None:
    """Terminate the children still alive, then kill any that ignore it for ``grace_s``."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=grace_s)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=grace_s)


class LocalGroup:
    """The parent's side: start ``world_size`` children of ``target(member, results, *args(rank))``
    from the multiprocessing context ``ctx``; ``who(rank)`` names a child in errors ("rank 1 of 2",
    "pipeline stage 1 of 2"), which are raised as ``error``."""

    def __init__(self, ctx: Any, world_size: int, target: Callable[..., None], *, timeout_s: float, threads: int,
                 who: Callable[[int], str], error: type[Exception], name: str,
                 args: Callable[[int], tuple] = lambda rank: ()) -> None:
        self.world_size, self.who, self.error = world_size, who, error
        timeout = timedelta(seconds=timeout_s)
        # Held for the group's life: the children's rendezvous store.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                                    wait_for_workers=False)
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(target=target, args=(Member(k, world_size, self._store.port, timeout_s, threads),
                                             self.results, *args(k)), name=f"{name}-{k}", daemon=True)
            for k in range(world_size)
        ]
        self.closed = False

    def start(self) -> None:
        for proc in self.procs:
            proc.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def dead(self) -> list[int]:
        """The ranks whose process has exited."""
        return [k for k, p in enumerate(self.procs) if p.exitcode is not None]

    def died(self, rank: int) -> str:
        proc = self.procs[rank]
        return f"{self.who(rank)} (pid {proc.pid}) died: exit code {proc.exitcode}"

    def collect(self, seq: int, deadline_s: float | None = None, what: str = "round",
                progress: Progress | None = None) -> list[Any]:
        """Every rank's answer to ``seq``, by rank, watching the processes while waiting;
        ``progress`` counts the ranks that answered (and shows the wait while none does)."""
        payloads: dict[int, Any] = {}
        errors: dict[int, tuple[str, str]] = {}  # in order of arrival: the first is the likely cause
        stop_at = None if deadline_s is None else time.monotonic() + deadline_s
        failed_at: float | None = None
        while len(payloads) < self.world_size:
            try:
                message = self.results.get(timeout=0.1)
            except queue_mod.Empty:
                message = None
            if progress is not None:
                _count(progress, len(payloads))
            if message is not None:
                if _take(message, seq, payloads, errors):
                    failed_at = failed_at or time.monotonic()
                continue
            dead = [k for k in self.dead() if k not in payloads and k not in errors]
            if dead:
                self._drain(seq, payloads, errors)
                dead = [k for k in dead if k not in payloads and k not in errors]
            if dead:
                raise self.error(self.died(dead[0]) + " before reporting a result" + self._others(errors))
            # A rank's failure makes its peers' collectives fail too; give a dead rank a moment to show.
            if failed_at is not None and time.monotonic() - failed_at > 1.0:
                first = next(iter(errors))
                message_, trace = errors[first]
                silent = [k for k in range(self.world_size) if k not in payloads and k not in errors]
                raise self.error(f"{self.who(first)} failed: {message_}"
                                 + self._others({k: e for k, e in errors.items() if k != first})
                                 + (f"; rank(s) {silent} had not reported" if silent else "")
                                 + f"\n--- traceback of {self.who(first)} ---\n{trace}")
            if stop_at is not None and time.monotonic() > stop_at:
                waiting = [k for k in range(self.world_size) if k not in payloads]
                raise self.error(f"{what} exceeded {deadline_s:g} s; ranks {waiting} of {self.world_size} "
                                 f"had not finished")
        if progress is not None:
            _count(progress, len(payloads))
        return [payloads[k] for k in range(self.world_size)]

    def _drain(self, seq: int, payloads: dict[int, Any], errors: dict[int, tuple[str, str]]) -> None:
        """Messages already written by children that have exited."""
        while True:
            try:
                _take(self.results.get(timeout=0.5), seq, payloads, errors)
            except queue_mod.Empty:
                return

    def _others(self, errors: dict[int, tuple[str, str]]) -> str:
        return "".join(f"; {self.who(k)}: {m}" for k, (m, _) in errors.items())

    def close(self, jobs: Sequence[Any] = (), graceful: bool = True) -> None:
        """Stop the children: idle ones asked to leave through their ``jobs`` queues (a None job)
        when ``graceful``, then every one still alive terminated."""
        if self.closed:
            return
        self.closed = True
        started = [p for p in self.procs if p.pid is not None]
        if graceful and jobs:
            for q in jobs:
                q.put(None)
            stop_at = time.monotonic() + 5.0
            for proc in started:
                proc.join(timeout=max(0.0, stop_at - time.monotonic()))
        stop_processes(started)
        for q in (*jobs, self.results):
            q.cancel_join_thread()  # what a dead child never read must not block our exit
            q.close()
        del self._store


def _count(progress: Progress, answered: int) -> None:
    """Advance ``progress`` to the ranks that answered; without a new answer, show the wait."""
    if answered > progress.done:
        progress.advance(answered - progress.done)
    else:
        progress.tick()


def _take(message: Answer | Failure, seq: int, payloads: dict[int, Any], errors: dict[int, tuple[str, str]]) -> bool:
    """File one message; True if it reports an error."""
    if isinstance(message, Failure):
        errors[message.rank] = (message.message, message.trace)
        return True
    if message.seq == seq:
        payloads[message.rank] = message.payload
    return False
