"""The worker's client against a hostile coordinator it pinned (issue 26, the worker's side).

A real in-process gRPC server on 127.0.0.1 (plaintext: what is tested is the client's logic, not
TLS) serves the answers a hostile or compromised coordinator could give; a real CoordinatorClient
talks to it. Retry waits go through an injected ``sleep`` that records them, so backoff is counted
rather than waited for; the payload tests hold the payload back on an event, so "refused before a
payload byte" is observed, not timed.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterator

import pytest

from attestation import WorkerKey
from benchmarks.hostile_coordinator import NESTED_CONFIG, Hostile, served, signed_header
from proto import pb
from storage_client import CID
from tests.conftest import small_config
from trainer.codec.wire import WireError
from trainer.config import estimated_parameters
from trainer.net.limits import (
    HEARTBEAT_FLOOR_S,
    RETRY_CEILING_S,
    RETRY_FLOOR_S,
    Backoff,
    dense_payload_limit,
)
from trainer.net.link import Link
from trainer.net.tls import ClientTls
from trainer.worker.client import MAX_EARLY_EMPTY, CoordinatorClient, WorkerError, heartbeats, wait_after_empty

CONFIG = small_config()


class Stop(Exception):
    """Raised by the recording sleep to end a retry loop the test has seen enough of."""


@pytest.fixture
def hostile() -> Iterator[tuple[Hostile, str]]:
    coordinator = Hostile(WorkerKey.generate(), CONFIG)
    with served(coordinator, threads=4) as (address, _):
        yield coordinator, address


def client_of(address: str, sleeps: list[float], *, stop_after: int = 10_000) -> CoordinatorClient:
    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) >= stop_after:
            raise Stop

    return CoordinatorClient(address, "w0", tls=ClientTls(insecure=True), attestation=None, reconnect_timeout_s=30,
                             fetch_wait_s=5, link=Link(), on_first_join=lambda config, shard, shards: None,
                             sleep=sleep)


def held_back_payload(header: pb.GlobalChunk, chunks: int, released: threading.Event,
                      sent: list[int]) -> Callable[[], Iterator[pb.GlobalChunk]]:
    """The header at once; its payload (``chunks`` MiB) only once the test releases it."""
    def stream() -> Iterator[pb.GlobalChunk]:
        yield header
        released.wait(10)
        for _ in range(chunks):
            sent.append(1)
            yield pb.GlobalChunk(data=b"\0" * (1 << 20))
    return stream


def test_an_oversized_declared_payload_is_refused_before_a_byte_is_read(hostile) -> None:
    coordinator, address = hostile
    client = client_of(address, [])
    client.join()
    released, sent = threading.Event(), []
    coordinator.fetch = held_back_payload(signed_header(coordinator.key, payload_size=1 << 50,
                                                        payload_sha256="0" * 64), 4, released, sent)
    try:
        with pytest.raises(WireError, match="declares 1125899906842624 bytes, more than the") as refused:
            client.fetch(1)
    finally:
        released.set()
    assert sent == [] and client.bytes_received < 1024  # refused on the header alone
    limit = dense_payload_limit(estimated_parameters(CONFIG.model))
    assert f"the {limit} this run's model can need" in str(refused.value) and "\n" not in str(refused.value)


def test_the_signature_is_checked_before_a_payload_byte_is_read(hostile) -> None:
    coordinator, address = hostile
    client = client_of(address, [])
    client.join()
    released, sent = threading.Event(), []
    payload = b"\0" * (1 << 20)
    forged = signed_header(WorkerKey.generate(), payload_size=len(payload), payload_sha256=CID.of(payload).digest.hex())
    coordinator.fetch = held_back_payload(forged, 1, released, sent)
    try:
        with pytest.raises(WireError, match="is signed by .*, not by the coordinator's key"):
            client.fetch(1)
    finally:
        released.set()
    assert sent == []


def test_a_stream_longer_than_declared_is_cut_at_the_declared_size(hostile) -> None:
    coordinator, address = hostile
    client = client_of(address, [])
    client.join()
    sent: list[int] = []

    def stream() -> Iterator[pb.GlobalChunk]:
        yield signed_header(coordinator.key, payload_size=1000, payload_sha256="0" * 64)
        for _ in range(64):
            sent.append(1)
            yield pb.GlobalChunk(data=b"\0" * 1000)
    coordinator.fetch = stream
    with pytest.raises(WireError, match="more than the declared 1000 bytes arrived"):
        client.fetch(1)
    assert client.bytes_received < 8 * 1024


def test_no_new_global_yet_is_asked_again_after_growing_waits_then_refused(hostile) -> None:
    coordinator, address = hostile
    sleeps: list[float] = []
    client = client_of(address, sleeps)
    client.join()

    def not_yet() -> Iterator[pb.GlobalChunk]:
        if coordinator.fetches > 200:  # the old client asked without end: stop it (it fails below)
            raise RuntimeError("asked too often")
        yield pb.GlobalChunk(header=pb.GlobalHeader(available=False, open_round=1))
    coordinator.fetch = not_yet
    with pytest.raises(WorkerError, match="'no new global state yet' 21 times in a row without holding"):
        client.fetch(1)
    assert coordinator.fetches == MAX_EARLY_EMPTY + 1
    assert len(sleeps) == MAX_EARLY_EMPTY
    # Each wait is the backoff's less the time the empty answer took (milliseconds here).
    assert 0 < sleeps[0] <= RETRY_FLOOR_S and max(sleeps) <= RETRY_CEILING_S
    assert sum(sleeps[-5:]) >= 5 * RETRY_CEILING_S / 2  # grown to the ceiling (jitter: at least half of it)


def test_a_long_poll_the_coordinator_held_is_asked_again_at_once() -> None:
    sleeps: list[float] = []
    backoff = Backoff(sleep=sleeps.append, uniform=lambda: 1.0)
    for _ in range(30):
        wait_after_empty(backoff, took_s=5.0, fetch_wait_s=5.0)  # an honest coordinator held each poll 5 s
    assert sleeps == [] and backoff.retries == 0


def test_calls_retry_after_growing_jittered_waits(hostile) -> None:
    _, address = hostile
    sleeps: list[float] = []
    client = client_of(address, sleeps, stop_after=12)
    with pytest.raises(Stop):
        client.status()
    assert len(sleeps) == 12 and min(sleeps) >= RETRY_FLOOR_S and max(sleeps) <= RETRY_CEILING_S
    assert sleeps[0] <= RETRY_FLOOR_S and sum(sleeps[-4:]) >= 4 * RETRY_CEILING_S / 2
    assert len(set(sleeps[-4:])) > 1  # jittered, not in lockstep


def test_a_heartbeat_interval_of_zero_is_held_to_the_floor(hostile) -> None:
    coordinator, address = hostile
    coordinator.heartbeat_interval_s = 0.0
    client = client_of(address, [])
    client.join()
    assert client.heartbeat_interval_s == HEARTBEAT_FLOOR_S
    stop = threading.Event()
    thread = threading.Thread(target=heartbeats, args=(client, stop), daemon=True)
    thread.start()
    try:
        assert coordinator.third_heartbeat.wait(10)
    finally:
        stop.set()
        thread.join(10)
    first, third = coordinator.heartbeat_times[0], coordinator.heartbeat_times[2]
    assert third - first >= 2 * HEARTBEAT_FLOOR_S * 0.9  # at most the floor's rate (20 a second)


def test_a_deeply_nested_config_is_one_line_not_a_recursion_error(hostile) -> None:
    coordinator, address = hostile
    coordinator.config_json = NESTED_CONFIG  # its CID is named alongside: it "matches"
    client = client_of(address, [])
    with pytest.raises(WorkerError, match="run configuration is refused: .*nests deeper than") as refused:
        client.join()
    assert "\n" not in str(refused.value) and len(str(refused.value)) < 400


def test_the_heartbeat_bounds_are_the_run_configs_own() -> None:
    # The worker never heartbeats slower than an honest run's config asks, so never looks dead to it.
    from trainer.config import _RANGES
    from trainer.net.limits import HEARTBEAT_CEILING_S

    low, high, *_ = _RANGES["rounds.heartbeat_interval_s"]
    assert (low, high) == (HEARTBEAT_FLOOR_S, HEARTBEAT_CEILING_S)
