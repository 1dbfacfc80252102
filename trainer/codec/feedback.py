"""Error feedback: what compression drops is carried into the next round.

Per tensor, per round (Δ the pseudo-gradient, e the worker's error buffer, e⁽⁰⁾ = 0), whatever the
codec kind (Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient Compression
Schemes", ICML 2019):

    A  = Δ + β·e                                          (float64)
    Â  = decode(encode(A))                                (the tensor every replica receives)
    e  ← A − Â                                            (float32; float64 for float64 tensors)

β is ``CompressionConfig.error_decay``, the worker's uplink only (the coordinator's downlink,
trainer.codec.downlink, keeps β = 1: its buffer is what the broadcast still owes every replica).
β = 1 is plain error feedback. β < 1 is SparseLoCo's (Sarfi et al., arXiv:2508.15706, Alg. 1): the
buffer is then a decaying sum of past pseudo-gradients, the role DiLoCo's outer Nesterov momentum
plays, so with top-k SparseLoCo runs the outer step as plain averaged descent (lr 1, momentum 0).
The audit forms A' with the same ``accumulate`` (audit.replay), so the replay's arithmetic is the
worker's.

``compress`` is one round of it over a whole update; ``ErrorFeedbackCompressor`` is a worker's
compressor (its buffer e and its rank policy), with ``carry_back`` for a payload that never
counted (e ← e + Â: the buffer again holds all of A). Compression is a deterministic function of (Δ, e, policy state) on a given machine, and
the worker's e is computed from the very reconstruction every replica rebuilds (trainer.codec.frame).

Aggregation: an average of low-rank factors is not low-rank, so the coordinator decompresses each
validated payload and averages the dense tensors (trainer.rounds.aggregation); a compressed broadcast of
the global update keeps its own error buffer (trainer.codec.downlink).
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping

import torch

from trainer.codec.kinds import CompressionError
from trainer.codec.frame import CompressionStream
from trainer.codec.policy import AdaptiveRankPolicy, RoundDecision
from trainer.codec.wire import Params, dtype_name


def error_dtype(dtype: torch.dtype) -> torch.dtype:
    """e is kept in float32 (float64 for float64 tensors): a 16-bit buffer would lose the residual."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulate(delta: torch.Tensor, error: torch.Tensor | None, decay: float = 1.0) -> torch.Tensor:
    """A = Δ + β·e in float64 (``error`` None: A = Δ); β = 1 adds e unscaled, bit for bit as before
    the decay existed."""
    a = delta.detach().to(torch.float64)
    if error is None:
        return a
    e = error.detach().to(torch.float64)
    return a + (e if decay == 1.0 else e * decay)


def compress(
    tensors: Mapping[str, torch.Tensor],
    errors: MutableMapping[str, torch.Tensor] | None,
    policy: AdaptiveRankPolicy,
    device: torch.device | None = None,
    *,
    decay: float = 1.0,
    received: MutableMapping[str, torch.Tensor] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """(payload, header) for ``tensors``; see the module docstring. ``device``: where the encoding's
    linear algebra and the rebuilding of Â run (trainer.codec.frame.CompressionStream; the CPU by
    default). ``received``, when given, is filled with Â of every tensor, what each receiver
    rebuilds from the payload (``decompress``'s bits): a caller that needs it decodes nothing again.

    ``errors`` is the error-feedback buffer, updated in place with e ← A − Â, A = Δ + ``decay``·e
    (entries created on first use, float32, or float64 for float64 tensors); pass None to compress
    without feedback.
    The buffer and the policy are left as they were if any input is refused. The round's decisions
    are in ``policy.last_decision``.
    """
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            raise CompressionError(f"tensor {name}: dtype {dtype_name(t.dtype)} is not floating point")
        if not bool(torch.isfinite(t).all()):
            raise CompressionError(f"tensor {name}: values are not all finite")
        if errors is not None and name in errors and tuple(errors[name].shape) != tuple(t.shape):
            raise CompressionError(
                f"tensor {name}: error buffer shape {list(errors[name].shape)} != {list(t.shape)}"
            )
    stream = CompressionStream(policy, device)
    residuals: Params = {}
    rebuilt: Params = {}
    try:
        for name in sorted(tensors):
            t = tensors[name]
            a = accumulate(t, errors.get(name) if errors is not None else None, decay)
            rebuilt[name] = stream.add(name, t, a)
            residuals[name] = (a - rebuilt[name].to(torch.float64)).to(error_dtype(t.dtype))
        payload, header = stream.finish()
    except BaseException:
        stream.abort()
        raise
    if errors is not None:
        errors.update(residuals)
    if received is not None:
        received.update(rebuilt)
    return payload, header


class ErrorFeedbackCompressor:
    """A worker's compressor: the error buffer e per tensor plus its rank policy."""

    ERROR_PREFIX = "error/"
    POLICY_PREFIX = "policy/"

    def __init__(self, policy: AdaptiveRankPolicy | None = None, device: torch.device | None = None) -> None:
        self.policy = policy or AdaptiveRankPolicy()
        self.device = device  # where the encoding runs (the worker's device); e stays on the CPU
        self.errors: Params = {}

    def compress(
        self, tensors: Mapping[str, torch.Tensor], received: MutableMapping[str, torch.Tensor] | None = None
    ) -> tuple[bytes, dict[str, Any], RoundDecision]:
        """(payload, header, decisions) for this round's pseudo-gradient; e is updated, and
        ``received`` (when given) filled with Â (module ``compress``)."""
        payload, header = compress(tensors, self.errors, self.policy, self.device,
                                   decay=self.policy.config.error_decay, received=received)
        assert self.policy.last_decision is not None
        return payload, header, self.policy.last_decision

    def carry_back(self, transmitted: Mapping[str, torch.Tensor]) -> None:
        """The last payload never counted (its round was refused or closed without it): e ← e + Â,
        so the buffer again holds all of A = Δ + β·e and nothing is lost."""
        for name, sent in transmitted.items():
            e = self.errors.get(name)
            if e is None:
                e = torch.zeros(sent.shape, dtype=error_dtype(sent.dtype))
            self.errors[name] = (e.to(torch.float64) + sent.to(torch.float64)).to(e.dtype)

    def state_dict(self, copy: bool = True) -> Params:
        """e and the policy's state; ``copy=False`` hands e's own tensors (a snapshot that only reads
        them: ``compress`` and ``carry_back`` replace a buffer, never write into it, and
        ``load_state_dict`` copies)."""
        state = {self.ERROR_PREFIX + name: e.clone() if copy else e for name, e in sorted(self.errors.items())}
        state.update({self.POLICY_PREFIX + k: v for k, v in self.policy.state_dict().items()})
        return state

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        errors: Params = {}
        policy_state: Params = {}
        for key, value in state.items():
            if key.startswith(self.ERROR_PREFIX):
                name = key[len(self.ERROR_PREFIX):]
                if not value.is_floating_point() or not bool(torch.isfinite(value).all()):
                    raise CompressionError(
                        f"compressor state: tensor {name}: field error is not finite floating point")
                errors[name] = value.clone()
            elif key.startswith(self.POLICY_PREFIX):
                policy_state[key[len(self.POLICY_PREFIX):]] = value
            else:
                raise CompressionError(f"compressor state: unexpected entry {key}")
        self.policy.load_state_dict(policy_state)
        self.errors = errors
