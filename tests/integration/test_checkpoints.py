"""Full checkpoints every K rounds, pushed bytes kept as sent: a coordinator killed with a round's
update bytes stored but its manifest not, whose HEAD keeps no full checkpoint, resumes and the audit
passes, before and after ``dilocox gc``. Real anvil, contracts, coordinator and worker processes;
nothing is mocked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.cluster import LocalCluster
from proto import Encoding
from settlement import Anvil
from storage_client import Codec, lineage
from tests.conftest import small_config
from tests.integration.test_cluster import assert_rederivable
from tests.integration.test_ledger_catch_up import audit
from tests.integration.test_trust import pinned, start
from trainer.codec import CompressionConfig
from trainer.config import RoundConfig
from trainer.runstore.checkpoints import is_full_checkpoint
from trainer.runstore.update_record import record_bytes, slice_ref

pytestmark = pytest.mark.integration


def wait_for_pending(path: Path, timeout_s: float) -> None:
    """Until the coordinator's journal of an open round names an accepted update."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if json.loads(path.read_text()):
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.01)
    raise AssertionError(f"{path} never named an accepted update")


def test_killed_between_the_bytes_and_the_manifest_with_k3_resumes_and_audits(
        cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    config = pinned(small_config(
        compression=CompressionConfig(enabled=True, min_rank=1, max_rank=4),
        rounds=RoundConfig(rounds=4, expected_workers=2, quorum=2, straggler_timeout_s=60.0, heartbeat_interval_s=0.5,
                           liveness_timeout_s=10.0, checkpoint_every=3)))
    co_args, wo_args = start(cluster, chain, config, tmp_path)
    port = int(cluster.address.rsplit(":", 1)[1])
    cluster.start_worker("w0", extra=wo_args)
    cluster.start_worker("w1", extra=[*wo_args, "--link-latency", "1500"])  # its push lands well after w0's
    # Round 3 is open once round 2 (no full checkpoint: K = 3) is HEAD; kill the coordinator once
    # w0's round-3 update bytes are stored and journalled, before w1's arrive and the round publishes.
    wait_for_pending(cluster.run_dir.path / "pending" / "round-000003.json", 180)
    cluster.kill("coordinator", signal.SIGKILL)
    run = cluster.run_dir
    before = lineage(run.store, run.head())
    assert before[-1][1].round == 2 and not run.store.has(before[-1][1].params)

    cluster.start_coordinator(port=port, extra=[*co_args, "--report-timeout", "10"])
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 240) == 0, cluster.log(name, tail=80)
    log = cluster.log("coordinator", tail=400)
    assert "resumed at round 2" in log and "kept w0's update" in log, log
    after = lineage(run.store, run.head())
    assert [m.round for _, m in after] == [0, 1, 2, 3, 4] and after[:3] == before
    assert [r for _, m in after if run.store.has(m.params) for r in [m.round]] == [0, 3, 4]
    assert all(is_full_checkpoint(config.rounds, m.round) == run.store.has(m.outer_state) for _, m in after)
    assert_rederivable(run)
    code, text = audit(cluster, chain.rpc_url)
    assert code == 0 and "AUDIT PASSED" in text, text[-4000:]

    # An abandoned push (its payload and record, journalled nowhere): a dry run removes nothing,
    # gc removes it and nothing the run needs, and the audit still passes.
    payload = b"the payload of a push whose round closed without it"
    abandoned = {run.store.put(payload).hex,
                 run.store.put(record_bytes([slice_ref(0, 1, Encoding.DENSE_F32, payload, None)]), Codec.JSON).hex}
    objects = set(run.store)
    dry = dilocox("gc", "--run", str(run.path), "--dry-run")
    assert dry.returncode == 0 and "would remove 2 unreferenced object(s)" in dry.stdout, dry.stdout + dry.stderr
    assert set(run.store) == objects
    done = dilocox("gc", "--run", str(run.path))
    assert done.returncode == 0 and "removed 2 unreferenced object(s)" in done.stdout, done.stdout + done.stderr
    assert set(run.store) == objects - abandoned
    code, text = audit(cluster, chain.rpc_url)
    assert code == 0 and "AUDIT PASSED" in text, text[-4000:]


def dilocox(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], capture_output=True, text=True, timeout=120)
