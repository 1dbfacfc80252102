"""Run configuration: everything that determines what a run computes, and nothing else.

A run is identified by its configuration's content identifier (the CID of its canonical JSON), so
two processes agree on what they train exactly when they hold byte-identical configurations. Local
process settings (ports, directories, thread counts) are command-line options, not configuration,
because they do not change the numbers a run produces.

Canonical JSON refuses floats (their text forms differ across languages), so float fields travel
as their shortest round-trip decimal strings (``repr``): ``0.0004`` becomes ``"0.0004"``.

Each field is described once, where it is declared (trainer.config_fields): its choices by a
``Literal`` type, its help and accepted range in its metadata. The checks of each field on its own,
the reading of ``--set`` values and the field list of ``dilocox config --help`` are derived from the
declarations; ``_validate`` adds the relations between fields.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Sequence, TypeVar, get_args, get_type_hints

from storage_client import CID, Codec, DilocoxError, InvalidCIDError, canonical_json, digest_json, strict_json
from trainer.codec import CODEC_LOWRANK, CompressionConfig
from trainer.config_fields import Range, choice_refusal, choices_of, setting

SCHEMA = "dilocox.config/v1"
# The longest chain of a worker's contributions (audit.replay) the audit can decide when it replays it
# in its own kernels rather than the worker's: its fallback tolerance is measured up to this chain
# position and no further (audit.replay_env.FALLBACK_MEASURED; docs/verification.md "Replay
# tolerance"). rounds.state_every may not exceed it, and the audit fails a run whose chain does.
REPLAY_HORIZON = 5
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

# The values of model.family: the built-in GPT (trainer.model.gpt) and the decoder families built from
# Hugging Face ``transformers`` classes (trainer.model.hf), from the configuration alone.
ModelFamily = Literal["gpt", "llama", "qwen2"]
# transformers' RoPE variants whose frequencies depend on the configuration alone, and that
# transformers 4.4x and 5.x compute alike from the exported config.json
# (trainer.model.hf.rope_parameters). Not here: "dynamic" and "longrope", whose frequencies change with
# the length of the sequence at inference (a model trained on block_size tokens would be evaluated
# with other frequencies past its original context).
RopeType = Literal["default", "linear", "llama3", "yarn"]
# Where an overlapped worker starts its next round (trainer.worker.loops states both rules).
OverlapStart = Literal["delayed", "eager"]
# The inner optimisers of inner.optimizer: AdamW on every parameter (trainer.runtime.inner), or Muon on
# the blocks' matrices with AdamW on the rest (trainer.runtime.muon states both updates).
InnerOptimizer = Literal["adamw", "muon"]
# The robust means of rounds.aggregator (trainer.rounds.aggregation.aggregate states each rule).
Aggregator = Literal["mean", "trimmed_mean", "median"]
# How the inner states a worker commits to reach an auditor (rounds.state_reveal): "upload", with a
# push once per window of rounds.state_every rounds (trainer.runtime.state_commit); "on_challenge",
# never with a push: each worker keeps them on its own disk for rounds.reveal_rounds rounds and
# reveals one when an auditor asks for it by CID (trainer.worker.retention, audit.reveal).
StateReveal = Literal["upload", "on_challenge"]
MODEL_FAMILIES: tuple[str, ...] = get_args(ModelFamily)
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)
OVERLAP_STARTS: tuple[str, ...] = get_args(OverlapStart)
AGGREGATORS: tuple[str, ...] = get_args(Aggregator)
STATE_REVEALS: tuple[str, ...] = get_args(StateReveal)
INNER_OPTIMIZERS: tuple[str, ...] = get_args(InnerOptimizer)
# The families whose attention uses rotary position embeddings (head_dim must be even).
ROPE_FAMILIES = ("llama", "qwen2")


def _hf_option(default: Any, help: str, accepted: Range | None = None, rope_types: tuple[str, ...] = ()) -> Any:
    """A model field added with the HF families, left out of the JSON at its default: the GPT needs
    the default; a RoPE field (``rope_types``: the RoPE types that read it) keeps its default under
    the other types (a setting that would be ignored is a mistake, not a no-op)."""
    extra = {"rope_types": rope_types} if rope_types else {}
    return setting(default, help, accepted, omitted_at_default=True, **extra)


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: the built-in nanoGPT-style GPT (``family="gpt"``, the default,
    which trains on 2 CPU cores), or a Llama or Qwen2 architecture of the given sizes.

    The HF families map onto their ``transformers`` configurations as n_embd -> hidden_size,
    n_layer -> num_hidden_layers, n_head -> num_attention_heads, n_kv_head -> num_key_value_heads,
    block_size -> max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings,
    attention_bias, head_size -> head_dim, rope_type and rope_<field> -> rope_parameters[<field>]
    (trainer.model.hf.hf_config). The model has at most MAX_PARAMETERS (1e10) parameters in all
    (estimated_parameters).
    """

    family: ModelFamily = setting("gpt", "the architecture: the built-in GPT, or a transformers family",
                                  unsupported="")
    vocab_size: int = setting(256, "tokens in the vocabulary; 256 is the byte-level tokenizer (no vocabulary "
                                   "file, no download)", Range(256, 262_144))
    block_size: int = setting(64, "tokens of context", Range(2, 16_384))
    n_layer: int = setting(2, "transformer blocks", Range(1, 256))
    n_head: int = setting(4, "attention heads", Range(1, 256))
    n_embd: int = setting(128, "width, a multiple of n_head (n_embd / n_head even for the RoPE families)",
                          Range(1, 16_384))
    n_kv_head: int = setting(0, "key/value heads of the HF families (grouped-query attention), dividing n_head; "
                                "0 = n_head (the GPT: 0)", Range(0, 256))
    intermediate_size: int = setting(0, "MLP width of the HF families; 0 = derived from n_embd "
                                        "(ModelConfig.mlp_width; the GPT's is 4 n_embd: 0)", Range(0, 1 << 20))
    rope_theta: float = setting(10000.0, "base of the HF families' rotary position embeddings (the GPT: 10000)",
                                Range(1.0, 1e9))
    rms_norm_eps: float = setting(1e-6, "epsilon of the HF families' RMSNorm (Llama 2 and 3: 1e-5; the GPT's "
                                        "LayerNorm has its own: 1e-6 there)", Range(1e-12, 0.01))
    # The fields below are left out of the JSON while at their defaults. Up to init_from, the HF
    # families' options, which map onto the transformers configuration under their own names
    # (trainer.model.hf.hf_config); the GPT needs each at its default.
    tie_word_embeddings: bool = _hf_option(False, "the output head is the input embedding (one tensor, "
                                                  "model.embed_tokens.weight), as in Qwen2-0.5B")
    attention_bias: bool = _hf_option(False, "Llama: biases on the q, k, v and o projections (Qwen2's q, k, v "
                                             "biases are fixed by its class, and it has none on o: false there)")
    head_size: int = _hf_option(0, "Llama: the attention head dimension (head_dim), even; 0 = n_embd / n_head "
                                   "(transformers' Qwen2Config has no head_dim)", Range(0, 1024))
    # RoPE scaling, as transformers defines it (modeling_rope_utils): the type, and the fields it reads.
    rope_type: RopeType = setting("default", "RoPE scaling, as transformers' rope_type", omitted_at_default=True,
                                  unsupported="dynamic and longrope change the frequencies with the sequence's length")
    rope_factor: float = _hf_option(1.0, "RoPE scaling factor", Range(1.0, 1e4), ("linear", "llama3", "yarn"))
    rope_original_max_position_embeddings: int = _hf_option(
        0, "the pretraining context, > 0 for llama3 and yarn", Range(0, 1 << 24), ("llama3", "yarn"))
    rope_low_freq_factor: float = _hf_option(1.0, "llama3's low-frequency factor", Range(0.0, 1e4, low_open=True),
                                             ("llama3",))
    rope_high_freq_factor: float = _hf_option(4.0, "llama3's high-frequency factor, > rope_low_freq_factor",
                                              Range(0.0, 1e4, low_open=True), ("llama3",))
    rope_beta_fast: float = _hf_option(32.0, "yarn's beta_fast, > rope_beta_slow", Range(0.0, 1e4, low_open=True),
                                       ("yarn",))
    rope_beta_slow: float = _hf_option(1.0, "yarn's beta_slow", Range(0.0, 1e4, low_open=True), ("yarn",))
    rope_attention_factor: float = _hf_option(0.0, "yarn's scale of cos and sin; 0 = transformers' default, "
                                                   "0.1 ln(rope_factor) + 1", Range(0.0, 100.0), ("yarn",))
    # θ⁽⁰⁾ from existing weights (trainer.model.init_weights; `dilocox config --init-from DIR`): the folder
    # is read by the coordinator at genesis only; the CID of those weights as the run encodes θ⁽⁰⁾
    # (trainer.codec.wire) is checked by every party: the coordinator before genesis, each worker on the
    # θ⁽⁰⁾ it is sent, the audit on the genesis checkpoint. "" and "": θ⁽⁰⁾ is built from the seed.
    init_from: str = _hf_option("", "a folder holding config.json and model.safetensors: θ(0)'s weights")
    init_params: str = _hf_option("", "the CID of those weights as the run encodes θ(0)")

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head when it is 0."""
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        """The attention head dimension: head_size, or n_embd / n_head when it is 0."""
        return self.head_size or self.n_embd // self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: 4 n_embd for the GPT; for the gated (SwiGLU) MLP of the HF
        families intermediate_size, or when 0 the width with about the parameters of a 4 n_embd
        MLP, 8 n_embd / 3, rounded up to a multiple of 32 (as Llama rounds up to a multiple)."""
        if self.family == "gpt":
            return 4 * self.n_embd
        return self.intermediate_size or 32 * math.ceil(8 * self.n_embd / (3 * 32))


