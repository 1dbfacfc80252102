"""The round transition gives the same bytes on every CPU (trainer.rounds.transition's four rules).

A stored run of three rounds (clipping, a trimmed mean, and a compressed downlink with its carried
error) is re-derived in fresh processes under torch's generic kernels (ATEN_CPU_CAPABILITY=default,
no fused multiply-add) and under the machine's best capability, with 1 thread and with 4; every
digest must equal the coordinator-side result. A float32 numpy re-implementation of one round, in
this file, must match bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.codec import AdaptiveRankPolicy, CompressionConfig
from trainer.codec.downlink import DownlinkCompressor
from trainer.codec.wire import encode_params
from trainer.config import OuterConfig, RoundConfig
from trainer.rounds.aggregation import exact_norm, lower_median
from trainer.rounds.outer import zero_momentum
from trainer.rounds.transition import OuterState, round_transition

REPO = Path(__file__).resolve().parents[2]
OUTER = OuterConfig()
RULES = [RoundConfig(clip_multiple=2.0), RoundConfig(clip_multiple=2.0, aggregator="trimmed_mean", trim_fraction=0.2),
         RoundConfig(clip_multiple=0.0)]


def _params(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Odd sizes, so vectorised kernels have tails as well as full vectors.
    return {"blocks.0.attn.weight": torch.randn(96, 67, generator=g), "blocks.0.ln.bias": torch.randn(67, generator=g),
            "head.weight": torch.randn(131, 40, generator=g) * 0.02}


def _updates(round_: int, workers: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + round_)
    out = {}
    for i in range(workers):
        scale = 1e-3 * (1.0 + i) * (40.0 if i == workers - 1 else 1.0)  # the last one is clipped
        out[f"w{i}"] = {k: scale * torch.randn(v.shape, generator=g) for k, v in _params(0).items()}
    return out


def _write_run(directory: Path) -> list[dict[str, str]]:
    """Three rounds computed in this process, stored as the audit would find them; returns their
    digests (params, outer state) as the coordinator computed them."""
    state = OuterState(_params(0), zero_momentum(_params(0)))
    (directory / "genesis.params").write_bytes(state.params_bytes())
    (directory / "genesis.outer").write_bytes(state.outer_state_bytes())
    encoder = DownlinkCompressor(AdaptiveRankPolicy(CompressionConfig(enabled=True, min_rank=3, max_rank=3)))
    digests, history = [], []
    for r, rules in enumerate(RULES, start=1):
        updates = _updates(r, 5 if rules.aggregator == "trimmed_mean" else 3)
        for w, u in updates.items():
            (directory / f"r{r}.{w}.update").write_bytes(encode_params(u))
        result = round_transition(state, updates, outer=OUTER, rounds=rules, history=history,
                                  downlink=encoder if r == 3 else None)
        if result.downlink is not None:
            (directory / f"r{r}.downlink").write_bytes(result.downlink.payload)
            (directory / f"r{r}.header").write_text(json.dumps(result.downlink.header))
        history = [lower_median(list(result.aggregated.norms.values()))]
        state = result.state
        digests.append({"params": hashlib.sha256(state.params_bytes()).hexdigest(),
                        "outer": hashlib.sha256(state.outer_state_bytes()).hexdigest()})
        # The next round starts from the stored state, as an auditor does.
        (directory / f"r{r}.params").write_bytes(state.params_bytes())
        (directory / f"r{r}.outer").write_bytes(state.outer_state_bytes())
    return digests


# Run in a fresh interpreter, so ATEN_CPU_CAPABILITY and the thread count apply from torch's import.
_REDERIVE = """
import hashlib, json, sys
from pathlib import Path
import torch
from audit.rederive import rederive, update_norms
from trainer.rounds.aggregation import round_norm
from trainer.config import OuterConfig, RoundConfig
d, threads = Path(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(threads)
rules = [RoundConfig(clip_multiple=2.0), RoundConfig(clip_multiple=2.0, aggregator="trimmed_mean", trim_fraction=0.2),
         RoundConfig(clip_multiple=0.0)]
parent, out, history = "genesis", [], []
for r, how in enumerate(rules, start=1):
    updates = {p.name.split(".")[1]: p.read_bytes() for p in sorted(d.glob(f"r{r}.*.update"))}
    downlink = None
    if (d / f"r{r}.downlink").exists():
        downlink = ((d / f"r{r}.downlink").read_bytes(), json.loads((d / f"r{r}.header").read_text()))
    got = rederive(OuterConfig(), (d / f"{parent}.params").read_bytes(), (d / f"{parent}.outer").read_bytes(),
                   updates, downlink, rounds=how, history=history)
    history = [round_norm(list(update_norms(updates).values()))]
    out.append({"params": got.params_digest.hex(), "outer": got.outer_state_digest.hex()})
    parent = f"r{r}"
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
                  "digests": out}))
