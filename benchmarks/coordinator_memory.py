"""The coordinator's peak memory: where it comes from, and how it grows with the model and the workers.

Two measurements, both at the built-in GPT of ``--layers`` × ``--width`` (6 × 512, vocab 256,
context 64: 19M parameters, 77 MB of float32, by default) with compression on:

``cluster``     a real coordinator and N real workers (cli.cluster.LocalCluster: separate
                processes over gRPC on 127.0.0.1) for a few rounds of a few inner steps; the
                coordinator's peak RSS is its ``ru_maxrss`` as its parent reaps it (``os.wait4``),
                the workers' likewise.
``phases``      the coordinator's round machinery in this process (trainer.coordinator.Coordinator
                on a run opened by trainer.coordinator.open_run), fed N compressed updates made
                beforehand by a child process (so making them costs this process nothing), pushed
                as the service pushes them (``checked_update``, then ``Coordinator.accept``), then
                the round closed. Around each phase the peak RSS is reset (``/proc/self/clear_refs``
                5) and read back (VmHWM), so each phase's own peak is seen, and the close is split
                into its parts (aggregation, outer step, downlink compression, stores, evaluation).

Memory is read from /proc (Linux): RSS is what the kernel holds for the process, the number the
issue's bound is stated in (peak ≤ 4 × the model's float32 bytes + 1 GB).

    python -m benchmarks.coordinator_memory phases --workers 2
    python -m benchmarks.coordinator_memory cluster --workers 2 --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from storage_client import strict_json

MIB = 1 << 20


# ------------------------------------------------------------------------------------- /proc


def _status_kib(pid: int | str, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def rss_mib(pid: int | str = "self") -> float:
    return _status_kib(pid, "VmRSS") / 1024


def peak_mib(pid: int | str = "self") -> float:
    return _status_kib(pid, "VmHWM") / 1024


def reset_peak() -> None:
    """VmHWM ← VmRSS (Linux ≥ 4.0: writing 5 to clear_refs resets the peak RSS)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@dataclass
