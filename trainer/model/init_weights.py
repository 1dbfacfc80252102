"""θ⁽⁰⁾ from existing weights: a run that starts from a Hugging Face checkpoint instead of the seed.

``dilocox config --init-from DIR`` takes the model section from ``DIR/config.json``
(trainer.model.hf.read_hf_config: llama, qwen2, or a GPT-2 folder as ``dilocox export`` writes the
built-in GPT) and pins the weights of ``DIR/model.safetensors`` into the run's configuration:

    model.init_from    DIR, read by the coordinator at genesis only
    model.init_params  CID(encode_params(θ⁽⁰⁾)): the RAW CID of θ⁽⁰⁾ as the run stores it (trainer.codec.wire)

θ⁽⁰⁾ is the file's tensors under the run's names (a GPT's from GPT-2's, trainer.model.hf.import_state),
each exactly a parameter of the run's model with its shape, upcast to float32 (exact from bfloat16 and
float16). A tied checkpoint may leave ``lm_head.weight`` out (or hold a copy of the embedding, dropped).
A name the model lacks, a parameter the file lacks, a shape or a non-float dtype is refused by name.

Every party checks the same θ⁽⁰⁾ by that CID: the coordinator before genesis (:func:`pin_init`; a
file that hashes to another CID is refused), each worker on the θ⁽⁰⁾ it is sent
(trainer.worker.client: the round-0 global state must carry ``model.init_params``), and the audit on
the genesis checkpoint (audit.lineage: ``genesis-checkpoint``). The file is read through
``safetensors`` (a bounded JSON header and raw tensors; nothing is unpickled), its size bounded by
what the model's parameters can take.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from storage_client import CID
from trainer.codec.wire import Params, encode_params
from trainer.config import ConfigError, ModelConfig, RunConfig, estimated_parameters

WEIGHTS_NAME = "model.safetensors"
# safetensors caps its JSON header at 100 MB; the tensors of a float32 model take 4 bytes a parameter.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class InitWeightsError(ConfigError):
    """Weights that cannot start the run; the message names the file and what is wrong."""


def _names(items: list[str]) -> str:
    return ", ".join(n[:80] for n in items[:5]) + (f" and {len(items) - 5} more" if len(items) > 5 else "")


def read_init_params(cfg: ModelConfig) -> Params:
    """θ⁽⁰⁾ from ``cfg.init_from``'s model.safetensors (see the module doc), not yet checked against
    ``cfg.init_params``."""
    from safetensors import SafetensorError, safe_open

    from trainer.model.gpt import new_model
    from trainer.model.hf import import_state

    path = Path(cfg.init_from) / WEIGHTS_NAME
    where = f"--init-from {str(path)[:200]}"
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise InitWeightsError(f"{where}: {exc.strerror or exc}") from None
    limit = 4 * estimated_parameters(cfg) + MAX_HEADER_BYTES
    if size > limit:
        raise InitWeightsError(f"{where} is {size:,} bytes, more than the {limit:,} the model's parameters can take")
    with torch.device("meta"):
        expected = {n: tuple(p.shape) for n, p in new_model(cfg).named_parameters()}
    try:
        with safe_open(str(path), "pt") as f:
            stored = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise InitWeightsError(f"{where} is not a safetensors file: {reason}") from None
    state = import_state(cfg, stored)
    if cfg.tie_word_embeddings and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")  # some tied checkpoints store the head as a copy
        if not torch.equal(head, state.get("model.embed_tokens.weight", head)):
            raise InitWeightsError(f"{where}: lm_head.weight differs from model.embed_tokens.weight, but the "
                                   f"config ties them (model.tie_word_embeddings)")
    unexpected, missing = sorted(set(state) - set(expected)), sorted(set(expected) - set(state))
    if unexpected:
        raise InitWeightsError(f"{where} holds tensors the run's model does not have: {_names(unexpected)}")
    if missing:
        raise InitWeightsError(f"{where} lacks parameters of the run's model: {_names(missing)}")
    params: Params = {}
    for name, shape in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise InitWeightsError(f"{where}: {name} has shape {list(tensor.shape)}, the run's model {list(shape)}")
        if tensor.dtype not in _FLOAT_DTYPES:
            raise InitWeightsError(f"{where}: {name} is {str(tensor.dtype).removeprefix('torch.')}; float32, "
                                   f"bfloat16 or float16 weights start a float32 run exactly")
        params[name] = tensor.to(torch.float32).contiguous()
    return params


def init_params_cid(params: Params) -> CID:
    """The CID θ⁽⁰⁾ has in the run's store (and on the chain, as its genesis checkpoint)."""
    return CID.of(encode_params(params))


def pin_init(config: RunConfig) -> tuple[RunConfig, Params | None]:
    """``config`` with ``model.init_params`` filled in from ``model.init_from``'s weights, and θ⁽⁰⁾;
    the weights must hash to ``init_params`` when it is set already. ``(config, None)`` for a run
    whose θ⁽⁰⁾ comes from the seed."""
    model = config.model
    if not model.init_from:
        return config, None
    params = read_init_params(model)
    cid = str(init_params_cid(params))
    if model.init_params and model.init_params != cid:
        raise InitWeightsError(f"--init-from {model.init_from[:200]}: its weights hash to {cid}, but the run's "
                               f"config pins model.init_params = {model.init_params}: they are not the weights "
                               f"the run was configured with")
    return config.replace(model=dataclasses.replace(model, init_params=cid)), params
