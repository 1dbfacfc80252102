"""The AllReduce baseline: synchronous data-parallel training, gradients all-reduced every step.

DiLoCoX (Qi et al., arXiv:2506.21263) measures itself against "AllReduce": plain synchronous data
parallelism, where every worker exchanges its full gradient after every step. This module is that
baseline, built so that it differs from this project's DiLoCo in the synchronisation alone: the
same model and initialisation, the same AdamW (one parameter group, weight decay on every
parameter, as :class:`trainer.runtime.inner.InnerLoop`), the same global-norm clipping, and the same
batches, so that a comparison at equal tokens is a comparison on the very same tokens.

The algorithm
-------------
W ranks hold identical replicas θ (``build_model(config.model, config.seed)`` on every rank).
At global step t = 0, 1, …, T−1, with H = ``inner.steps``, rank k takes batch (t mod H) of
``round_batches(shard k, round ⌊t/H⌋ + 1)`` — the batch a DiLoCo worker on shard k trains on at
inner step (t mod H) + 1 of round ⌊t/H⌋ + 1 — and every rank computes

    g_k, ℓ_k  = ∇_θ ℓ(θ; x_k, y_k), ℓ(θ; x_k, y_k)     local forward and backward
    [g ; ℓ]   = (1/W) Σ_k [g_k ; ℓ_k]                    ONE all-reduce of one fp32 buffer
    g        ← g · min(1, c / (‖g‖ + 1e-6))              clip_grad_norm_ as InnerLoop (c =
                                                           ``grad_clip``; skipped when c = 0)
    θ        ← AdamW(θ, g)                               lr, betas, weight decay of ``inner``

The gradients of all parameters, flattened in ``named_parameters`` order, and the step's loss as
one extra element form a single contiguous buffer of n = 4·(P + 1) bytes for P parameters, so a
step costs one collective. Every rank applies the same averaged gradient to the same parameters,
so the replicas stay identical; :func:`run_allreduce` checks that they end bit for bit equal. A
non-finite mean loss stops every rank at the same step (the check follows the all-reduce, so no
rank is left waiting in a collective its peers have abandoned).

Bytes and the emulated link
---------------------------
Bytes are counted with the standard cost of a ring all-reduce (a reduce-scatter then an
all-gather, each W−1 messages of n/W bytes): every rank sends, and receives,

    b = 2·(W − 1)/W · n   bytes per step           (rounded down to whole bytes; 0 when W = 1)

whatever algorithm gloo actually picks on the loopback; the ring is the bandwidth-optimal
algorithm a real deployment would use, so b is what the network would carry.

Each rank owns a :class:`trainer.net.link.Link` and, around every all-reduce, waits for what that link
would allow: the latency once (``Link.call``, one round trip, as a DiLoCo worker's RPC pays it;
a real ring pays it 2·(W−1) times, so this errs in the baseline's favour), then the b bytes up
and the b bytes down paced *concurrently*, in two helper threads, while the real all-reduce runs
in the calling thread — a full-duplex link sends and receives at once. A step's communication
time is therefore latency + max(real all-reduce, 8·b / bandwidth).

Timing: ``wall_s`` is the training loop alone, clocked from a barrier that every rank reaches once
its model and optimiser are built (start-up, about 3 s a rank on a CPU, is mostly importing torch
and the first AdamW construction). ``comm_s`` is the time in the all-reduce and the link's waits,
which includes waiting inside the collective for a slower peer, as synchronous training must;
``compute_s`` is forward, backward, the buffer copies, clipping and the optimiser step.

Processes
---------
:func:`run_allreduce` spawns W processes (``spawn`` start method), one trainer.runtime.procgroup.LocalGroup
as the pipeline stages are: they meet through a ``TCPStore`` on 127.0.0.1 with an OS-chosen port
and run gloo bound to the loopback interface. The process group's timeout bounds the rendezvous (so it must cover
the spread of the ranks' start-up) and every collective, so a rank whose peer stops responding
fails instead of waiting forever. The caller
watches the processes: a rank that dies or raises ends the run with an :class:`AllReduceError`
naming it — a rank that died before the peers that failed because of it, otherwise the first rank
to report an error — and the others are terminated. Results come back over a multiprocessing queue as numpy arrays, never as pickled
torch tensors (whose shared memory dies with the child).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trainer.config import RunConfig
from trainer.data.corpus import load_corpus, round_batches
from trainer.model.gpt import build_model
from trainer.net.link import Link
from trainer.runtime.device import autocast, backend_for, parse_device, stage_device
from trainer.runtime.procgroup import LocalGroup, Member, answer, join_group, leave_child, report_error


class AllReduceError(RuntimeError):
    """An all-reduce run that could not finish; the message names the rank (and step) and why."""


@dataclass(frozen=True)
class AllReduceResult:
    workers: int
    steps: int
    tokens: int  # total over all workers: steps * workers * batch_size * block_size
    wall_s: float  # max over ranks of the training loop's wall time (no start-up, no rendezvous)
    compute_s: float  # mean over ranks: forward, backward, buffer copies, clip, optimiser step
    comm_s: float  # mean over ranks: the all-reduce and the link's waits
    bytes_sent_per_worker: int  # ring all-reduce cost, see the module docstring
    bytes_received_per_worker: int
    train_losses: list[float]  # per step, the mean over workers of the step's training loss
    snapshots: list[tuple[int, int, dict[str, torch.Tensor]]]  # (steps done, tokens so far, θ)
    params: dict[str, torch.Tensor]  # final parameters (identical on every rank; rank 0's)


def ring_allreduce_bytes(nbytes: int, world_size: int) -> int:
    """Bytes one rank sends (and receives) in a ring all-reduce of an ``nbytes`` buffer."""
    return 2 * (world_size - 1) * nbytes // world_size


# ------------------------------------------------------------------------------- one rank


@dataclass(frozen=True)
class _Job:
    config: RunConfig
    workers: int
    steps: int
    link_bandwidth_bps: float
    link_latency_s: float
    snapshot_every: int
    threads: int
    timeout_s: float
    fault: tuple[int, int, str] | None  # tests only: (rank, step, "exit"|"raise"|"hang"|"nan")
    device: str = "cpu"  # trainer.runtime.device: rank k on cuda:(k mod GPUs) over NCCL, bf16 autocast; or the CPU


def _paced_all_reduce(buf: torch.Tensor, link: Link, pacer: ThreadPoolExecutor | None,
                      nbytes: int) -> None:
    """Sum ``buf`` over the ranks, taking at least as long as the emulated link would."""
    if pacer is None:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return
    link.call()
    # Up and down on their own virtual clocks at the same time: full duplex, not their sum.
    up = pacer.submit(link.transfer, "up", nbytes)
    down = pacer.submit(link.transfer, "down", nbytes)
    try:
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    finally:
        up.result()
        down.result()


class _Replica:
    """One rank's model and AdamW (exactly InnerLoop's: one group, weight decay on every parameter),
    and the one buffer its gradients and loss travel in."""

    def __init__(self, cfg: RunConfig, device: torch.device) -> None:
        inner = cfg.inner
        self.device = device
        self.model = build_model(cfg.model, cfg.seed).to(device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=inner.lr, betas=(inner.beta1, inner.beta2),
                                           weight_decay=inner.weight_decay)
        self.grad_clip = inner.grad_clip
        self.names = [n for n, _ in self.model.named_parameters()]
        self.params = [p for _, p in self.model.named_parameters()]
        sizes = [p.numel() for p in self.params]
        self.buf = torch.zeros(sum(sizes) + 1, dtype=torch.float32, device=device)  # every gradient, then the loss
        self.grad_views = list(self.buf[:-1].split(sizes))

    def local_step(self, x: torch.Tensor, y: torch.Tensor, fault: str | None) -> None:
        """g_k, ℓ_k into the buffer."""
        with autocast(self.device):
            _, loss = self.model(x.to(self.device), y.to(self.device))
        assert loss is not None
        if fault == "nan":
            loss = loss * float("nan")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for view, p in zip(self.grad_views, self.params):
            if p.grad is None:  # unused parameter: contributes a zero gradient
                view.zero_()
            else:
                view.copy_(p.grad.view(-1))
        self.buf[-1] = loss.detach()

    def apply_mean(self, world: int, step: int, steps: int) -> float:
        """After the all-reduce: the mean gradient clipped and applied; returns the mean loss."""
        self.buf.div_(world)
        mean_loss = self.buf[-1].item()
        if not math.isfinite(mean_loss):
            raise FloatingPointError(f"step {step} of {steps}: mean training loss over {world} workers is {mean_loss}")
        for view, p in zip(self.grad_views, self.params):
            if p.grad is None:
                p.grad = view.view_as(p).clone()
            else:
                p.grad.copy_(view.view_as(p))
        if self.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        return mean_loss

    def numpy_params(self) -> dict[str, np.ndarray]:
        return {n: p.detach().cpu().numpy().copy() for n, p in zip(self.names, self.params)}

    def digest(self, final: dict[str, np.ndarray]) -> str:
        digest = hashlib.sha256()
        for name in self.names:
            digest.update(name.encode())
            digest.update(final[name].tobytes())
        return digest.hexdigest()


def _train(rank: int, job: _Job, shard: torch.Tensor) -> dict[str, Any]:
    """This rank's training loop; returns its timings and, on rank 0, losses and parameters."""
    cfg, world, horizon = job.config, job.workers, job.config.inner.steps
    replica = _Replica(cfg, stage_device(torch.device(job.device), rank))
    step_bytes = ring_allreduce_bytes(replica.buf.numel() * replica.buf.element_size(), world)
    link = Link(job.link_bandwidth_bps, job.link_latency_s)
    pacer = ThreadPoolExecutor(2, thread_name_prefix="link") if link.limited else None
    losses: list[float] = []
    snapshots: list[tuple[int, int, dict[str, np.ndarray]]] = []
    compute_s = comm_s = 0.0
    tokens = 0
    batches: list[tuple[torch.Tensor, torch.Tensor]] = []
    dist.barrier()  # every rank is built and ready: start the clocks together
    loop_start = time.perf_counter()
    try:
        for t in range(job.steps):
            step = t + 1
            if t % horizon == 0:  # DiLoCo's batches: round t // H + 1, one list per round
                batches = list(round_batches(shard, seed=cfg.seed, shard_index=rank, round_=t // horizon + 1,
                                             steps=horizon, batch_size=cfg.inner.batch_size,
                                             block_size=cfg.model.block_size))
            x, y = batches[t % horizon]
            fault = job.fault[2] if job.fault and job.fault[:2] == (rank, step) else None
            _inject(fault, step)
            t0 = time.perf_counter()
            replica.local_step(x, y, fault)
            t1 = time.perf_counter()
            _paced_all_reduce(replica.buf, link, pacer, step_bytes)
            t2 = time.perf_counter()
            losses.append(replica.apply_mean(world, step, job.steps))
            compute_s += (t1 - t0) + (time.perf_counter() - t2)
            comm_s += t2 - t1
            tokens += x.numel() * world
            if rank == 0 and job.snapshot_every > 0 and (step % job.snapshot_every == 0 or step == job.steps):
                snapshots.append((step, tokens, replica.numpy_params()))
    finally:
        if pacer is not None:
            pacer.shutdown(wait=True)
    wall_s = time.perf_counter() - loop_start
    final = replica.numpy_params()
    return {
        "wall_s": wall_s, "compute_s": compute_s, "comm_s": comm_s, "tokens": tokens,
        "bytes": step_bytes * job.steps, "digest": replica.digest(final),
        "losses": losses if rank == 0 else [], "snapshots": snapshots, "params": final if rank == 0 else {},
    }


