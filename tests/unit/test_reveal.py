"""States revealed on challenge: a worker keeps its committed inner states (trainer.worker.retention), an
auditor asks for them by CID (audit.reveal) and names a worker that does not reveal one in time;
nothing but the update crosses the wire in an unchallenged round (trainer.coordinator.checks)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
from pathlib import Path

import pytest
import torch

from audit.replay import unrevealed_row
from audit.reveal import RevealedStore, RevealSourceError, challenge, local_sources, open_source
from storage_client import ObjectStore, StoreError, open_store
from storage_client.gateway import start_gateway
from storage_client.manifest import Manifest
from tests.conftest import small_config
from trainer.config import RoundConfig
from trainer.coordinator.checks import check_state_upload
from trainer.coordinator.state import UpdateHeader
from trainer.codec.wire import layout_of
from trainer.net.refusal import Refusal
from trainer.runtime.inner import FRESH_STATE
from trainer.runtime.state_commit import NO_STATE, commitment, state_cid
from trainer.worker.retention import INDEX, RETAINED_DIR, CommittedStates, Retention, RetentionError


def _state(seed: float) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    w = torch.full((3, 4), seed)
    return ({"exp_avg.w": w, "exp_avg_sq.w": w.abs() + 1, "step.w": torch.tensor(float(int(seed) + 1))},
            {"w": w / 2})


def test_a_kept_state_is_the_bytes_of_its_commitment_and_the_window_is_pruned(tmp_path: Path) -> None:
    kept = Retention(tmp_path / "w0", keep_rounds=2)
    states = {r: commitment(*_state(float(r))) for r in range(1, 6)}
    kept.keep(1, commitment({}, {}))  # fresh: nothing to keep (an auditor starts there unasked)
    assert kept.rounds == {} and commitment({}, {}).digest == FRESH_STATE
    for r in range(2, 6):
        kept.keep(r, states[r])
        data = kept.store.get(state_cid(states[r].digest))
        assert hashlib.sha256(data).hexdigest() == states[r].digest  # the file is the commitment
        kept.prune(r)
    assert sorted(kept.rounds) == [4, 5]  # R = 2 counted rounds
    assert not kept.has(states[2].digest) and not kept.has(states[3].digest)
    assert kept.bytes_on_disk == sum(kept.store.size(state_cid(states[r].digest)) for r in (4, 5))
    assert sorted(Retention(tmp_path / "w0", 2).rounds) == [4, 5]  # a restarted worker still reveals them


def test_a_state_two_rounds_name_stays_while_either_is_kept(tmp_path: Path) -> None:
    """A refused push keeps its state: the next round starts from the same σ (one file), and pruning the
    older round does not remove what the newer one names."""
    kept = Retention(tmp_path / "w0", keep_rounds=1)
    same = commitment(*_state(2.0))
    kept.keep(2, same)
    kept.keep(3, same)
    assert kept.prune(3) == [] and kept.has(same.digest) and sorted(kept.rounds) == [3]
    kept.keep(4, commitment(*_state(4.0)))
    assert kept.prune(4) == [same.digest] and not kept.has(same.digest)


def test_a_state_that_cannot_be_kept_stops_the_push_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kept = Retention(tmp_path / "w0", keep_rounds=4)

    def full(*_: object, **__: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kept.store, "put_chunks", full)
    with pytest.raises(RetentionError, match=r"round 7: cannot keep the committed inner state in .*No space left"):
        kept.keep(7, commitment(*_state(7.0)))
    assert kept.rounds == {}


@pytest.mark.parametrize("index", ['{"1": "zz"}', "[1, 2]", "not json", '{"x": "' + "a" * 64 + '"}'])
def test_a_retention_index_that_is_not_one_is_refused(tmp_path: Path, index: str) -> None:
    (tmp_path / "w0").mkdir()
    (tmp_path / "w0" / INDEX).write_text(index)
    with pytest.raises(RetentionError, match="retention index"):
        Retention(tmp_path / "w0", 4)


def test_a_run_that_reveals_on_challenge_sends_no_state_and_one_that_uploads_does(tmp_path: Path) -> None:
    state = commitment(*_state(3.0))
    rounds = RoundConfig(state_every=2, state_reveal="on_challenge")
    revealing = CommittedStates(rounds, tmp_path / "kept", None)
    assert revealing.for_push(2, state) is NO_STATE and revealing.retention.has(state.digest)
    revealing.counted(2)
    uploading = CommittedStates(dataclasses.replace(rounds, state_reveal="upload"), tmp_path / "up", None)
    assert uploading.for_push(2, state).size > 0 and uploading.retention is None  # due at round 2 (K = 2)
    assert not (tmp_path / "up").exists()


def _header(size: int, state: str = "ab" * 32) -> UpdateHeader:
    return UpdateHeader(1, "test", "w0", 3, 0, 1, 1, (), 0, "", 0.0, 0, 3, "", 0, b"", b"", state, size)


def test_the_coordinator_takes_no_state_bytes_in_a_run_that_reveals_on_challenge(tmp_path: Path) -> None:
    config = small_config(rounds=RoundConfig(state_reveal="on_challenge", state_every=1))
    layout = layout_of({"w": torch.zeros(3, 4)})
    check_state_upload(_header(0), layout, config, [], open_store(tmp_path))  # due by K = 1, yet not asked
    with pytest.raises(Refusal, match="revealed on challenge .* never pushed") as refused:
        check_state_upload(_header(100), layout, config, [], open_store(tmp_path))
    assert refused.value.reason.name == "MALFORMED"


class _Flaky(ObjectStore):
    """A source that reveals nothing for its first ``misses`` asks, or serves other bytes (a liar)."""

    def __init__(self, root: Path, misses: int = 0, lie: bytes | None = None) -> None:
        super().__init__(root)
        self.misses, self.lie, self.asked = misses, lie, 0

    def get(self, cid):  # noqa: ANN001, ANN201
        self.asked += 1
        if self.asked <= self.misses:
            raise StoreError("not yet")
        return self.lie if self.lie is not None else super().get(cid)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_challenge_asks_until_the_deadline_takes_only_the_committed_bytes_and_says_what_is_missing(tmp_path: Path) -> None:
    data = b"the state" * 100
    digest = hashlib.sha256(data).hexdigest()
    liar = _Flaky(tmp_path / "liar", lie=b"other bytes")
    late = _Flaky(tmp_path / "late", misses=3)
    late.put(data)
    clock, cache = _Clock(), ObjectStore(tmp_path / "cache")
    got = challenge([digest, FRESH_STATE, "cd" * 32], [("liar", liar), ("late", late)], cache, deadline_s=10.0,
                    clock=clock, sleep=clock.sleep)
    assert got.revealed == {digest: "late"} and got.missing == {"cd" * 32}
    assert got.bytes == len(data) and got.seconds == 10.0 and cache.get(state_cid(digest)) == data
    assert liar.asked >= 4  # asked every poll, never taken
    view = RevealedStore(open_store(tmp_path / "run"), cache)
    assert view.has(state_cid(digest)) and view.get(state_cid(digest)) == data
    with pytest.raises(StoreError, match="read-only"):
        view.put(b"x")


def test_a_worker_reveals_over_its_gateway_and_the_fetcher_verifies(tmp_path: Path) -> None:
    kept = Retention(tmp_path / "w0", keep_rounds=4)
    state = commitment(*_state(5.0))
    kept.keep(5, state)
    server, thread = start_gateway(kept.store)
    try:
        got = challenge([state.digest], [(server.url, open_source(server.url))], ObjectStore(tmp_path / "cache"),
                        deadline_s=5.0)
        assert got.revealed == {state.digest: server.url} and not got.missing
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert open_source(str(tmp_path / "w0")).has(state_cid(state.digest))  # the folder itself is a source
    with pytest.raises(RevealSourceError, match="neither an http"):
        open_source(str(tmp_path / "nowhere"))
    with pytest.raises(RevealSourceError, match="characters"):
        open_source("x" * 600)
    (tmp_path / "run" / RETAINED_DIR).mkdir(parents=True)
    (tmp_path / "w0").rename(tmp_path / "run" / RETAINED_DIR / "w0")
    assert local_sources(tmp_path / "run") == [str(tmp_path / "run" / RETAINED_DIR / "w0")]


def test_an_unrevealed_state_names_its_worker_only_inside_the_reveal_window() -> None:
    config = small_config(rounds=RoundConfig(state_reveal="on_challenge", reveal_rounds=3, reveal_deadline_s=2.5))
    manifests = {r: Manifest.__new__(Manifest) for r in range(0, 11)}
    inside = unrevealed_row(config, manifests, 8, "w1", True)
    assert inside.status == "unrevealed" and "within 2.5s" in inside.note
    outside = unrevealed_row(config, manifests, 7, "w1", True)
    assert outside.status == "not replayed" and "more than 3 rounds" in outside.note
    assert json.dumps(inside.to_json())