# The model fields that only some RoPE types read, with their defaults and those types (from the
# fields' declarations): each must keep its default under the other types.
ROPE_TYPE_FIELDS: dict[str, tuple[Any, tuple[str, ...]]] = {
    f.name: (f.default, f.metadata["rope_types"]) for f in fields(ModelConfig) if "rope_types" in f.metadata}


@dataclass(frozen=True)
class InnerConfig:
    """Inner optimiser, run by every worker for ``steps`` (H) steps a round: AdamW, or Muon on the
    blocks' matrices with AdamW on the rest (``optimizer``; trainer.runtime.muon).

    Defaults follow the DiLoCo lineage: lr 4e-4, weight decay 0.1, betas (0.9, 0.95).
    """

    steps: int = setting(50, "inner steps (H) a round", Range(1, 1_000_000))
    batch_size: int = setting(16, "sequences a step", Range(1, 4096))
    lr: float = setting(4e-4, "AdamW learning rate (of every parameter Muon does not train)", Range(0.0, 10.0, low_open=True))
    weight_decay: float = setting(0.1, "AdamW weight decay", Range(0.0, 10.0))
    beta1: float = setting(0.9, "AdamW beta1", Range(0.0, 1.0, high_open=True))
    beta2: float = setting(0.95, "AdamW beta2", Range(0.0, 1.0, high_open=True))
    grad_clip: float = setting(1.0, "max global gradient norm; 0 disables clipping", Range(0.0, 1e6))
    # DiLoCoX's adaptive H: H_r falls with the downlink's rank (trainer.rounds.schedule.inner_steps_for_round
    # has the rule); it needs compression with the low-rank codec.
    adaptive_steps: bool = setting(False, "round r trains H_r steps, falling with the downlink's rank")
    min_steps: int = setting(1, "the floor of H_r when adaptive_steps is on, <= steps", Range(1, 1_000_000))
    # Left out of the JSON at their defaults (added after runs existed: their CIDs stay).
    optimizer: InnerOptimizer = setting("adamw", "the inner optimiser: AdamW, or Muon on the blocks' matrices",
                                        omitted_at_default=True)
    muon_lr: float = setting(8e-4, "Muon's learning rate (its update scaled to AdamW's RMS); the rest take lr",
                             Range(0.0, 10.0, low_open=True), omitted_at_default=True)
    muon_momentum: float = setting(0.95, "Muon's Nesterov momentum", Range(0.0, 1.0, high_open=True),
                                   omitted_at_default=True)


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimiser (SGD with Nesterov momentum on the averaged pseudo-gradient).

    Defaults follow DiLoCo: lr 0.7, momentum 0.9, Nesterov.
    """

    lr: float = setting(0.7, "outer SGD learning rate", Range(0.0, 10.0, low_open=True))
    momentum: float = setting(0.9, "outer SGD momentum", Range(0.0, 1.0, high_open=True))
    nesterov: bool = setting(True, "Nesterov momentum")


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are split.

    ``corpus`` is ``"embedded"`` (a corpus the project generates from the run seed) or a path to a
    UTF-8 text file readable by every process. ``corpus_sha256`` pins the bytes; it is filled in by
    :func:`trainer.data.corpus.load_corpus` when a run is created, and checked by every worker.

    ``tokens``, when set, replaces ``corpus``: a directory written by ``dilocox data prepare``
    (flat token files and their index, :mod:`trainer.data.dataset`), the same path on every process.
    ``tokens_cid`` pins its index (filled in when the run is created); its split is the prepared
    one, so ``eval_fraction`` does not apply.
    """

    corpus: str = setting("embedded", "\"embedded\" (generated from the seed) or a UTF-8 text file")
    corpus_sha256: str = setting("", "the corpus's sha256 (pinned when the run is created)")
    tokens: str = setting("", "a directory written by `dilocox data prepare`; \"\" = `corpus` as byte tokens")
    tokens_cid: str = setting("", "CID of that directory's index.json (pinned when the run is created)")
    eval_fraction: float = setting(0.1, "the tail of the corpus held out for evaluation",
                                   Range(0.0, 0.5, low_open=True))
    # eval_batches x batch_size x block_size is at most MAX_EVAL_TOKENS (2^24): the held-out
    # batches are kept in memory by every process.
    eval_batches: int = setting(8, "held-out batches of inner.batch_size", Range(1, 10_000))


