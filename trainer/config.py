"""Run configuration: everything that determines what a run computes, and nothing else.

A run is identified by its configuration's content identifier (the CID of its canonical JSON), so
two processes agree on what they train exactly when they hold byte-identical configurations. Local
process settings (ports, directories, thread counts) are command-line options, not configuration,
because they do not change the numbers a run produces.

Canonical JSON refuses floats (their text forms differ across languages), so float fields travel
as their shortest round-trip decimal strings (``repr``): ``0.0004`` becomes ``"0.0004"``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence, TypeVar, get_type_hints

from storage_client import CID, Codec, InvalidCIDError, canonical_json, digest_json, strict_json
from trainer.codec import CODEC_LOWRANK, CompressionConfig

SCHEMA = "dilocox.config/v1"
# The values of rounds.aggregator (trainer.aggregation.aggregate states each rule).
AGGREGATORS = ("mean", "trimmed_mean", "median")
# The values of rounds.overlap_start: where an overlapped worker starts its next round
# (trainer.worker.loops states both rules).
OVERLAP_STARTS = ("delayed", "eager")
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


# The values of model.family: the built-in GPT (trainer.model) and the decoder families built from
# Hugging Face ``transformers`` classes (trainer.hf_model), from the configuration alone.
MODEL_FAMILIES = ("gpt", "llama", "qwen2")
# The families whose attention uses rotary position embeddings (head_dim must be even).
ROPE_FAMILIES = ("llama", "qwen2")
# The values of model.rope_type: transformers' RoPE variants whose frequencies depend on the
# configuration alone, and that transformers 4.4x and 5.x compute alike from the exported config.json
# (trainer.hf_model.rope_parameters). Not here: "dynamic" and "longrope", whose frequencies change with
# the length of the sequence at inference (a model trained on block_size tokens would be evaluated
# with other frequencies past its original context).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The model fields that only some RoPE types read, with their defaults: each must keep its default
# under the other types (a setting that would be ignored is a mistake, not a no-op).
ROPE_TYPE_FIELDS = {
    "rope_factor": (1.0, ("linear", "llama3", "yarn")),
    "rope_original_max_position_embeddings": (0, ("llama3", "yarn")),
    "rope_low_freq_factor": (1.0, ("llama3",)),
    "rope_high_freq_factor": (4.0, ("llama3",)),
    "rope_beta_fast": (32.0, ("yarn",)),
    "rope_beta_slow": (1.0, ("yarn",)),
    "rope_attention_factor": (0.0, ("yarn",)),
}
# Fields left out of the configuration's JSON while they hold their default (dataclass field
# metadata): added after runs existed, they keep the CIDs of configurations that do not use them.
OMITTED_AT_DEFAULT = {"omitted_at_default": True}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: the built-in nanoGPT-style GPT (``family="gpt"``, the default,
    which trains on 2 CPU cores), or a Llama or Qwen2 architecture of the given sizes.

    The HF families map onto their ``transformers`` configurations as n_embd -> hidden_size,
    n_layer -> num_hidden_layers, n_head -> num_attention_heads, n_kv_head -> num_key_value_heads,
    block_size -> max_position_embeddings, rope_theta, rms_norm_eps, tie_word_embeddings,
    attention_bias, head_size -> head_dim, rope_type and rope_<field> -> rope_parameters[<field>]
    (trainer.hf_model.hf_config).
    """

    family: str = "gpt"  # one of MODEL_FAMILIES
    vocab_size: int = 256  # [256, 262144]; byte-level tokenizer (256 tokens): no vocabulary file, no download
    block_size: int = 64  # [2, 16384] tokens of context
    n_layer: int = 2  # [1, 256]
    n_head: int = 4  # [1, 256]
    n_embd: int = 128  # [1, 16384], a multiple of n_head; n_embd / n_head even for the RoPE families
    # [0, 256]: key/value heads (grouped-query attention) of the HF families, dividing n_head;
    # 0 = n_head (plain multi-head attention). The GPT has no such choice: 0 there.
    n_kv_head: int = 0
    # [0, 1048576]: MLP width of the HF families; 0 = derived from n_embd (ModelConfig.mlp_width).
    # The GPT's MLP is 4 x n_embd: 0 there.
    intermediate_size: int = 0
    # [1, 1e9]: base of the rotary position embeddings of the HF families; 10000 (the default) for the GPT.
    rope_theta: float = 10000.0
    # [1e-12, 0.01]: epsilon of the HF families' RMSNorm (Llama 2 and 3 use 1e-5); the GPT's
    # LayerNorm has its own (1e-5): the default (1e-6) there.
    rms_norm_eps: float = 1e-6
    # and at most MAX_PARAMETERS (1e10) parameters in all (estimated_parameters)

    # The fields below are left out of the JSON while at their defaults (OMITTED_AT_DEFAULT). Up to
    # init_from, the HF families' options, which map onto the transformers configuration under their
    # own names (trainer.hf_model.hf_config); the GPT needs each at its default.
    # The output head is the input embedding (one tensor, model.embed_tokens.weight), as in Qwen2-0.5B.
    tie_word_embeddings: bool = field(default=False, metadata=OMITTED_AT_DEFAULT)
    # Llama: biases on the q, k, v and o projections. Qwen2's q, k, v biases are fixed by its class
    # (and it has none on o): false there.
    attention_bias: bool = field(default=False, metadata=OMITTED_AT_DEFAULT)
    # [0, 1024], even: the attention head dimension (transformers' head_dim); 0 = n_embd / n_head.
    # Llama only: transformers' Qwen2Config has no head_dim (its attention uses n_embd / n_head).
    head_size: int = field(default=0, metadata=OMITTED_AT_DEFAULT)
    # RoPE scaling, as transformers defines it (modeling_rope_utils): one of ROPE_TYPES, and the
    # fields its type reads (ROPE_TYPE_FIELDS; the others keep their defaults).
    rope_type: str = field(default="default", metadata=OMITTED_AT_DEFAULT)
    rope_factor: float = field(default=1.0, metadata=OMITTED_AT_DEFAULT)  # [1, 1e4]: linear, llama3, yarn
    # [0, 16777216]: the pretraining context, > 0 for llama3 and yarn
    rope_original_max_position_embeddings: int = field(default=0, metadata=OMITTED_AT_DEFAULT)
    rope_low_freq_factor: float = field(default=1.0, metadata=OMITTED_AT_DEFAULT)  # (0, 1e4]: llama3
    rope_high_freq_factor: float = field(default=4.0, metadata=OMITTED_AT_DEFAULT)  # (0, 1e4], > low: llama3
    rope_beta_fast: float = field(default=32.0, metadata=OMITTED_AT_DEFAULT)  # (0, 1e4], > beta_slow: yarn
    rope_beta_slow: float = field(default=1.0, metadata=OMITTED_AT_DEFAULT)  # (0, 1e4]: yarn
    # [0, 100]: yarn's scale of cos and sin; 0 = transformers' default, 0.1 ln(rope_factor) + 1
    rope_attention_factor: float = field(default=0.0, metadata=OMITTED_AT_DEFAULT)
    # θ⁽⁰⁾ from existing weights (trainer.init_weights; `dilocox config --init-from DIR`): a folder
    # holding config.json and model.safetensors, read by the coordinator at genesis only, and the CID
    # of those weights as the run encodes θ⁽⁰⁾ (trainer.wire), which every party checks: the
    # coordinator before genesis, each worker on the θ⁽⁰⁾ it is sent, the audit on the genesis
    # checkpoint. "" and "": θ⁽⁰⁾ is built from the seed.
    init_from: str = field(default="", metadata=OMITTED_AT_DEFAULT)
    init_params: str = field(default="", metadata=OMITTED_AT_DEFAULT)

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


