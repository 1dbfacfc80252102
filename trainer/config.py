"""Run configuration: everything that determines what a run computes, and nothing else.

A run is identified by its configuration's content identifier (the CID of its canonical JSON), so
two processes agree on what they train exactly when they hold byte-identical configurations. Local
process settings (ports, directories, thread counts) are command-line options, not configuration,
because they do not change the numbers a run produces.

Canonical JSON refuses floats (their text forms differ across languages), so float fields travel
as their shortest round-trip decimal strings (``repr``): ``0.0004`` becomes ``"0.0004"``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

from storage_client import CID, canonical_json, digest_json
from trainer.compression import CompressionConfig

SCHEMA = "dilocox.config/v1"
_RUN_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


@dataclass(frozen=True)
class ModelConfig:
    """A nanoGPT-style decoder-only transformer; the default trains on 2 CPU cores."""

    vocab_size: int = 256  # byte-level tokenizer: no vocabulary file, no download
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


@dataclass(frozen=True)
class InnerConfig:
    """Inner optimiser (AdamW), run by every worker for ``steps`` (H) steps a round.

    Defaults follow the DiLoCo lineage: lr 4e-4, weight decay 0.1, betas (0.9, 0.95).
    """

    steps: int = 50
    batch_size: int = 16
    lr: float = 4e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimiser (SGD with Nesterov momentum on the averaged pseudo-gradient).

    Defaults follow DiLoCo: lr 0.7, momentum 0.9, Nesterov.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True


@dataclass(frozen=True)
class DataConfig:
    """Where the tokens come from and how they are split.

    ``corpus`` is ``"embedded"`` (a corpus the project generates from the run seed) or a path to a
    UTF-8 text file readable by every process. ``corpus_sha256`` pins the bytes; it is filled in by
    :func:`trainer.data.load_corpus` when a run is created, and checked by every worker.
    """

    corpus: str = "embedded"
    corpus_sha256: str = ""
    eval_fraction: float = 0.1
    eval_batches: int = 8


@dataclass(frozen=True)
class RoundConfig:
    """How rounds open and close.

    A round closes as soon as ``quorum`` updates are accepted and every live worker has delivered,
    or ``straggler_timeout_s`` after its first accepted update, with whatever was accepted by then.
    A worker silent for ``liveness_timeout_s`` is no longer waited for.
    """

    rounds: int = 5
    expected_workers: int = 2  # also the number of data shards
    quorum: int = 2
    straggler_timeout_s: float = 60.0
    heartbeat_interval_s: float = 1.0
    liveness_timeout_s: float = 6.0
    max_update_norm: float = 0.0  # L2 bound on a pseudo-gradient; 0 derives it (see aggregation)
    # DiLoCoX's one-step-delay overlap of the exchange with the next round's compute (see
    # trainer.worker). Staleness and outer momentum compound: on the tiny GPT, 2 workers, 8 rounds
    # of 100 steps, eval loss was 1.56 synchronous, 2.10 overlapped at momentum 0.9, and 1.66
    # overlapped at momentum 0.5, so lower outer momentum when turning this on (the ablation benchmark
    # uses 0.3 for every DiLoCoX row; benchmarks/ablation.py says what it measured).
    overlap: bool = False


@dataclass(frozen=True)
class RunConfig:
    run_id: str = "dilocox"
    seed: int = 1337
    model: ModelConfig = field(default_factory=ModelConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rounds: RoundConfig = field(default_factory=RoundConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)

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

    @classmethod
    def load(cls, path: str | Path) -> RunConfig:
        try:
            return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not JSON: {exc}") from exc

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")


class ConfigError(ValueError):
    """A configuration that cannot be used, with the field that is wrong."""


T = TypeVar("T")


def _encode(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out[f.name] = _encode(value)
        elif isinstance(value, float):
            out[f.name] = repr(value)
        else:
            out[f.name] = value
    return out


def _decode(cls: type[T], obj: Any, path: str) -> T:
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
            kwargs[name] = _decode(kind, value, where)
        elif kind is float:
            try:
                kwargs[name] = float(value) if isinstance(value, str) else _exact(value, int, where)
            except ValueError as exc:
                raise ConfigError(f"{where}: not a number: {value!r}") from exc
        elif kind is bool:
            kwargs[name] = _exact(value, bool, where)
        else:
            kwargs[name] = _exact(value, kind, where)
    return cls(**kwargs)


def _exact(value: Any, kind: type, where: str) -> Any:
    # bool is an int subclass; a true/false where a count belongs is a mistake, not a 1/0.
    if type(value) is not kind:
        raise ConfigError(f"{where}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _validate(cfg: RunConfig) -> list[str]:
    m, i, o, d, r = cfg.model, cfg.inner, cfg.outer, cfg.data, cfg.rounds
    checks = [
        (bool(_RUN_ID.match(cfg.run_id)), "run_id must match [A-Za-z0-9._-]{1,64}"),
        (m.vocab_size >= 2 and m.block_size >= 2, "model.vocab_size and block_size must be >= 2"),
        (m.n_layer >= 1 and m.n_head >= 1, "model.n_layer and n_head must be >= 1"),
        (m.n_embd % m.n_head == 0, "model.n_embd must be divisible by model.n_head"),
        (i.steps >= 1 and i.batch_size >= 1, "inner.steps and inner.batch_size must be >= 1"),
        (i.lr > 0 and i.weight_decay >= 0, "inner.lr must be > 0 and weight_decay >= 0"),
        (0 <= i.beta1 < 1 and 0 <= i.beta2 < 1, "inner betas must be in [0, 1)"),
        (i.grad_clip >= 0, "inner.grad_clip must be >= 0"),
        (o.lr > 0 and 0 <= o.momentum < 1, "outer.lr must be > 0 and momentum in [0, 1)"),
        (0 < d.eval_fraction < 1 and d.eval_batches >= 1, "data.eval_fraction in (0,1), eval_batches >= 1"),
        (r.rounds >= 1 and r.expected_workers >= 1, "rounds.rounds and expected_workers must be >= 1"),
        (1 <= r.quorum <= r.expected_workers, "rounds.quorum must be in [1, expected_workers]"),
        (r.straggler_timeout_s > 0 and r.heartbeat_interval_s > 0, "round timeouts must be > 0"),
        (r.liveness_timeout_s > r.heartbeat_interval_s, "liveness_timeout_s must exceed heartbeat_interval_s"),
        (r.max_update_norm >= 0, "rounds.max_update_norm must be >= 0"),
    ]
    return [message for ok, message in checks if not ok]


def demo_config() -> RunConfig:
    """The embedded default of ``dilocox demo``: 2 workers, 8 rounds, on the generated corpus.

    The inner learning rate is raised above the DiLoCo default because a tiny model over a few
    hundred inner steps is far from the regime that default was tuned for.
    """
    return RunConfig(
        run_id="demo",
        inner=InnerConfig(steps=50, batch_size=16, lr=2e-3),
        rounds=RoundConfig(rounds=8, expected_workers=2, quorum=2),
    )