"""


def _rederive_in(directory: Path, capability: str | None, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS")}
    if capability is not None:
        env["ATEN_CPU_CAPABILITY"] = capability
    done = subprocess.run([sys.executable, "-c", _REDERIVE, str(directory), str(threads)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_stored_run_rederives_to_the_same_bytes_on_every_capability_and_thread_count(tmp_path: Path) -> None:
    want = _write_run(tmp_path)
    seen = []
    for capability, threads in ((None, 1), (None, 4), ("default", 1), ("default", 4)):
        got = _rederive_in(tmp_path, capability, threads)
        seen.append(got["capability"])
        assert got["digests"] == want, f"capability {got['capability']}, {got['threads']} thread(s)"
    assert "DEFAULT" in seen  # the generic kernels really ran
    if len(set(seen)) == 1:
        pytest.skip("this CPU has no vectorised capability to compare the generic kernels with")


# ----------------------------------------------------------------------------- numpy, independently


def _numpy_round(params: dict, momentum: dict, updates: dict, clip_multiple: float) -> tuple[dict, dict]:
    """One round in plain float32 numpy: clip to c × the lower median norm, mean in sorted worker
    order, Nesterov step, one rounding per operation."""
    f32 = np.float32
    norms = {w: math.sqrt(math.fsum(math.fsum(np.square(t.astype(np.float64)).ravel().tolist())
                                    for _, t in sorted(u.items()))) for w, u in updates.items()}
    ordered = sorted(norms.values())
    tau = clip_multiple * ordered[(len(ordered) - 1) // 2]
    clipped = {}
    for w, u in updates.items():
        scale = f32(tau / norms[w]) if norms[w] > tau else None
        clipped[w] = {k: (t * scale if scale is not None else t) for k, t in u.items()}
    workers = sorted(clipped)
    mu, lr = f32(OUTER.momentum), f32(OUTER.lr)
    new_params, new_momentum = {}, {}
    for k, theta in params.items():
        total = clipped[workers[0]][k].copy()
        for w in workers[1:]:
            total = total + clipped[w][k]
        delta = total / f32(len(workers))
        m = momentum[k] * mu + delta
        direction = delta + m * mu
        new_params[k] = theta - direction * lr
        new_momentum[k] = m
        assert new_params[k].dtype == np.float32
    return new_params, new_momentum


def test_a_float32_numpy_round_matches_bit_for_bit() -> None:
    params = _params(0)
    g = torch.Generator().manual_seed(5)
    momentum = {k: 0.01 * torch.randn(v.shape, generator=g) for k, v in params.items()}
    updates = _updates(1, 3)
    result = round_transition(OuterState(params, momentum), updates, outer=OUTER, rounds=RoundConfig(clip_multiple=2.0))
    assert result.aggregated.clipped == ["w2"]
    want_params, want_momentum = _numpy_round(
        {k: v.numpy() for k, v in params.items()}, {k: v.numpy() for k, v in momentum.items()},
        {w: {k: v.numpy() for k, v in u.items()} for w, u in updates.items()}, 2.0)
    for k in params:
        assert np.array_equal(result.state.params[k].numpy(), want_params[k]), k
        assert np.array_equal(result.state.momentum[k].numpy(), want_momentum[k]), k


def test_exact_norms_do_not_depend_on_the_order_of_summation() -> None:
    update = _updates(2, 1)["w0"]
    flipped = {k: v.flip(0) for k, v in reversed(list(update.items()))}
    assert exact_norm(update) == exact_norm(flipped)
