"""The command line: ``--set section.field=value`` for any run setting, and subcommands that import
only what they run (``dilocox config`` loads neither torch's trainer nor the benchmarks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import RunConfig, SettingError, demo_config

REPO = Path(__file__).resolve().parents[2]


def test_settings_are_read_as_their_fields_types_and_validated_whole() -> None:
    config = demo_config().with_settings(["rounds.overlap=true", "inner.lr=3e-3", "seed=7", "run_id=x",
                                          "compression.enabled=on", "rounds.rounds=3", "rounds.rounds=4"])
    assert config.rounds.overlap is True and config.inner.lr == 3e-3 and config.seed == 7
    assert config.run_id == "x" and config.compression.enabled is True
    assert config.rounds.rounds == 4  # later settings win
    assert RunConfig().with_settings([]) == RunConfig()


@pytest.mark.parametrize(("setting", "says"), [
    ("rounds.overlap", "expected section.field=value"),
    ("rounds.nope=1", "no field 'nope' in rounds"),
    ("inner=3", "inner is a section"),
    ("model.n_layer.x=1", "n_layer is a value, not a section"),
    ("inner.lr=fast", "not a float"),
    ("rounds.overlap=maybe", "not a bool"),
    ("seed=1.5", "not a int"),
    ("schema=x", "no field 'schema'"),
    ("rounds.quorum=3", "quorum"),  # parses, but more than the 2 expected workers
])
def test_a_bad_setting_names_itself(setting: str, says: str) -> None:
    with pytest.raises(SettingError, match=says.replace(".", r"\.")):
        demo_config().with_settings([setting])


_PROBE = """
import sys
from cli.main import parser
args = parser(["config", "--set", "rounds.rounds=3"]).parse_args(["config", "--set", "rounds.rounds=3"])
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("benchmarks", "torch", "settlement", "audit", "grpc"))
print(" ".join(heavy) or "light")
"""


def test_parsing_a_command_line_imports_no_benchmark_and_no_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "light", done.stdout[:2000]


def test_status_json_is_every_field_by_its_proto_name_with_numbers() -> None:
    from cli.main import message_json
    from proto import pb

    status = pb.StatusResponse(run_id="r", open_round=3, total_rounds=2**40, workers=[
        pb.WorkerStatus(worker_id="w0", phase=2, last_seen_s=float("nan"))], rounds=[pb.RoundSummary(round=1)])
    doc = message_json(status)
    assert doc["total_rounds"] == 2**40 and doc["finished"] is False and doc["ledger_lag_rounds"] == 0
    worker = doc["workers"][0]
    assert worker == {"worker_id": "w0", "shard": 0, "alive": False, "last_seen_s": None, "round": 0,
                      "phase": "WORKER_PHASE_JOINED", "address": ""}
    assert doc["rounds"][0]["participants"] == [] and doc["rounds"][0]["eval_loss"] == 0.0


def test_help_shows_defaults() -> None:
    from cli.main import parser

    text = " ".join(parser(["coordinator"])._subparsers._group_actions[0].choices["coordinator"].format_help().split())
    assert "(default: 30.0)" in text  # --report-timeout
    assert "(default: 127.0.0.1)" in text  # --host
    assert "(default: None)" not in text and "(default: False)" not in text