def _inject(fault: str | None, step: int) -> None:
    """The failures the tests provoke: a rank that dies, raises, or stops answering."""
    if fault == "exit":
        os._exit(3)
    if fault == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if fault == "hang":
        time.sleep(3600)  # alive but silent: the peers' collective must time out


def _rank_main(member: Member, results: Any, job: _Job) -> None:
    """Entry point of a spawned rank: rendezvous, train, report to the parent, leave."""
    try:
        cfg = job.config
        # Each rank reads the corpus itself: it is cheap, and a shard passed as a spawn argument
        # would block Process.start() until the child has imported torch, serialising start-up.
        shard = load_corpus(cfg.data, cfg.seed, cfg.model.block_size).shard(member.rank, job.workers)
        device = stage_device(torch.device(job.device), member.rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        join_group(member, AllReduceError, _who(member.rank, job.workers), backend_for(device))
        answer(results, member.rank, 1, _train(member.rank, job, shard))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        report_error(results, member.rank, 1, exc)
    leave_child(results)


def _who(rank: int, world: int) -> str:
    return f"rank {rank} of {world}"


# --------------------------------------------------------------------------------- parent


def _launch(job: _Job) -> list[dict[str, Any]]:
    """Spawn the ranks and collect their payloads, by rank; raise AllReduceError on a failure."""
    group = LocalGroup(mp.get_context("spawn"), job.workers, _rank_main, timeout_s=job.timeout_s, threads=job.threads,
                       who=lambda k: _who(k, job.workers), error=AllReduceError, name="allreduce-rank",
                       args=lambda k: (job,))
    try:
        group.start()
        payloads = group.collect(1)
        for proc in group.procs:  # each leaves by itself once its result is sent
            proc.join(timeout=job.timeout_s)
        return payloads
    finally:
        group.close()


def run_allreduce(
    config: RunConfig, *, workers: int, steps: int,
    link_bandwidth_bps: float = 0.0, link_latency_s: float = 0.0,
    snapshot_every: int = 0, threads_per_worker: int = 1, timeout_s: float = 300.0,
    _fault: tuple[int, int, str] | None = None, device: str = "cpu",
) -> AllReduceResult:
    """Train ``steps`` synchronous data-parallel steps on ``workers`` local ranks (module doc).

    ``link_*`` emulate each rank's network link (0: unlimited). With ``snapshot_every`` > 0, rank
    0 keeps a copy of the parameters after every ``snapshot_every`` steps and after the last one.
    ``timeout_s`` bounds the rendezvous and every collective. ``_fault`` is for tests only.
    ``device`` (trainer.runtime.device: cpu, cuda, cuda:N; refused here if absent): on CUDA rank k trains on
    cuda:(k mod GPUs) under bf16 autocast and the ranks all-reduce over NCCL.
    """
    if workers < 1 or steps < 1:
        raise ValueError("run_allreduce needs workers >= 1 and steps >= 1")
    if snapshot_every < 0 or threads_per_worker < 1 or timeout_s <= 0:
        raise ValueError("snapshot_every must be >= 0, threads_per_worker >= 1, timeout_s > 0")
    Link(link_bandwidth_bps, link_latency_s)  # refuse a negative bandwidth or latency here
    device = str(parse_device(device))
    # Read here too, so that a corpus that cannot be used fails now, before any process starts.
    load_corpus(config.data, config.seed, config.model.block_size)
    job = _Job(config=config, workers=workers, steps=steps,
               link_bandwidth_bps=link_bandwidth_bps, link_latency_s=link_latency_s,
               snapshot_every=snapshot_every, threads=threads_per_worker, timeout_s=timeout_s,
               fault=_fault, device=device)
    ranks = _launch(job)

    digests = {r["digest"] for r in ranks}
    if len(digests) != 1:
        raise AllReduceError(f"the {workers} replicas ended with different parameters: "
                             f"{[r['digest'][:12] for r in ranks]}")
    lead = ranks[0]
    return AllReduceResult(
        workers=workers, steps=steps, tokens=lead["tokens"],
        wall_s=max(r["wall_s"] for r in ranks),
        compute_s=sum(r["compute_s"] for r in ranks) / workers,
        comm_s=sum(r["comm_s"] for r in ranks) / workers,
        bytes_sent_per_worker=lead["bytes"], bytes_received_per_worker=lead["bytes"],
        train_losses=lead["losses"],
        snapshots=[(s, tok, {n: torch.from_numpy(a) for n, a in p.items()})
                   for s, tok, p in lead["snapshots"]],
        params={n: torch.from_numpy(a) for n, a in lead["params"].items()},
    )
