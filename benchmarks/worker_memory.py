"""A worker's memory by phase: where a one-process worker's peak RSS comes from, at a real size.

The worker's round machinery runs in this process, on the model of a ``dilocox bench scale`` cell
(``--size``, its Llama layers, compression on, ``--rounds`` rounds of ``--inner-steps`` AdamW
steps on batches of 4 × 128 byte tokens), through the same calls trainer.worker.role.Worker makes:

    join        θ⁽⁰⁾ built from the seed and its CID (``Worker.set_up``), the inner loop, the uplink
    fetch       θ⁽ʳ⁻¹⁾ from a compressed global update: decoded, applied, its CID checked
                (trainer.worker.client.global_params), for r ≥ 2; the coordinator's side of it (the
                downlink's encoding) is made beforehand and not counted
    commit      the state the round starts from, its digest and the undo's copy (``Worker._train``:
                trainer.runtime.state_commit.commitment, ``InnerLoop.snapshot``, ``Uplink.snapshot``)
    inner loop  H AdamW steps and Δ (trainer.runtime.inner.InnerLoop.run)
    encode      Δ compressed with error feedback (trainer.codec.uplink.Uplink.encode)
    state bytes the committed state's bytes, on a round whose push carries them (``Committed.payload``)
    evaluate    the worker's check of a checkpoint (``Reporter.evaluation_problem``'s evaluation)

Around each phase the peak RSS is reset and read back (benchmarks.coordinator_memory.PhaseLog:
VmHWM after ``/proc/self/clear_refs`` 5), so each phase's own peak is seen; "peak − before" is what
the phase adds on top of what the worker already held.

    python -m benchmarks.worker_memory --size 20M
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.coordinator_memory import MIB, PhaseLog
from benchmarks.scale import SIZES, Settings, cell_config
from proto import Encoding
from proto import dilocox_pb2 as pb
from storage_client import strict_json
from trainer.codec import AdaptiveRankPolicy
from trainer.codec.downlink import DownlinkCompressor, apply_update, decode_update, global_update
from trainer.codec.uplink import Uplink
from trainer.codec.wire import cid_of_chunks, layout_of, params_chunks
from trainer.data.corpus import eval_batches, round_batches
from trainer.data.dataset import open_dataset
from trainer.model.gpt import build_model, param_count
from trainer.model.params import load_params, params_of
from trainer.runtime.inner import InnerLoop, evaluate_batches
from trainer.runtime.state_commit import commitment
from trainer.worker.client import global_params


def compressed_global(config, held: dict[str, torch.Tensor], target: dict[str, torch.Tensor]) -> tuple[pb.GlobalHeader, bytes]:
    """The coordinator's C⁽ʳ⁾ taking ``held`` towards ``target``, as a FetchGlobal header and payload."""
    encoded = DownlinkCompressor(AdaptiveRankPolicy(config.compression))(global_update(held, target), {})
    rebuilt = apply_update(held, decode_update(encoded.payload, encoded.header, layout_of(held)))
    header = pb.GlobalHeader(encoding=Encoding.LOWRANK_INT4, params_cid=str(cid_of_chunks(params_chunks(rebuilt))),
                             base_params_cid=str(cid_of_chunks(params_chunks(held))),
                             compression_header=strict_json(dict(encoded.header)).encode())
    return header, encoded.payload


def measure(size: str, rounds: int, steps: int) -> tuple[PhaseLog, int]:
    config = cell_config(Settings(inner_steps=steps, rounds=rounds), SIZES[size], 2)
    log = PhaseLog()
    dataset = open_dataset(config)
    shard = dataset.slot_tokens(0)
    held_out = eval_batches(dataset.eval_tokens(), seed=config.seed, count=config.data.eval_batches,
                            batch_size=config.inner.batch_size, block_size=config.model.block_size)
    with log.phase("join"):
        model = build_model(config.model, config.seed)
        genesis = params_of(model)
        cid = str(cid_of_chunks(params_chunks(genesis)))
        inner, uplink = InnerLoop(model, config.inner), Uplink(config.compression, 1)
    held = (cid, genesis)
    for r in range(1, rounds + 1):
        if r > 1:  # what the coordinator publishes: here, the worker's own θ (any θ decodes alike)
            header, payload = compressed_global(config, held[1], params_of(model))
            with log.phase(f"round {r} fetch: decode the global update"):
                params = global_params(header, payload, held)
            held = (header.params_cid, params)
            del header, payload
        batches = round_batches(shard, seed=config.seed, shard_index=0, round_=r, steps=steps,
                                batch_size=config.inner.batch_size, block_size=config.model.block_size)
        with log.phase(f"round {r} commit: digest and undo copy"):
            start = inner.snapshot()
            committed = commitment(start, uplink.error_state())
            snapshot = (start, uplink.snapshot())
        with log.phase(f"round {r} inner loop"):
            result = inner.run(held[1], batches)
        with log.phase(f"round {r} encode"):
            encoded = uplink.encode(result.pseudo_gradient)
        with log.phase(f"round {r} state bytes (rounds that send them)"):
            raw = sum(len(c) for c in committed.stream().chunks())  # made as a push sends them, a piece at a time
        del result, encoded, raw, snapshot, committed, start
        with log.phase(f"round {r} evaluate"):
            load_params(model, held[1])
            with torch.no_grad():
                evaluate_batches(model, held_out)
    return log, param_count(model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker_memory", description=__doc__.split("\n")[0])
    p.add_argument("--size", default="20M", choices=sorted(SIZES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inner-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    log, n = measure(args.size, args.rounds, args.inner_steps)
    print(f"{args.size}: {n:,} parameters, {4 * n / MIB:.1f} MiB of float32 (MiB below)")
    print(log.table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
