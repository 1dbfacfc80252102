"""The coordinator's close at a real size, in one process: peak RSS of the round transition (W compressed
updates held compact, the compressed downlink with its error), the outer state's write and θ's bytes.

    python -m benchmarks.close_peak new      # as trainer.coordinator.publish closes a round now
    python -m benchmarks.close_peak whole    # as it did before issue 30: a pure transition (parent and
                                             # child outer states whole at once), m and e serialised
                                             # whole, θ held apart from its bytes

The model is the Llama layout of ``dilocox bench scale``'s 100M cell (16 layers x 768, MLP 2048, 4 of
12 heads key/value, vocab 256: 101,081,856 parameters; ``--layers`` changes the depth). Each worker's
update is a valid rank-8 int4 payload with random factors (what it holds is the compact payload; its
values do not change the memory), parsed as the coordinator parses a push. The peak is VmHWM after a
reset (/proc/self/clear_refs 5) just before the close, so it counts what the close adds to what the
coordinator already holds (θ, m, e and the updates); the bound of issue 30 is 4 x the model's float32
bytes + 1 GiB. Evaluation (a forward pass of the model on the held-out batches) is not included.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

import torch

from storage_client import CID
from trainer.codec import AdaptiveRankPolicy, CompressedPayload, CompressionConfig
from trainer.codec.base import TensorEntry
from trainer.codec.downlink import DownlinkCompressor
from trainer.codec.frame import FORMAT
from trainer.codec.quant import PartSpec
from trainer.codec.wire import Layout, ParamsPayload, cid_of_chunks, encode_params, params_chunks
from trainer.config import OuterConfig, RoundConfig
from trainer.rounds.outer import outer_state_of, zero_momentum
from trainer.rounds.transition import OuterState, round_transition

MIB = 1 << 20


def status_mib(key: str) -> float:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def llama_layout(layers: int, width: int = 768, kv: int = 256, mlp: int = 2048, vocab: int = 256) -> Layout:
    shapes: dict[str, tuple[int, ...]] = {"embed": (vocab, width), "lm_head": (vocab, width), "norm": (width,)}
    for i in range(layers):
        for part, shape in {"q": (width, width), "k": (kv, width), "v": (kv, width), "o": (width, width),
                            "gate": (mlp, width), "up": (mlp, width), "down": (width, mlp),
                            "n1": (width,), "n2": (width,)}.items():
            shapes[f"layers.{i:02d}.{part}"] = shape
    return {name: ("float32", shape) for name, shape in sorted(shapes.items())}


def compact_update(layout: Layout, g: torch.Generator, rank: int = 8) -> CompressedPayload:
    """A valid compressed push (rank-``rank`` int4 factors, int8 vectors) with random values."""
    entries, packed = [], {}
    for name, (_, shape) in layout.items():
        bits, kind = (8, "int8") if len(shape) == 1 else (4, "lowrank-int4")
        dims = {"W": [shape[0]]} if bits == 8 else {"P": [shape[0], rank], "Q": [shape[1], rank]}
        parts = {part: PartSpec.of(d, bits, 64) for part, d in dims.items()}
        for part, spec in parts.items():
            packed[f"{name}.{part}.q"] = (torch.randint(-100, 100, (spec.packed_len,), generator=g, dtype=torch.int8)
                                          if bits == 8 else
                                          torch.randint(0, 256, (spec.packed_len,), generator=g, dtype=torch.uint8))
            packed[f"{name}.{part}.scale"] = torch.full((spec.num_scales,), 1e-4)
        entries.append(TensorEntry(name, shape, "float32", kind, 0 if bits == 8 else rank, 64, parts))
    header = {"format": FORMAT, "tensors": [e.to_json() for e in entries]}
    return CompressedPayload.parse(encode_params(packed), header, layout)


def close(mode: str, layers: int, workers: int) -> dict[str, float]:
    layout = llama_layout(layers)
    g = torch.Generator().manual_seed(0)
    updates = {f"w{i}": compact_update(layout, g) for i in range(workers)}
    params = {name: torch.randn(shape, generator=g) * 0.02 for name, (_, shape) in layout.items()}
    if mode == "new":  # as open_run holds θ: views of the bytes it serves
        holder = ParamsPayload(layout)
        params = {name: holder.put(name, t) for name, t in params.items()}
    payload = holder.payload() if mode == "new" else encode_params(params)
    parent = OuterState(params, zero_momentum(params), {n: torch.zeros(s) for n, (_, s) in layout.items()})
    downlink = DownlinkCompressor(AdaptiveRankPolicy(CompressionConfig(enabled=True)))
    gc.collect()
    held = status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    started = time.perf_counter()
    if mode == "new":
        into = ParamsPayload(layout)
        child = round_transition(parent, updates, outer=OuterConfig(), rounds=RoundConfig(), downlink=downlink,
                                 release_parent=True, params_into=into).state
        cid_of_chunks(params_chunks(outer_state_of(child.momentum, child.downlink_error)))
        served = into.payload()
    else:
        child = round_transition(parent, updates, outer=OuterConfig(), rounds=RoundConfig(), downlink=downlink).state
        outer_bytes = child.outer_state_bytes()
        CID.of(outer_bytes)
        del outer_bytes
        served = child.params_bytes()
    del payload, served
    model = 4 * sum(torch.Size(s).numel() for _, s in layout.values()) / MIB
    return {"parameters": model * MIB / 4, "model_mib": model, "held_mib": held, "peak_mib": status_mib("VmHWM"),
            "seconds": time.perf_counter() - started}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.close_peak", description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("new", "whole"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args(argv)
    r = close(args.mode, args.layers, args.workers)
    bound = 4 * r["model_mib"] + 1024
    print(f"{args.mode}: {int(r['parameters']):,} parameters ({r['model_mib']:.0f} MiB float32), {args.workers} "
          f"workers: held before the close {r['held_mib']:.0f} MiB; peak during it {r['peak_mib']:.0f} MiB = "
          f"{r['peak_mib'] / r['model_mib']:.2f} x the model (bound 4 x + 1 GiB = {bound:.0f} MiB: "
          f"{'within' if r['peak_mib'] <= bound else 'over'}); {r['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
