"""The run a coordinator serves: created at genesis, or resumed from the store's lineage.

Genesis pins the corpus digest into the config, builds θ⁽⁰⁾ from the seed (or reads it from the
weights ``model.init_from`` names, checked against ``model.init_params``: trainer.model.init_weights),
stores config, θ⁽⁰⁾ and the zero outer state, and publishes manifest 0 (HEAD). Resume re-hashes every manifest from HEAD
back to genesis (storage_client.lineage), refuses a given config that is not the run's own, and
rebuilds the published state (θ, m, e and the last compressed global update) from the store: HEAD's
own checkpoint when stored, else rebuilt from the newest full one (trainer.runstore.checkpoints).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch

from storage_client import CID, Manifest, canonical_json, lineage, to_e6
from trainer.codec import AdaptiveRankPolicy, CodecHeader
from trainer.codec.downlink import DownlinkCompressor
from trainer.codec.wire import Params, ParamsPayload, encode_params, layout_of, params_chunks, streamable
from trainer.config import ConfigError, RunConfig
from trainer.coordinator.state import CompressedGlobal, GlobalState, RoundSummary
from trainer.data.corpus import eval_batches
from trainer.data.dataset import Dataset, TokenSpan, pin_dataset, run_dataset
from trainer.model.gpt import build_model
from trainer.model.init_weights import pin_init
from trainer.model.params import bind_params, load_params, params_of
from trainer.progress import Progress
from trainer.rounds.outer import outer_state_of, zero_momentum
from trainer.rounds.schedule import inner_steps_for_round, round_tokens, stored_downlink_header
from trainer.runstore.checkpoints import checkpoint_at
from trainer.runstore.run_dir import RunDir
from trainer.runtime.inner import evaluate_batches

log = logging.getLogger("dilocox.coordinator")


@dataclass
class Run:
    """What the coordinator knows of its run before any worker speaks, and the published rounds."""

    run_dir: RunDir
    config: RunConfig
    config_cid: CID
    model: torch.nn.Module  # evaluates each published checkpoint
    eval_batches: list
    eval_tokens: torch.Tensor | TokenSpan  # the held-out split, for screening (trainer.coordinator.screening)
    shard_digests: list[bytes]  # by shard: what each participant's report restates as dataDigest
    downlink: DownlinkCompressor | None  # compresses the global update when compression is on
    global_state: GlobalState
    manifests: dict[int, tuple[CID, Manifest]]
    summaries: list[RoundSummary]
    # round -> its parsed downlink codec header, read once from the store (adaptive inner steps)
    _headers: dict[int, CodecHeader | None] = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def config_bytes(self) -> bytes:
        """The config's canonical JSON, as every Challenge and Join sends it."""
        return self.config.canonical()

    @property
    def finished(self) -> bool:
        """The run has published its last round."""
        return self.global_state.round >= self.config.rounds.rounds

    @property
    def genesis_cid(self) -> CID:
        """The run's on-chain identity: config, corpus and θ⁽⁰⁾ in one digest."""
        return self.manifests[0][0]

    @property
    def run_digest(self) -> bytes:
        return self.genesis_cid.digest

    def inner_steps(self, round_: int) -> int:
        """H_r (trainer.rounds.schedule), from the stored downlink header of round r−2 that its manifest
        names: the same bytes after a restart, and the same rule the audit re-derives."""
        return inner_steps_for_round(self.config, round_, self._downlink_header(round_ - 2))

    def round_tokens(self, round_: int) -> int:
        """The tokens of one worker's round r: H_r steps of batch_size sequences of block_size tokens."""
        return round_tokens(self.config, self.inner_steps(round_))

    def _downlink_header(self, round_: int) -> CodecHeader | None:
        if not self.config.inner.adaptive_steps or round_ < 1 or round_ not in self.manifests:
            return None
        if round_ not in self._headers:
            self._headers[round_] = stored_downlink_header(self.run_dir.store, self.manifests[round_][1],
                                                           layout_of(self.global_state.params))
        return self._headers[round_]

    def evaluate(self, params: Params) -> tuple[float, tuple[int, ...]]:
        """The mean held-out loss of ``params``, and each batch's as to_e6 (trainer.data.shared_eval)."""
        bind_params(self.model, params)  # θ's own tensors, which the global state keeps: no copy
        losses = evaluate_batches(self.model, self.eval_batches)
        return sum(losses) / len(losses), tuple(to_e6(x) for x in losses)


def open_run(run_dir: RunDir, config: RunConfig | None) -> Run:
    """The run in ``run_dir``: resumed from its HEAD, or started from ``config`` at genesis."""
    head = run_dir.head()
    if head is None:
        if config is None:
            raise ConfigError(f"{run_dir.path} holds no run yet: a configuration is needed to start one")
        run = _genesis(run_dir, config)  # θ made as views of the bytes it serves
    else:
        run = _resume(run_dir, head, config)
        run.global_state = served_once(run.global_state)
    bind_params(run.model, run.global_state.params)  # the model's own copy of θ is dropped
    return run


def served_once(state: GlobalState) -> GlobalState:
    """``state`` with θ held as views of the bytes it serves (trainer.codec.wire.ParamsPayload), as
    every published round holds it (trainer.coordinator.publish), rather than twice."""
    layout = layout_of(state.params)
    if not streamable(layout):
        return state
    payload, params = ParamsPayload.of(state.payload, layout)
    return dataclasses.replace(state, payload=payload, params=params)


