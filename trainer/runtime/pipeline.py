"""A worker as P pipeline stages: the model cut into contiguous slices, one local process per slice.

DiLoCoX trains models too large for one device by pipeline parallelism inside a worker, with a
*dual optimiser policy*: each stage holds its own slice θ_s of the parameters, its own inner AdamW
over that slice, and computes the pseudo-gradient of that slice. The coordinator can then
aggregate stage by stage, because a stage's pseudo-gradient is exactly a slice (by parameter name)
of the worker's full pseudo-gradient.

Stages
------
Which parameters stage s of P holds is trainer.model.stages' rule (contiguous blocks, balanced by count;
the input embeddings on stage 0, the final norm and the head on stage P−1). Here each stage is a
module holding (not copying) those modules of the model: a stage's ``named_parameters`` carry the
full model's names (``blocks.3.attn.qkv.weight``, not ``blocks.0...``), blocks sitting in an
``nn.ModuleDict`` keyed by their global index, so they are exactly
``trainer.model.stages.stage_param_names``, and :func:`build_stage` gives exactly the slice of
``build_model(cfg, seed)``.

The Llama and Qwen2 families (trainer.model.hf) split the same way over their L decoder layers
(``model.layers.3.self_attn.q_proj.weight``). Rotary position embeddings have no parameters, so
each stage holds the rotary module itself and computes (cos, sin) for positions 0..T−1, instead of
receiving them with the activations; each decoder layer then runs causal attention with no mask,
as the whole model does (trainer.model.hf.HFStage). A model of another class is refused by name.

The inner loop (one round, per stage s)
---------------------------------------
Every stage starts from its slice of the global parameters, θ_s ← θ⁽ʳ⁻¹⁾_s, and for each of the H
batches (x_h, y_h) of B sequences, cut along the batch dimension into n equal microbatches
(x_{h,1..n}, y_{h,1..n}; B must be a multiple of n):

    ℓ_{h,m}  = CE(f(θ; x_{h,m}), y_{h,m})             mean over the B/n·T tokens of microbatch m
    g_s      = (1/n) Σ_m ∇_{θ_s} ℓ_{h,m}               = ∇_{θ_s} CE(f(θ; x_h), y_h), the full-batch
                                                          gradient (equal-sized microbatches)
    ‖g‖      = sqrt(Σ_s ‖g_s‖²)                        all-reduced over the stages
    g_s      ← g_s · min(1, c / (‖g‖ + 1e-6))          global-norm clipping (c = ``grad_clip``;
                                                          skipped when c = 0), as clip_grad_norm_
    θ_s      ← AdamW_s(θ_s, g_s)                       this stage's own optimiser and state

and after H steps its pseudo-gradient is Δ_s = θ⁽ʳ⁻¹⁾_s − θ_s. The loss of step h is
ℓ_h = (1/n) Σ_m ℓ_{h,m} (the full-batch mean) and the round's loss is (1/H) Σ_h ℓ_h. This is the
computation of :class:`trainer.runtime.inner.InnerLoop`, only distributed: up to float re-association,
P stages train to the same parameters as one process.

Schedule
--------
GPipe (fill-drain), via ``torch.distributed.pipelining.ScheduleGPipe``: every stage runs the
forwards of microbatches 0, 1, …, n−1 in order (stage s receives microbatch m's activations from
stage s−1 and sends its output to s+1; the last stage computes ℓ_{h,m}), then the backwards of
microbatches 0, 1, …, n−1 in order (the last stage starts from ℓ_{h,m}, each stage sends the input
gradient to s−1), accumulating parameter gradients; the schedule then divides them by n
(``scale_grads=True``), which gives g_s above. After the schedule, one all-reduce of
(‖g_s‖², ℓ_h) gives every stage the global gradient norm and the step's loss, so all stages clip
by the same factor and all stop together on a non-finite loss.

``torch.distributed.pipelining`` works on CPU with gloo in torch 2.13: ``PipelineStage`` infers
the activation shapes from the first microbatch (the integer token ids of stage 0 need no
gradient), and the P2P ops and the metadata exchange run over gloo.

Processes, time limits and failures
-----------------------------------
A worker's P stages are P long-lived local processes, rank s = stage s, held by a
:class:`StageGroup` and started once, when the worker sets up at its first join
(:meth:`PipelinedInnerLoop.start`), so that no round's training pays for them; a worker's ``finished``
metrics report that start-up apart. How many stages and threads a worker runs on the cores it is
given is :func:`plan_stages`'s rule (``dilocox worker --stages auto|P --cores C``). They are
forked by a ``forkserver`` that imports torch once, so only the first group of a worker pays for
that import and a replacement group starts without it. The start is shown as
progress in the worker's log (stages ready of P, trainer.progress), and the last stage logs each
round's inner steps (step i/H, tokens/s, ETA) into the same log, on the stderr it inherits.
Every round the worker puts one job on each stage's own queue (its slice of θ⁽ʳ⁻¹⁾, the batches,
the inner hyper-parameters, and, when updates travel compressed, the stage's error-feedback state)
and each stage answers on a shared queue with Δ_s, the losses, its token count and Δ_s encoded for
the push: compressed by the stage itself, with that state, which comes back updated
(trainer.codec.uplink). The worker pushes each stage's slice as its own stream, so the coordinator
aggregates stage by stage, and merges the Δ_s by name (they partition the names exactly) into the
full pseudo-gradient for its own bookkeeping. Each stage also returns the AdamW state its round
started from (a copy), which the worker commits to with its error feedback (trainer.worker.role:
the one-process digest rule over the stages' states together) and, when the round does not count,
hands back with the next round's job (:meth:`PipelinedInnerLoop.undo`), so that the state moves only
through counted rounds and the audit's replay (trainer.runtime.staged) can rebuild it. A stage's module, GPipe schedule and AdamW state stay in its own memory across
rounds, as :class:`trainer.runtime.inner.InnerLoop` keeps them in the worker process: only the round's
inputs and Δ_s cross the queues, as numpy arrays pickled by value. The queues join the worker to its
own children only, so nothing received from the network is unpickled.

The stages are one trainer.runtime.procgroup.LocalGroup: they meet through a ``TCPStore`` the worker opens
on 127.0.0.1 with an OS-chosen port (no race for a free port), and gloo is bound to the loopback
interface, so nothing leaves the host. The
process group is created with ``timeout=timeout_s``, which bounds the rendezvous and every
collective and point-to-point wait, so a stage whose peer stops responding fails instead of waiting
forever. While it waits for a round the worker polls its stages' liveness: a stage that exits
without a result, or reports an error, ends the round at once (not at the end of a timeout) with a
:class:`PipelineError` naming it (``pipeline stage 1 of 2 (pid N) died: exit code -9``; a stage
that died is named before the peers that failed because of it), and every stage of the group is
terminated.

A group that failed is never reused: its process group may hold half-finished transfers. The next
round starts a fresh group (new processes, new AdamW state) and logs that it did; the worker
abandons the failed round and rejoins the run at the next one from the newest global checkpoint,
so what is lost is that round's work and the inner optimiser's moments. A stage found dead between
rounds is replaced the same way before the round starts, without failing it. A stage leaves by
itself when the worker is gone, so a killed worker leaves no stage processes behind;
:meth:`PipelinedInnerLoop.close` stops them at once.

Islands
-------
A worker may run N data-parallel replicas of its P stages (trainer.runtime.island, ``dilocox
worker --data-parallel N``): the group is then N·P processes, rank r = replica r // P, stage r mod P,
each replica's stages a pipeline group and each stage's replicas a data-parallel group. Every
replica trains on its slice of every batch; after each step's backward the replicas of a stage
average their gradients in rank order, then clip and step alike, so they end every round at the
same θ_s: replica 0's ranks encode and return their slices (with their AdamW start state), the
others only a digest of Δ_s, which must match (else the round fails, naming the replica). With
one stage a replica holds the whole model and computes the model's own forward on its slice.

Under ``torchrun`` call :func:`init_from_env`, build one :class:`StageRunner` in each process and
call its :meth:`StageRunner.run` every round: its AdamW state persists in the runner; end the
process with :func:`leave` once its results are written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import queue as queue_mod
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from storage_client import Kernels
from trainer.codec import CompressionConfig
from trainer.codec.uplink import Slice, encode_slice, new_compressor
from trainer.codec.wire import Params
from trainer.config import MODEL_FAMILIES, InnerConfig, ModelConfig
from trainer.model.gpt import GPT, build_model
from trainer.model.hf import HFDecoder, HFStage
from trainer.model.params import load_params
from trainer.model.stages import check_split, stage_blocks, stage_param_names
from trainer.progress import PLAIN_LOG_FORMAT, Progress
from trainer.runtime.device import backend_for, stage_device
from trainer.runtime.inner import inner_optimizer, load_optimizer_state, optimizer_state, set_inner_hyperparameters
from trainer.runtime.island import Island, IslandGroups, average_gradients, mean_over_replicas, replica_slice
from trainer.runtime.kernels import agreed_kernels, current_kernels
from trainer.runtime.procgroup import LocalGroup, Member, answer, available_cpus, join_group, leave_child, report_error
from trainer.runtime.staged import WORKER_MICROBATCHES, clip_coefficient, squared_norm

log = logging.getLogger("dilocox.pipeline")

Batch = tuple[torch.Tensor, torch.Tensor]

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class StagePlan:
    """How a worker uses the cores it is given: P stage processes of T torch threads each, and T₀
    threads for the worker process itself."""

    stages: int
    threads_per_stage: int
    worker_threads: int


def plan_stages(requested: int | None, n_layer: int, cores: int, threads: int | None = None,
                replicas: int = 1) -> StagePlan:
    """The worker's stages and thread budget on ``cores`` cores (``requested`` None: ``auto``), for
    ``replicas`` data-parallel replicas of them (trainer.runtime.island).

    C = ``threads`` when given (the torch threads the worker may run), else ``cores``.
    auto: P = 2 when the model has at least 2 layers and C ≥ 2, else 1 (on CPU; a worker on a GPU
    runs one stage unless told otherwise, trainer.worker.role).
    Pipeline stages exist for models that do not fit one device (DiLoCoX's dual optimiser runs per
    stage); on a machine without a core per stage they only cost: the stages then time-share the
    cores and pay the microbatch bubble and the activation transfers on top. Two stages are what
    the benchmarks measure; more is an explicit ``--stages N``.

    Threads: each stage gets max(1, C // P), so P stages never run more threads than the cores they were given; the worker process, which only
    waits while its stages train (its exchange thread decodes and evaluates), gets 1. One stage is
    the worker process itself, with all C threads. With N > 1 replicas, auto is one stage (the
    replicas take the cores) and each of the N·P ranks gets max(1, C // (N·P)) threads.
    """
    if cores < 1 or (threads is not None and threads < 1) or replicas < 1:
        raise ValueError(f"need at least one core, thread and replica, got cores={cores}, threads={threads}, "
                         f"replicas={replicas}")
    budget = threads if threads is not None else cores
    auto = 2 if n_layer >= 2 and budget >= 2 and replicas == 1 else 1
    stages = requested if requested is not None else auto
    if not 1 <= stages <= n_layer:
        raise ValueError(f"{stages} pipeline stages: this run's model has {n_layer} layers, "
                         f"so a worker can run 1 to {n_layer} stages")
    if stages == 1 and replicas == 1:
        return StagePlan(1, budget, budget)
    return StagePlan(stages, max(1, budget // (stages * replicas)), 1)


class PipelineError(RuntimeError):
    """A pipelined inner loop that could not finish; the message names the stage."""


# ----------------------------------------------------------------------------------- stages


class GPTStage(nn.Module):
    """Stage ``index`` of ``num_stages`` of a :class:`GPT`, holding (not copying) its modules."""

    def __init__(self, model: GPT, index: int, num_stages: int) -> None:
        super().__init__()
        if not 0 <= index < num_stages:
            raise ValueError(f"stage {index} out of range for {num_stages} stages")
        self.index = index
        self.num_stages = num_stages
        self.is_first = index == 0
        self.is_last = index == num_stages - 1
        self.block_size = model.cfg.block_size
        # Registration order follows GPT's, so named_parameters() lists names in the same order.
        if self.is_first:
            self.wte = model.wte
            self.wpe = model.wpe
        blocks = stage_blocks(len(model.blocks), num_stages)[index]
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in blocks})
        if self.is_last:
            self.ln_f = model.ln_f
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (stage 0) or activations in; activations or logits (last stage) out."""
        if self.is_first:
            time_ = x.shape[1]
            if time_ > self.block_size:
                raise ValueError(f"sequence of {time_} tokens exceeds block_size {self.block_size}")
            pos = torch.arange(time_, device=x.device)
            x = self.wte(x) + self.wpe(pos)
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            x = self.lm_head(self.ln_f(x))
        return x


def _stage_of(model: nn.Module, index: int, num_stages: int) -> GPTStage | HFStage:
    """Stage ``index`` of ``model``, of whichever family it is; a model of no splittable family is
    refused by name."""
    if isinstance(model, GPT):
        return GPTStage(model, index, num_stages)
    if isinstance(model, HFDecoder):
        return HFStage(model, index, num_stages, check_split(model.cfg, num_stages)[index])
    raise ValueError(f"a {type(model).__name__[:60]} cannot be split into pipeline stages: only the "
                     f"{', '.join(MODEL_FAMILIES)} families' models (trainer.model.gpt.build_model) can")


def split_model(model: nn.Module, num_stages: int) -> list[GPTStage | HFStage]:
    """All stages of ``model``; they share its parameter tensors."""
    return [_stage_of(model, s, num_stages) for s in range(num_stages)]


def build_stage(cfg: ModelConfig, seed: int, index: int, num_stages: int) -> GPTStage | HFStage:
    """Stage ``index``: exactly that slice (names and values) of ``build_model(cfg, seed)``."""
    return _stage_of(build_model(cfg, seed), index, num_stages)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the tokens, as in :meth:`GPT.forward`."""
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ------------------------------------------------------------------------------ one stage


@dataclass(frozen=True)
class StageResult:
    stage: int
    pseudo_gradient: Params  # Δ_s, keyed by the full model's parameter names
    losses: list[float]  # ℓ_h of each step (the same on every stage)
    tokens: int
    optimizer_steps: int  # AdamW steps this stage's state has taken, over all its rounds
    update: Slice | None = None  # Δ_s encoded for the push (trainer.codec.uplink), by run_round
    uplink_state: Params | None = None  # the stage's error-feedback state after encoding it
    start_state: Params | None = None  # the stage's AdamW state the round started from, by run_round
    kernels: Kernels | None = None  # what decided the stage's floating point (trainer.runtime.kernels), by run_round
    # sha256 of Δ_s, by run_round: every replica of a stage must hold the same (trainer.runtime.island);
    # a replica other than 0 sends only this, with an empty pseudo_gradient
    delta_sha256: str = ""


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> None:
    """Join the process group ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def leave(code: int = 0) -> NoReturn:
    """End a process that has finished its work with ``code``, without the C++ runtime's teardown.

    At interpreter exit, the static destruction of gloo's (and gRPC's) native threads has aborted
    finished processes under load ("terminate called without an active exception", SIGABRT, exit
    −6), even after ``destroy_process_group``: a clean finish then reads as a crash. Call this once
    everything the process owes is written (files are written atomically; queues flushed by the
    caller); the process group is left first when one stands.
    """
    if dist.is_available() and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - leaving anyway; peers see the group end either way
            pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_microbatches(batches: Sequence[Batch], n_microbatches: int, island: Island | None = None) -> None:
    """Every batch cuts into the island's replica slices, each (with several stages) into
    ``n_microbatches`` equal microbatches; ValueError naming the first that does not."""
    if not batches:
        raise ValueError("an inner loop needs at least one batch")
    for x, _ in batches:
        if n_microbatches < 1:
            raise ValueError(f"{n_microbatches} microbatches: need at least one")
        if island is not None and island.replicas > 1:
            island.check_batch(x.shape[0], n_microbatches)
        elif (island is None or island.stages > 1) and x.shape[0] % n_microbatches:
            raise ValueError(f"batch of {x.shape[0]} sequences cannot be cut into "
                             f"{n_microbatches} equal microbatches")


class StageRunner:
    """This process's stage of the pipeline (rank = stage; in an island of data-parallel replicas,
    trainer.runtime.island, rank = replica · P + stage), kept from round to round.

    It holds the stage's module (with one stage, the whole model: each replica computes the model's
    own forward on its slice), its AdamW (made on the first round; its state carries over to
    every later round, as in :class:`trainer.runtime.inner.InnerLoop`) and the GPipe schedule. The process
    group must already exist (``groups``: the island's subgroups; None, a pipeline of the whole
    group); every rank runs the same rounds with the same batches.
    """

    def __init__(self, model_cfg: ModelConfig, *, n_microbatches: int,
                 device: torch.device | None = None, groups: IslandGroups | None = None) -> None:
        self.groups = groups or IslandGroups.join(Island(1, dist.get_world_size()))
        island, rank = self.groups.island, self.groups.rank
        self.index, self.num_stages, self.replica = island.stage_of(rank), island.stages, island.replica_of(rank)
        self.device = device or _default_device()
        self.n_microbatches = n_microbatches
        self.where = island.who(rank)
        # The values are overwritten by every round's start parameters.
        self.stage: nn.Module = (build_model(model_cfg, 0) if self.num_stages == 1
                                 else build_stage(model_cfg, 0, self.index, self.num_stages)).to(self.device)
        self.names = [n for n, _ in self.stage.named_parameters()]
        self.optimizer: torch.optim.Optimizer | None = None
        self._schedule: Any = None
        self._schedule_shape: tuple[int, ...] | None = None

    def _optimizer_for(self, cfg: InnerConfig) -> torch.optim.Optimizer:
        if self.optimizer is None:
            self.optimizer = inner_optimizer(self.stage, cfg)
        else:  # the state carries over; the round's hyper-parameters apply
            set_inner_hyperparameters(self.optimizer, cfg)
        return self.optimizer

    def _schedule_for(self, shape: tuple[int, ...]) -> Any:
        # PipelineStage infers the activation shapes from the first microbatch it runs, so a batch
        # of another shape needs a new one; all ranks see the same batches and rebuild together.
        if self._schedule is None or shape != self._schedule_shape:
            # Imported here so that importing this module does not load the pipelining package.
            from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

            pipe = PipelineStage(self.stage, self.index, self.num_stages, self.device, group=self.groups.pipeline)
            self._schedule = ScheduleGPipe(pipe, self.n_microbatches, loss_fn=lm_loss, scale_grads=True)
            self._schedule_shape = shape
        return self._schedule

    def state(self) -> Params:
        """This stage's optimiser state by parameter name (trainer.runtime.inner.optimizer_state): its slice of
        the worker's inner state; empty before the first step."""
        return {} if self.optimizer is None else optimizer_state(self.stage, self.optimizer)

    def load_state(self, inner_cfg: InnerConfig, state: Params) -> None:
        """Go on from ``state`` (a ``state()`` of this stage), undoing the rounds since."""
        load_optimizer_state(self.stage, self._optimizer_for(inner_cfg), state)

    def run(self, inner_cfg: InnerConfig, start: Params, batches: Sequence[Batch],
            progress: Progress | None = None) -> StageResult:
        """One round of this stage; see the module doc (and trainer.runtime.island for replicas).

        ``start`` needs (at least) this stage's slice; ``batches`` are the worker's full batches
        (stage 0 reads the inputs, the last stage the targets, each replica its slice); ``progress``
        counts the steps and their tokens.
        """
        where, stage, island = self.where, self.stage, self.groups.island
        _check_microbatches(batches, self.n_microbatches, island)
        missing = [n for n in self.names if n not in start]
        if missing:
            raise ValueError(f"{where}: start parameters lack {missing}")
        mine = {n: start[n].detach().to("cpu", copy=True) for n in self.names}
        load_params(stage, mine)
        stage.train()
        optimizer = self._optimizer_for(inner_cfg)

        losses: list[float] = []
        tokens = 0
        for step, (x, y) in enumerate(batches, start=1):
            optimizer.zero_grad(set_to_none=True)
            x_k, y_k = replica_slice(x, self.replica, island.replicas), replica_slice(y, self.replica, island.replicas)
            local_loss = self._gradients(step, x_k, y_k)
            grads = [p.grad for p in stage.parameters() if p.grad is not None]
            try:
                loss = self._reduce(step, grads, local_loss, inner_cfg.grad_clip)
            except FloatingPointError:
                raise
            except Exception as exc:
                raise PipelineError(f"{where}, inner step {step}: all-reduce of the gradient norm "
                                    f"failed: {exc}") from exc
            optimizer.step()
            losses.append(loss)
            tokens += x.numel()
            if progress is not None:
                progress.advance(1, amount=x.numel())

        delta = {n: mine[n] - p.detach().cpu() for n, p in stage.named_parameters()}
        steps = min((int(s["step"]) for s in optimizer.state.values()), default=0)
        return StageResult(self.index, delta, losses, tokens, steps)

    def _gradients(self, step: int, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This replica's unclipped gradients of (x, y) left in ``.grad``, and its loss (float64; 0 on
        a stage that is not the last): the model's own forward with one stage, else the GPipe
        schedule's microbatches (their gradients divided by n)."""
        if self.num_stages == 1:
            _, loss = self.stage(x.to(self.device), y.to(self.device))
            loss.backward()
            return loss.detach().double()
        schedule = self._schedule_for(tuple(x.shape))
        mb_losses: list[torch.Tensor] = []
        args = (x.to(self.device),) if self.stage.is_first else ()
        target = y.to(self.device) if self.stage.is_last else None
        try:
            schedule.step(*args, target=target, losses=mb_losses if self.stage.is_last else None,
                          return_outputs=False)
        except Exception as exc:
            raise PipelineError(f"{self.where}, inner step {step}: pipeline schedule failed: {exc}") from exc
        if not self.stage.is_last:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack([loss.detach() for loss in mb_losses]).mean().double()

    def _reduce(self, step: int, grads: list[torch.Tensor], local_loss: torch.Tensor, clip: float) -> float:
        """ḡ over the replicas (trainer.runtime.island), the step's loss over the stages and replicas,
        and the clip (the stages' global norm; clip_grad_norm_ with one stage); the step's loss.
        FloatingPointError, on every rank alike, when it is not finite."""
        average_gradients(grads, self.groups)
        stats = torch.zeros(2, dtype=torch.float64, device=self.device)
        stats[1] = local_loss
        if self.num_stages > 1:
            if grads:  # q_s; trainer.runtime.staged computes the same in one process, for the replay
                stats[0] = squared_norm(grads)
            dist.all_reduce(stats, group=self.groups.pipeline)
        loss = mean_over_replicas(stats[1:], self.groups).item()
        if not np.isfinite(loss):
            raise FloatingPointError(f"inner step {step}: loss is {loss}")
        if clip > 0 and self.num_stages == 1:
            torch.nn.utils.clip_grad_norm_(self.stage.parameters(), clip)  # as InnerLoop clips
        elif clip > 0:
            coef = clip_coefficient(stats[0], clip)
            torch._foreach_mul_(grads, coef.to(self.device))
        return loss


# ------------------------------------------------------------------ persistent stage processes


def _to_numpy(obj: Any) -> Any:
    """Tensors as numpy arrays: pickled by value, not as shared memory that dies with the child."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_numpy(v) for v in obj)
    return obj


def _to_torch(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    return obj


@dataclass(frozen=True)
class _Setup:
    """What a stage process is given once, for its whole life, besides its group membership."""

    model_cfg: ModelConfig
    n_microbatches: int
    device: str = "cpu"  # the worker's; rank r runs on trainer.runtime.device.stage_device(device, r)
    replicas: int = 1  # data-parallel replicas of the pipeline (trainer.runtime.island)


@dataclass(frozen=True)
class RoundJob:
    """One round for one stage; numpy arrays only."""

    seq: int  # the group's round count, from 1 (0 is the rendezvous)
    inner_cfg: InnerConfig
    start: dict[str, np.ndarray]  # this stage's slice of the start parameters
    batches: list[tuple[np.ndarray, np.ndarray]]
    compression: CompressionConfig | None = None  # None: the slice goes dense
    uplink_state: dict[str, np.ndarray] | None = None  # the stage's error feedback, kept by the worker
    what: str = "inner steps"  # what the last stage's progress lines call the round's steps
    # The AdamW state to go on from, set when the worker's last round did not count (it is undone).
    restore: dict[str, np.ndarray] | None = None


# Runs one round in a stage process; tests substitute one that fails on purpose.
RoundFn = Callable[[StageRunner, RoundJob], dict[str, Any]]

# How often an idle stage checks that its parent still lives.
_IDLE_POLL_S = 1.0
# Allowance for the forkserver to import torch before the stages' rendezvous timeout counts.
_START_ALLOWANCE_S = 120.0


def _context() -> Any:
    """``forkserver``: one clean server process imports torch and the pipelining package once,
    then forks every stage, so a group (re)starts without each stage importing them again as
    under ``spawn``. The server is single-threaded (it only
    imports), so forking it is safe, unlike forking the worker with its gRPC threads."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__, "torch.distributed.pipelining"])
    return ctx


def run_round(runner: StageRunner, job: RoundJob) -> dict[str, Any]:
    """The default :data:`RoundFn`: the stage's round, then its slice encoded for the push
    (trainer.codec.uplink: compressed with the error feedback the job brought, or dense), as a plain
    dict of numpy arrays."""
    # The last stage knows each step's loss last: it alone shows the round's progress, in the worker's log.
    shown = runner.index == runner.num_stages - 1 and runner.replica == 0
    if job.restore is not None:
        runner.load_state(job.inner_cfg, _to_torch(job.restore))
    start_state = runner.state()  # what the worker's push commits to (trainer.worker.role)
    with Progress(job.what, len(job.batches), unit="steps", rate_unit="tokens") if shown else nullcontext() as progress:
        result = runner.run(job.inner_cfg, _to_torch(job.start), _to_torch(job.batches), progress)
    out = dict(vars(result))  # plain dicts: _to_numpy does not enter dataclasses
    if runner.groups.island.replicas > 1:
        out["delta_sha256"] = _digest(result.pseudo_gradient)
    out["kernels"] = current_kernels(runner.device)  # this process's: its own threads and capability
    if runner.replica > 0:  # replica 0 holds the same Δ_s (checked by its digest), and encodes it
        out["pseudo_gradient"] = {}
        return _to_numpy(out)
    compressor = None
    if job.compression is not None:
        compressor = new_compressor(job.compression, _to_torch(job.uplink_state), runner.device)  # encode where Δ_s is
    piece = encode_slice(result.pseudo_gradient, runner.index, runner.num_stages, compressor)
    update = dict(vars(piece))
    if compressor is None:
        update["transmitted"] = None  # the dense slice is Δ_s itself: sent once
    out["update"] = update
    out["uplink_state"] = compressor.state_dict() if compressor is not None else None
    out["start_state"] = start_state
    return _to_numpy(out)


def _digest(delta: Params) -> str:
    """sha256 over Δ_s's names and float32 bytes, in name order: what the replicas of a stage compare."""
    digest = hashlib.sha256()
    for name in sorted(delta):
        digest.update(name.encode())
        digest.update(memoryview(delta[name].detach().cpu().contiguous().numpy()).cast("B"))
    return digest.hexdigest()


def _stage_result(payload: dict[str, Any]) -> StageResult:
    """A stage's answer, back from numpy arrays and plain dicts."""
    fields = _to_torch(payload)
    update = fields.get("update")
    if update is not None:
        if update["transmitted"] is None:
            update["transmitted"] = fields["pseudo_gradient"]
        fields["update"] = Slice(**update)
    return StageResult(**fields)


def _stage_main(member: Member, results: Any, setup: _Setup, jobs: Any, round_fn: RoundFn) -> None:
    """A stage process: join the group, then serve rounds until told to stop, or on the first
    failure (trainer.runtime.procgroup's messages; seq 0, payload None, once the process group stands)."""
    seq = 0
    # The process that started this one: the worker, or the forkserver, which leaves when the
    # worker is gone. Either way, once it is gone this process is adopted and no job will come.
    parent = os.getppid()
    if not logging.getLogger().handlers:  # its lines (progress) join the worker's log, on the inherited stderr
        logging.basicConfig(level=logging.INFO, format=PLAIN_LOG_FORMAT)
    try:
        device = stage_device(torch.device(setup.device), member.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before NCCL's rendezvous: each stage on its own GPU
        island = Island(setup.replicas, member.world_size // setup.replicas)
        join_group(member, PipelineError, island.who(member.rank), backend_for(device))
        runner = StageRunner(setup.model_cfg, n_microbatches=setup.n_microbatches, device=device,
                             groups=IslandGroups.join(island))
        answer(results, member.rank, 0, None)
        while True:
            try:
                job = jobs.get(timeout=_IDLE_POLL_S)
            except queue_mod.Empty:
                if os.getppid() != parent:  # the worker is gone: no job will come
                    results.cancel_join_thread()  # nobody reads what is still unsent
                    return
                continue
            if job is None:
                return
            seq = job.seq
            answer(results, member.rank, seq, round_fn(runner, job))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        report_error(results, member.rank, seq, exc)
    finally:
        leave_child(results)


@dataclass(frozen=True)
class PipelineResult:
    pseudo_gradient: Params  # the full Δ, all stages' slices together
    mean_loss: float
    tokens: int
    steps: int
    stage_pseudo_gradients: list[Params]  # Δ_s of each stage
    optimizer_steps: list[int]  # AdamW steps each stage's state has taken, over its group's rounds
    slices: list[Slice]  # each stage's Δ_s encoded for its push (trainer.codec.uplink)
    uplink_states: list[Params] | None  # each stage's error feedback after encoding (None: dense)
    # The stages' AdamW states the round started from, together: the one-process worker's names
    # (the stages partition the parameters), so its digest is the one-process rule's.
    start_state: Params
    # The kernels the worker records for the round: those every stage ran (trainer.runtime.kernels.
    # agreed_kernels), or None, ``kernels_note`` saying why.
    kernels: Kernels | None = None
    kernels_note: str = ""


class StageGroup:
    """P local stage processes and their gloo process group, serving round after round.

    The constructor starts the processes and returns once their process group stands. A round that
    fails closes the group (see the module doc); a closed group runs no more rounds.
    """

    def __init__(self, model_cfg: ModelConfig, num_stages: int, *, n_microbatches: int = WORKER_MICROBATCHES,
                 timeout_s: float = DEFAULT_TIMEOUT_S, threads_per_stage: int | None = None,
                 round_fn: RoundFn = run_round, device: str = "cpu", replicas: int = 1) -> None:
        self.names = stage_param_names(model_cfg, num_stages)  # refuses an impossible split
        self.num_stages = num_stages
        self.island = island = Island(replicas, num_stages)  # rank r: replica r // P, stage r mod P
        self.n_microbatches = n_microbatches
        self.threads = threads_per_stage or max(1, available_cpus() // island.world_size)
        self._seq = 0
        ctx = _context()
        self._jobs = [ctx.Queue() for _ in range(island.world_size)]
        setup = _Setup(model_cfg, n_microbatches, device, replicas)
        self.group = LocalGroup(ctx, island.world_size, _stage_main, timeout_s=timeout_s, threads=self.threads,
                                who=island.who, error=PipelineError, name="pipeline-stage",
                                args=lambda r: (setup, self._jobs[r], round_fn))
        began = time.monotonic()
        what = f"{num_stages} pipeline stages" if replicas == 1 else f"{replicas} × {num_stages} island ranks"
        try:
            self.group.start()
            for r, pid in enumerate(self.group.pids):
                log.info("%s: pid %d", island.who(r), pid)
            with Progress(f"starting {what}", island.world_size, unit="ready") as progress:
                self.group.collect(0, timeout_s + _START_ALLOWANCE_S, "pipeline start", progress)
        except BaseException:
            self.close(graceful=False)
            raise
        log.info("%s ready in %.1fs (%d torch thread(s) each)", what, time.monotonic() - began, self.threads)

    def __enter__(self) -> StageGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self.group.closed

    @property
    def procs(self) -> list[Any]:
        return self.group.procs

    @property
    def pids(self) -> list[int]:
        return self.group.pids

    def dead(self) -> list[int]:
        """The stages whose process has exited."""
        return self.group.dead()

    def run(self, inner_cfg: InnerConfig, start_params: Params, batches: Sequence[Batch], *,
            deadline_s: float | None = None, compression: CompressionConfig | None = None,
            uplink_states: Sequence[Params] | None = None, what: str = "inner steps",
            restore: Params | None = None) -> PipelineResult:
        """One round's inner loop on the group's stages, from the full θ⁽ʳ⁻¹⁾ ``start_params``,
        each stage then encoding its slice: compressed with ``compression`` and its state from
        ``uplink_states`` (one per stage), or dense when ``compression`` is None. ``restore``: an
        earlier ``start_state`` of this group, which the stages go on from (undoing the rounds since).

        ``deadline_s`` bounds the round (None: only the stages' own timeouts); ``what`` names the
        steps in the last stage's progress lines (trainer.progress). ValueError for
        inputs that do not fit (the group stays usable); PipelineError, the group closed, when a
        stage fails.
        """
        if compression is not None and (uplink_states is None or len(uplink_states) != self.num_stages):
            raise ValueError(f"compressed slices need {self.num_stages} error-feedback states, one per stage")
        if self.closed:
            raise PipelineError("this group of pipeline stages is closed")
        batches = list(batches)
        _check_microbatches(batches, self.n_microbatches, self.island)
        full = [n for stage in self.names for n in stage]
        if set(full) != set(start_params):
            raise ValueError(f"start parameters differ from the model's: missing "
                             f"{sorted(set(full) - set(start_params))}, unexpected "
                             f"{sorted(set(start_params) - set(full))}")
        self._seq += 1
        shared = _to_numpy([(x, y) for x, y in batches])
        try:
            for r in range(self.island.world_size):
                s, names = self.island.stage_of(r), self.names[self.island.stage_of(r)]
                # Replica 0 encodes each stage's slice: only it needs the error feedback.
                state = None if compression is None or r >= self.num_stages else _to_numpy(dict(uplink_states[s]))
                own = None if restore is None else _to_numpy(
                    {key: v for key, v in restore.items() if key.split(".", 1)[1] in names})
                self._jobs[r].put(RoundJob(self._seq, inner_cfg, _to_numpy({n: start_params[n] for n in names}),
                                           shared, compression, state, what, own))
            ranks = [_stage_result(p) for p in self.group.collect(self._seq, deadline_s, "pipeline round")]
            stages = ranks[:self.num_stages]  # replica 0's
            for r, result in enumerate(ranks[self.num_stages:], start=self.num_stages):
                if result.delta_sha256 != stages[result.stage].delta_sha256:
                    raise PipelineError(f"{self.island.who(r)} ended the round at other parameters than "
                                        f"replica 0: the replicas diverged")
            delta: Params = {}
            for s, result in enumerate(stages):
                if list(result.pseudo_gradient) != self.names[s]:
                    raise PipelineError(f"pipeline stage {s} returned parameters "
                                        f"{list(result.pseudo_gradient)}, expected {self.names[s]}")
                delta.update(result.pseudo_gradient)
        except BaseException:
            self.close(graceful=False)  # never reused: its process group may be half-way through
            raise
        losses = stages[-1].losses
        assert all(r.update is not None for r in stages), "run_round encodes every slice"
        kernels, kernels_note = agreed_kernels([r.kernels for r in ranks])
        if kernels is not None and self.island.replicas > 1:
            kernels = dataclasses.replace(kernels, data_parallel=self.island.replicas)
        return PipelineResult(
            pseudo_gradient={n: delta[n] for n in start_params}, mean_loss=sum(losses) / len(losses),
            tokens=stages[-1].tokens, steps=len(losses),
            stage_pseudo_gradients=[r.pseudo_gradient for r in stages],
            optimizer_steps=[r.optimizer_steps for r in stages],
            slices=[r.update for r in stages],  # type: ignore[misc]
            uplink_states=None if compression is None else [r.uplink_state for r in stages],  # type: ignore[misc]
            start_state={key: v for r in stages for key, v in (r.start_state or {}).items()},
            kernels=kernels, kernels_note=kernels_note,
        )

    def close(self, graceful: bool = True) -> None:
        """Stop the stages: asked to leave (``graceful``, for idle ones), then terminated."""
        self.group.close(self._jobs, graceful)


# ------------------------------------------------------------------------------- entry points


class PipelinedInnerLoop:
    """:class:`trainer.runtime.inner.InnerLoop` on P persistent local stage processes, each stage also
    encoding its own slice of Δ for the push (trainer.codec.uplink; compressed when ``compression`` is
    given and enabled).

    The stages start at :meth:`start` (or the first :meth:`run`) and serve every later one, each
    keeping its AdamW state. After a failed round (a :class:`PipelineError`) the next :meth:`run` starts a fresh
    group. Call :meth:`close` (or use it as a context manager) to stop the stages.
    """

    def __init__(self, model_cfg: ModelConfig, cfg: InnerConfig, stages: int, *,
                 compression: CompressionConfig | None = None,
                 n_microbatches: int = WORKER_MICROBATCHES, timeout_s: float = DEFAULT_TIMEOUT_S,
                 deadline_s: float | None = None, threads_per_stage: int | None = None,
                 round_fn: RoundFn = run_round, device: str = "cpu", replicas: int = 1) -> None:
        stage_blocks(model_cfg.n_layer, stages)  # refuse an impossible split now
        if replicas > 1:
            Island(replicas, stages).check_batch(cfg.batch_size, n_microbatches)
        elif cfg.batch_size % n_microbatches:
            raise ValueError(f"a batch of {cfg.batch_size} sequences cannot be cut into "
                             f"{n_microbatches} equal microbatches")
        self.replicas = replicas  # data-parallel replicas of the P stages (trainer.runtime.island)
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.compression = compression if compression is not None and compression.enabled else None
        self.stages = stages
        self.n_microbatches = n_microbatches
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.threads_per_stage = threads_per_stage
        self.round_fn = round_fn
        self.device = device  # trainer.runtime.device: the stages' GPUs (NCCL) on CUDA, else the CPU (gloo)
        self.group: StageGroup | None = None
        self.groups_started = 0
        self.last: PipelineResult | None = None
        self._failure: str | None = None  # why the last group ended, told when the next starts
        self._restore: Params | None = None  # the AdamW state the next round goes on from (undo)

    def __enter__(self) -> PipelinedInnerLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [] if self.group is None else self.group.pids

    def start(self) -> None:
        """Start the stage processes now (a worker does at set-up, so that no round pays for it)."""
        self._ensure_group()

    def _ensure_group(self) -> StageGroup:
        group = self.group
        if group is not None and not group.closed:
            dead = group.dead()
            if not dead:
                return group
            # Died while idle: no round's work is lost, so replace the group rather than fail.
            self._failure = group.group.died(dead[0]) + " between rounds"
            group.close(graceful=False)
        self.group = None
        if self._failure is not None:
            log.warning("starting a fresh group of %d pipeline stages after %s; their inner AdamW "
                        "state starts over", self.stages, self._failure)
        self._restore = None  # new stages start fresh: nothing of the old group's state to undo to
        self.group = StageGroup(self.model_cfg, self.stages, n_microbatches=self.n_microbatches,
                                timeout_s=self.timeout_s, threads_per_stage=self.threads_per_stage,
                                round_fn=self.round_fn, device=self.device, replicas=self.replicas)
        self.groups_started += 1
        self._failure = None
        return self.group

    def run(self, start: Params, batches: Sequence[Batch],
            uplink_states: Sequence[Params] | None = None, what: str = "inner steps") -> PipelineResult:
        """One round; each stage encodes its slice, compressed when the loop was made with a
        ``compression`` config (``uplink_states``: each stage's error feedback, see trainer.codec.uplink);
        ``what`` names the steps in the progress lines."""
        try:
            group = self._ensure_group()
            restore, self._restore = self._restore, None
            result = group.run(self.cfg, start, batches, deadline_s=self.deadline_s, compression=self.compression,
                               uplink_states=uplink_states, what=what, restore=restore)
        except PipelineError as exc:
            self._failure = f"a failure ({str(exc).splitlines()[0]})"
            self.close()
            raise
        if result.kernels is None and (self.last is None or self.last.kernels_note != result.kernels_note):
            # Said once, not every round: the worker's pushes then name no kernels (trainer.runtime.kernels).
            log.warning("no kernels recorded: %s; an auditor replays these rounds in its own kernels",
                        result.kernels_note)
        self.last = result
        return result

    def undo(self, start_state: Params) -> None:
        """The last round does not count: the next round goes on from ``start_state`` (that round's
        ``PipelineResult.start_state``), as a one-process worker restores its snapshot."""
        self._restore = start_state

    def close(self) -> None:
        """Stop the stage processes (a later :meth:`run` would start new ones)."""
        if self.group is not None:
            self.group.close()
            self.group = None
