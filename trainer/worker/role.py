"""The worker's role: what it trains, what it pushes and signs, and how a refused round is undone.

It ties the transport (trainer.worker.client) to the inner loop (trainer.runtime.inner, or
trainer.runtime.pipeline for several stages) and the uplink codec (trainer.codec.uplink); the round loops
(trainer.worker.loops) drive it. The inner state a round starts from (AdamW, and the error feedback
when compressed) is committed in each push (``inner_state_sha256``, trainer.runtime.inner.inner_state_digest)
and moves only through counted rounds: when a push is refused, the round is undone (AdamW and
error feedback restored), so an auditor rebuilds the state from the manifests alone (``dilocox
audit --replay``). A worker of several pipeline stages commits the same digest of the same names:
its stages' AdamW states (each the slice of the one-process state its parameters name) taken
together, and every stage's error feedback; every stage slice of its push names it, and its stages
go back to the round's start state when the round does not count. An overlapped
worker learns of a refusal while its next round trains from the refused one: once that round is
done, both are dropped, the state rewound to before the refused round (``rewind``) and the worker
starts over from the newest global state (trainer.worker.loops.overlapped), so its chain of counted
rounds replays across the refusal, and a worker none of whose rounds has counted yet commits a
fresh state; a worker of several stages rewinds the same way (its stages' AdamW when they next run).
With ``rounds.state_reveal = "on_challenge"`` (DiLoCoX's default) the state's bytes never go with a
push: the worker keeps them on its own disk before it pushes (trainer.worker.retention) and serves
them by CID to an auditor that challenges one (``reveal_port``: the store's trustless gateway). In a
run that uploads them (``"upload"``), they go with a push at the worker's first counted contribution
in each window of ``rounds.state_every`` rounds, counted from its last push the coordinator took,
and with its next push after a refused one, which may have counted all the same (a lost reply):
decided when the push goes (trainer.runtime.state_commit.StateUploads).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from attestation import EvidenceProvider
from proto import WorkerPhase
from storage_client import CID, Kernels, strict_json, to_e6
from trainer.codec.uplink import Slice, Uplink, merged, merged_decision
from trainer.codec.wire import Params, cid_of_chunks, params_chunks
from trainer.config import RunConfig
from trainer.data.corpus import eval_batches, round_batches
from trainer.data.dataset import PreparedDataset, open_dataset
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.net.link import Link
from trainer.net.tls import ClientTls
from trainer.progress import Progress
from trainer.rounds.schedule import ScheduleError, StepsDecision
from trainer.runstore.update_record import record_of_slices
from trainer.runtime.device import parse_device
from trainer.runtime.inner import InnerLoop, InnerResult
from trainer.runtime.island import Island, check_devices
from trainer.runtime.kernels import current_kernels
from trainer.runtime.pipeline import PipelinedInnerLoop, PipelineError, StagePlan, plan_stages
from trainer.runtime.procgroup import available_cpus
from trainer.runtime.state_commit import NO_STATE, Committed, commitment
from trainer.worker.client import (
    REFUSED,
    Checkpoint,
    CoordinatorClient,
    PhaseSeconds,
    PushHeader,
    WorkerError,
    heartbeats,
    slice_name,
    slice_signature,
)
from trainer.worker.hold import RoundHold
from trainer.worker.loops import overlapped, synchronous
from trainer.worker.receipts import ReceiptBook
from trainer.worker.retention import CommittedStates
from trainer.worker.reporter import Reporter
from trainer.worker.succession import Successors

log = logging.getLogger("dilocox.worker")


@dataclass(frozen=True)
class RoundWork:
    """A round's training: the inner loop's result, and its Δ encoded as one slice per stage."""

    result: InnerResult  # its pseudo_gradient left empty: Δ is encoded, and the slices hold what was sent
    slices: list[Slice]
    # The inner state the round started from and its sha256 (trainer.runtime.state_commit.Committed);
    # None where not committed.
    committed: Committed | None = None
    # The AdamW state before the round (trainer.runtime.inner.optimizer_state's; with several stages,
    # their start_state) and the error feedback's, restored if the round does not count.
    snapshot: tuple[Params, list | None] | None = None
    inner_s: float = 0.0  # seconds in the inner loop (the whole pipeline, with several stages)
    compress_s: float = 0.0  # seconds encoding Δ for the push (one-process worker)
    steps: StepsDecision | None = None  # the round's H_r and how it was decided (trainer.rounds.schedule)
    # What decided the round's floating point (trainer.runtime.kernels), named with the push so that
    # an auditor replays it bit for bit; None on an accelerator, or where the stages disagreed.
    kernels: Kernels | None = None

    @property
    def state(self) -> str:
        """sha256 of the inner state the round started from; "" where not committed."""
        return self.committed.digest if self.committed is not None else ""


@dataclass(frozen=True)
class Pushed:
    """An update the coordinator holds: what this worker's report of that round will restate."""

    round: int
    update: bytes  # sha256 of the record: safetensors of the Δ̂ the coordinator rebuilt
    train_loss_e6: int
    tokens: int
    inner_steps: int
    bytes_sent: int
    bytes_received: int  # wire bytes of the fetch that delivered the parameters it started from
    parent: bytes  # sha256 of the round's parent checkpoint θ⁽ʳ⁻¹⁾ (what its report restates)