def _prepared(run_dir: RunDir, config: RunConfig, dataset: Dataset | None = None) -> dict:
    # The coordinator reads the held-out tokens only; shard digests come from the (pinned) index.
    dataset = dataset or run_dataset(config, run_dir.store)
    held_out = dataset.eval_tokens()
    return dict(
        run_dir=run_dir, config=config, config_cid=run_dir.store.put_json(config.to_json()),
        model=build_model(config.model, config.seed),
        eval_batches=eval_batches(held_out, seed=config.seed, count=config.data.eval_batches,
                                  batch_size=config.inner.batch_size, block_size=config.model.block_size),
        eval_tokens=held_out, shard_digests=list(dataset.shard_digests),
        downlink=(DownlinkCompressor(AdaptiveRankPolicy(config.compression.downlink(config.rounds.expected_workers)))
                  if config.compression.enabled else None),
    )


def _genesis(run_dir: RunDir, config: RunConfig) -> Run:
    # Pin the corpus bytes (or the prepared tokens' index) into the run's identity, so every worker
    # must train on the same tokens.
    config, dataset = pin_dataset(config, run_dir.store)
    # θ⁽⁰⁾ from existing weights when the config names them, checked against the CID it pins.
    config, init = pin_init(config)
    parts = _prepared(run_dir, config, dataset)
    store, model = run_dir.store, parts["model"]
    if init is not None:
        load_params(model, init)
    # θ⁽⁰⁾ held once, as views of the bytes served (as open_run's served_once makes them on a resume),
    # and m⁽⁰⁾'s bytes stored a tensor at a time: genesis needs no more than a round's close does.
    params, payload = _served_params(model)
    momentum = zero_momentum(params)
    params_cid = store.put(payload)
    losses = evaluate_batches(model, parts["eval_batches"])
    manifest = Manifest(
        run_id=config.run_id, round=0, parent=None, config=str(parts["config_cid"]),
        params=str(params_cid), outer_state=str(store.put_chunks(params_chunks(outer_state_of(momentum)))),
        participants=(), dropped=(), eval_loss_e6=to_e6(sum(losses) / len(losses)),
        bytes_up=0, bytes_down=0,
    )
    manifest_cid = manifest.store(store)
    run_dir.set_head(manifest_cid)
    summary = RoundSummary.of(manifest_cid, manifest)
    run_dir.log_round(dataclasses.asdict(summary))
    log.info("run %s: genesis %s (config %s)", config.run_id, manifest_cid, parts["config_cid"])
    return Run(**parts, global_state=GlobalState(0, params, momentum, payload, params_cid, manifest_cid,
                                                 manifest.eval_loss_e6,
                                                 eval_losses_e6=tuple(to_e6(x) for x in losses)),
               manifests={0: (manifest_cid, manifest)}, summaries=[summary])


def _served_params(model: torch.nn.Module) -> tuple[Params, bytes | bytearray]:
    """(θ, θ's bytes) of ``model``: θ as views of the bytes, the model bound to them (its own
    tensors dropped), where the layout allows; else a copy of θ and its serialisation."""
    own = {name: p.detach() for name, p in model.named_parameters()}
    layout = layout_of(own)
    if not streamable(layout):
        params = params_of(model)
        return params, encode_params(params)
    into = ParamsPayload(layout)
    params = {name: into.put(name, own.pop(name)) for name in sorted(layout)}
    bind_params(model, params)
    return params, into.payload()


def _resume(run_dir: RunDir, head: CID, config: RunConfig | None) -> Run:
    store = run_dir.store
    chain = lineage(store, head)  # re-hashes every manifest back to genesis
    tip_cid, tip = chain[-1]
    stored = RunConfig.from_json(store.get_json(tip.config))
    # A config given on resume must be the run's own; its corpus digest may be left for us to fill.
    pinned = config and config.replace(data=dataclasses.replace(config.data, corpus_sha256=stored.data.corpus_sha256,
                                                                tokens_cid=stored.data.tokens_cid))
    if pinned is not None and pinned.cid != stored.cid:
        raise ConfigError(
            f"{run_dir.path} holds run {stored.run_id!r} with config {tip.config}; the given "
            f"configuration differs ({pinned.cid}). Resume without --config, or use a new run directory"
        )
    parts = _prepared(run_dir, stored)
    # HEAD's checkpoint: stored, or rebuilt from the newest full one (trainer.runstore.checkpoints).
    with Progress(f"resuming at round {tip.round}: its checkpoint", unit="rounds", final_if_shown=True) as progress:
        outer = checkpoint_at(store, chain, tip.round, stored, progress)
    payload = outer.params_bytes()
    params = outer.params
    downlink = None
    if tip.downlink is not None:
        header = canonical_json(store.get_json(tip.downlink.header))
        downlink = CompressedGlobal(store.get(tip.downlink.payload), header, chain[-2][1].params)
    load_params(parts["model"], params)
    # The tip's per-batch losses are not stored: evaluated once more here, for the workers' shared
    # check (trainer.data.shared_eval). e carries on from the stored outer state; the rank policy's
    # window starts afresh.
    losses = tuple(to_e6(x) for x in evaluate_batches(parts["model"], parts["eval_batches"]))
    state = GlobalState(tip.round, params, outer.momentum, payload, CID.parse(tip.params), tip_cid,
                        tip.eval_loss_e6, downlink, outer.downlink_error, losses)
    log.info("run %s: resumed at round %d from %s", stored.run_id, tip.round, tip_cid)
    return Run(**parts, global_state=state, manifests={m.round: (cid, m) for cid, m in chain},
               summaries=[RoundSummary.of(cid, m) for cid, m in chain])