class PhaseLog:
    """Each phase: RSS before, its own peak, RSS after (MiB). Phases nest: resetting the peak for an
    inner phase first folds the peak so far into every enclosing phase's."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    _open: list[dict[str, Any]] = field(default_factory=list)

    def _fold(self) -> None:
        now = peak_mib()
        for row in self._open:
            row["peak"] = max(row["peak"], now)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._fold()
        reset_peak()
        row: dict[str, Any] = {"phase": "  " * len(self._open) + name, "rss_before": rss_mib(), "peak": 0.0}
        self.rows.append(row)
        self._open.append(row)
        started = time.perf_counter()
        try:
            yield
        finally:
            self._fold()
            self._open.pop()
            row.update(rss_after=rss_mib(), seconds=time.perf_counter() - started)

    def wrap(self, owner: Any, attribute: str, name: str) -> None:
        """Measure every call of ``owner.attribute`` as phase ``name`` (an instrument: the call
        itself runs unchanged)."""
        original = getattr(owner, attribute)

        def measured(*args: Any, **kwargs: Any) -> Any:
            with self.phase(name):
                return original(*args, **kwargs)

        setattr(owner, attribute, measured)

    def table(self) -> str:
        lines = [f"{'phase':44} {'rss before':>11} {'peak':>9} {'rss after':>10} {'seconds':>8}"]
        for r in self.rows:
            lines.append(f"{r['phase']:44} {r['rss_before']:11.0f} {r['peak']:9.0f} {r['rss_after']:10.0f} "
                         f"{r['seconds']:8.2f}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------- config


def bench_config(layers: int, width: int, workers: int, rounds: int, steps: int, batch: int) -> Any:
    from trainer.codec import CompressionConfig
    from trainer.config import DataConfig, InnerConfig, ModelConfig, RoundConfig, RunConfig

    return RunConfig(
        run_id="memory",
        model=ModelConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=8, n_embd=width),
        inner=InnerConfig(steps=steps, batch_size=batch),
        data=DataConfig(eval_batches=2),
        rounds=RoundConfig(rounds=rounds, expected_workers=workers, quorum=workers, straggler_timeout_s=900.0,
                           heartbeat_interval_s=1.0, liveness_timeout_s=120.0),
        compression=CompressionConfig(enabled=True),
    )


def model_mib(config: Any) -> float:
    from trainer.model.gpt import build_model, param_count

    return param_count(build_model(config.model, config.seed)) * 4 / MIB


# ------------------------------------------------------------------------------------- phases


def make_updates(config_path: str, workers: int, out: str) -> None:
    """Child process: each worker's compressed pseudo-gradient for round 1, as the worker would send
    it (an AdamW-sized random update: lr × √steps per coordinate, compressed with a fresh error
    feedback buffer), written as <out>/<worker>.payload and .header.json."""
    import torch

    from trainer.codec import AdaptiveRankPolicy, ErrorFeedbackCompressor
    from trainer.config import RunConfig
    from trainer.model.gpt import build_model
    from trainer.model.params import params_of

    config = RunConfig.load(config_path)
    params = params_of(build_model(config.model, config.seed))
    scale = config.inner.lr * config.inner.steps ** 0.5
    for i in range(workers):
        g = torch.Generator().manual_seed(1000 + i)
        update = {n: torch.randn(p.shape, generator=g) * scale for n, p in sorted(params.items())}
        payload, header, _ = ErrorFeedbackCompressor(AdaptiveRankPolicy(config.compression)).compress(update)
        Path(out, f"w{i}.payload").write_bytes(payload)
        Path(out, f"w{i}.header.json").write_text(strict_json(header))


def _push(c: Any, worker: str, payload: bytes, header: dict) -> None:
    """What trainer.coordinator.service does with a push whose bytes arrived whole."""
    from proto import PROTOCOL_VERSION, Encoding
    from storage_client import canonical_json
    from trainer.codec.wire import sha256_hex
    from trainer.coordinator import UpdateHeader
    from trainer.rounds.aggregation import checked_update

    g = c.global_state
    h = UpdateHeader(
        protocol_version=PROTOCOL_VERSION, run_id=c.config.run_id, worker_id=worker, round=c.round.number, stage=0,
        num_stages=1, encoding=int(Encoding.LOWRANK_INT4),
        tensors=tuple((n, d, tuple(s)) for n, (d, s) in c.layout.items()), payload_size=len(payload),
        payload_sha256=sha256_hex(payload), train_loss=g.eval_loss_e6 / 1e6, tokens=c.run.round_tokens(c.round.number),
        inner_steps=c.run.inner_steps(c.round.number), base_params_cid=str(g.params_cid), base_bytes_received=0,
        signature=b"", compression_header=canonical_json(header), inner_state_sha256="ab" * 32)
    declared = c.admit_header(h)
    update = checked_update(payload, declared, c.bound, encoding=Encoding.LOWRANK_INT4, codec_header=header)
    c.accept(h, update, len(payload), payload)


def phases(args: argparse.Namespace) -> dict[str, Any]:
    import trainer.rounds.transition as transition
    from proto import PROTOCOL_VERSION
    from trainer.codec.downlink import DownlinkCompressor
    from trainer.coordinator import Coordinator, open_run, publish
    from trainer.coordinator import run as run_module
    from trainer.runstore.run_dir import RunDir

    config = bench_config(args.layers, args.width, args.workers, 1, args.steps, args.batch)
    log = PhaseLog()
    with tempfile.TemporaryDirectory(prefix="coordinator-memory-") as tmp:
        config.save(Path(tmp, "config.json"))
        subprocess.run([sys.executable, "-m", "benchmarks.coordinator_memory", "_make-updates", "--config",
                        str(Path(tmp, "config.json")), "--workers", str(args.workers), "--out", tmp], check=True)
        pushes = [(f"w{i}", Path(tmp, f"w{i}.payload").read_bytes(),
                   json.loads(Path(tmp, f"w{i}.header.json").read_text())) for i in range(args.workers)]
        start = rss_mib()
        log.wrap(publish, "round_transition", "round_transition")
        log.wrap(transition, "_step_tensors", "aggregate, outer step, downlink (per tensor)")
        log.wrap(run_module.Run, "evaluate", "evaluate")
        log.wrap(DownlinkCompressor, "open", "downlink open")
        with log.phase("open_run + Coordinator"):
            c = Coordinator(open_run(RunDir(Path(tmp, "run")), config))
        store = c.run.run_dir.store
        log.wrap(store, "put", "store.put")
        for i in range(args.workers):
            c.join(f"w{i}", PROTOCOL_VERSION)
        for worker, payload, header in pushes:
            with log.phase(f"push {worker}"):
                _push(c, worker, payload, header)
        assert c.close_due(), "every worker pushed: the round must close"
        with log.phase("close_round"):
            c.close_round()
    peak = max(r["peak"] for r in log.rows)
    return {"mode": "phases", "workers": args.workers, "model_mib": model_mib(config), "start_rss_mib": start,
            "peak_rss_mib": peak, "table": log.table(), "rows": log.rows}


# ------------------------------------------------------------------------------------- cluster


def _reap(process: subprocess.Popen[bytes], timeout_s: float) -> tuple[int, float]:
    """(exit status, peak RSS MiB) of a child, reaped with wait4 so its rusage is its own."""
    deadline = time.monotonic() + timeout_s
    while True:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)
        if pid == process.pid:
            process.returncode = os.waitstatus_to_exitcode(status)
            return process.returncode, usage.ru_maxrss / 1024
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {process.pid} still running after {timeout_s}s")
        time.sleep(0.1)


def cluster(args: argparse.Namespace) -> dict[str, Any]:
    from cli.cluster import LocalCluster

    config = bench_config(args.layers, args.width, args.workers, args.rounds, args.steps, args.batch)
    with tempfile.TemporaryDirectory(prefix="coordinator-memory-") as tmp:
        path = Path(tmp, "config.json")
        config.save(path)
        started = time.monotonic()
        with LocalCluster(Path(tmp, "run"), insecure=True) as local:
            extra = ["--idle-timeout", str(args.idle_timeout)] if args.idle_timeout else []
            coordinator = local.start_coordinator(path, timeout_s=300, extra=extra)
            sampler = RssSampler(coordinator.pid)
            sampler.start()
            workers = {f"w{i}": local.start_worker(f"w{i}") for i in range(args.workers)}
            reaped: dict[str, tuple[int, float]] = {}
            for name, process in [*workers.items(), ("coordinator", coordinator)]:
                if name == "coordinator":
                    sampler.stop()
                reaped[name] = _reap(process, args.timeout_s)
                if reaped[name][0] != 0:
                    raise RuntimeError(f"{name} exited with {reaped[name][0]}:\n{local.log(name)}\n"
                                       f"coordinator:\n{local.log('coordinator', tail=30)}")
            log_tail = local.log("coordinator", tail=4 * args.rounds + 4)
        seconds = time.monotonic() - started
    return {"mode": "cluster", "workers": args.workers, "rounds": args.rounds, "model_mib": model_mib(config),
            "coordinator_peak_rss_mib": reaped["coordinator"][1],
            "worker_peak_rss_mib": max(v[1] for k, v in reaped.items() if k != "coordinator"),
            "seconds": seconds, "coordinator_rss_timeline": sampler.timeline(), "coordinator_log_tail": log_tail}


class RssSampler(threading.Thread):
    """The coordinator's RSS every 50 ms, to line its peaks up with its log (wall-clock seconds)."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self._stop_at = pid, [], threading.Event()

    def run(self) -> None:
        while not self._stop_at.is_set():
            with contextlib.suppress(OSError, KeyError):
                self.samples.append((time.time(), rss_mib(self.pid)))
            time.sleep(0.05)

    def stop(self) -> None:
        self._stop_at.set()
        self.join()

    def timeline(self) -> list[str]:
        """Per second: the highest RSS sampled, where it changed by 20 MiB or more."""
        out, last = [], 0.0
        for second in sorted({int(t) for t, _ in self.samples}):
            top = max(r for t, r in self.samples if int(t) == second)
            if abs(top - last) >= 20:
                out.append(f"{time.strftime('%H:%M:%S', time.gmtime(second))} {top:.0f}")
                last = top
        return out


