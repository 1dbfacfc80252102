"""The coordinator: collects each round's pseudo-gradients over gRPC, aggregates, publishes.

Life of round r (the global checkpoint of round r-1 is the run's HEAD):

  open     workers fetch θ⁽ʳ⁻¹⁾ (FetchGlobal) and push Δᵢ⁽ʳ⁾ (PushUpdate), a worker of P pipeline
           stages as P slices, one stream per stage (trainer.codec.uplink). Each push is checked before
           its payload is read (checks) and after (trainer.rounds.aggregation); an accepted one is stored
           and journalled at once (intake).
  close    when ``quorum`` updates are accepted and every live worker has delivered, or
           ``straggler_timeout_s`` after the first accepted update (late or dead workers, and
           workers missing a stage's slice, are dropped from the round; they rejoin at the next).
  publish  the round transition the audit re-runs, then θ⁽ʳ⁾, m⁽ʳ⁾, the manifest, HEAD (publish).

Refused by name besides malformed pushes: an all-zero update, a replay of an accepted one, one that
names no base or not the round's base, claims of tokens or inner steps other than the config's, a
train loss that is no cross-entropy (negative or not finite), and (screening) an update that raises
the held-out loss. Every refusal carries a typed reason (trainer.net.refusal).

    run         Run / open_run: genesis or resume; what the run is before any worker speaks
    state       the domain types: UpdateHeader, JournalEntry, OpenRound, GlobalState, StatusView ...
    registry    WorkerRegistry: who joined, shards, liveness, who may take over an id
    checks      the push checks in refusal order, and the rules between slices and replays
    screening   Screen: screening by effect on private held-out batches
    intake      Intake: the open round's accepted updates and slices, journalled; traffic
    publish     where a round is published (the transition itself: trainer.rounds.transition)
    machine     Coordinator: the state machine that ties them, thread-safe, no transport
    trust       RunTrust: what the machine asks of a ledger-backed trust layer (settlement/)
    calls       CallGate: how a call gets in (arrival deadline, decoding, sessions, budgets, pace),
                its thread pools, refusal reasons → status codes
    service     the gRPC handlers: bounds, protobuf ↔ the machine's types, long-polls, push streams
    server      serve(): the process: lock, the grpc.aio server, the round loop, settlement, exit codes
"""

from trainer.coordinator.machine import Coordinator
from trainer.coordinator.run import Run, open_run
from trainer.coordinator.state import GlobalState, RoundSummary, StatusView, UpdateHeader

__all__ = ["Coordinator", "GlobalState", "Run", "RoundSummary", "StatusView", "UpdateHeader", "open_run"]
