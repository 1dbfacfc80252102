"""The README's "Running it by hand" section, run as written: no Python between the commands.

The shell block is read out of README.md (so the README cannot drift from what works) and run by
bash in a temporary directory, with two substitutions only: ``.venv/bin/dilocox`` is this
interpreter's ``-m cli.main``, and the coordinator's port 50051 a free one. It starts a local chain (``chain
up``), deploys the contracts, allows the run, starts a coordinator and two workers on 127.0.0.1
over TLS, funds the pool, mines past the challenge window, settles (claiming), audits with
``--replay 2`` and stops the chain (``chain down``). Then, from the chain state that ``chain down``
saved (a copy, restarted here), every worker must have been credited and paid for every round; while
it ran, ``dilocox status`` must have shown both workers' addresses beside their ids.

Rounds that train longer than ``--report-timeout`` are tests/integration/test_reports_in_time.py's:
the same processes started by the cluster harness, every report of every round on the ledger.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from settlement import Anvil, Chain, Deployment, Ledger
from settlement.provision import run_of
from settlement.rewards import RewardPool
from settlement.roster import roster_of
from storage_client import ObjectStore
from tests.integration.test_user_errors import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RUN = "runs/byhand"  # where the README's commands keep the run, relative to where they run
SCRIPT_TIMEOUT_S = 300
WORKERS = ("site-a", "site-b")


def readme_block() -> str:
    """The shell block of the README's "Running it by hand" section."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Running it by hand\n"):]
    start = section.index("```sh\n") + len("```sh\n")
    return section[start:section.index("\n```", start)]


def _replace_once(script: str, old: str, new: str) -> str:
    assert script.count(old) == 1, f"the README's by-hand block no longer has exactly one {old!r}"
    return script.replace(old, new)


def by_hand_script(port: int) -> str:
    script = readme_block()
    script = _replace_once(script, "--port 50051", f"--port {port}")
    script = _replace_once(script, "--coordinator 127.0.0.1:50051", f"--coordinator 127.0.0.1:{port}")
    return script.replace(".venv/bin/dilocox", f"{sys.executable} -m cli.main")


def _status(port: int, cwd: Path) -> dict | None:
    """``dilocox status --json`` of the run's coordinator; None while it does not answer."""
    done = subprocess.run([sys.executable, "-m", "cli.main", "status", "--coordinator", f"127.0.0.1:{port}",
                           "--tls-ca", f"{RUN}/tls/cert.pem", "--json"], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}


def _addresses_while_running(script: subprocess.Popen[str], port: int, cwd: Path) -> dict[str, str]:
    """Each worker id's address as ``dilocox status`` shows it, once both have joined (waiting on
    the status itself, while the script runs)."""
    seen: dict[str, str] = {}
    while script.poll() is None and len(seen) < len(WORKERS):
        status = _status(port, cwd) if (cwd / RUN / "coordinator.addr").exists() else None
        for worker in (status or {}).get("workers", []):
            if worker.get("address"):  # the id's key: protobuf's JSON name, or the proto field name
                seen[worker.get("workerId") or worker["worker_id"]] = worker["address"]
        time.sleep(0.5)
    return seen


def run_by_hand(tmp_path: Path) -> tuple[str, dict[str, str]]:
    """Run the README's block in ``tmp_path``; returns its output and the addresses status showed.
    Whatever happens, the script's processes and its chain are stopped."""
    port = free_port()
    log = tmp_path / "by-hand.log"
    with open(log, "w") as out:
        script = subprocess.Popen(["bash", "-e", "-c", by_hand_script(port)], cwd=tmp_path, env=_env(),
                                  stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        addresses = _addresses_while_running(script, port, tmp_path)
        code = script.wait(SCRIPT_TIMEOUT_S)
        text = log.read_text()
        assert code == 0, text[-6000:]
        return text, addresses
    finally:
        if script.poll() is None:
            os.killpg(script.pid, signal.SIGKILL)
            script.wait()
        # The chain runs in its own session: stopped by its own command (a no-op once the script did).
        subprocess.run([sys.executable, "-m", "cli.main", "chain", "down", "--dir", f"{RUN}/chain"], cwd=tmp_path,
                       env=_env(), capture_output=True, timeout=60)


def check_everyone_paid(tmp_path: Path, addresses: dict[str, str]) -> None:
    """From a copy of the chain state ``chain down`` saved: each worker credited and paid for every
    round, by its id; no update recorded without a report; the pool paid out."""
    run_dir = tmp_path / RUN
    rounds = json.loads((run_dir / "config.json").read_text())["rounds"]["rounds"]
    state = tmp_path / "state-copy.json"
    shutil.copyfile(run_dir / "chain" / "state.json", state)
    deployment = Deployment.load(run_dir / "chain" / "deployment.json")
    with Anvil(state_file=state, chain_id=deployment.chain_id) as anvil:
        chain = Chain(anvil.rpc_url, os.urandom(32))
        ledger = Ledger(chain, deployment.ledger, from_block=deployment.deployed_block)
        store = ObjectStore(run_dir / "store")
        run_id = run_of(store, ledger)
        assert run_id is not None
        roster = roster_of(store, ledger.recorded_rounds(run_id))
        statement = RewardPool(chain, deployment.rewards, ledger).statement(run_id)
    assert statement is not None
    assert [u.to_json() for u in roster.unreported] == []
    assert {roster.id_of(a): a for a in statement.workers} == addresses  # ids as status showed them
    for address, account in statement.workers.items():
        assert account.rounds == list(range(1, rounds + 1)), (roster.id_of(address), account)
        assert account.paid == account.earned > 0 and account.claimable == account.pending == 0
    assert statement.funded - statement.paid < rounds * len(WORKERS)  # at most rounding dust stays


def test_the_readme_by_hand_section_runs_audits_and_settles(tmp_path: Path) -> None:
    text, addresses = run_by_hand(tmp_path)
    assert set(addresses) == set(WORKERS), text[-3000:]
    assert "AUDIT PASSED" in text and "UNREPORTED" not in text, text[-6000:]
    assert re.search(r"replay \(seed \d+\)", text), text[-6000:]
    for worker in WORKERS:  # settle and the audit name each worker by its id beside its address
        assert len(re.findall(rf"^ *claimed [\d.,]+ for {worker} \(0x[0-9a-fA-F]{{8}}…", text, re.M)) == 1, text
        assert len(re.findall(rf"^ *{worker} +0x[0-9a-fA-F]{{8}}…[0-9a-fA-F]{{4}} ", text, re.M)) == 2, text
    assert "chain stopped" in text
    check_everyone_paid(tmp_path, addresses)