# ------------------------------------------------------------------------------------- main


def _arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="inner steps a round")
    p.add_argument("--batch", type=int, default=2, help="sequences an inner step")
    p.add_argument("--json", type=Path, help="also write the result here")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coordinator_memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    _arguments(sub.add_parser("phases", help="the round machinery in-process, phase by phase"))
    p = sub.add_parser("cluster", help="a real coordinator and workers; peak RSS of each process")
    _arguments(p)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--idle-timeout", type=float, default=0.0,
                   help="the coordinator's --idle-timeout (0: its default); 8 workers on 2 cores keep it busy "
                        "checking pushes for longer than the default allows a silent stream")
    make = sub.add_parser("_make-updates")
    make.add_argument("--config", required=True)
    make.add_argument("--workers", type=int, required=True)
    make.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.mode == "_make-updates":
        make_updates(args.config, args.workers, args.out)
        return 0
    run: Callable[[argparse.Namespace], dict[str, Any]] = phases if args.mode == "phases" else cluster
    result = run(args)
    bound = 4 * result["model_mib"] + 1024
    peak = result.get("peak_rss_mib", result.get("coordinator_peak_rss_mib"))
    if "table" in result:
        print(result["table"])
    print(strict_json({k: v for k, v in result.items() if k not in ("table", "rows")}, indent=1))
    print(f"coordinator peak {peak:.0f} MiB = {peak / result['model_mib']:.1f} x the model's {result['model_mib']:.0f} "
          f"MiB; bound 4 x model + 1 GiB = {bound:.0f} MiB: {'within' if peak <= bound else 'OVER'}")
    if args.json:
        args.json.write_text(strict_json(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
