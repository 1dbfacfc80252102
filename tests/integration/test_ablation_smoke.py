"""``dilocox bench ablation --smoke``: every mode runs for real and the report holds together.

The smoke configuration is tiny, so its numbers say nothing about DiLoCoX; what is checked is
that every mode (real coordinator/worker processes, the AllReduce ranks, pipeline stages, the
emulated link) produces a row, and the relations that hold whatever the machine: DiLoCo sends
fewer bytes per token than an all-reduce every step, and compression sends fewer than dense.
No timing is asserted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.ablation import MODES, main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_smoke_ablation_reports_every_mode(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path)]) == 0

    result = json.loads((tmp_path / "ablation.json").read_text())
    conv, thr = result["convergence"], result["throughput"]
    keys = [m.key for m in MODES]
    assert set(conv) == set(keys) and set(thr) == set(keys)
    for key in keys:
        assert math.isfinite(conv[key]["final_loss"]), key
        assert conv[key]["tokens"] == conv["allreduce"]["tokens"], key  # equal tokens
        assert thr[key]["tokens_per_s"] > 0, key

    dense = conv["allreduce"]["bytes_per_token"]
    for m in MODES:
        if not m.allreduce:
            assert conv[m.key]["bytes_per_token"] < dense, m.key
        if m.compression:
            assert conv[m.key]["bytes_sent_per_worker"] < conv["diloco"]["bytes_sent_per_worker"], m.key

    markdown = (tmp_path / "ablation.md").read_text()
    for m in MODES:
        assert f"| {m.name} |" in markdown
    assert "held" in markdown.lower() and ("test.txt" in markdown or "NOT WikiText-2" in markdown)
    assert (tmp_path / "ablation_loss.png").read_bytes()[:8] == PNG_SIGNATURE
    assert not (tmp_path / "runs").exists()  # run directories are removed unless --keep-runs