@dataclass(frozen=True)
class InnerConfig:
    """Inner optimiser (AdamW), run by every worker for ``steps`` (H) steps a round.

    Defaults follow the DiLoCo lineage: lr 4e-4, weight decay 0.1, betas (0.9, 0.95).
    """

    steps: int = 50  # [1, 1_000_000] inner steps (H) a round
    batch_size: int = 16  # [1, 4096] sequences a step
    lr: float = 4e-4  # (0, 10]
    weight_decay: float = 0.1  # [0, 10]
    beta1: float = 0.9  # [0, 1)
    beta2: float = 0.95  # [0, 1)
    grad_clip: float = 1.0  # [0, 1e6]: max global grad norm; 0 disables clipping
    # DiLoCoX's adaptive H: round r trains H_r steps, H_r falling with the downlink's rank
    # (trainer.schedule.inner_steps_for_round has the rule); needs compression with the low-rank codec.
    adaptive_steps: bool = False
    min_steps: int = 1  # [1, 1_000_000], <= steps: the floor of H_r when adaptive_steps is on


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimiser (SGD with Nesterov momentum on the averaged pseudo-gradient).

    Defaults follow DiLoCo: lr 0.7, momentum 0.9, Nesterov.
    """

    lr: float = 0.7  # (0, 10]
    momentum: float = 0.9  # [0, 1)
    nesterov: bool = True


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are split.

    ``corpus`` is ``"embedded"`` (a corpus the project generates from the run seed) or a path to a
    UTF-8 text file readable by every process. ``corpus_sha256`` pins the bytes; it is filled in by
    :func:`trainer.data.load_corpus` when a run is created, and checked by every worker.

    ``tokens``, when set, replaces ``corpus``: a directory written by ``dilocox data prepare``
    (flat token files and their index, :mod:`trainer.dataset`), the same path on every process.
    ``tokens_cid`` pins its index (filled in when the run is created); its split is the prepared
    one, so ``eval_fraction`` does not apply.
    """

    corpus: str = "embedded"
    corpus_sha256: str = ""
    tokens: str = ""  # a directory written by `dilocox data prepare`; "" = `corpus` text as byte tokens
    tokens_cid: str = ""  # CID of that directory's index.json (pinned when the run is created)
    eval_fraction: float = 0.1  # (0, 0.5]: the tail of the corpus held out for evaluation
    # [1, 10_000] batches of inner.batch_size, and eval_batches x batch_size x block_size at most
    # MAX_EVAL_TOKENS (2^24): the held-out batches are kept in memory by every process
    eval_batches: int = 8


