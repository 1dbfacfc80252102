"""``dilocox chain|run|pool``: what a person gets wrong ends in one line and a non-zero exit.

Each case runs the real CLI as a subprocess (tests.integration.test_user_errors.dilocox: one error
line, no traceback); the chain ones against a real anvil. A key file's content never appears in
any output.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from settlement import DEV_ACCOUNTS, Anvil
from settlement.provision import dev_key_file, write_dev_keys
from tests.integration.test_user_errors import REPO, dilocox, free_port

pytestmark = pytest.mark.integration

SECRET = "not-a-key " + "5e" * 40  # what a wrong key file holds; it must never be echoed


def succeeds(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    return proc.stdout


def test_key_files_are_refused_by_name_never_echoed(tmp_path: Path) -> None:
    rpc = f"http://127.0.0.1:{free_port()}"
    code, line = dilocox("chain", "deploy", "--rpc", rpc, "--key-file", str(tmp_path / "none.key"),
                         "--out", str(tmp_path / "d.json"))
    assert code == 1 and f"--key-file {tmp_path / 'none.key'}: no such file" in line
    (tmp_path / "bad.key").write_text(SECRET)
    code, line = dilocox("chain", "deploy", "--rpc", rpc, "--key-file", str(tmp_path / "bad.key"),
                         "--out", str(tmp_path / "d.json"))
    assert code == 1 and "not a chain private key" in line and "5e5e" not in line
    assert not (tmp_path / "d.json").exists()


def test_arguments_out_of_range_name_their_flag(tmp_path: Path) -> None:
    code, line = dilocox("chain", "up", "--dir", str(tmp_path / "chain"), "--port", "70000")
    assert code == 2 and "--port 70000 is out of range" in line and not (tmp_path / "chain").exists()
    rpc = f"http://127.0.0.1:{free_port()}"
    code, line = dilocox("chain", "mine", "--rpc", rpc, "0")
    assert code == 1 and "BLOCKS 0 is out of range" in line
    key = write_dev_keys(tmp_path / "keys")[1]
    code, line = dilocox("pool", "fund", "--run", str(tmp_path), "--rpc", rpc, "--key-file", str(key),
                         "--amount", "lots")
    assert code == 1 and "--amount 'lots' is not a number of tokens" in line
    code, line = dilocox("pool", "fund", "--run", str(tmp_path), "--rpc", rpc, "--key-file", str(key),
                         "--amount", "1e-19")
    assert code == 1 and "at most 18 decimals" in line
    code, line = dilocox("run", "create", "--rpc", rpc, "--key-file", str(key), "--deployment", "d.json",
                         "--config", "c.json", "--coordinator", "0x12")
    assert code == 1 and "--coordinator '0x12' is not a chain address" in line


def test_a_chain_that_does_not_answer_is_one_line(tmp_path: Path) -> None:
    code, line = dilocox("chain", "mine", "--rpc", f"http://127.0.0.1:{free_port()}", "3")
    assert code == 1 and "is unreachable" in line


def test_up_twice_is_refused_down_twice_is_fine_and_the_chain_comes_back(tmp_path: Path) -> None:
    chain = tmp_path / "chain"
    try:
        out = succeeds("chain", "up", "--dir", str(chain))
        url = (chain / "rpc-url").read_text().strip()
        assert url in out and "0x70997970C51812dc3A010C7d01b50e0d17dc79C8" in out
        assert all(key.removeprefix("0x") not in out for key in DEV_ACCOUNTS)  # addresses, never keys
        assert (dev_key_file(chain, 1).stat().st_mode & 0o777) == 0o600
        code, line = dilocox("chain", "up", "--dir", str(chain))
        assert code == 1 and f"a chain is already up in {chain}: {url}" in line
        assert "head is block 5" in succeeds("chain", "mine", "--rpc", url, "5")
        succeeds("chain", "deploy", "--rpc", url, "--key-file", str(dev_key_file(chain, 0)),
                 "--out", str(chain / "deployment.json"))  # blocks 6..10 (the receipt court last)
        settle = subprocess.run([sys.executable, "-m", "cli.main", "settle", "--run", str(tmp_path)], cwd=REPO,
                                capture_output=True, text=True, timeout=60)  # would start a second anvil on its state
        assert settle.returncode == 2 and f"is up at {url}" in " ".join(settle.stdout.split()), settle.stdout
        assert "state saved" in succeeds("chain", "down", "--dir", str(chain))
        assert "nothing to stop" in succeeds("chain", "down", "--dir", str(chain))
        succeeds("chain", "up", "--dir", str(chain))  # the same chain, restored from its state
        url = (chain / "rpc-url").read_text().strip()
        assert "head is block 11" in succeeds("chain", "mine", "--rpc", url, "1")
    finally:
        succeeds("chain", "down", "--dir", str(chain))
    assert not (chain / "anvil.pid").exists() and not (chain / "rpc-url").exists()


def test_dev_keys_are_refused_off_a_local_chain(tmp_path: Path) -> None:
    key = write_dev_keys(tmp_path)[0]
    with Anvil(chain_id=1) as mainnet_lookalike:
        code, line = dilocox("chain", "deploy", "--rpc", mainnet_lookalike.rpc_url, "--key-file", str(key),
                             "--out", str(tmp_path / "d.json"))
    assert code == 1 and "PUBLIC dev keys" in line and "chain 1," in line
    assert not (tmp_path / "d.json").exists()


def test_pool_fund_without_the_run_on_the_ledger_says_so(tmp_path: Path) -> None:
    chain = tmp_path / "run" / "chain"
    with Anvil() as anvil:
        keys = write_dev_keys(chain)
        succeeds("chain", "deploy", "--rpc", anvil.rpc_url, "--key-file", str(keys[0]),
                 "--out", str(chain / "deployment.json"))
        code, line = dilocox("chain", "deploy", "--rpc", anvil.rpc_url, "--key-file", str(keys[0]),
                             "--out", str(chain / "deployment.json"))
        assert code == 1 and "a deployment is already there" in line
        code, line = dilocox("pool", "fund", "--run", str(tmp_path / "run"), "--rpc", anvil.rpc_url,
                             "--key-file", str(keys[1]), "--amount", "10", "--wait", "0")
        assert code == 1 and "no run on the ledger" in line and "--ledger" in line
    with Anvil() as empty:  # a fresh chain: the deployment's contracts are not there
        code, line = dilocox("pool", "fund", "--run", str(tmp_path / "run"), "--rpc", empty.rpc_url,
                             "--key-file", str(keys[1]), "--amount", "10", "--wait", "0")
        assert code == 1 and "has no contract at the registry address" in line