def append_metric(metrics: Path | None, record: dict) -> None:
    """Append one JSON line to the worker's metrics file, when it was given one."""
    if metrics is not None:
        with open(metrics, "a", encoding="utf-8") as f:
            f.write(strict_json(record, sort_keys=True) + "\n")


class Worker:
    def __init__(self, address: str, worker_id: str, *, tls: ClientTls, attestation: EvidenceProvider | None = None,
                 reconnect_timeout_s: float = 120.0, fetch_wait_s: float = 5.0, link: Link | None = None,
                 metrics: Path | None = None, stages: int | None = 1, cores: int | None = None,
                 threads: int | None = None, device: str = "cpu", receipts: Path | None = None,
                 data_parallel: int = 1, store_sources: Sequence[str] = (),
                 successors: Successors = Successors(), retain: Path | None = None,
                 reveal_address: tuple[str, int] | None = None) -> None:
        self.created_at = time.monotonic()  # start-up is measured from here (trainer.runtime.pipeline.plan_stages)
        self.worker_id, self.metrics = worker_id, metrics
        self.device = parse_device(device)  # where the inner loop runs (trainer.runtime.device); refused now if absent
        # Pipeline stages (None: auto) on the cores given, and the torch threads of each: planned at
        # the first join, when the model's depth is known.
        self.requested_stages, self.cores, self.threads = stages, cores or available_cpus(), threads
        self.stages, self.threads_per_stage = stages or 1, threads or 1
        # Data-parallel replicas of its stages (trainer.runtime.island): one identity, N·P ranks.
        self.replicas = data_parallel
        # The coordinator's signed receipts of this worker's counted updates and taken reports.
        self.receipts = ReceiptBook(receipts if receipts is not None else Path("receipts") / worker_id)
        self.client = CoordinatorClient(address, worker_id, tls=tls, attestation=attestation,
                                        reconnect_timeout_s=reconnect_timeout_s, fetch_wait_s=fetch_wait_s,
                                        link=link or Link(), on_first_join=self.set_up, store_sources=store_sources,
                                        successors=successors, decode_device=self.device)
        self.config: RunConfig | None = None
        self.inner: InnerLoop | PipelinedInnerLoop | None = None
        self.started_at = time.monotonic()  # reset when the first round starts
        self.first_step_at: float | None = None  # when the first round's training began
        self.last_trained_at: float | None = None  # when the latest round's training ended
        self.compute_s, self.tokens = 0.0, 0  # time in the inner loop and tokens trained, all rounds
        self._counted = (0, 0)  # bytes sent/received up to the last progress record
        # Where committed states are kept to reveal, and their gateway's address (trainer.worker.retention).
        self.keep_states = (retain if retain is not None else Path("retained") / worker_id, reveal_address)
        self.states: CommittedStates | None = None
        # Seconds by phase since the last progress record ("push", "evaluate"; see _phases).
        self.phase_seconds = PhaseSeconds()
        self.hold = RoundHold.from_env()  # a test's pause before a round (trainer.worker.hold); none in a run

    def set_up(self, config: RunConfig, shard: int, num_shards: int) -> None:
        """At the first Join: the shard, the held-out batches, θ⁽⁰⁾ and the inner loop."""
        # On a GPU, auto is one stage: GPU stages need a device each, and the worker was given one.
        requested = self.requested_stages if self.requested_stages is not None or self.device.type == "cpu" else 1
        if requested is None and config.model.tie_word_embeddings:
            requested = 1  # auto: a tied embedding and head cannot be split across stages (trainer.runtime.pipeline)
        plan = planned(self.worker_id, requested, config.model.n_layer, self.cores, self.threads, self.replicas,
                       self.device)
        self.stages, self.threads_per_stage = plan.stages, plan.threads_per_stage
        torch.set_num_threads(plan.worker_threads)
        self.shard_index = shard
        # Verified before any training: the pinned index, tokenizer.json, and this slot's shard
        # files and the held-out file (each checked against the index, then memory-mapped).
        dataset = open_dataset(config)
        if num_shards != dataset.slots:
            raise WorkerError(f"the coordinator splits the data into {num_shards} shards, but the run's config "
                              f"has rounds.expected_workers {dataset.slots}")
        if isinstance(dataset, PreparedDataset):
            dataset.verify_tokenizer()
        self.shard = dataset.slot_tokens(shard)
        self.data_digest = dataset.shard_digests[shard]
        self.eval_batches = eval_batches(dataset.eval_tokens(), seed=config.seed, count=config.data.eval_batches,
                                         batch_size=config.inner.batch_size, block_size=config.model.block_size)
        self.model = build_model(config.model, config.seed)
        # Overlapped, a checkpoint is checked (and its report signed) while the next round trains
        # self.model in this process: on a model of its own (one more copy of the parameters, no
        # optimiser state). Pipeline stages train in their own processes.
        own = config.rounds.overlap and self.stages == 1 and self.replicas == 1
        self.reporter = Reporter(self.client, config, shard, self.data_digest, self.eval_batches,
                                 build_model(config.model, config.seed) if own else self.model, self.phase_seconds,
                                 functools.partial(self.receipts.keep_sent, self.client), bind=own)
        # θ⁽⁰⁾ is a function of the run's seed: built here, it need not cross the network. Its CID
        # is checked against the genesis checkpoint's when the coordinator serves it (as "held").
        # θ⁽⁰⁾ from existing weights (model.init_params) is fetched, and checked against that CID.
        if not config.model.init_params:
            genesis = params_of(self.model)
            self.client.held = (str(cid_of_chunks(params_chunks(genesis))), genesis)  # no whole bytes beside θ⁽⁰⁾
        if self.stages > 1 or self.replicas > 1:
            try:
                self.inner = PipelinedInnerLoop(config.model, config.inner, self.stages,
                                                compression=config.compression, device=str(self.device),
                                                threads_per_stage=self.threads_per_stage, replicas=self.replicas)
            except ValueError as exc:  # e.g. a batch that does not cut into equal microbatches
                what = f"{self.replicas} data-parallel replicas of " if self.replicas > 1 else ""
                raise WorkerError(f"{what}{self.stages} pipeline stages: {exc}") from exc
            self.inner.start()  # alive for the whole run: no round pays for starting them
        else:
            self.inner = InnerLoop(self.model, config.inner, self.device)
        # Error feedback lives as long as the worker (not its stage processes): what compression
        # drops is sent next round.
        self.uplink = Uplink(config.compression, self.stages, self.device)  # encodes on the worker's device
        self.states = CommittedStates(config.rounds, *self.keep_states)  # RetentionError: a WorkerError
        self.config = config

    # ----------------------------------------------------------------------------- a round

    def train(self, round_: int, params: Params) -> RoundWork:
        """The round's inner loop and its Δ encoded for the push, by the stages themselves when
        there are several; PipelineError when a pipeline stage failed (see abandon)."""
        if self.first_step_at is None:
            self.first_step_at = time.monotonic()
        work = self._train(round_, params)
        self.last_trained_at = time.monotonic()
        return work

    def _train(self, round_: int, params: Params) -> RoundWork:
        self.client.round, self.client.phase = round_, WorkerPhase.TRAINING
        self.hold.wait(self.worker_id, round_)
        cfg = self.config
        assert self.client.schedule is not None
        try:  # H_r: fixed, or adaptive (trainer.rounds.schedule)
            steps = self.client.schedule.decide(round_)
        except ScheduleError as exc:
            raise WorkerError(str(exc)) from None
        batches = round_batches(self.shard, seed=cfg.seed, shard_index=self.shard_index, round_=round_,
                                steps=steps.steps, batch_size=cfg.inner.batch_size, block_size=cfg.model.block_size)
        what = f"round {round_} inner steps"
        if isinstance(self.inner, PipelinedInnerLoop):
            errors, uplink_snapshot = self.uplink.error_state(), self.uplink.snapshot()
            started = time.perf_counter()
            piped = self.inner.run(params, batches, uplink_snapshot, what=what)
            self.uplink.update(piped.uplink_states)
            # The stages' AdamW states partition the one-process state's names: the same digest rule.
            committed = commitment(piped.start_state, errors)
            snapshot = (piped.start_state, uplink_snapshot)  # kept whatever the mode, as below
            return RoundWork(InnerResult({}, piped.mean_loss, piped.tokens, piped.steps),
                             piped.slices, committed, snapshot, inner_s=time.perf_counter() - started, steps=steps,
                             kernels=piped.kernels)
        # One copy of the start state: committed, uploaded when due, restored if the round is undone (``rewind``).
        start = self.inner.snapshot()
        committed = commitment(start, self.uplink.error_state())
        snapshot = (start, self.uplink.snapshot())
        started = time.perf_counter()
        with Progress(what, steps.steps, unit="steps", rate_unit="tokens") as progress:
            result = self.inner.run(params, batches, progress)
        trained = time.perf_counter()
        encoded = [self.uplink.encode(result.pseudo_gradient)]
        return RoundWork(dataclasses.replace(result, pseudo_gradient={}), encoded, committed, snapshot, trained - started, time.perf_counter() - trained,
                         steps, current_kernels(self.device))

    def push(self, round_: int, work: RoundWork, base_cid: str, parent_cid: str | None = None) -> Pushed | None:
        """Send Δ for ``round_``, one stream per stage slice; what was sent if the coordinator holds
        every slice, None if one was refused (the coordinator then drops the others: the worker is
        out of the round, which is undone or carried forward as the module docstring says).

        ``base_cid``: the global parameters the round trained from; ``parent_cid``: the round's
        parent in the lineage, θ⁽ʳ⁻¹⁾, which the report restates (the same but for an overlapped
        round, which trained from θ⁽ʳ⁻²⁾ while θ⁽ʳ⁻¹⁾ was in flight)."""
        self.client.phase = WorkerPhase.PUSHING
        result = work.result
        received = self.client.received_for.get(base_cid, 0)
        # The round's record names the bytes of the slices as pushed, which the coordinator stores
        # (trainer.runstore.update_record) with the signature each was pushed with; the report restates its digest.
        record = record_of_slices(work.slices, [slice_signature(self.client.key, self.client.run_digest, round_, s)
                                                for s in work.slices])
        decision = merged_decision(round_, work.slices)
        if decision is not None:
            dense_bytes = sum(t.numel() * t.element_size() for t in merged(work.slices).values())
            log.info("round %d: compressed %d -> %d bytes in %d slice(s) (%s)", round_, dense_bytes,
                     sum(len(s.payload) for s in work.slices), len(work.slices), decision.describe())
        # The kernels it trained with (its stages', with several), so that its round replays bit for bit.
        what = PushHeader(round_, result.mean_loss, result.tokens, result.steps, base_cid, received, work.state,
                          work.kernels)
        wire_bytes, started, receipt = 0, time.perf_counter(), None
        # Kept to reveal before it is committed to, or sent when due (trainer.worker.retention).
        upload = self.states.for_push(round_, work.committed)
        for piece in work.slices:
            try:
                sent, receipt = self.client.push_slice(piece, what, upload if piece.stage == 0 else NO_STATE)
                wire_bytes += sent
            except grpc.RpcError as exc:
                if exc.code() not in REFUSED:
                    raise
                log.warning("round %d: %s refused (%s): %s", round_, slice_name(piece), exc.code().name, exc.details())
                self._undo(work)
                return None
            finally:
                self.phase_seconds.add("push", time.perf_counter() - started)
                started = time.perf_counter()
        update = CID.of(record).digest
        self.states.counted(round_)
        self.receipts.keep_sent(self.client, receipt, round_, update)
        return Pushed(round_, update, to_e6(result.mean_loss), result.tokens,
                      result.steps, wire_bytes, received, CID.parse(parent_cid or base_cid).digest)

    def _undo(self, work: RoundWork) -> None:
        if work.snapshot is None:
            # Error feedback assumed these values arrived; none counts, so carry them.
            self.uplink.carry_back(work.slices)
        elif not self.config.rounds.overlap:
            # The inner state moves only through counted rounds (trainer.runtime.inner.InnerLoop), so that
            # an auditor can rebuild it from the manifests: undo this round.
            self.rewind(work, work)
        # Overlapped, the next round is training from this state now: the loop rewinds both once it
        # is done (trainer.worker.loops.overlapped), never under the inner loop's feet.

    def rewind(self, work: RoundWork, dropped: RoundWork) -> None:
        """Put the inner state back to where it was before ``work``'s round (``rewind_inner_state``)."""
        rewind_inner_state(self.inner, self.uplink, work, dropped)

    def abandon(self, round_: int, exc: PipelineError, inflight: Future | None = None) -> int:
        """Drop out of ``round_`` after a pipeline stage failed: push nothing for it, and tell the
        coordinator at once (ABANDONED) so the round closes with the others. Returns the round whose
        checkpoint to go on from: ``round_`` (wait for it to close), or ``round_ - 1`` when no other
        live worker is still on the round, which then could never close: this worker trains it
        again. Either way the next round starts fresh stage processes. ``inflight``: the overlapped
        path's exchange of the round before, which still counts and is waited for (it reports that
        round itself).
        """
        log.error("round %d: abandoned, no update pushed: %s", round_, exc)
        self.client.phase = WorkerPhase.ABANDONED
        try:
            self.client.say(round_, WorkerPhase.ABANDONED)
        except grpc.RpcError as rpc:  # the periodic heartbeat says it again
            log.warning("round %d: could not tell the coordinator: %s", round_, rpc.details())
        if inflight is not None:
            inflight.result()
        status = self.client.status()
        if status.open_round == round_ and not any(
                w.alive and w.worker_id != self.worker_id and w.phase != WorkerPhase.DONE
                and not (w.phase == WorkerPhase.ABANDONED and w.round == round_) for w in status.workers):
            log.warning("round %d: no other live worker is on it; training it again", round_)
            return round_ - 1
        return round_

    # ----------------------------------------------------------------------------- progress

    def round_done(self, round_: int, work: RoundWork, trained_s: float, waited_s: float) -> None:
        """Progress of one round: a log line, and a metrics record (bytes since the last one)."""
        result, client = work.result, self.client
        self.compute_s += trained_s
        self.tokens += result.tokens
        sent, received = client.bytes_sent - self._counted[0], client.bytes_received - self._counted[1]
        self._counted = (client.bytes_sent, client.bytes_received)
        decision = merged_decision(round_, work.slices)
        rho = work.steps.rank_fraction if work.steps is not None else None
        source = f" ({work.steps.source}{f', rank fraction {rho:.3f}' if rho is not None else ''})" \
            if work.steps is not None and self.config.inner.adaptive_steps else ""
        log.info("round %d: %d steps%s, loss %.4f, %d tokens, train %.2fs, waited %.2fs, %d bytes up, %d down%s",
                 round_, result.steps, source, result.mean_loss, result.tokens, trained_s, waited_s, sent, received,
                 f", uplink mean rank {decision.mean_rank:.1f}" if decision and decision.tensors else "")
        record = {"event": "round", "round": round_, "tokens": result.tokens, "inner_steps": result.steps,
                  "rank_fraction": rho,
                  "stages": self.stages, "threads_per_stage": self.threads_per_stage, "data_parallel": self.replicas,
                  "train_loss": result.mean_loss, "compute_s": trained_s, "waited_s": waited_s,
                  "bytes_sent": sent, "bytes_received": received, "time": time.time(),
                  "inner_s": work.inner_s, "compress_s": work.compress_s, **self._phases()}
        if decision is not None and decision.tensors:
            record["ranks"] = {name: d.rank for name, d in decision.tensors.items()}
            record["energy"] = decision.energy
        append_metric(self.metrics, record)

    def finished(self, checkpoint: Checkpoint) -> int:
        wall, client = time.monotonic() - self.started_at, self.client
        log.info("run finished at round %d (%s); sent %d bytes, received %d; trained %.1fs of %.1fs (%.0f%%)",
                 checkpoint.round, checkpoint.manifest_cid, client.bytes_sent, client.bytes_received,
                 self.compute_s, wall, 100 * self.compute_s / wall if wall > 0 else 0.0)
        now = time.monotonic()
        first = self.first_step_at if self.first_step_at is not None else now
        last = self.last_trained_at if self.last_trained_at is not None else now
        # Start-up (stage processes, join, the fetch of θ⁰) and the last exchange, which no round
        # can overlap, apart from the rounds between them.
        append_metric(self.metrics, {"event": "finished", "rounds": checkpoint.round, "wall_s": wall, "compute_s": self.compute_s,
                      "tokens": self.tokens, "bytes_sent": client.bytes_sent, "bytes_received": client.bytes_received,
                      "startup_s": first - self.created_at, "last_exchange_s": now - last,
                      "steady_wall_s": last - first, "steady_compute_s": self.compute_s,
                      **self._phases()})
        return 0

    def _phases(self) -> dict[str, float]:
        """Seconds by phase since the last progress record, as ``<phase>_s`` fields: "push" (the
        push streams, up to the coordinator's reply), "evaluate" (checking a checkpoint's loss
        before signing), and from the client "fetch" (streaming global states in, not waiting for
        them) and "decode" (rebuilding θ from a compressed global update)."""
        taken = {**self.phase_seconds.take(), **self.client.phase_seconds.take()}
        return {f"{phase}_s": seconds for phase, seconds in sorted(taken.items())}

    # ----------------------------------------------------------------------------- the run

    def run(self) -> int:
        client = self.client
        stop = threading.Event()
        # Started first: it speaks from the Join on, while this worker sets up (WorkerPhase.STARTING).
        beat = threading.Thread(target=heartbeats, args=(client, stop), name="heartbeat", daemon=True)
        beat.start()
        try:
            client.call("join", client.join)
            # Wall time for utilisation runs from here (joined) to holding the final checkpoint.
            self.started_at = time.monotonic()
            return (overlapped if self.config.rounds.overlap else synchronous)(self)
        finally:
            client.phase = WorkerPhase.DONE
            stop.set()
            beat.join(timeout=10)  # no gRPC call may still be in flight when the channel closes
            try:  # tell the coordinator at once, so it need not wait for liveness to lapse
                client.say(client.round, WorkerPhase.DONE, timeout=2)
            except grpc.RpcError:
                pass
            if isinstance(self.inner, PipelinedInnerLoop):
                self.inner.close()  # stop the stage processes
            client.close()