@dataclass(frozen=True)
class RoundConfig:
    """How rounds open and close.

    A round closes as soon as ``quorum`` updates are accepted and every live worker has delivered,
    or ``straggler_timeout_s`` after its first accepted update, with whatever was accepted by then.
    A worker silent for ``liveness_timeout_s`` is no longer waited for.
    """

    rounds: int = setting(5, "outer rounds", Range(1, 1_000_000))
    expected_workers: int = setting(2, "workers, and data shards", Range(1, 1024))
    quorum: int = setting(2, "accepted updates that close a round, <= expected_workers", Range(1, 1024))
    straggler_timeout_s: float = setting(60.0, "seconds a round waits after its first accepted update",
                                         Range(0.1, 86_400.0))
    heartbeat_interval_s: float = setting(1.0, "seconds between a worker's heartbeats", Range(0.05, 60.0))
    liveness_timeout_s: float = setting(6.0, "seconds of silence after which a worker is not waited for, "
                                             "> heartbeat_interval_s", Range(0.1, 3600.0))
    # An explicit bound must be at least inner.lr x sqrt(parameters): the norm of a single AdamW step
    # (every coordinate moves by about lr), so a smaller bound would refuse every honest update and no
    # round would ever close.
    max_update_norm: float = setting(0.0, "L2 bound on a pseudo-gradient; 0 derives it "
                                          "(trainer.rounds.aggregation.norm_bound)", Range(0.0, 1e12))
    # Staleness and outer momentum compound, so lower outer.momentum when turning this on
    # (docs/measurements.md has the figures; `dilocox bench overlap` measures them).
    overlap: bool = setting(False, "DiLoCoX's one-step-delay overlap of the exchange with the next round's "
                                   "compute (trainer.worker.loops)")
    # "delayed": the newest global state plus the worker's own last Δ; "eager" (Kale et al. 2025):
    # the newest global state moved by a proxy of the outer step still in flight (the step before it,
    # corrected by the worker's own change of Δ).
    overlap_start: OverlapStart = setting("delayed", "where an overlapped round starts")
    # Robust aggregation (trainer.rounds.aggregation.aggregate): each update is clipped to clip_multiple (c)
    # x the lower median of the round's update norms and the previous clip_history_rounds (K) rounds'.
    clip_multiple: float = setting(2.0, "c: updates are clipped to c x the median norm",
                                   Range(1.0, 100.0, off=0.0, off_means="no clipping", with_relations=True))
    clip_history_rounds: int = setting(2, "K: earlier rounds whose norms join the median",
                                       Range(0, 64, with_relations=True))
    # "trimmed_mean" drops the floor(trim_fraction x n) lowest and as many highest of the n values
    # and averages the rest; "median" is the lower median.
    aggregator: Aggregator = setting("mean", "robust mean of the clipped updates, coordinate by coordinate")
    trim_fraction: float = setting(0.2, "trimmed_mean's fraction trimmed at each end (none below n = "
                                        "1/trim_fraction)", Range(0, 0.5, high_open=True, with_relations=True))
    # trainer.coordinator.screening: the held-out batches are drawn privately each round.
    screen_margin: float = setting(0.0, "refuse an update that raises the loss of the round's start checkpoint "
                                        "by more than this many nats on held-out batches",
                                   Range(0, 100, low_open=True, off=0.0, off_means="no screening",
                                         with_relations=True))
    # Full parameters and outer state are stored for genesis, every round r with r % K == 0, and the
    # last round; a round in between is rebuilt from the newest full one before it by re-running the
    # later rounds' transitions from their manifests (trainer.runstore.checkpoints).
    checkpoint_every: int = setting(1, "K: rounds between stored full checkpoints", Range(1, 1_000_000))
    # On every round r with r % K == 0 each worker sends the inner state it commits to (AdamW, error
    # feedback) with its push, and the coordinator stores it by CID (trainer.runtime.state_commit),
    # so the audit's replay starts a worker's chain at most K rounds back (audit.replay). A run rule:
    # 1 <= K <= REPLAY_HORIZON, so that every chain is decidable even in the auditor's own kernels.
    # The default 4 is inside the horizon with room: at the 4th contribution of a chain the largest
    # honest distance measured across kernels is 9.1e-5, 550 times below the fallback tolerance
    # (at the 5th, 2.1e-3: 24 times), and it costs the demo one upload per worker in 8 rounds at
    # most twice (docs/verification.md gives the bytes). Left out of the JSON at the default, so a
    # configuration's CID did not move; a configuration written before the rule (which left 0, "never",
    # out) reads as 4, and the audit names the states such a run did not store.
    state_every: int = setting(4, "K: rounds between the inner states each worker uploads, so a replay needs at most "
                                  "K rounds of a worker's history (at most the replay horizon)",
                               Range(1, REPLAY_HORIZON), omitted_at_default=True)
    # "upload" is how runs made before reveals existed sent their states (a configuration without the
    # field reads so, and its audit is unchanged); DiLoCoX's default is "on_challenge": nothing but the
    # update crosses the wire in a round nobody challenges (docs/verification.md, "Revealed on challenge").
    state_reveal: StateReveal = setting("upload", "how committed inner states reach an auditor: pushed once per "
                                                  "rounds.state_every rounds, or kept by each worker and revealed "
                                                  "when challenged", omitted_at_default=True)
    # With on_challenge: a worker keeps the committed start state of each of its last R counted rounds
    # on its own disk (at most R states: R x three float32 copies of the model), so a contribution less
    # than R rounds behind the run's newest round can be challenged; an older one can be replayed only
    # from a state revealed within the window (its worker is not named for it).
    reveal_rounds: int = setting(16, "R: the newest rounds whose committed inner states each worker keeps to "
                                     "reveal when challenged", Range(1, 1_000_000), omitted_at_default=True)
    # How long an auditor waits for a challenged worker to reveal a committed state before it names the
    # worker (audit.reveal): a run rule, so every auditor of the run gives every worker the same time.
    reveal_deadline_s: float = setting(60.0, "seconds an auditor keeps asking a worker's reveal sources for a "
                                             "committed state before naming the worker", Range(0.1, 86_400.0),
                                       omitted_at_default=True)


