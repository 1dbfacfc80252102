"""A run that outlives its coordinator (issue 29): real anvil, contracts, coordinators, workers and
gateway, as a user would start them.

Coordinator A (dev account 1, the run's creator) runs rounds 1-4; a mirror of its store is taken over
its trustless gateway (``dilocox store serve`` + ``dilocox mirror``) and A is killed. The creator hands
the run to B (dev account 2: another key) on chain (``dilocox run hand-over``); B, in another run
directory filled only by the mirror and with a TLS identity of its own, takes the run over
(``dilocox coordinator --take-over``). The workers, given B as ``--successor`` with its fingerprint and
the chain's RPC, move to it once A stays unreachable, check on chain that B is the run's coordinator,
and finish rounds 5-8. The ledger holds all eight rounds under one run id, A's and B's, and the audit
of B's directory passes across the handover with every contribution replayed, A's rounds and B's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from audit.cli import audit_run_dir
from cli.cluster import LocalCluster
from cli.main import main as cli_main
from settlement import DEV_ACCOUNTS, Anvil, Chain, Deployment, Ledger
from settlement.takeover import TakeoverError, take_over
from storage_client import CID, Codec
from tests.conftest import Holds, small_config
from tests.integration.test_trust import ledger_of, pinned, start
from tests.integration.test_user_errors import REPO, free_port
from trainer.config import RoundConfig
from trainer.net.tls import ensure_self_signed
from trainer.runstore.run_dir import RunDir

pytestmark = pytest.mark.integration

ROUNDS, STOPPED_AFTER = 8, 4


def _wait_recorded(ledger: Ledger, run_id: bytes, round_: int, cluster: LocalCluster, name: str) -> None:
    deadline = time.monotonic() + 120
    while (run := ledger.run_of(run_id)) is None or run.last_round < round_:
        process = cluster.processes.get(name)
        assert process is None or process.poll() is None, cluster.log(name, tail=80)
        assert time.monotonic() < deadline, f"round {round_} not recorded in time:\n{cluster.log(name, tail=80)}"
        time.sleep(0.1)


def _mirror(source: Path, to: Path, run_id: bytes, rpc_url: str, deployment: Path) -> None:
    """``dilocox mirror`` of ``source``'s store, served by ``dilocox store serve`` (plain HTTP on loopback)."""
    server = subprocess.Popen([sys.executable, "-m", "cli.main", "store", "serve", "--run", str(source), "--port", "0"],
                              cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        url = re.search(r"(https?://\S+?)/ipfs/", server.stdout.readline()).group(1)
        assert cli_main(["mirror", "--run-id", "0x" + run_id.hex(), "--from", url, "--to", str(to),
                         "--rpc", rpc_url, "--deployment", str(deployment)]) == 0
    finally:
        server.terminate()
        server.wait(30)


def test_a_second_coordinator_takes_the_run_over_and_the_audit_spans_both(
        cluster: LocalCluster, chain: Anvil, holds: Holds, tmp_path: Path) -> None:
    config = pinned(small_config(rounds=RoundConfig(rounds=ROUNDS, expected_workers=2, quorum=2,
                                                    straggler_timeout_s=30.0, heartbeat_interval_s=0.5,
                                                    liveness_timeout_s=3.0)))
    # B's address and certificate are published before the run starts, as its operator would.
    b_dir, b_port = tmp_path / "run-b", free_port()
    b_fingerprint = ensure_self_signed(b_dir / "tls", ["127.0.0.1"]).fingerprint
    co_args, wo_args = start(cluster, chain, config, tmp_path)
    successor = ["--successor", f"127.0.0.1:{b_port}", "--successor-fingerprint", b_fingerprint,
                 "--chain-rpc", chain.rpc_url, "--reconnect-timeout", "3"]
    for worker in ("w0", "w1"):
        holds.hold(worker, STOPPED_AFTER + 1)  # both in round 5 when A stops: its updates go to B
        cluster.start_worker(worker, extra=[*wo_args, *successor])

    keys = cluster.run_dir.path / "chain"
    deployment_file = keys / "deployment.json"
    deployment = Deployment.load(deployment_file)
    _wait_recorded(*ledger_of(cluster, chain), STOPPED_AFTER, cluster, "coordinator")
    ledger, run_id = ledger_of(cluster, chain)
    b_address = Chain(chain.rpc_url, DEV_ACCOUNTS[2]).address
    b_ledger = Ledger(Chain(chain.rpc_url, DEV_ACCOUNTS[2]), deployment.ledger, from_block=deployment.deployed_block)
    b_run = RunDir(b_dir)
    with pytest.raises(TakeoverError, match="names 0x.* as the coordinator .* not this account"):
        take_over(b_run, b_ledger, run_id)  # not handed over yet
    _mirror(cluster.run_dir.path, b_dir, run_id, chain.rpc_url, deployment_file)
    cluster.kill("coordinator")  # A's machine is gone: its keys, journals and open round with it

    hand_over = ["run", "hand-over", "--rpc", chain.rpc_url, "--deployment", str(deployment_file),
                 "--run-id", "0x" + run_id.hex(), "--to", b_address]
    assert cli_main([*hand_over, "--key-file", str(keys / "dev-account-2.key")]) == 1  # only the creator
    assert cli_main([*hand_over, "--key-file", str(keys / "dev-account-1.key")]) == 0
    assert cli_main(["run", "create", "--rpc", chain.rpc_url, "--key-file", str(keys / "dev-account-0.key"),
                     "--deployment", str(deployment_file), "--config", str(tmp_path / "config.json"),
                     "--coordinator", b_address]) == 0  # B admits workers too

    # B's side refuses a mirror behind the chain, and a directory whose HEAD is not the chain's last round.
    with pytest.raises(TakeoverError, match=f"behind the chain: it does not hold round {STOPPED_AFTER}'s manifest b"):
        take_over(RunDir(tmp_path / "empty"), b_ledger, run_id)
    round_3 = CID(Codec.JSON, ledger.round_of(run_id, STOPPED_AFTER - 1).manifest_digest)
    b_run.set_head(round_3)
    with pytest.raises(TakeoverError, match=f"holds HEAD {round_3}, not round {STOPPED_AFTER}'s manifest"):
        take_over(b_run, b_ledger, run_id)
    (b_dir / "HEAD").unlink()

    (b_dir / "chain").mkdir()
    shutil.copyfile(deployment_file, b_dir / "chain" / "deployment.json")  # public: the auditor's copy
    b = LocalCluster(b_dir)
    b_args = [a if a != str(keys / "dev-account-1.key") else str(keys / "dev-account-2.key") for a in co_args]
    try:
        b.start_coordinator(port=b_port, extra=[*b_args, "--report-timeout", "10", "--linger", "1",
                                                "--take-over", "0x" + run_id.hex()])
        for worker in ("w0", "w1"):
            holds.release(worker, STOPPED_AFTER + 1)
        for worker in ("w0", "w1"):
            assert cluster.wait_exit(worker, 240) == 0, cluster.log(worker, tail=80)
        assert b.wait_exit("coordinator", 120) == 0, b.log("coordinator", tail=80)
    finally:
        b.stop()
    assert "moving to 127.0.0.1:%d" % b_port in cluster.log("w0", tail=2000)
    assert f"taken over at round {STOPPED_AFTER}" in b.log("coordinator", tail=2000)

    run = ledger.run_of(run_id)
    recorded = ledger.recorded_rounds(run_id)
    assert run is not None and run.last_round == ROUNDS and run.coordinator == b_address
    assert [r.round for r in recorded] == list(range(1, ROUNDS + 1))
    a_address = Chain(chain.rpc_url, DEV_ACCOUNTS[1]).address
    assert [r.sender for r in recorded] == [a_address] * STOPPED_AFTER + [b_address] * (ROUNDS - STOPPED_AFTER)
    assert all(len(r.reports) == 2 for r in recorded)  # every round credits both workers, on either side
    assert ledger.tenures(run_id, run).tenures == ((1, a_address), (STOPPED_AFTER + 1, b_address))

    console = Console(record=True, width=200)
    root = (cluster.run_dir.path / "dev-root" / "dev-root.address").read_text().strip()
    code = audit_run_dir(b_dir, rpc_url=chain.rpc_url, allow_dev=True, dev_roots=(root,), console=console,
                         replay=(2 * ROUNDS, 0),
                         receipts=(cluster.receipts_dir("w0"), cluster.receipts_dir("w1")))
    text = console.export_text()
    assert code == 0 and "AUDIT PASSED" in text, text[-4000:]
    said = f"the run passed from coordinator {a_address} to {b_address} from round {STOPPED_AFTER + 1} on"
    assert said in " ".join(text.split()), text[-4000:]