def planned(worker_id: str, requested: int | None, n_layer: int, cores: int, threads: int | None,
            replicas: int, device: torch.device) -> StagePlan:
    """The worker's stages and threads (trainer.runtime.pipeline.plan_stages), said in its log;
    WorkerError, in one line, for a plan the model (or, on CUDA, the GPUs) does not allow."""
    try:
        plan = plan_stages(requested, n_layer, cores, threads, replicas)
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        check_devices(Island(replicas, plan.stages), device.type, gpus)
    except ValueError as exc:
        raise WorkerError(str(exc)) from None
    ranks = plan.stages * replicas
    if ranks > cores:
        log.warning("%d pipeline stages on %d core(s): the stages oversubscribe the cores", ranks, cores)
    island = f"{replicas} data-parallel replica(s) x " if replicas > 1 else ""
    log.info("worker %s: %s%d stage(s) x %d torch thread(s) on %d core(s)", worker_id, island, plan.stages,
             plan.threads_per_stage, cores)
    return plan


def rewind_inner_state(inner: InnerLoop | PipelinedInnerLoop, uplink: Uplink, work: RoundWork,
                       dropped: RoundWork) -> None:
    """Put the inner state (AdamW, error feedback) back to where it was before ``work``'s round:
    that round, and every one trained after it, do not count; ``dropped`` is the last of them,
    trained and never pushed. Without a snapshot (none was taken), as with a refused push
    (``Worker._undo``), the dropped round's Δ̂ goes into its error feedback instead."""
    if work.snapshot is None:
        uplink.carry_back(dropped.slices)
        return
    if isinstance(inner, InnerLoop):
        inner.restore(work.snapshot[0])
    else:  # the stages' AdamW, when they next run
        inner.undo(work.snapshot[0])
    uplink.restore(work.snapshot[1])
