"""A worker that is an island: N data-parallel replicas × P pipeline stages, one identity.

A site with several GPUs (or cores) runs one worker as a group of N·P local processes
(``dilocox worker --data-parallel N --stages P``): the worker process alone speaks to the
coordinator (Join, attestation, pushes, reports, receipts), and its ranks train. Rank r is replica
k = r // P, stage s = r mod P (trainer.runtime.pipeline starts and supervises them). Every replica
holds the same θ and the same AdamW state; each step, replica k computes the gradient of its own
slice of the worker's batch, and the replicas average them (DDP's semantics) before clipping and
AdamW, so Δ is computed once, by every replica alike, and replica 0 encodes and returns it. For the
batch (x, y) of B sequences of step h:

    x_k, y_k = tensor_split(x, N)[k], tensor_split(y, N)[k]      B/N sequences (N | B)
    g_k      = ∇ ℓ(θ; x_k, y_k)                                   P = 1: the model's own forward;
                                                                  P > 1: that replica's pipeline, its
                                                                  n microbatches (trainer.runtime.staged)
    ḡ        = fl32(fl32(fl32(g_0 + g_1) + g_2) + … + g_{N−1}) / N  summed in rank order, then divided
    ḡ        ← clip(ḡ)                                            clip_grad_norm_ (P = 1), or the
                                                                  stages' global norm (P > 1)
    θ        ← AdamW(θ, ḡ)

Exact replay. The sum is pinned to rank order: each stage's replicas all-gather their gradients
(in buckets of at most BUCKET_ELEMENTS, so a rank holds N buckets at a time, not N models) and
every rank adds them up in the same order (:func:`mean_in_rank_order`), instead of gloo's or
NCCL's all-reduce, whose ring adds in an order of its own for N > 2. So every replica holds the
same ḡ bit for bit, and the audit's replay (audit.replay, trainer.runtime.staged) computes g_k for
each slice in one process, in the same kernels (trainer.runtime.kernels: the ranks' capability and
threads, recorded with ``data_parallel`` = N), and the same sum: an honest island's update
re-derives exactly. Every op is elementwise after the gradients, so the buckets' layout does not
change a bit. The step's loss is the replicas' mean (float64), as reported; it is not replayed.

Ranks meet in one gloo (CPU) or NCCL (CUDA) process group; a replica's stages form a pipeline
group (the P2P of the GPipe schedule and the gradient norm), and a stage's replicas a data-parallel
group. Every rank creates every group, in the same order, as torch.distributed requires.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

# Elements of one all-gathered bucket: a rank holds N of them at a time (N × 128 MiB of float32).
BUCKET_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class Island:
    """N data-parallel replicas of a P-stage pipeline: rank r = replica r // P, stage r mod P."""

    replicas: int
    stages: int

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.stages < 1:
            raise ValueError(f"an island needs at least one replica and one stage, got {self.replicas} × {self.stages}")

    @property
    def world_size(self) -> int:
        return self.replicas * self.stages

    def replica_of(self, rank: int) -> int:
        return rank // self.stages

    def stage_of(self, rank: int) -> int:
        return rank % self.stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one replica's stages, in stage order."""
        return [replica * self.stages + s for s in range(self.stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks holding one stage, in replica order (the order their gradients are summed in)."""
        return [k * self.stages + stage for k in range(self.replicas)]

    def who(self, rank: int) -> str:
        """A rank's name in logs and errors."""
        stage = f"pipeline stage {self.stage_of(rank)} of {self.stages}"
        if self.replicas == 1:
            return stage
        replica = f"data-parallel replica {self.replica_of(rank)} of {self.replicas}"
        return replica if self.stages == 1 else f"{replica}, {stage}"

    def check_batch(self, batch_size: int, microbatches: int) -> None:
        """ValueError unless a batch cuts into N equal replica slices, each (with P > 1) into
        ``microbatches`` equal microbatches."""
        per_replica = microbatches if self.stages > 1 else 1
        if batch_size % (self.replicas * per_replica):
            cut = f" of {per_replica} microbatches each" if self.stages > 1 else ""
            raise ValueError(f"a batch of {batch_size} sequences cannot be cut into {self.replicas} equal "
                             f"data-parallel slices{cut}")


def check_devices(island: Island, device_type: str, gpus: int) -> None:
    """ValueError unless each rank of an island of several replicas on CUDA has a GPU of its own:
    NCCL refuses two ranks of one group on one GPU."""
    if device_type == "cuda" and island.replicas > 1 and island.world_size > gpus:
        raise ValueError(f"{island.replicas} data-parallel replicas x {island.stages} stage(s) need "
                         f"{island.world_size} GPUs, one a rank; this machine has {gpus}")


def replica_slice(t: torch.Tensor, replica: int, replicas: int) -> torch.Tensor:
    """Replica ``replica``'s slice of a batch tensor (along the batch): ``tensor_split``'s cut."""
    if t.shape[0] % replicas:
        raise ValueError(f"batch of {t.shape[0]} sequences cannot be cut into {replicas} equal data-parallel slices")
    return torch.tensor_split(t, replicas)[replica]


def mean_in_rank_order(per_rank: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """ḡ: the replicas' gradients (``per_rank[k]``: replica k's tensors, the same shapes on every
    replica) added in rank order, then divided by N; new tensors. The one sum both the ranks and the
    replay compute."""
    total = [g.clone() for g in per_rank[0]]
    for grads in per_rank[1:]:
        if len(grads) != len(total):
            raise ValueError("replicas hold different numbers of gradients")
        for t, g in zip(total, grads):
            t.add_(g)
    for t in total:
        t.div_(len(per_rank))
    return total


@dataclass
class IslandGroups:
    """This rank's process groups: its replica's pipeline and its stage's data-parallel replicas
    (None where the group is the whole world, or a single rank)."""

    island: Island
    rank: int
    pipeline: Any = None
    data_parallel: Any = None

    @classmethod
    def join(cls, island: Island) -> IslandGroups:
        """Every rank calls this once the world group stands: it creates every subgroup, in order."""
        rank = dist.get_rank()
        if dist.get_world_size() != island.world_size:
            raise ValueError(f"a process group of {dist.get_world_size()} ranks is not an island of "
                             f"{island.replicas} × {island.stages}")
        groups = cls(island, rank)
        if island.replicas > 1 and island.stages > 1:
            for k in range(island.replicas):
                group = dist.new_group(island.pipeline_ranks(k))
                if k == island.replica_of(rank):
                    groups.pipeline = group
            for s in range(island.stages):
                group = dist.new_group(island.replica_ranks(s))
                if s == island.stage_of(rank):
                    groups.data_parallel = group
        elif island.replicas > 1:
            groups.data_parallel = dist.group.WORLD
        else:
            groups.pipeline = dist.group.WORLD
        return groups


def average_gradients(grads: Sequence[torch.Tensor], groups: IslandGroups) -> None:
    """Replace ``grads`` (this rank's, in place) with ḡ over its stage's replicas: bucket by bucket,
    all-gathered, then :func:`mean_in_rank_order`."""
    replicas = groups.island.replicas
    if replicas == 1:
        return
    for bucket in _buckets(grads):
        flat = _flatten_dense_tensors(bucket)
        gathered = [torch.empty_like(flat) for _ in range(replicas)]
        dist.all_gather(gathered, flat, group=groups.data_parallel)
        (mean,) = mean_in_rank_order([[g] for g in gathered])
        for g, averaged in zip(bucket, _unflatten_dense_tensors(mean, bucket)):
            g.copy_(averaged)


def mean_over_replicas(value: torch.Tensor, groups: IslandGroups) -> torch.Tensor:
    """A float64 scalar (the step's loss) averaged over the stage's replicas."""
    if groups.island.replicas == 1:
        return value
    dist.all_reduce(value, group=groups.data_parallel)
    return value / groups.island.replicas


def _buckets(grads: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``grads`` of at most BUCKET_ELEMENTS each (a larger tensor alone)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        if not out or size + g.numel() > BUCKET_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(g)
        size += g.numel()
    return out
