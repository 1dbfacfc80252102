"""A worker as P pipeline stages: the GPT cut into contiguous slices, one local process per slice.

DiLoCoX trains models too large for one device by pipeline parallelism inside a worker, with a
*dual optimiser policy*: each stage holds its own slice θ_s of the parameters, its own inner AdamW
over that slice, and computes the pseudo-gradient of that slice. The coordinator can then
aggregate stage by stage, because a stage's pseudo-gradient is exactly a slice (by parameter name)
of the worker's full pseudo-gradient.

Stages
------
With L = ``n_layer`` blocks and P stages, ``q, r = divmod(L, P)``; stage s holds blocks
``[s·q + min(s, r), (s+1)·q + min(s+1, r))`` (the first r stages hold one block more). Stage 0
also holds ``wte`` and ``wpe``; stage P−1 also holds ``ln_f`` and ``lm_head``. A stage's
``named_parameters`` carry the full model's names (``blocks.3.attn.qkv.weight``, not
``blocks.0...``): blocks sit in an ``nn.ModuleDict`` keyed by their global index. The stages of a
model partition its parameter names exactly, and :func:`build_stage` gives exactly the slice of
``build_model(cfg, seed)``. 1 ≤ P ≤ L, so that no stage is empty.

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
computation of :class:`trainer.diloco.InnerLoop`, only distributed: up to float re-association,
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
:func:`run_pipelined_inner` spawns P processes (``spawn`` start method), rank s = stage s. They
meet through a ``TCPStore`` the caller opens on 127.0.0.1 with an OS-chosen port (no race for a
free port), and gloo is bound to the loopback interface, so nothing leaves the host. The process
group is created with ``timeout=timeout_s``, which bounds the rendezvous and every collective and
point-to-point wait, so a stage whose peer stops responding fails instead of waiting forever.
The caller watches the processes: a stage that exits without a result, or reports an error, ends
the run with a :class:`PipelineError` naming the stage (a stage that died is named before the
peers that failed because of it); the remaining stages are terminated.

Under ``torchrun`` call :func:`init_from_env` and then :func:`run_stage` in each process: it runs
this process's stage and returns its :class:`StageResult`.

The inner AdamW state of each stage persists across rounds in :class:`PipelinedInnerLoop` (it is
carried back from the stage processes after every round and handed to the next round's), as
:class:`trainer.diloco.InnerLoop` keeps it in the worker process.
"""

from __future__ import annotations

import os
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

from trainer.config import InnerConfig, ModelConfig
from trainer.diloco import InnerResult, load_params
from trainer.model import GPT, build_model
from trainer.wire import Params

Batch = tuple[torch.Tensor, torch.Tensor]

DEFAULT_TIMEOUT_S = 60.0


class PipelineError(RuntimeError):
    """A pipelined inner loop that could not finish; the message names the stage."""


# ----------------------------------------------------------------------------------- stages


def stage_blocks(n_layer: int, num_stages: int) -> list[range]:
    """The block indices of each stage: contiguous, balanced by count, the first ones larger."""
    if not 1 <= num_stages <= n_layer:
        raise ValueError(f"{num_stages} pipeline stages cannot split {n_layer} blocks (1 <= P <= n_layer)")
    q, r = divmod(n_layer, num_stages)
    return [range(s * q + min(s, r), (s + 1) * q + min(s + 1, r)) for s in range(num_stages)]


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


def split_model(model: GPT, num_stages: int) -> list[GPTStage]:
    """All stages of ``model``; they share its parameter tensors."""
    return [GPTStage(model, s, num_stages) for s in range(num_stages)]


def build_stage(cfg: ModelConfig, seed: int, index: int, num_stages: int) -> GPTStage:
    """Stage ``index``: exactly that slice (names and values) of ``build_model(cfg, seed)``."""
    return GPTStage(build_model(cfg, seed), index, num_stages)


def stage_param_names(cfg: ModelConfig, num_stages: int) -> list[list[str]]:
    """The parameter names of each stage, in ``named_parameters`` order."""
    with torch.device("meta"):
        model = GPT(cfg)
    return [[n for n, _ in stage.named_parameters()] for stage in split_model(model, num_stages)]


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
    optimizer_state: dict[str, Any]  # this stage's AdamW state_dict, for the next round


