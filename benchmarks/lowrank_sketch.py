"""The low-rank codec's two decompositions (trainer.codec.lowrank): where the randomized one starts to
pay, and how far its rank-r reconstruction is from the best one on a real pseudo-gradient.

    python -m benchmarks.lowrank_sketch crossover --threads 1
    python -m benchmarks.lowrank_sketch quality --threads 1

``crossover``: per k × 4k Gaussian matrix and r_max, the seconds of the exact decomposition (k × k
Gram ``eigh``, vectors at r_max, and the policy's spectrum of a second matrix) against the sketched
one at s = r_max + SKETCH_OVERSAMPLING (the same three), the fastest of 3; the codec takes the sketch
where k > EXACT_UP_TO × s.

``quality``: A = Δ + e of one layer of ``dilocox bench scale``'s 100M cell (benchmarks.codec_cost:
3 AdamW steps, e from a first round at the default configuration), per matrix that takes the
sketch at rank r (``--ranks``):

    excess    ‖A − Ã_r‖ / ‖A − A_r‖ − 1    Ã_r the sketched rank-r reconstruction, A_r the best (LAPACK SVD)
    kept      1 − ‖A − A_r‖² / ‖A‖²  and  1 − ‖A − Ã_r‖² / ‖A‖²   (the energy a round sends)
    int4      ‖Â − Ã_r‖ / ‖Ã_r‖          Â what the codec sends at rank r (int4 factors of Ã_r)
    int4 adds ‖A − Â‖ / ‖A − Ã_r‖ − 1     what quantisation adds to the residual, as ``excess`` does
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from benchmarks.codec_cost import pseudo_gradient
from trainer.codec import AdaptiveRankPolicy, CompressionConfig, compress, decompress
from trainer.codec.lowrank import Decomposition, sketch_size, spectrum
from trainer.codec.wire import layout_of


def fastest(run: Callable[[], object], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def crossover() -> None:
    print("| k × n | r_max | s | k / s | exact | sketched | exact ÷ sketched |")
    print("|---|---|---|---|---|---|---|")
    for k in (96, 128, 192, 256, 384, 512):
        a, other = torch.randn(2, k, 4 * k, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        for max_rank in (8, 32, 64):
            s = max_rank + 16
            if s >= k:
                continue
            exact = fastest(lambda: (Decomposition.of(a, None).svd(max_rank), spectrum(other, None)))
            sketched = fastest(lambda: (Decomposition.of(a, s).svd(max_rank), spectrum(other, s)))
            print(f"| {k} × {4 * k} | {max_rank} | {s} | {k / s:.1f} | {1e3 * exact:.1f} ms | "
                  f"{1e3 * sketched:.1f} ms | {exact / sketched:.2f} |", flush=True)


def quality(ranks: list[int]) -> None:
    delta, _ = pseudo_gradient(1, 3, "cpu")
    errors: dict[str, torch.Tensor] = {}
    compress(delta, errors, AdaptiveRankPolicy(CompressionConfig(enabled=True)))
    print("| matrix | m × n | r | excess | kept: best | kept: sketched | int4 | int4 adds |")
    print("|---|---|---|---|---|---|---|---|")
    for rank in ranks:
        for name in sorted(delta):
            a = delta[name].double() + errors[name].double()
            if a.dim() != 2 or sketch_size(*a.shape, rank) is None:
                continue
            u, sigma, vh = torch.linalg.svd(a, full_matrices=False)
            best = (u[:, :rank] * sigma[:rank]) @ vh[:rank]
            u, sigma, vh = Decomposition.of(a, sketch_size(*a.shape, rank)).svd(rank)
            sketched = (u * sigma[:rank]) @ vh
            payload, header = compress({name: a}, None, AdaptiveRankPolicy.fixed(rank))
            sent = decompress(payload, header, layout_of({name: a}))[name]
            whole, residual = float(a.norm()), float((a - sketched).norm())
            print(f"| {name.removeprefix('model.')} | {a.shape[0]} × {a.shape[1]} | {rank} | "
                  f"{residual / float((a - best).norm()) - 1:.2%} | {1 - float((a - best).norm() / whole) ** 2:.3f} | "
                  f"{1 - (residual / whole) ** 2:.3f} | {float((sent - sketched).norm() / sketched.norm()):.1%} | "
                  f"{float((a - sent).norm()) / residual - 1:.2%} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.lowrank_sketch", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["crossover", "quality"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--ranks", default="32,64", help="quality: the ranks r (comma-separated)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.what == "crossover":
        crossover()
    else:
        quality([int(r) for r in args.ranks.split(",")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
