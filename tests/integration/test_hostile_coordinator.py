"""``dilocox worker`` (a real process, over TLS to a pinned certificate) against a hostile coordinator.

The coordinator is benchmarks.hostile_coordinator's stand-in, served here over TLS with a
self-signed certificate the worker pins by fingerprint: what a compromised coordinator could send.
The worker must refuse each misbehaviour with one line and a non-zero exit, with bounded memory
(peak RSS from the kernel's own account of the child, ``os.wait4``) and heartbeats no faster
than the floor whatever interval it is told.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from attestation import WorkerKey
from benchmarks.hostile_coordinator import NESTED_CONFIG, PAYLOAD_CHUNKS, Hostile, run_worker, served, signed_header
from proto import pb
from tests.unit.test_hostile_coordinator import CONFIG
from trainer.config import estimated_parameters
from trainer.net.limits import HEARTBEAT_FLOOR_S

pytestmark = pytest.mark.integration

@pytest.fixture
def hostile_tls(tmp_path: Path) -> Iterator[tuple[Hostile, list[str]]]:
    """The stand-in coordinator over TLS, and the flags that make a worker pin it."""
    coordinator = Hostile(WorkerKey.generate(), CONFIG)
    with served(coordinator, tmp_path / "tls") as (_, flags):
        yield coordinator, flags


def test_a_worker_refuses_an_oversized_global_state_with_bounded_memory_and_heartbeats(hostile_tls, tmp_path) -> None:
    coordinator, flags = hostile_tls
    coordinator.heartbeat_interval_s = 0.0
    sent: list[int] = []

    def oversized() -> Iterator[pb.GlobalChunk]:
        coordinator.third_heartbeat.wait(30)  # let it heartbeat first: at the floor's rate, not 2,000/s
        yield signed_header(coordinator.key, payload_size=1 << 50, payload_sha256="0" * 64)
        for _ in range(PAYLOAD_CHUNKS):
            sent.append(1)
            yield pb.GlobalChunk(data=b"\0" * (1 << 20))
    coordinator.fetch = oversized
    code, output, peak = run_worker(flags, tmp_path / "w0.log")

    assert code == 1, output
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and "WireError: global state of round 1 declares 1125899906842624 bytes" in errors[0]
    assert "Traceback" not in output
    assert f"sending one every {HEARTBEAT_FLOOR_S:.4g}s" in output
    gaps = [b - a for a, b in zip(coordinator.heartbeat_times, coordinator.heartbeat_times[1:3])]
    assert len(gaps) == 2 and min(gaps) >= HEARTBEAT_FLOOR_S * 0.9, coordinator.heartbeat_times
    # The stream was cut at its header: what the transport had buffered ahead is all that was sent.
    assert len(sent) < PAYLOAD_CHUNKS // 4, len(sent)
    assert peak < 4 * 4 * estimated_parameters(CONFIG.model) + (1 << 30), peak
    print(f"worker peak RSS {peak / 2**20:.0f} MiB; {len(sent)} MiB yielded past the header before the cut; "
          f"heartbeat gaps {', '.join(f'{g:.3f}s' for g in gaps)}")


def test_a_worker_refuses_a_nested_config_with_one_line(hostile_tls, tmp_path) -> None:
    coordinator, flags = hostile_tls
    coordinator.config_json = NESTED_CONFIG
    code, output, _ = run_worker(flags, tmp_path / "w0.log")
    assert code == 1, output
    assert "WorkerError: the coordinator's run configuration is refused: " in output and "nests deeper" in output
    assert "Traceback" not in output and "RecursionError" not in output
