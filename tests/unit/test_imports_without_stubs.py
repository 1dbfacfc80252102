"""The pure parts import before the gRPC stubs are generated: the codec, the run config, the round
transition and the whole audit need none of them; the stubs' own names say how to make them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_PROBE = """
import sys
sys.modules["proto.dilocox_pb2"] = None  # as if `make stubs` had never run
sys.modules["proto.dilocox_pb2_grpc"] = None
import trainer.codec.wire, trainer.config, trainer.rounds.transition, audit, audit.rederive, audit.replay, audit.core
from proto import CHUNK_BYTES
assert CHUNK_BYTES == 1 << 20
try:
    from proto import pb
except ImportError as exc:
    print(exc)
else:
    raise SystemExit("pb imported without stubs")
"""


def test_the_codec_config_transition_and_audit_import_without_stubs() -> None:
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gRPC stubs are missing: run `make stubs`" in done.stdout