@dataclass(frozen=True)
class RoundConfig:
    """How rounds open and close.

    A round closes as soon as ``quorum`` updates are accepted and every live worker has delivered,
    or ``straggler_timeout_s`` after its first accepted update, with whatever was accepted by then.
    A worker silent for ``liveness_timeout_s`` is no longer waited for.
    """

    rounds: int = 5  # [1, 1_000_000]
    expected_workers: int = 2  # [1, 1024]; also the number of data shards
    quorum: int = 2  # [1, expected_workers]
    straggler_timeout_s: float = 60.0  # [0.1, 86400] seconds
    heartbeat_interval_s: float = 1.0  # [0.05, 60] seconds
    liveness_timeout_s: float = 6.0  # [0.1, 3600] seconds, and > heartbeat_interval_s
    # L2 bound on a pseudo-gradient; 0 derives it (see trainer.aggregation.norm_bound). An explicit
    # bound must be in [inner.lr x sqrt(parameters), 1e12]: the floor is the norm of a single AdamW
    # step (every coordinate moves by about lr), so a smaller bound would refuse every honest update
    # and no round would ever close.
    max_update_norm: float = 0.0
    # DiLoCoX's one-step-delay overlap of the exchange with the next round's compute (see
    # trainer.worker.loops). Staleness and outer momentum compound, so lower outer.momentum when
    # turning this on (docs/measurements.md has the figures; `dilocox bench overlap` measures them).
    overlap: bool = False
    # Where an overlapped round starts (trainer.worker.loops): "delayed", the newest global state
    # plus the worker's own last Δ; or "eager" (Kale et al. 2025), the newest global state moved by
    # a proxy of the outer step still in flight: the step before it, corrected by the worker's own
    # change of Δ.
    overlap_start: str = "delayed"
    # Robust aggregation (trainer.aggregation.aggregate): each update is clipped to clip_multiple
    # (c) x the lower median of the round's update norms and the previous clip_history_rounds (K)
    # rounds' norms. c: 0 (off: the plain mean) or [1, 100]; K: [0, 64].
    clip_multiple: float = 2.0
    clip_history_rounds: int = 2
    # Robust mean of the clipped updates, coordinate by coordinate (trainer.aggregation.aggregate):
    # one of AGGREGATORS: "mean" (the plain mean), "trimmed_mean" (drop the floor(trim_fraction x n)
    # lowest and as many highest of the n values, average the rest) or "median" (the lower median).
    # trim_fraction: [0, 0.5); it matters only to "trimmed_mean", and trims nothing below n = 1/trim_fraction.
    aggregator: str = "mean"
    trim_fraction: float = 0.2
    # Screening by effect (trainer.coordinator.screening): refuse an update that raises the loss of the round's
    # start checkpoint by more than screen_margin nats on held-out batches the coordinator draws
    # privately each round. 0: off (the default); otherwise (0, 100].
    screen_margin: float = 0.0
    # K: full parameters and outer state are stored for genesis, every round r with r % K == 0, and
    # the last round; a round in between is rebuilt from the newest full one before it by re-running
    # the later rounds' transitions from their manifests (trainer.checkpoints). [1, 1_000_000].
    checkpoint_every: int = 1


