"""``dilocox export --run DIR --round N OUT/``: a round's checkpoint as a Hugging Face folder.

Writes ``OUT/config.json`` (the family's ``transformers`` configuration, trainer.hf_model.hf_config:
``architectures`` names the causal LM class, dtype float32) and ``OUT/model.safetensors``, the
round's parameters under their own names, which are the Hugging Face ones, so
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads the model as trained. A run on
prepared tokens with a BPE tokenizer also gets ``OUT/tokenizer.json`` (the pinned one, read from the
run's store by its CID) and ``OUT/tokenizer_config.json``, so ``AutoTokenizer.from_pretrained(OUT)``
encodes text as the run did; its end-of-text token is the config's ``bos_token_id`` and
``eos_token_id``. Byte-token runs have no Hugging Face tokenizer: ids are the UTF-8 bytes. The
safetensors metadata ties the file to the run:

    format            "pt"
    dilocox.manifest  the CID of round N's manifest (the lineage entry ``dilocox audit`` checks)
    dilocox.round     N, as a decimal string
    dilocox.config    the CID of the run's configuration

The lineage from HEAD back to genesis is re-hashed before anything is read (storage_client.lineage),
and the parameters must be exactly the names, shapes and dtype (float32) of the run's model. The
folder is written beside OUT and renamed into place, so OUT holds a whole export or nothing.

Refused with one line: a DIR that holds no run, a round the run has not reached (exit 2), an OUT that
exists and is not an empty folder (exit 2), and a run of the built-in gpt family, which has no
``transformers`` class.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from storage_client import CID, Manifest, lineage, strict_json
from trainer.checkpoints import checkpoint_at
from trainer.config import RunConfig
from trainer.progress import Progress
from trainer.run_dir import RunDir
from trainer.tokenizer import BpeTokenizer
from trainer.wire import Params

SAFETENSORS_NAME = "model.safetensors"


class ExportError(ValueError):
    """A run or checkpoint that cannot be exported; the message names what is wrong."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory (its store/ and HEAD)")
    parser.add_argument("--round", required=True, type=int, metavar="N", help="the round whose checkpoint to export")
    parser.add_argument("out", metavar="OUT", help="folder to write (must not exist, or be empty)")


def checkpoint_params(run_dir: RunDir, round_: int, progress: Progress | None = None) -> tuple[CID, Params]:
    """Round ``round_``'s manifest CID and its full parameters θ⁽ʳᵒᵘⁿᵈ⁾, after re-hashing the
    lineage from HEAD to genesis (``progress``: trainer.checkpoints.checkpoint_at's)."""
    head = run_dir.head()
    if head is None:
        raise ExportError(f"--run {run_dir.path}: holds no run (no HEAD)")
    chain = lineage(run_dir.store, head)
    if not 0 <= round_ < len(chain):
        raise ExportError(f"--round {round_}: run {chain[-1][1].run_id!r} has rounds 0 to {len(chain) - 1}")
    # Stored every rounds.checkpoint_every rounds; rebuilt from the newest stored one otherwise.
    return chain[round_][0], checkpoint_at(run_dir.store, chain, round_, progress=progress).params


def run(args: argparse.Namespace) -> int:
    from cli.main import UsageError

    path, out = Path(args.run), Path(args.out)
    # Looked for before RunDir, which would create the folders of a new run.
    if not (path / "HEAD").is_file():
        raise ExportError(f"--run {str(path)[:200]}: holds no run (no HEAD file)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{str(out)[:200]}: exists and is not an empty folder; export writes a new one")
    run_dir = RunDir(path)
    head = run_dir.head()
    tip = Manifest.load(run_dir.store, head)  # type: ignore[arg-type] - HEAD was found above
    if not 0 <= args.round <= tip.round:
        raise UsageError(f"--round {args.round}: run {tip.run_id!r} has rounds 0 to {tip.round}")
    # Steps: the checkpoint read, each round rebuilt from it (rounds.checkpoint_every), the folder written.
    with Progress(f"export of round {args.round}", 1, unit="steps") as progress:
        manifest_cid, params = checkpoint_params(run_dir, args.round, progress)
        manifest = Manifest.load(run_dir.store, manifest_cid)
        written = export_checkpoint(run_dir, manifest, manifest_cid, params, out)
        progress.advance()
    print(f"round {args.round} of run {manifest.run_id!r} (manifest {manifest_cid}) exported to {out}: "
          f"{', '.join(written)}")
    return 0