# What the product runs: DiLoCoX. Each section's own defaults above are the plain building block
# (DiLoCo: dense, synchronous, outer lr 0.7 / momentum 0.9); a RunConfig's defaults, and a section
# a configuration file gives only in part, are DiLoCoX's: compression (adaptive low-rank + int4, both
# directions, error feedback), the one-step-delay overlap, and an outer step tuned for them. The
# values are the ablation's (benchmarks.ablation; the sweep that chose the outer step is in
# docs/ablation.md). `plain_diloco` is the one switch back. Its inner steps are AdamW: Muon
# (inner.optimizer) reaches dense DiLoCo's loss only at about 19x fewer bytes, and at DiLoCoX's
# 25x+ it is no better (README, "Against dense DiLoCo").
DILOCOX_OUTER = OuterConfig(lr=0.7, momentum=0.3)
DILOCO_OUTER = OuterConfig()
DILOCOX_COMPRESSION = CompressionConfig(enabled=True, target_energy=0.9, min_rank=16, max_rank=32,
                                        int4_group_size=128)
DILOCOX_ROUNDS = RoundConfig(overlap=True, overlap_start="delayed", state_reveal="on_challenge")


@dataclass(frozen=True)
class RunConfig:
    run_id: str = setting("dilocox", "the run's name, [A-Za-z0-9._-]{1,64}")
    seed: int = setting(1337, "seeds θ(0), the embedded corpus and every draw of the run", Range(0, 2**63 - 1))
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=lambda: DILOCOX_OUTER)
    data: DataConfig = field(default_factory=DataConfig)
    rounds: RoundConfig = field(default_factory=lambda: DILOCOX_ROUNDS)
    # Its fields declare their ranges (trainer.codec.CompressionConfig), checked here.
    compression: CompressionConfig = field(default_factory=lambda: DILOCOX_COMPRESSION)

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise ConfigError("invalid run configuration: " + "; ".join(problems))

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **_encode(self)}

    @classmethod
    def from_json(cls, obj: Any) -> RunConfig:
        if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
            raise ConfigError(f"not a run configuration: expected schema {SCHEMA!r}")
        body = {k: v for k, v in obj.items() if k != "schema"}
        return _decode(cls, body, "$")

    def canonical(self) -> bytes:
        return canonical_json(self.to_json())

    @property
    def cid(self) -> CID:
        return digest_json(self.to_json())

    def replace(self, **sections: Any) -> RunConfig:
        """Copy with some sections or top-level fields replaced (``model=..., seed=...``)."""
        return dataclasses.replace(self, **sections)

    def plain_diloco(self) -> RunConfig:
        """The same run as plain DiLoCo: dense fp32 updates, synchronous rounds, DiLoCo's outer
        step (``dilocox demo --diloco``, ``dilocox config --diloco``)."""
        return self.replace(compression=dataclasses.replace(self.compression, enabled=False),
                            rounds=dataclasses.replace(self.rounds, overlap=False), outer=DILOCO_OUTER)

    def with_settings(self, settings: Sequence[str]) -> RunConfig:
        """Copy with ``section.field=value`` (or ``field=value`` for a top-level field) settings
        applied in order, as ``--set`` gives them: each value is read as its field's type (true or
        false for a flag) and the result validated as a whole, with the setting named on error."""
        return RunConfig.from_json_with_settings(self.to_json(), settings)

    @classmethod
    def from_json_with_settings(cls, body: dict[str, Any], settings: Sequence[str]) -> RunConfig:
        """:meth:`with_settings` on a configuration's JSON form ``body`` (complete in its sections),
        validated once, after the settings: so a setting can mend a value the body alone would
        have refused (``dilocox config --model-config`` takes a model's context from its
        config.json, which ``--set model.block_size=...`` may lower into range)."""
        body = copy.deepcopy(body)  # the settings edit it in place
        for setting in settings:
            path, sep, text = setting.partition("=")
            names = path.strip().split(".")
            if not sep or not all(names):
                raise SettingError(f"--set {setting[:80]!r}: expected section.field=value")
            holder, kind = body, cls
            for depth, name in enumerate(names):
                hints = get_type_hints(kind)
                if name not in hints or name == "schema":
                    known = ", ".join(f.name for f in fields(kind))
                    raise SettingError(f"--set {path[:80]}: no field {name[:40]!r} in "
                                      f"{'.'.join(names[:depth]) or 'the run configuration'} (fields: {known})")
                kind = hints[name]
                if depth < len(names) - 1:
                    if not dataclasses.is_dataclass(kind):
                        raise SettingError(f"--set {path[:80]}: {name} is a value, not a section")
                    holder = holder[name]
            if dataclasses.is_dataclass(kind):
                raise SettingError(f"--set {path[:80]}: {names[-1]} is a section; name one of its fields")
            holder[names[-1]] = _setting_value(text.strip(), kind, path)
        try:
            return cls.from_json(body)
        except ConfigError as exc:
            if not settings:
                raise
            raise SettingError(f"--set {', '.join(settings)[:200]}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not JSON: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(strict_json(self.to_json(), indent=2, sort_keys=True) + "\n")


class ConfigError(DilocoxError, ValueError):
    """A configuration that cannot be used, with the field that is wrong."""


class SettingError(ConfigError):
    """A ``--set`` setting that does not name a field, does not parse, or leaves the configuration
    invalid (a usage error: the command line, not a file, is wrong)."""


T = TypeVar("T")


def _encode(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("omitted_at_default") and value == f.default:
            continue
        if dataclasses.is_dataclass(value):
            out[f.name] = _encode(value)
        elif isinstance(value, float):
            out[f.name] = repr(value)
        else:
            out[f.name] = value
    return out


def _decode(cls: type[T], obj: Any, path: str, base: T | None = None) -> T:
    """``obj`` as a ``cls``; a field it leaves out takes ``base``'s value (a RunConfig section: the
    RunConfig default's, so that a file naming one rounds field does not turn DiLoCoX off)."""
    if not isinstance(obj, dict):
        raise ConfigError(f"{path}: expected an object")
    hints = get_type_hints(cls)
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown field(s) {', '.join(unknown)}")
    kwargs: dict[str, Any] = {}
    if base is not None:  # a field left out at its default is that default, whatever the base holds
        kwargs.update({f.name: f.default for f in fields(cls)  # type: ignore[arg-type]
                       if f.metadata.get("omitted_at_default") and f.name not in obj})
    for name, value in obj.items():
        kind = hints[name]
        where = f"{path}.{name}"
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _decode(kind, value, where, getattr(cls(), name) if cls is RunConfig else None)
        elif kind is float:
            kwargs[name] = _number(value, where)
        elif kind is bool:
            kwargs[name] = _exact(value, bool, where)
        elif choices_of(kind) is not None:  # one of the choices, checked with the other fields
            kwargs[name] = _exact(value, str, where)
        else:
            kwargs[name] = _exact(value, kind, where)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def _setting_value(text: str, kind: type, path: str) -> Any:
    """A ``--set`` value as the JSON form of a field of type ``kind`` (floats travel as text)."""
    try:
        if kind is bool:
            flags = {"true": True, "false": False, "1": True, "0": False, "yes": True, "no": False,
                     "on": True, "off": False}
            return flags[text.lower()]
        if kind is int:
            return int(text)
        if kind is float:
            return repr(float(text))
    except (KeyError, ValueError):
        raise SettingError(f"--set {path[:80]}={text[:40]!r}: not a {kind.__name__}") from None
    return text


def _number(value: Any, where: str) -> float:
    """A float field as a person or a program writes it: a JSON number (``0.001``, ``3``) or the
    decimal text the canonical form uses (``"0.001"``, what ``dilocox config`` writes, so that the
    CID never depends on how a JSON library prints a float). Either way the value is the same float,
    so the same configuration has the same CID whichever way it was written."""
    if isinstance(value, str) and len(value) <= 64:
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(f"{where}: not a number: {value[:64]!r}") from None
    elif type(value) in (int, float):  # bool is an int subclass: a true/false here is a mistake
        number = float(value)
    else:
        shown = repr(value)[:64] if isinstance(value, str) else type(value).__name__
        raise ConfigError(f"{where}: expected a number, got {shown}")
    return number  # a non-finite value is refused with its range by the field's validation


def _exact(value: Any, kind: type, where: str) -> Any:
    # bool is an int subclass; a true/false where a count belongs is a mistake, not a 1/0.
    if type(value) is not kind:
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


# Held-out tokens (eval_batches x batch_size x block_size) the coordinator and every worker keep in
# memory, as int64 inputs and targets: 2^24 tokens is 256 MiB. The default is 8 x 16 x 64 = 8192.
MAX_EVAL_TOKENS = 1 << 24
# Parameters of the model (estimated_parameters; the default GPT has about 0.47M).
MAX_PARAMETERS = 10_000_000_000


def _numeric_fields(cfg: RunConfig) -> list[tuple[str, Any]]:
    """Every int and float field of the configuration, as ("section.field", value); bools excluded."""
    out: list[tuple[str, Any]] = []
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out += [(f"{f.name}.{g.name}", getattr(value, g.name)) for g in fields(value)]
        else:
            out.append((f.name, value))
    return [(name, v) for name, v in out if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _declarations(kind: type, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """Every field of a configuration section, nested sections walked, as ("section.field" or
    "field", its declaration, its type), in declaration order."""
    hints = get_type_hints(kind)
    out: list[tuple[str, dataclasses.Field[Any], Any]] = []
    for f in fields(kind):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _declarations(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((prefix + f.name, f, hints[f.name]))
    return out


_DECLARED = _declarations(RunConfig)
# The range of every numeric field checked on its own, by "section.field" (the ranges declared
# with_relations are checked with the relations between fields).
_RANGES: dict[str, Range] = {name: f.metadata["range"] for name, f, _ in _DECLARED
                             if "range" in f.metadata and not f.metadata["range"].with_relations}


def _value_at(cfg: RunConfig, name: str) -> Any:
    """The value of "section.field" (or "field") in ``cfg``."""
    value: Any = cfg
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _declared_problems(cfg: RunConfig) -> list[str]:
    """Each field against its own declaration: a choice field holds one of its choices, a numeric
    field is in its range; a NaN or infinity is refused in every float field."""
    problems: list[str] = []
    for name, f, kind in _DECLARED:
        value = _value_at(cfg, name)
        choices = choices_of(kind)
        if choices is not None:
            if value not in choices:
                problems.append(choice_refusal(name, value, choices, f.metadata.get("unsupported")))
            continue
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            continue
        accepted = f.metadata.get("range")
        if accepted is None or accepted.with_relations:
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{name} = {value!r} must be a finite number")
        elif not accepted.admits(value):
            problems.append(accepted.refusal(name, value))
    return problems


def fields_help() -> str:
    """Every setting of ``--set``, one a line: its name, type, the default of RunConfig(), the values
    it accepts and its help (the field list of ``dilocox config --help``)."""
    defaults = RunConfig()
    lines = []
    for name, f, kind in _DECLARED:
        choices = choices_of(kind)
        accepted = " | ".join(choices) if choices else f.metadata["range"].describe() if "range" in f.metadata else ""
        type_name = "choice" if choices else getattr(kind, "__name__", str(kind))
        default = _value_at(defaults, name)
        lines.append(f"  {name} ({type_name} = {default!r}{'; ' + accepted if accepted else ''}): "
                     f"{f.metadata.get('help', '')}")
    return "\n".join(lines)


def estimated_parameters(m: ModelConfig) -> int:
    """The model's parameter count, from its fields; exact (tests compare it with the built model).

    With d = n_embd, V = vocab_size, L = n_layer, q = n_head x head_dim, kv = kv_heads x head_dim
    and I = mlp_width; E = 2 V d for untied input and output embeddings, V d when tied:

        gpt:    2 V d + block_size d (learned positions) + L (12 d^2 + 13 d) + 2 d (final LayerNorm)
        llama:  E + L (2 d q + 2 d kv + 3 d I + 2 d) + d                 (RMSNorm weights)
                + L (q + 2 kv + d) with attention_bias                   (q, k, v, o projection biases)
        qwen2:  llama's + L (q + 2 kv)                                    (q, k, v projection biases)
    """
    d, vocab = m.n_embd, m.vocab_size
    if m.family == "gpt":
        return 2 * vocab * d + m.block_size * d + m.n_layer * (12 * d * d + 13 * d) + 2 * d
    if m.family not in ROPE_FAMILIES:
        raise ConfigError(choice_refusal("model.family", m.family, MODEL_FAMILIES, unsupported=""))
    q, kv = m.n_head * m.head_dim, m.kv_heads * m.head_dim
    layer = 2 * d * q + 2 * d * kv + 3 * d * m.mlp_width + 2 * d
    if m.family == "qwen2" or m.attention_bias:
        layer += q + 2 * kv + (d if m.attention_bias else 0)
    return (1 if m.tie_word_embeddings else 2) * vocab * d + m.n_layer * layer + d


# The model fields only the HF families read, with the value the GPT needs (its default).
_HF_ONLY_FIELDS = ("n_kv_head", "intermediate_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
                   "attention_bias", "head_size", "rope_type", *ROPE_TYPE_FIELDS)


def _model_problems(m: ModelConfig) -> list[str]:
    """The model section's relations (its fields each in range already)."""
    if not m.head_size and m.n_embd % m.n_head != 0:
        return [f"model.n_embd must be divisible by model.n_head (n_embd {m.n_embd}, n_head {m.n_head})"]
    problems = _init_problems(m)
    defaults = {f.name: f.default for f in fields(ModelConfig)}
    if m.family == "gpt":
        # The GPT has multi-head attention, a 4x MLP, learned positions and untied LayerNorm-ed
        # embeddings: these would be ignored.
        for name in _HF_ONLY_FIELDS:
            value, default = getattr(m, name), defaults[name]
            if value != default:
                problems.append(f"model.{name} = {value!r} applies to the {', '.join(ROPE_FAMILIES)} families only; "
                                f"the gpt family needs {default!r}")
        return problems
    if m.n_head % m.kv_heads != 0:
        problems.append(f"model.n_head = {m.n_head} must be a multiple of model.n_kv_head = {m.n_kv_head} "
                        f"(each key/value head serves n_head / n_kv_head query heads)")
    if m.head_dim % 2:
        problems.append(f"model.head_size, or model.n_embd / model.n_head when it is 0, = {m.head_dim} (the head "
                        f"dimension) must be even: rotary position embeddings rotate pairs of coordinates")
    if m.family == "qwen2":
        if m.attention_bias:
            problems.append("model.attention_bias applies to the llama family: qwen2's q, k, v biases are fixed by "
                            "its transformers class (and o has none)")
        if m.head_size and m.head_size != m.n_embd // m.n_head:
            problems.append(f"model.head_size = {m.head_size} applies to the llama family: transformers' Qwen2Config "
                            f"has no head_dim (its attention uses n_embd / n_head)")
    return problems + _rope_problems(m, defaults)


def _rope_problems(m: ModelConfig, defaults: dict[str, Any]) -> list[str]:
    """The fields the RoPE type reads (ROPE_TYPE_FIELDS), and the others at their defaults."""
    problems = []
    for name, (default, types) in ROPE_TYPE_FIELDS.items():
        if m.rope_type not in types and getattr(m, name) != default:
            problems.append(f"model.{name} = {getattr(m, name)!r} applies to rope_type {' or '.join(types)} only; "
                            f"rope_type {m.rope_type!r} needs {default!r}")
    if m.rope_type in ("llama3", "yarn") and m.rope_original_max_position_embeddings == 0:
        problems.append(f"model.rope_type {m.rope_type!r} needs model.rope_original_max_position_embeddings "
                        f"(the pretraining context)")
    if m.rope_type == "llama3" and not m.rope_high_freq_factor > m.rope_low_freq_factor:
        problems.append(f"model.rope_high_freq_factor = {m.rope_high_freq_factor!r} must exceed "
                        f"model.rope_low_freq_factor = {m.rope_low_freq_factor!r}")
    if m.rope_type == "yarn" and not m.rope_beta_fast > m.rope_beta_slow:
        problems.append(f"model.rope_beta_fast = {m.rope_beta_fast!r} must exceed model.rope_beta_slow = "
                        f"{m.rope_beta_slow!r}")
    return problems


def _pinned_folder_problems(path_name: str, path: Any, cid_name: str, cid: Any, codec: Codec, pinned: str,
                            folder: str) -> list[str]:
    """A folder path field and the CID field that pins what it holds (or ""): a bounded path, a CID
    of ``codec`` (what it pins: ``pinned``), set only with the path (``folder`` says what it is)."""
    problems = []
    if not isinstance(path, str) or len(path) > 4096 or "\x00" in path:
        problems.append(f"{path_name} must be a directory path of at most 4096 characters")
    if not isinstance(cid, str) or len(cid) > 128:
        problems.append(f"{cid_name} must be a CID of at most 128 characters")
    elif cid:
        try:
            if CID.parse(cid).codec != codec:
                problems.append(f"{cid_name} must be the CID of {pinned} (codec {codec.name.lower()})")
        except InvalidCIDError:
            problems.append(f"{cid_name} is not a CID")
        if not path:
            problems.append(f"{cid_name} is set but {path_name} ({folder}) is not")
    return problems


def _init_problems(m: ModelConfig) -> list[str]:
    """model.init_from (a bounded path) and model.init_params (a RAW CID, with init_from)."""
    return _pinned_folder_problems("model.init_from", m.init_from, "model.init_params", m.init_params, Codec.RAW,
                                   "θ⁽⁰⁾'s bytes", "the weights' folder")


def _data_problems(cfg: RunConfig) -> list[str]:
    """The prepared-token fields: a bounded path, and a JSON-codec CID (or "")."""
    d = cfg.data
    return _pinned_folder_problems("data.tokens", d.tokens, "data.tokens_cid", d.tokens_cid, Codec.JSON,
                                   "a JSON index", "the prepared directory")


def _validate(cfg: RunConfig) -> list[str]:
    problems: list[str] = []
    if not (isinstance(cfg.run_id, str) and _RUN_ID.match(cfg.run_id)):
        problems.append(f"run_id {cfg.run_id!r} must match [A-Za-z0-9._-]{{1,64}}")
    problems += _declared_problems(cfg)
    if problems:  # the relations below assume every field is a finite number in its range
        return problems
    m, i, r, c = cfg.model, cfg.inner, cfg.rounds, cfg.compression
    problems += _model_problems(m)
    if problems:  # the parameter count below needs a well-formed model
        return problems
    n_params = estimated_parameters(m)
    if n_params > MAX_PARAMETERS:
        problems.append(f"model has about {n_params:,} parameters; at most {MAX_PARAMETERS:,} are supported "
                        f"(lower model.n_layer, n_embd or vocab_size)")
    eval_tokens = cfg.data.eval_batches * i.batch_size * m.block_size
    if eval_tokens > MAX_EVAL_TOKENS:
        problems.append(f"data.eval_batches = {cfg.data.eval_batches} holds {eval_tokens:,} held-out tokens "
                        f"(eval_batches x inner.batch_size x model.block_size); at most {MAX_EVAL_TOKENS:,}")
    problems += _data_problems(cfg)
    if not i.min_steps <= i.steps:
        problems.append(f"inner.min_steps = {i.min_steps} must not exceed inner.steps = {i.steps}")
    if i.adaptive_steps and not (c.enabled and c.codec == CODEC_LOWRANK):
        problems.append(f"inner.adaptive_steps follows the downlink's rank: it needs compression.enabled with "
                        f"compression.codec = {CODEC_LOWRANK!r}")
    if not r.quorum <= r.expected_workers:
        problems.append(f"rounds.quorum = {r.quorum} must be in [1, expected_workers = {r.expected_workers}]")
    if not r.liveness_timeout_s > r.heartbeat_interval_s:
        problems.append(f"rounds.liveness_timeout_s = {r.liveness_timeout_s!r} must exceed "
                        f"rounds.heartbeat_interval_s = {r.heartbeat_interval_s!r}")
    if r.max_update_norm > 0:
        # One AdamW step moves every coordinate by about lr (exactly lr on the first step, where
        # m/sqrt(v) = sign(g)), so an honest pseudo-gradient has a norm around lr x sqrt(P) or more;
        # an explicit bound below that refuses every update and no round would ever close.
        floor = i.lr * math.sqrt(n_params)
        if r.max_update_norm < floor:
            problems.append(f"rounds.max_update_norm = {r.max_update_norm!r} is below {floor:.4g}, the norm of one "
                            f"inner step (inner.lr x sqrt(parameters)): every update would be refused; "
                            f"use 0 to derive the bound")
    if not c.min_rank <= c.max_rank:
        problems.append(f"compression.min_rank = {c.min_rank} must not exceed compression.max_rank = {c.max_rank}")
    for name, f, _ in _DECLARED:  # the ranges declared with_relations, each field finite by now
        accepted, value = f.metadata.get("range"), _value_at(cfg, name)
        if accepted is not None and accepted.with_relations and not accepted.admits(value):
            problems.append(accepted.refusal(name, value))
    return problems


def demo_config() -> RunConfig:
    """The embedded default of ``dilocox demo``: 2 workers, 8 rounds, on the generated corpus.

    The inner learning rate is raised above the DiLoCo default because a tiny model over a few
    hundred inner steps is far from the regime that default was tuned for.
    """
    return RunConfig(
        run_id="demo",
        inner=InnerConfig(steps=50, batch_size=16, lr=2e-3),
        rounds=dataclasses.replace(DILOCOX_ROUNDS, rounds=8, expected_workers=2, quorum=2),
    )