# What the product runs: DiLoCoX. Each section's own defaults above are the plain building block
# (DiLoCo: dense, synchronous, outer lr 0.7 / momentum 0.9); a RunConfig's defaults, and a section
# a configuration file gives only in part, are DiLoCoX's: compression (adaptive low-rank + int4, both
# directions, error feedback), the one-step-delay overlap, and an outer step tuned for them. The
# values are the ablation's (benchmarks.ablation; the sweep that chose the outer step is in
# docs/ablation.md). `plain_diloco` is the one switch back.
DILOCOX_OUTER = OuterConfig(lr=0.7, momentum=0.3)
DILOCO_OUTER = OuterConfig()
DILOCOX_COMPRESSION = CompressionConfig(enabled=True, target_energy=0.9, min_rank=16, max_rank=32,
                                        int4_group_size=128)
DILOCOX_ROUNDS = RoundConfig(overlap=True, overlap_start="delayed")


@dataclass(frozen=True)
class RunConfig:
    run_id: str = "dilocox"
    seed: int = 1337  # [0, 2^63 - 1]
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=lambda: DILOCOX_OUTER)
    data: DataConfig = field(default_factory=DataConfig)
    rounds: RoundConfig = field(default_factory=lambda: DILOCOX_ROUNDS)
    # Ranges checked here (trainer.codec checks less): target_energy (0, 1], min_rank and
    # max_rank [1, 4096] with min <= max, window [1, 1000], max_rank_factor [1, 1000], group sizes
    # [1, 2^20].
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


class ConfigError(ValueError):
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
    for name, value in obj.items():
        kind = hints[name]
        where = f"{path}.{name}"
        if dataclasses.is_dataclass(kind):
            kwargs[name] = _decode(kind, value, where, getattr(cls(), name) if cls is RunConfig else None)
        elif kind is float:
            kwargs[name] = _number(value, where)
        elif kind is bool:
            kwargs[name] = _exact(value, bool, where)
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


# The accepted range of every numeric field, by "section.field": (low, high, low_open, high_open).
# Each field's comment repeats its range; _validate refuses a value outside it (and any NaN or
# infinity) with a message naming the field, the value and the range.
_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "seed": (0, 2**63 - 1, False, False),
    "model.vocab_size": (256, 262_144, False, False),
    "model.block_size": (2, 16_384, False, False),
    "model.n_layer": (1, 256, False, False),
    "model.n_head": (1, 256, False, False),
    "model.n_embd": (1, 16_384, False, False),
    "model.n_kv_head": (0, 256, False, False),
    "model.intermediate_size": (0, 1 << 20, False, False),
    "model.rope_theta": (1.0, 1e9, False, False),
    "model.rms_norm_eps": (1e-12, 0.01, False, False),
    "model.head_size": (0, 1024, False, False),
    "model.rope_factor": (1.0, 1e4, False, False),
    "model.rope_original_max_position_embeddings": (0, 1 << 24, False, False),
    "model.rope_low_freq_factor": (0.0, 1e4, True, False),
    "model.rope_high_freq_factor": (0.0, 1e4, True, False),
    "model.rope_beta_fast": (0.0, 1e4, True, False),
    "model.rope_beta_slow": (0.0, 1e4, True, False),
    "model.rope_attention_factor": (0.0, 100.0, False, False),
    "inner.steps": (1, 1_000_000, False, False),
    "inner.batch_size": (1, 4096, False, False),
    "inner.lr": (0.0, 10.0, True, False),
    "inner.weight_decay": (0.0, 10.0, False, False),
    "inner.beta1": (0.0, 1.0, False, True),
    "inner.beta2": (0.0, 1.0, False, True),
    "inner.grad_clip": (0.0, 1e6, False, False),
    "inner.min_steps": (1, 1_000_000, False, False),
    "outer.lr": (0.0, 10.0, True, False),
    "outer.momentum": (0.0, 1.0, False, True),
    "data.eval_fraction": (0.0, 0.5, True, False),
    "data.eval_batches": (1, 10_000, False, False),
    "rounds.rounds": (1, 1_000_000, False, False),
    "rounds.expected_workers": (1, 1024, False, False),
    "rounds.quorum": (1, 1024, False, False),
    "rounds.straggler_timeout_s": (0.1, 86_400.0, False, False),
    "rounds.heartbeat_interval_s": (0.05, 60.0, False, False),
    "rounds.liveness_timeout_s": (0.1, 3600.0, False, False),
    "rounds.max_update_norm": (0.0, 1e12, False, False),
    "rounds.checkpoint_every": (1, 1_000_000, False, False),
    "compression.target_energy": (0.0, 1.0, True, False),
    "compression.min_rank": (1, 4096, False, False),
    "compression.max_rank": (1, 4096, False, False),
    "compression.window": (1, 1000, False, False),
    "compression.max_rank_factor": (1.0, 1000.0, False, False),
    "compression.int4_group_size": (1, 1 << 20, False, False),
    "compression.int8_group_size": (1, 1 << 20, False, False),
    "compression.topk_density": (0.0, 1.0, True, False),
    "compression.topk_chunk": (1, 65_536, False, False),
}
# Held-out tokens (eval_batches x batch_size x block_size) the coordinator and every worker keep in
# memory, as int64 inputs and targets: 2^24 tokens is 256 MiB. The default is 8 x 16 x 64 = 8192.
MAX_EVAL_TOKENS = 1 << 24
# Parameters of the model (estimated_parameters; the default GPT has about 0.47M).
MAX_PARAMETERS = 10_000_000_000


