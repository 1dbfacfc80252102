"""``dilocox bench scale --smoke``: one tiny cell runs for real (chain, coordinator, workers, audit)
and its row is filled with figures that hold whatever the machine: every phase was timed, both
kinds of process have a peak RSS, the run stored and sent bytes, and the audit of it passed. No
timing is asserted beyond being measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale import COLUMNS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_smoke_cell_fills_its_row(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "cli.main", "bench", "scale", "--smoke",
                           "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads((tmp_path / "scale.json").read_text())
    assert result["machine"]["cores"] >= 1 and result["machine"]["torch"]
    [cell] = result["cells"]
    assert "failed" not in cell and "skipped" not in cell, cell
    assert cell["workers"] == 2 and cell["rounds"] == 2
    assert 10_000 < cell["parameters"] < 1_000_000
    for key in ("round_s", "inner_s", "compress_s", "transfer_s", "aggregate_s", "store_s",
                "evaluate_coordinator_s", "evaluate_worker_s", "audit_s_per_round"):
        assert 0 < cell[key] < 120, (key, cell[key])
    assert cell["inner_s"] < cell["round_s"]
    for key in ("coordinator_rss", "worker_rss"):
        assert 50e6 < cell[key] < 8e9, (key, cell[key])
    assert cell["wire_bytes_per_round"] > 0 and cell["store_bytes_per_round"] > cell["checkpoint_bytes_per_round"] > 0
    # The store keeps what crossed the wire (the pushed payloads), plus the full checkpoints.
    updates = cell["store_bytes_per_round"] - cell["checkpoint_bytes_per_round"]
    assert updates <= 1.2 * cell["wire_bytes_per_round"], (updates, cell["wire_bytes_per_round"])
    # Compressed updates cross the network: far below two dense float32 copies of the model a worker.
    assert cell["wire_bytes_per_round"] < 2 * 2 * 4 * cell["parameters"]
    table = (tmp_path / "scale.md").read_text()
    assert "| " + " | ".join(COLUMNS) + " |" in table
    [row] = [line for line in table.splitlines() if line.startswith("| smoke |")]
    assert all(cell_text.strip() for cell_text in row.strip("|").split("|")), row
    assert not (tmp_path / "runs" / "smoke-2w").exists()  # deleted without --keep-runs
