"""States revealed on challenge, end to end on real processes (docs/verification.md "Revealed on challenge").

A run with ``rounds.state_reveal = "on_challenge"``: two real workers push their updates and nothing
else; each keeps the committed start state of its rounds in its retention folder. The audit's replay
asks for the states it needs, replays every contribution from its own revealed state (no chains), in
its worker's kernels, at d = 0. Then worker w1's folder is lost: an audit that asks w0's folder over a
real trustless gateway process (``dilocox store serve``) gets w0's states over HTTP, names w1 for the
two states it did not reveal within ``rounds.reveal_deadline_s`` (check ``reveal``), and
``--dispute`` voids those two credits on chain: w1 is paid for round 1 only (its state was fresh), w0
in full.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from audit.cli import audit_run_dir
from audit.disputes import DisputeOptions
from cli.cluster import LocalCluster
from settlement import DEV_ACCOUNTS, Anvil, Chain, Deployment, Ledger
from settlement.provision import await_run, fund_pool, mine
from settlement.rewards import RewardPool
from storage_client import lineage, open_store
from tests.conftest import small_config
from trainer.config import RoundConfig
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import state_cid

from .test_disputes import start_provisioned

pytestmark = pytest.mark.integration

ROUNDS = 3
FUNDED = 3_000_000
WINDOW = 100  # blocks: the pool's funding and the auditor's admission happen inside it


def _serve(folder: Path) -> tuple[subprocess.Popen[str], str]:
    """``dilocox store serve`` over a worker's retention folder: the process and its URL."""
    process = subprocess.Popen([sys.executable, "-m", "cli.main", "store", "serve", "--run", str(folder),
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline() if process.stdout else ""
    assert line.startswith("serving "), line
    return process, line.split(" at ", 1)[1].split("/ipfs/", 1)[0]


def test_states_are_revealed_on_challenge_and_a_worker_that_does_not_is_named_and_unpaid(
        cluster: LocalCluster, chain: Anvil, tmp_path: Path) -> None:
    config = small_config(rounds=RoundConfig(rounds=ROUNDS, expected_workers=2, quorum=2, straggler_timeout_s=60.0,
                                             heartbeat_interval_s=0.5, liveness_timeout_s=10.0,
                                             state_reveal="on_challenge", reveal_deadline_s=2.0))
    config = config.replace(compression=dataclasses.replace(config.compression, enabled=True, min_rank=1, max_rank=4))
    run_dir = cluster.run_dir.path
    wo_args = start_provisioned(cluster, chain, config, tmp_path, WINDOW)
    for worker in ("w0", "w1"):
        cluster.start_worker(worker, extra=wo_args)
    for name in ("w0", "w1", "coordinator"):
        assert cluster.wait_exit(name, 180) == 0, cluster.log(name, tail=60)

    # Nothing but the updates crossed the wire: no committed state is in the run's store, each is kept
    # by its worker, and every round's state after the first is one the worker can reveal.
    store = open_store(run_dir)
    rounds = [m for _, m in lineage(store, cluster.run_dir.head())][1:]
    assert [m.round for m in rounds] == list(range(1, ROUNDS + 1))
    for manifest in rounds:
        for p in manifest.participants:
            assert (p.state == FRESH_STATE) == (manifest.round == 1)
            if p.state != FRESH_STATE:
                assert not store.has(state_cid(p.state))
                assert open_store(cluster.retained_dir(p.worker)).has(state_cid(p.state))

    deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    owner, coordinator = Chain(chain.rpc_url, DEV_ACCOUNTS[0]), Chain(chain.rpc_url, DEV_ACCOUNTS[1])
    ledger = Ledger(owner, deployment.ledger, from_block=deployment.deployed_block)
    run_id = await_run(store, ledger, timeout_s=0)
    fund_pool(coordinator, deployment, run_id, FUNDED, ROUNDS, minter=owner)

    honest = tmp_path / "honest.json"
    assert audit_run_dir(run_dir, rpc_url=chain.rpc_url, allow_dev=True, replay=(2 * ROUNDS, 1),
                         json_path=honest) == 0
    replay = json.loads(honest.read_text())["replay"]
    assert {(row["round"], row["worker"]): (row["status"], row["distance"]) for row in replay["contributions"]} == \
        {(r, w): ("ok", 0.0) for r in range(1, ROUNDS + 1) for w in ("w0", "w1")}
    assert len(replay["reveal"]["revealed"]) == 2 * (ROUNDS - 1) and not replay["reveal"]["missing"]
    assert replay["steps"] == 2 * ROUNDS * config.inner.steps  # each contribution once: no chains

    shutil.rmtree(cluster.retained_dir("w1"))  # w1 lost what it had to keep
    gateway, url = _serve(cluster.retained_dir("w0"))
    try:
        options = DisputeOptions(bytes.fromhex(DEV_ACCOUNTS[0].removeprefix("0x")), "dev", str(run_dir / "dev-root"))
        named = tmp_path / "named.json"
        assert audit_run_dir(run_dir, rpc_url=chain.rpc_url, allow_dev=True, replay=(2 * ROUNDS, 1),
                             dispute=options, json_path=named, reveal=(url,)) == 1
    finally:
        gateway.terminate()
        gateway.wait(10)
    result = json.loads(named.read_text())
    statuses = {(row["round"], row["worker"]): row["status"] for row in result["replay"]["contributions"]}
    assert statuses == {**{(r, "w0"): "ok" for r in range(1, ROUNDS + 1)}, (1, "w1"): "ok",
                        **{(r, "w1"): "unrevealed" for r in range(2, ROUNDS + 1)}}
    assert set(result["replay"]["reveal"]["revealed"].values()) == {url}  # w0's, over HTTP
    failures = [(f["round"], f["check"]) for f in result["failures"]]
    assert sorted(failures) == [(r, "reveal") for r in range(2, ROUNDS + 1)], result["failures"]
    assert all("w1 was asked for the inner state" in f["message"] for f in result["failures"])
    disputes = sorted((d["round"], d["party_id"], d["check"], d["outcome"]) for d in result["disputes"])
    assert disputes == [(r, "w1", "reveal", "upheld") for r in range(2, ROUNDS + 1)]

    mine(owner, WINDOW)  # the rounds' challenge windows close: their credits are payable now
    pool = RewardPool(owner, deployment.rewards, ledger, from_block=deployment.deployed_block)
    share = FUNDED // ROUNDS // 2
    (named_worker,) = {d["party"] for d in result["disputes"]}
    (round1,) = [r for r in ledger.recorded_rounds(run_id) if r.round == 1]
    (other,) = set(round1.workers) - {named_worker}
    assert pool.claim(run_id, named_worker)[0] == share  # round 1 only: rounds 2 and 3 are voided
    assert pool.claim(run_id, other)[0] == ROUNDS * share  # paid in full