def _interval(spec: tuple[float, float, bool, bool]) -> str:
    lo, hi, lo_open, hi_open = spec
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def _in_range(value: float, spec: tuple[float, float, bool, bool]) -> bool:
    lo, hi, lo_open, hi_open = spec
    if not math.isfinite(value):
        return False
    return (lo < value if lo_open else lo <= value) and (value < hi if hi_open else value <= hi)


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
        raise ConfigError(_unknown_family(m.family))
    q, kv = m.n_head * m.head_dim, m.kv_heads * m.head_dim
    layer = 2 * d * q + 2 * d * kv + 3 * d * m.mlp_width + 2 * d
    if m.family == "qwen2" or m.attention_bias:
        layer += q + 2 * kv + (d if m.attention_bias else 0)
    return (1 if m.tie_word_embeddings else 2) * vocab * d + m.n_layer * layer + d


def _unknown_family(family: object) -> str:
    return (f"model.family = {str(family)[:40]!r} is not supported: must be one of "
            f"{', '.join(MODEL_FAMILIES)}")


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
    """The RoPE type and the fields it reads (ROPE_TYPE_FIELDS)."""
    if m.rope_type not in ROPE_TYPES:
        return [f"model.rope_type = {str(m.rope_type)[:40]!r} is not supported: must be one of "
                f"{', '.join(ROPE_TYPES)} (dynamic and longrope change the frequencies with the sequence's length)"]
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
    if cfg.model.family not in MODEL_FAMILIES:
        problems.append(_unknown_family(cfg.model.family))
    if cfg.rounds.overlap_start not in OVERLAP_STARTS:
        problems.append(f"rounds.overlap_start = {cfg.rounds.overlap_start[:40]!r} must be one of "
                        f"{', '.join(OVERLAP_STARTS)}")
    if cfg.rounds.aggregator not in AGGREGATORS:
        problems.append(f"rounds.aggregator = {cfg.rounds.aggregator!r} must be one of {', '.join(AGGREGATORS)}")
    for name, value in _numeric_fields(cfg):
        spec = _RANGES.get(name)
        if spec is None:  # a field without a listed range: at least refuse NaN and infinities
            if isinstance(value, float) and not math.isfinite(value):
                problems.append(f"{name} = {value!r} must be a finite number")
            continue
        if not _in_range(value, spec):
            problems.append(f"{name} = {value!r} is out of range: must be in {_interval(spec)}")
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
    if not (r.clip_multiple == 0 or 1 <= r.clip_multiple <= 100):
        problems.append(f"rounds.clip_multiple = {r.clip_multiple!r} must be 0 (no clipping) or in [1, 100]")
    if not 0 <= r.clip_history_rounds <= 64:
        problems.append(f"rounds.clip_history_rounds = {r.clip_history_rounds} must be in [0, 64]")
    if not 0 <= r.trim_fraction < 0.5:
        problems.append(f"rounds.trim_fraction = {r.trim_fraction!r} must be in [0, 0.5)")
    if not 0 <= r.screen_margin <= 100:
        problems.append(f"rounds.screen_margin = {r.screen_margin!r} must be 0 (no screening) or in (0, 100]")
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
