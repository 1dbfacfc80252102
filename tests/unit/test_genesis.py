"""A run's genesis (trainer.coordinator.run.open_run): θ⁽⁰⁾ is held once, as views of the bytes the
coordinator serves and stores, the evaluation model bound to them, and its stored objects are those
the plain serialisation gives (the same CIDs as before genesis was made lean)."""

from __future__ import annotations

import torch

from storage_client import CID
from trainer.codec.wire import encode_params
from trainer.config import InnerConfig, ModelConfig, RoundConfig, RunConfig
from trainer.coordinator.run import open_run
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.rounds.outer import outer_state_of, zero_momentum
from trainer.runstore.run_dir import RunDir

CONFIG = RunConfig(model=ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=16), inner=InnerConfig(batch_size=2),
                   rounds=RoundConfig(rounds=2))


def _inside(t: torch.Tensor, buffer: bytearray) -> bool:
    base = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    return base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= base + len(buffer)


def test_genesis_holds_theta_once_and_stores_what_the_plain_serialisation_gives(tmp_path) -> None:
    run = open_run(RunDir(tmp_path / "run"), CONFIG)
    state = run.global_state
    expected = params_of(build_model(run.config.model, run.config.seed))
    assert bytes(state.payload) == encode_params(expected)
    assert state.params_cid == CID.of(encode_params(expected))
    manifest = run.manifests[0][1]
    assert run.run_dir.store.get(manifest.params) == encode_params(expected)
    assert manifest.outer_state == str(CID.of(encode_params(outer_state_of(zero_momentum(expected)))))
    own = dict(run.model.named_parameters())
    for name, t in state.params.items():
        assert torch.equal(t, expected[name]), name
        assert _inside(t, state.payload), name  # a view of the served bytes, not a copy
        assert own[name].data_ptr() == t.data_ptr(), name  # the evaluation model computes with it


def test_a_resumed_genesis_is_the_same_state(tmp_path) -> None:
    first = open_run(RunDir(tmp_path / "run"), CONFIG).global_state
    again = open_run(RunDir(tmp_path / "run"), None).global_state
    assert (again.params_cid, again.manifest_cid) == (first.params_cid, first.manifest_cid)
    assert bytes(again.payload) == bytes(first.payload)