def init_from_env(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> None:
    """Join the process group ``torchrun`` describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT)."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_microbatches(batches: Sequence[Batch], n_microbatches: int) -> None:
    if not batches:
        raise ValueError("an inner loop needs at least one batch")
    for x, _ in batches:
        if n_microbatches < 1 or x.shape[0] % n_microbatches:
            raise ValueError(f"batch of {x.shape[0]} sequences cannot be cut into "
                             f"{n_microbatches} equal microbatches")


def run_stage(
    model_cfg: ModelConfig, inner_cfg: InnerConfig, start: Params, batches: Sequence[Batch], *,
    n_microbatches: int, optimizer_state: dict[str, Any] | None = None,
    device: torch.device | None = None,
) -> StageResult:
    """Run this process's stage (rank = stage) of one pipelined inner loop; see the module doc.

    ``start`` needs (at least) this stage's slice; ``batches`` are the worker's full batches
    (stage 0 reads the inputs, the last stage the targets). Every rank must call it with the same
    batches and ``n_microbatches``. The process group must already exist.
    """
    index, num_stages = dist.get_rank(), dist.get_world_size()
    device = device or _default_device()
    where = f"pipeline stage {index} of {num_stages}"
    _check_microbatches(batches, n_microbatches)

    # Imported here so that importing this module does not load the pipelining package.
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    stage = build_stage(model_cfg, 0, index, num_stages)  # values are overwritten by ``start``
    names = [n for n, _ in stage.named_parameters()]
    missing = [n for n in names if n not in start]
    if missing:
        raise ValueError(f"{where}: start parameters lack {missing}")
    mine = {n: start[n].detach().to("cpu", copy=True) for n in names}
    load_params(stage, mine)
    stage.to(device)
    stage.train()
    optimizer = torch.optim.AdamW(
        stage.parameters(), lr=inner_cfg.lr, betas=(inner_cfg.beta1, inner_cfg.beta2),
        weight_decay=inner_cfg.weight_decay,
    )
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    pipe = PipelineStage(stage, index, num_stages, device)
    schedule = ScheduleGPipe(pipe, n_microbatches, loss_fn=lm_loss, scale_grads=True)

    losses: list[float] = []
    tokens = 0
    for step, (x, y) in enumerate(batches, start=1):
        optimizer.zero_grad(set_to_none=True)
        mb_losses: list[torch.Tensor] = []
        args = (x.to(device),) if stage.is_first else ()
        target = y.to(device) if stage.is_last else None
        try:
            schedule.step(*args, target=target, losses=mb_losses if stage.is_last else None,
                          return_outputs=False)
        except Exception as exc:
            raise PipelineError(f"{where}, inner step {step}: pipeline schedule failed: {exc}") from exc

        grads = [p.grad for p in stage.parameters() if p.grad is not None]
        stats = torch.zeros(2, dtype=torch.float64, device=device)
        if grads:
            norms = torch._foreach_norm(grads)
            stats[0] = torch.linalg.vector_norm(torch.stack(norms)).double() ** 2
        if stage.is_last:
            stats[1] = torch.stack([loss.detach() for loss in mb_losses]).mean().double()
        try:
            dist.all_reduce(stats)
        except Exception as exc:
            raise PipelineError(f"{where}, inner step {step}: all-reduce of the gradient norm "
                                f"failed: {exc}") from exc
        loss = stats[1].item()
        if not np.isfinite(loss):
            raise FloatingPointError(f"inner step {step}: loss is {loss}")
        if inner_cfg.grad_clip > 0:
            total_norm = stats[0].sqrt().float()
            coef = torch.clamp(inner_cfg.grad_clip / (total_norm + 1e-6), max=1.0)
            torch._foreach_mul_(grads, coef.to(device))
        optimizer.step()
        losses.append(loss)
        tokens += x.numel()

    delta = {n: mine[n] - p.detach().cpu() for n, p in stage.named_parameters()}
    return StageResult(index, delta, losses, tokens, optimizer.state_dict())


# ------------------------------------------------------------------------ spawned processes


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


def _loopback_interface() -> str | None:
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


@dataclass(frozen=True)
class _Job:
    model_cfg: ModelConfig
    inner_cfg: InnerConfig
    start: Any  # numpy arrays: every stage's slice of the start parameters
    batches: Any  # numpy (x, y) pairs
    n_microbatches: int
    optimizer_states: Any  # one numpy state_dict per stage, or None
    timeout_s: float
    threads: int


StageFn = Callable[[_Job], Any]


def _pipelined_stage(job: _Job) -> Any:
    """What each spawned process runs once the process group exists."""
    index = dist.get_rank()
    states = job.optimizer_states
    result = run_stage(
        job.model_cfg, job.inner_cfg, _to_torch(job.start), _to_torch(job.batches),
        n_microbatches=job.n_microbatches,
        optimizer_state=None if states is None else _to_torch(states[index]),
        device=torch.device("cpu"),
    )
    return _to_numpy(dict(vars(result)))  # a plain dict: _to_numpy does not enter dataclasses


def _stage_main(index: int, world_size: int, port: int, job: _Job, stage_fn: StageFn,
                results: Any) -> None:
    """Entry point of a spawned stage process: rendezvous, run, report to the parent, leave."""
    try:
        torch.set_num_threads(job.threads)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        interface = _loopback_interface()
        if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        timeout = timedelta(seconds=job.timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        try:
            dist.init_process_group("gloo", store=store, rank=index, world_size=world_size,
                                    timeout=timeout)
        except Exception as exc:
            raise PipelineError(f"pipeline stage {index} of {world_size}: process group "
                                f"rendezvous failed within {job.timeout_s:g} s: {exc}") from exc
        payload = stage_fn(job)
        results.put(("ok", index, payload))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        message = f"{type(exc).__name__}: {exc}"
        results.put(("error", index, message, traceback.format_exc()))
    # No destroy_process_group: after a failure it may wait on dead peers; exiting frees it all.


def _available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _launch(job: _Job, world_size: int, stage_fn: StageFn = _pipelined_stage,
            deadline_s: float | None = None) -> list[Any]:
    """Spawn ``world_size`` stage processes running ``stage_fn``; their payloads, by stage.

    Raises :class:`PipelineError` naming the stage that died or failed (dead ones first), after
    terminating the rest. ``deadline_s`` bounds the whole run (None: the stages' own timeouts).
    """
    timeout = timedelta(seconds=job.timeout_s)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout,
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_stage_main, args=(s, world_size, store.port, job, stage_fn, results),
                    name=f"pipeline-stage-{s}", daemon=True)
        for s in range(world_size)
    ]
    payloads: dict[int, Any] = {}
    errors: dict[int, tuple[str, str]] = {}
    try:
        for proc in procs:
            proc.start()
        stop_at = None if deadline_s is None else time.monotonic() + deadline_s
        failed_at: float | None = None
        while len(payloads) < world_size:
            try:
                message = results.get(timeout=0.1)
            except queue_mod.Empty:
                message = None
            if message is not None:
                if message[0] == "ok":
                    payloads[message[1]] = message[2]
                else:
                    errors[message[1]] = (message[2], message[3])
                    failed_at = failed_at or time.monotonic()
                continue
            now = time.monotonic()
            dead = [s for s, p in enumerate(procs)
                    if p.exitcode is not None and s not in payloads and s not in errors]
            if dead:
                _drain(results, payloads, errors)
                dead = [s for s in dead if s not in payloads and s not in errors]
            if dead:
                first = dead[0]
                raise PipelineError(
                    f"pipeline stage {first} of {world_size} (pid {procs[first].pid}) exited with "
                    f"code {procs[first].exitcode} before reporting a result" + _others(errors))
            # A stage's error often makes its peers fail too; give a dead stage a moment to show.
            if errors and (failed_at is None or now - failed_at > 1.0):
                first = min(errors)
                message_, trace = errors[first]
                raise PipelineError(
                    f"pipeline stage {first} of {world_size} failed: {message_}"
                    + _others({s: e for s, e in errors.items() if s != first})
                    + f"\n--- traceback of stage {first} ---\n{trace}")
            if stop_at is not None and now > stop_at:
                waiting = [s for s in range(world_size) if s not in payloads]
                raise PipelineError(f"pipelined inner loop exceeded {deadline_s:g} s; "
                                    f"stages {waiting} of {world_size} had not finished")
        for proc in procs:
            proc.join(timeout=job.timeout_s)
        return [payloads[s] for s in range(world_size)]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        results.close()
        results.join_thread()


def _drain(results: Any, payloads: dict[int, Any], errors: dict[int, tuple[str, str]]) -> None:
    """Messages already written by stages that have exited."""
    while True:
        try:
            message = results.get(timeout=0.5)
        except queue_mod.Empty:
            return
        if message[0] == "ok":
            payloads[message[1]] = message[2]
        else:
            errors[message[1]] = (message[2], message[3])


def _others(errors: dict[int, tuple[str, str]]) -> str:
    return "".join(f"; stage {s}: {m}" for s, (m, _) in sorted(errors.items()))


# ------------------------------------------------------------------------------- entry points


@dataclass(frozen=True)
class PipelineResult:
    pseudo_gradient: Params  # the full Δ, all stages' slices together
    mean_loss: float
    tokens: int
    steps: int
    stage_pseudo_gradients: list[Params]  # Δ_s of each stage
    optimizer_states: list[dict[str, Any]]  # each stage's AdamW state, for the next round


def run_pipelined_inner(
    model_cfg: ModelConfig, inner_cfg: InnerConfig, start_params: Params,
    batches: Sequence[Batch], world_size: int, *, n_microbatches: int = 2,
    optimizer_states: Sequence[dict[str, Any]] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S, deadline_s: float | None = None,
    threads_per_stage: int | None = None,
) -> PipelineResult:
    """One round's inner loop on ``world_size`` local stage processes (gloo on 127.0.0.1).

    ``start_params`` is the full θ⁽ʳ⁻¹⁾ (names as ``build_model``); returns the full pseudo-gradient
    and each stage's slice of it, the mean loss, and each stage's AdamW state (pass it back as
    ``optimizer_states`` next round). ``timeout_s`` bounds the rendezvous and each wait on a peer.
    """
    batches = list(batches)
    _check_microbatches(batches, n_microbatches)
    names = stage_param_names(model_cfg, world_size)
    full = [n for stage in names for n in stage]
    if set(full) != set(start_params):
        raise ValueError(f"start parameters differ from the model's: missing "
                         f"{sorted(set(full) - set(start_params))}, unexpected "
                         f"{sorted(set(start_params) - set(full))}")
    if optimizer_states is not None and len(optimizer_states) != world_size:
        raise ValueError(f"{len(optimizer_states)} optimiser states for {world_size} stages")
    threads = threads_per_stage or max(1, _available_cpus() // world_size)
    job = _Job(
        model_cfg=model_cfg, inner_cfg=inner_cfg,
        start=_to_numpy({n: start_params[n] for n in full}),
        batches=_to_numpy([(x, y) for x, y in batches]),
        n_microbatches=n_microbatches,
        optimizer_states=None if optimizer_states is None else _to_numpy(list(optimizer_states)),
        timeout_s=timeout_s, threads=threads,
    )
    stages = [StageResult(**_to_torch(p)) for p in _launch(job, world_size, deadline_s=deadline_s)]
    losses = stages[-1].losses
    delta: Params = {}
    for s, result in enumerate(stages):
        if list(result.pseudo_gradient) != names[s]:
            raise PipelineError(f"pipeline stage {s} returned parameters {list(result.pseudo_gradient)}, "
                                f"expected {names[s]}")
        delta.update(result.pseudo_gradient)
    ordered = {n: delta[n] for n in start_params}
    return PipelineResult(
        pseudo_gradient=ordered, mean_loss=sum(losses) / len(losses), tokens=stages[-1].tokens,
        steps=len(losses), stage_pseudo_gradients=[r.pseudo_gradient for r in stages],
        optimizer_states=[r.optimizer_state for r in stages],
    )


class PipelinedInnerLoop:
    """:class:`trainer.diloco.InnerLoop` on P local stages; each stage's AdamW state persists."""

    def __init__(self, model_cfg: ModelConfig, cfg: InnerConfig, stages: int, *,
                 n_microbatches: int = 2, timeout_s: float = DEFAULT_TIMEOUT_S,
                 deadline_s: float | None = None) -> None:
        stage_blocks(model_cfg.n_layer, stages)  # refuse an impossible split now
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.stages = stages
        self.n_microbatches = n_microbatches
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.optimizer_states: list[dict[str, Any]] | None = None

    def run(self, start: Params, batches: Sequence[Batch]) -> InnerResult:
        result = run_pipelined_inner(
            self.model_cfg, self.cfg, start, batches, self.stages,
            n_microbatches=self.n_microbatches, optimizer_states=self.optimizer_states,
            timeout_s=self.timeout_s, deadline_s=self.deadline_s,
        )
        self.optimizer_states = result.optimizer_states
        return InnerResult(result.pseudo_gradient, result.mean_loss, result.tokens, result.steps)
