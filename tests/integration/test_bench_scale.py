"""`dilocox bench scale --smoke`: the scale benchmark's real processes, end to end, fill every column."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.scale import COLUMNS

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def test_scale_smoke_fills_the_table(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "cli.main", "bench", "scale", "--smoke", "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "| " + " | ".join(COLUMNS) + " |" in done.stdout
    [cell] = json.loads((tmp_path / "results.json").read_text())
    row = cell["row"]
    assert not cell["skipped"] and row["rounds"] == 2 and row["W"] == 2 and row["params"] > 0
    assert row["compute s"] > 0 and row["aggregate s"] > 0 and row["eval s"] > 0
    assert row["coord RSS MB"] > 100 and row["worker RSS MB"] > 100  # torch alone is a few hundred MB
    assert row["wire/round MB"] > 0 and row["store/round MB"] > 0
    assert row["audit s/round"] is not None and row["audit s/round"] > 0
