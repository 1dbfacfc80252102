"""What the codec costs per parameter against what training costs: one AdamW inner step, the encode
of a pseudo-gradient with error feedback, and its decode, on the same Llama layers in one process.

    python -m benchmarks.codec_cost --layers 4 --threads 1

The layers are those of ``dilocox bench scale``'s 100M cell (width 768, MLP 2048, 12 heads of which
4 key/value, vocab 256), ``--layers`` of them; a step is batch 4 × 128 tokens. The pseudo-gradient
is Δ = θ_start − θ after ``--steps`` steps; the encode timed is the second round's (e from the first,
so the rank policy's spectrum of Δ and the decomposition of A = Δ + e, exact or sketched by
trainer.codec.lowrank's rule, are both paid), on
``--device`` (the worker's device: trainer.codec.frame.CompressionStream; the inner steps run there
too, in float32); the decode is the CPU one
every receiver runs. Issue 30's target: encode + decode + aggregate per round ≤ 2.5 inner steps.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.codec import AdaptiveRankPolicy, CompressionConfig, compress, decompress
from trainer.codec.wire import layout_of


def pseudo_gradient(layers: int, steps: int, device: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Δ = θ_start − θ after ``steps`` AdamW steps of ``layers`` layers of the 100M cell (on the CPU,
    as the worker hands it to the codec), and each step's seconds."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=128,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (4, 128)).to(device)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    seconds = []
    for _ in range(steps):
        began = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    # Δ as the worker hands it to the codec: on the CPU (the codec moves what it encodes to the device).
    return {name: (start[name] - p.detach()).cpu() for name, p in model.named_parameters()}, seconds


def measure(layers: int, steps: int, device: str) -> dict[str, float]:
    delta, seconds = pseudo_gradient(layers, steps, device)
    errors: dict[str, torch.Tensor] = {}
    policy = AdaptiveRankPolicy(CompressionConfig(enabled=True))
    compress(delta, errors, policy, torch.device(device))  # round 1: e appears
    began = time.perf_counter()
    payload, header = compress(delta, errors, policy, torch.device(device))
    encoded = time.perf_counter()
    decompress(payload, header, layout_of(delta))
    decoded = time.perf_counter()
    count = sum(t.numel() for t in delta.values())
    return {"parameters": count, "inner_s": min(seconds[1:] or seconds), "encode_s": encoded - began,
            "decode_s": decoded - encoded, "max_rank": max(e["rank"] for e in header["tensors"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.codec_cost", description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="inner steps (the fastest after the first is the step time)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="where the inner steps and the encode run (cpu, cuda)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    r = measure(args.layers, args.steps, args.device)
    n = r["parameters"]
    print(f"{n:,} parameters, {torch.get_num_threads()} thread(s), encode on {args.device}, ranks up to "
          f"{r['max_rank']}: inner step {r['inner_s']:.2f} s ({1e9 * r['inner_s'] / n:.0f} ns/param), encode "
          f"{r['encode_s']:.2f} s ({1e9 * r['encode_s'] / n:.0f} ns/param), decode {r['decode_s']:.2f} s "
          f"({1e9 * r['decode_s'] / n:.1f} ns/param); (encode + decode) / inner step = "
          f"{(r['encode_s'] + r['decode_s']) / r['inner_s']:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
