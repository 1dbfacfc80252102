"""User errors end in one line naming the flag, field or file, a non-zero exit status, no traceback.

Each case runs the real CLI (``python -m cli.main``) as a subprocess, as a user would, except the
damaged state files of a ledger run (``settlement.json``, outbox items), which are read in process:
reaching them through the CLI needs a chain.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from settlement.outbox import Outbox, OutboxError
from tests.conftest import small_config
from trainer.config import ConfigError, DataConfig, RunConfig
from trainer.runstore.run_dir import RunDir, RunDirError

REPO = Path(__file__).resolve().parents[2]
BAD_PIN = "ab" * 32  # a well-formed SHA-256 fingerprint no server has


def dilocox(*args: str) -> tuple[int, str]:
    """Run the CLI; returns (exit status, stdout + stderr), after the checks every case shares."""
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=REPO, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode in (1, 2), (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if "ERROR" in line]
    assert len(errors) == 1, proc.stderr  # exactly one error line ...
    assert len(lines) <= 4, proc.stderr   # ... among at most a few (an INSECURE warning, a start-up line)
    return proc.returncode, errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_port_out_of_range(tmp_path: Path) -> None:
    code, line = dilocox("coordinator", "--run-dir", str(tmp_path / "run"), "--port", "70000", "--insecure")
    assert code == 2 and "--port 70000 is out of range" in line and "65535" in line
    assert not (tmp_path / "run" / "coordinator.addr").exists()


@pytest.mark.parametrize(("flag", "value"), [("--workers", "0"), ("--time-limit", "nan"), ("--time-limit", "0"),
                                             ("--report-timeout", "-1")])
def test_demo_arguments_out_of_range(tmp_path: Path, flag: str, value: str) -> None:
    code, line = dilocox("demo", "--run-dir", str(tmp_path / "demo"), flag, value)
    assert code == 2 and f"{flag} " in line and "is out of range" in line
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize(("setting", "says"), [
    ("rounds.rounds=0", "rounds.rounds = 0 is out of range"),
    ("rounds.nope=1", "no field 'nope' in rounds"),
    ("inner.lr=fast", "not a float"),
    ("rounds.overlap", "expected section.field=value"),
])
def test_a_bad_setting_is_a_usage_error_naming_it(tmp_path: Path, setting: str, says: str) -> None:
    for command in (("demo", "--run-dir", str(tmp_path / "demo")),
                    ("coordinator", "--run-dir", str(tmp_path / "run"), "--insecure")):
        code, line = dilocox(*command, "--set", setting)
        assert code == 2 and says in line, (command, line)
    assert not (tmp_path / "demo").exists() and not (tmp_path / "run" / "HEAD").exists()


BAD_FIELDS = [  # (section, field, value in the file, what the error line must say)
    ("inner", "lr", "inf", "inner.lr = inf is out of range: must be in (0, 10]"),
    ("rounds", "expected_workers", 100_000, "rounds.expected_workers = 100000 is out of range: must be in [1, 1024]"),
    ("data", "eval_batches", 10_000_000, "data.eval_batches = 10000000 is out of range: must be in [1, 10000]"),
    ("outer", "momentum", "nan", "outer.momentum = nan is out of range: must be in [0, 1)"),
]


def test_config_file_out_of_range(tmp_path: Path) -> None:
    """Every field out of range is named in the one line, with its value and its range."""
    obj = small_config().to_json()
    for section, name, value, _ in BAD_FIELDS:
        obj[section][name] = value
    (tmp_path / "cfg.json").write_text(json.dumps(obj))
    code, line = dilocox("coordinator", "--run-dir", str(tmp_path / "run"), "--config", str(tmp_path / "cfg.json"),
                         "--insecure")
    assert code == 1 and "ConfigError" in line
    for *_, shown in BAD_FIELDS:
        assert shown in line, line


def test_update_norm_that_no_update_can_meet(tmp_path: Path) -> None:
    obj = small_config().to_json()
    obj["rounds"]["max_update_norm"] = "1e-09"
    with pytest.raises(ConfigError, match=r"rounds\.max_update_norm = 1e-09 is below .*every update would be refused"):
        RunConfig.from_json(obj)


def test_empty_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "empty.txt"
    corpus.write_text("")
    small_config(data=DataConfig(corpus=str(corpus), eval_batches=2)).save(tmp_path / "cfg.json")
    code, line = dilocox("coordinator", "--run-dir", str(tmp_path / "run"), "--config", str(tmp_path / "cfg.json"),
                         "--insecure")
    assert code == 1 and f"corpus {corpus} is empty" in line


@pytest.mark.parametrize("command", ["worker", "status"])
def test_unresolvable_coordinator_host(command: str) -> None:
    extra = ["--worker-id", "w0"] if command == "worker" else []
    code, line = dilocox(command, "--coordinator", "nosuchhost.invalid:1", *extra, "--insecure")
    assert code == 2 and "--coordinator nosuchhost.invalid:1: cannot resolve host 'nosuchhost.invalid'" in line


@pytest.mark.parametrize("trust", [["--insecure"], ["--tls-fingerprint", BAD_PIN]])
def test_status_with_nothing_listening(trust: list[str]) -> None:
    address = f"127.0.0.1:{free_port()}"
    code, line = dilocox("status", "--coordinator", address, *trust)
    assert code == 1 and address in line


def test_ledger_without_chain_rpc(tmp_path: Path) -> None:
    code, line = dilocox("coordinator", "--run-dir", str(tmp_path / "run"), "--ledger", str(tmp_path / "d.json"),
                         "--insecure")
    assert code == 2 and "--chain-rpc, --chain-key-file missing" in line


def test_garbage_chain_key_file(tmp_path: Path) -> None:
    key = tmp_path / "coordinator.key"
    key.write_text("this is not a key\n")
    code, line = dilocox("coordinator", "--run-dir", str(tmp_path / "run"), "--ledger", str(tmp_path / "d.json"),
                         "--chain-rpc", "http://127.0.0.1:1", "--chain-key-file", str(key), "--insecure")
    assert code == 2 and f"--chain-key-file {key}: not a chain private key" in line
    assert "this is not a key" not in line  # the key file's content is never echoed


def test_dev_attestation_without_root_dir() -> None:
    code, line = dilocox("worker", "--coordinator", "127.0.0.1:1", "--worker-id", "w0", "--insecure",
                         "--attestation", "dev")
    assert code == 2 and "--attestation dev needs --dev-root-dir" in line


def test_worker_id_with_a_space() -> None:
    # refused before connecting: nothing listens on this port, and no retry is waited for
    code, line = dilocox("worker", "--coordinator", f"127.0.0.1:{free_port()}", "--worker-id", "a b", "--insecure")
    assert code == 2 and "--worker-id 'a b' must match [A-Za-z0-9._-]{1,64}" in line


def test_truncated_workers_json(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "workers.json").write_text('{"w0": 0, "w1')
    small_config().save(tmp_path / "cfg.json")
    code, line = dilocox("coordinator", "--run-dir", str(run), "--config", str(tmp_path / "cfg.json"), "--insecure",
                         "--linger", "0")
    assert code == 1 and f"state file {run / 'workers.json'} is damaged or unreadable" in line


@pytest.mark.parametrize("text, shown", [("[1, 2]", "holds a JSON list, not an object"),
                                          ('{"w0": "zero"}', "worker 'w0' has shard 'zero'"),
                                          ('{"w0": -1}', "worker 'w0' has shard -1")])
def test_misshapen_workers_json_names_the_file(tmp_path: Path, text: str, shown: str) -> None:
    run = RunDir(tmp_path / "run")
    (run.path / "workers.json").write_text(text)
    with pytest.raises(RunDirError) as info:
        run.workers()
    assert f"state file {run.path / 'workers.json'}" in str(info.value) and shown in str(info.value)


def test_corrupt_head(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "HEAD").write_text("bafy-truncated")
    small_config().save(tmp_path / "cfg.json")
    code, line = dilocox("coordinator", "--run-dir", str(run), "--config", str(tmp_path / "cfg.json"), "--insecure")
    assert code == 1 and f"state file {run / 'HEAD'} does not hold a manifest CID" in line


SETTLEMENT_DEFAULT = {"run_created": False, "queued_through": 0}  # as settlement.report_book reads it


@pytest.mark.parametrize("text, shown", [('{"run_created": true, "queued_th', "is damaged or unreadable"),
                                          ('{"run_created": true}', "'queued_through' is missing"),
                                          ('"yes"', "holds a JSON str, not an object")])
def test_corrupt_settlement_json_names_the_file(tmp_path: Path, text: str, shown: str) -> None:
    run = RunDir(tmp_path / "run")
    (run.path / "settlement.json").write_text(text)
    with pytest.raises(RunDirError) as info:
        run.load("settlement.json", SETTLEMENT_DEFAULT)
    assert f"state file {run.path / 'settlement.json'}" in str(info.value) and shown in str(info.value)
    assert "\n" not in str(info.value)


def test_corrupt_outbox_items_name_the_file(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox")
    path = outbox.enqueue_create_run(b"\x01" * 32, b"\x02" * 32, b"\x03" * 32, b"\x04" * 32)
    item = json.loads(path.read_text())
    path.write_text(path.read_text()[:40])  # cut short, as a crash mid-copy could leave it
    with pytest.raises(OutboxError, match=f"outbox item {path} is unreadable"):
        outbox.pending()
    item["genesis_checkpoint"] = "0x" + "zz" * 32  # the right length, not hex
    path.write_text(json.dumps(item))

    class NoChain:  # the item is refused before the chain is asked anything
        def run_of(self, run_id: bytes) -> None:
            raise AssertionError("the chain was asked about a damaged item")

    with pytest.raises(OutboxError, match=f"outbox item {path}: genesis_checkpoint must be 0x followed by 64 hex digits"):
        outbox.flush(NoChain())  # type: ignore[arg-type]
