"""Who is in the run: registered worker ids, their shards, liveness and what they last said.

A worker is registered once it joined; the registry holds at most ``max_registered`` ids, and a new
id beyond that takes the place of the longest-silent one that is neither live nor holding anything
in the open round, or is refused. A worker id that a live worker holds is taken over only by that
worker: a caller that proves the id's current session, or whose freshly verified key is the one the
id was admitted with. Not thread-safe by itself: the coordinator's lock guards it.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

from proto import WorkerPhase
from trainer.coordinator.state import WorkerState
from trainer.net.refusal import Reason, Refusal
from trainer.runstore.run_dir import RunDir

log = logging.getLogger("dilocox.coordinator")


class WorkerRegistry:
    def __init__(self, run_dir: RunDir, *, run_id: str, num_shards: int, max_registered: int,
                 liveness_s: float, clock: Callable[[], float]) -> None:
        self.run_dir = run_dir
        self.run_id = run_id
        self.num_shards = num_shards
        self.max_registered = max_registered
        self.liveness_s = liveness_s
        self.clock = clock
        self.started_at = clock()
        self.laggards: set[str] = set()
        self.accepted_before: set[str] = set()  # ids with an update accepted in the last closed round
        self.workers: dict[str, WorkerState] = {
            w: WorkerState(shard=s, last_seen=float("-inf")) for w, s in run_dir.workers().items()
        }

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.workers

    def alive(self, now: float) -> set[str]:
        return {w for w, s in self.workers.items() if now - s.last_seen <= self.liveness_s}

    def awaited(self, now: float) -> set[str]:
        """The live workers a round waits for: all but the laggards. A round waits for an id whose
        update was accepted in the round before, or that tried in the round before (a push refused,
        a late one included, or word that it abandoned the round) after an update of its own was
        accepted in the round before that. Every other id is a laggard until an update of its own
        is accepted. So an id kept live that never gets an update accepted holds back one round by
        the straggler timeout, once; one that withholds after an accepted update costs one timeout
        per accepted update at most; and an honest worker that lost one round to a failure, or
        pushed it late, is waited for in the next."""
        return self.alive(now) - self.laggards

    def closed(self, accepted: set[str], tried: set[str]) -> None:
        """A round closed with updates of ``accepted``, and ``tried`` refused or abandoned (``awaited``)."""
        self.laggards = set(self.workers) - (accepted | (tried & self.accepted_before))
        self.accepted_before = accepted

    def known(self, worker_id: str) -> WorkerState:
        state = self.workers.get(worker_id)
        if state is None:
            raise Refusal(Reason.UNKNOWN_WORKER, f"unknown worker {worker_id!r}: it has not joined run {self.run_id!r}")
        return state

    def seen(self, worker_id: str) -> WorkerState:
        state = self.known(worker_id)
        state.last_seen = self.clock()
        return state

    def join(self, worker_id: str, admitted: str | None, proves_session: bool, busy: set[str]) -> WorkerState:
        """Register (or re-join) ``worker_id``; ``busy`` are ids holding something in the open round."""
        now = self.clock()
        state = self.workers.get(worker_id)
        if state is not None and not proves_session and worker_id in self.alive(now) and (
                admitted is None or admitted != state.address):
            raise Refusal(Reason.ID_HELD,
                          f"worker id {worker_id!r} is held by a live worker; a restarted worker may take "
                          f"it over once {self.liveness_s:.0f}s pass without word from it")
        if state is None:
            self._make_room(now, busy)
            taken = {s.shard for s in self.workers.values()}
            free = [i for i in range(self.num_shards) if i not in taken]
            shard = free[0] if free else len(self.workers) % self.num_shards
            state = self.workers[worker_id] = WorkerState(shard=shard, last_seen=now)
            self.run_dir.save_workers({w: s.shard for w, s in self.workers.items()})
        state.last_seen, state.phase, state.address = now, WorkerPhase.JOINED, admitted
        log.info("worker %s joined (shard %d of %d)", worker_id, state.shard, self.num_shards)
        return state

    def _make_room(self, now: float, busy: set[str]) -> None:
        """At ``max_registered`` ids, forget the longest-silent one that is neither live nor busy."""
        if len(self.workers) < self.max_registered:
            return
        held = self.alive(now) | busy
        idle = [w for w in self.workers if w not in held]
        if not idle:
            raise Refusal(Reason.REGISTRY_FULL,
                          f"run {self.run_id!r} has {len(self.workers)} registered workers, all live or "
                          f"contributing: the most it keeps")
        gone = min(idle, key=lambda w: self.workers[w].last_seen)
        del self.workers[gone]
        log.info("forgot worker %s (silent longest) to register a new one", gone)

    def heartbeat(self, worker_id: str, round_: int, phase: WorkerPhase) -> None:
        state = self.known(worker_id)
        # A worker never resumes a round it abandoned: a later (or reordered) heartbeat of the
        # same round, e.g. WAITING for it to close, leaves it abandoned; DONE still counts.
        if state.phase is WorkerPhase.ABANDONED and round_ == state.round and phase is not WorkerPhase.DONE:
            phase = WorkerPhase.ABANDONED
        state.last_seen, state.round, state.phase = self.clock(), round_, phase

    def abandoned(self, round_: int) -> set[str]:
        """Workers that said they will push nothing for ``round_`` (a pipeline stage failed)."""
        return {w for w, s in self.workers.items() if s.phase is WorkerPhase.ABANDONED and s.round == round_}

    def live_done(self) -> bool:
        """Every live worker has said it saw the end of the run. A worker registered before a
        restart and not heard from since counts as live for one liveness window after it: it is
        reconnecting (TLS, a new Join) to fetch the final checkpoint."""
        now = self.clock()
        alive = self.alive(now)
        if now - self.started_at <= self.liveness_s:
            alive |= {w for w, s in self.workers.items() if not math.isfinite(s.last_seen)}
        return all(s.phase is WorkerPhase.DONE for w, s in self.workers.items() if w in alive)

    def heard_since(self, since: float) -> set[str]:
        return {w for w, s in self.workers.items() if s.last_seen >= since}
