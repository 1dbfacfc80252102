"""One round of P pipeline stages under ``torchrun``, the way trainer.runtime.pipeline documents it:
``init_from_env`` in each process, one ``StageRunner`` per process, ``run`` per round.

Run by tests/integration/test_pipeline.py as
``python -m torch.distributed.run --standalone --nproc-per-node P torchrun_stages.py OUT SEED``;
each rank writes its Δ_s and losses to ``OUT/stage<rank>.safetensors`` / ``.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.codec.wire import encode_params
from trainer.model.gpt import build_model
from trainer.model.params import params_of
from trainer.runtime import pipeline as pp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_pipeline import INNER, MODEL, SEED, make_batches  # noqa: E402  (one definition of the setup)


def main(out: Path, batch_seed: int) -> None:
    torch.set_num_threads(1)
    pp.init_from_env(timeout_s=30, backend="gloo")
    try:
        runner = pp.StageRunner(MODEL, n_microbatches=2)
        result = runner.run(INNER, params_of(build_model(MODEL, SEED)), make_batches(INNER.steps, seed=batch_seed))
        (out / f"stage{result.stage}.safetensors").write_bytes(encode_params(result.pseudo_gradient))
        (out / f"stage{result.stage}.json").write_text(json.dumps(
            {"world_size": dist.get_world_size(), "losses": result.losses, "tokens": result.tokens}))
    except BaseException:
        dist.destroy_process_group()
        raise


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
    pp.leave(0)  # the documented way out: a finished rank must not abort in the runtime's teardown
