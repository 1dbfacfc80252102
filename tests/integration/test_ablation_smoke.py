"""``dilocox bench ablation --smoke``: the benchmark's own code runs for real and the report holds together.

The smoke configuration is tiny, so its numbers say nothing about DiLoCoX; what is checked is
that each kind of row the benchmark measures (real coordinator/worker processes, the AllReduce
ranks, both codecs, adaptive H read at its token budget, pipeline stages, the emulated
link) produces a row, and the relations that hold whatever the machine: DiLoCo sends fewer bytes
per token than an all-reduce every step, compression sends fewer than dense, the two codecs send
about the same. No timing is asserted.

The six modes left out (``SKIPPED``: −compression, −overlap, a fixed rank, the other overlapped
start, and DiLoCo and DiLoCoX with Muon inner steps) are DiLoCo or DiLoCoX with one setting changed and
nothing of their own in the benchmark; that each one's configuration is exactly that is
tests/unit/test_product_defaults.py's, and each technique's training is its own integration test's
(test_overlap, test_cluster; Muon's, replayed, test_island). Each costs a cluster (about 10 s of CPU) here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.ablation import MODES, SMOKE_THROUGHPUT, main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


SKIPPED = ("no-compression", "no-overlap", "fixed-rank", "other-start", "diloco-muon", "muon")
RUN = [m for m in MODES if m.key not in SKIPPED]


def test_smoke_ablation_reports_each_kind_of_row(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path), "--modes", ",".join(m.key for m in RUN)]) == 0

    result = json.loads((tmp_path / "ablation.json").read_text())
    conv, thr = result["convergence"], result["throughput"]
    assert set(conv) == {m.key for m in RUN if m.convergence}
    assert set(thr) == set(SMOKE_THROUGHPUT)
    for key, row in conv.items():
        assert "failed" not in row, row.get("failed")
        assert math.isfinite(row["loss_mean"]), key
        # equal tokens; adaptive H is read at the first checkpoint that has the budget
        budget = conv["allreduce"]["tokens"]
        assert row["tokens"] == budget or (key == "adaptive-steps" and row["tokens"] > budget), key
    for key, row in thr.items():
        assert "failed" not in row, row.get("failed")
        assert row["steady_tokens_per_s"] > 0 and row["startup_s"] >= 0, key
    assert thr["pipeline"]["stages"] == 2
    steps = result["settings"]["inner_steps"]
    assert all(steps // 2 <= r["inner_steps"] <= steps for r in conv["adaptive-steps"]["per_round"])

    dense = conv["allreduce"]["bytes_per_token"]
    for m in RUN:
        if m.convergence and not m.allreduce:
            assert conv[m.key]["bytes_per_token"] < dense, m.key
        if m.convergence and m.compression:
            assert conv[m.key]["bytes_per_token"] < conv["diloco"]["bytes_per_token"], m.key
    # top-k is sized to rank 24's payload, the middle of the adaptive rank's [16, 32]: about DiLoCoX's bytes
    assert 0.5 < conv["topk"]["bytes_per_token"] / conv["dilocox"]["bytes_per_token"] < 2.0

    markdown = (tmp_path / "ablation.md").read_text()
    for m in MODES:
        assert (f"| {m.name} |" in markdown) == (m in RUN), m.key
    assert "Ceiling" in markdown and ("test.txt" in markdown or "NOT WikiText-2" in markdown)
    for png in ("ablation_loss.png", "ablation_rounds.png"):
        assert (tmp_path / png).read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "runs").exists()  # run directories are removed unless --keep-runs