def export_checkpoint(run_dir: RunDir, manifest: Manifest, manifest_cid: CID, params: Params, out: Path) -> list[str]:
    """Write the Hugging Face folder ``out`` for the round of ``manifest`` (see the module doc)."""
    import torch
    from safetensors.torch import save_file

    from trainer.hf_model import HF_CLASSES, hf_config
    from trainer.model import new_model

    config = RunConfig.from_json(run_dir.store.get_json(manifest.config))
    family = config.model.family
    if family not in HF_CLASSES:
        raise ExportError(f"run {config.run_id!r} trains the {family!r} family, which has no transformers class: "
                          f"only {', '.join(HF_CLASSES)} runs can be exported")
    with torch.device("meta"):
        expected = {n: (p.dtype, tuple(p.shape)) for n, p in new_model(config.model).named_parameters()}
    got = {n: (t.dtype, tuple(t.shape)) for n, t in params.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(n for n in got if got[n] != expected[n])
        raise ExportError(f"round {manifest.round}'s parameters do not fit the run's model: "
                          f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}")
    hf = hf_config(config.model).to_dict()
    hf["torch_dtype"] = "float32"  # the key transformers 4 reads; 5 reads "dtype" (also float32)
    files = {"config.json": b""}
    tokenizer = run_tokenizer(run_dir, config)
    if tokenizer is not None:
        hf["bos_token_id"] = hf["eos_token_id"] = tokenizer.eos_id
        hf["pad_token_id"] = None
        files["tokenizer.json"] = tokenizer.json_bytes
        files["tokenizer_config.json"] = (strict_json({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.eos_token, "eos_token": tokenizer.eos_token,
            "model_max_length": config.model.block_size, "clean_up_tokenization_spaces": False,
        }, indent=2, sort_keys=True) + "\n").encode("utf-8")
    files["config.json"] = (strict_json(hf, indent=2, sort_keys=True) + "\n").encode("utf-8")
    metadata = {"format": "pt", "dilocox.manifest": str(manifest_cid), "dilocox.round": str(manifest.round),
                "dilocox.config": manifest.config}
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        for name, data in files.items():
            (partial / name).write_bytes(data)
        save_file({n: t.contiguous() for n, t in params.items()}, str(partial / SAFETENSORS_NAME), metadata=metadata)
        for name in (*files, SAFETENSORS_NAME):
            with open(partial / name, "rb") as f:
                os.fsync(f.fileno())
        os.replace(partial, out)  # onto a missing or empty folder: atomic
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [*files, SAFETENSORS_NAME]


def run_tokenizer(run_dir: RunDir, config: RunConfig) -> BpeTokenizer | None:
    """The BPE tokenizer the run pinned (its token index, then tokenizer.json, both read from the
    run's store by CID, so verified), or None for byte tokens."""
    from trainer.dataset import TokenIndex

    if not config.data.tokens_cid:
        return None
    try:
        index = TokenIndex.from_bytes(run_dir.store.get(config.data.tokens_cid), "the run's token index")
        if index.kind != BpeTokenizer.kind or index.tokenizer_cid is None:
            return None
        return BpeTokenizer(run_dir.store.get(index.tokenizer_cid), what="the run's tokenizer.json")
    except (OSError, ValueError) as exc:  # StoreError, DataError, TokenizerError
        raise ExportError(f"the run's tokenizer cannot be read from its store: {exc}") from None
