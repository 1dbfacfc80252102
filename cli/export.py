"""``dilocox export --run DIR --round N OUT/``: a round's checkpoint as a Hugging Face folder
(``--car``: the round as a CARv1 file, cli.store.write_round_car).

Writes ``OUT/config.json`` and ``OUT/model.safetensors``, the round's parameters, so that
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads the model as trained, with
transformers 4.4x and 5 alike:

* llama and qwen2 runs: the family's configuration with every field both versions read
  (trainer.model.hf.hf_config_json: ``rope_theta`` and ``rope_scaling`` beside ``rope_parameters``,
  ``torch_dtype`` beside ``dtype``, ``tie_word_embeddings``, ``head_dim``, ``attention_bias``), the
  parameters under their own names, which are the Hugging Face ones (a tied head is not stored: it
  is the embedding);
* gpt runs: ``GPT2LMHeadModel`` (trainer.model.hf.gpt2_config_json: exact GELU, untied head), the
  parameters under GPT-2's names, linear weights transposed to GPT-2's Conv1D layout.

A run on prepared tokens with a BPE tokenizer also gets ``OUT/tokenizer.json`` (the pinned one,
read from the run's store by its CID) and ``OUT/tokenizer_config.json`` (:func:`tokenizer_config`),
so ``AutoTokenizer.from_pretrained(OUT)`` loads that tokenizer as it stands
(``PreTrainedTokenizerFast``, not a family's own class that rebuilds the pre-tokenizer); its
end-of-text token is bos, eos and pad (``bos_token_id``, ``eos_token_id`` and ``pad_token_id`` in
config.json), padding on the left for batched ``generate``. Byte-token runs have no Hugging Face
tokenizer: ids are the UTF-8 bytes, and no special token id is written. The safetensors metadata
ties the file to the run:

    format            "pt"
    dilocox.manifest  the CID of round N's manifest (the lineage entry ``dilocox audit`` checks)
    dilocox.round     N, as a decimal string
    dilocox.config    the CID of the run's configuration

The lineage from HEAD back to genesis is re-hashed before anything is read (storage_client.lineage),
and the parameters must be exactly the names, shapes and dtype (float32) of the run's model. The
folder is written beside OUT, checked as a user loads it (:func:`check_export`: the tokenizer's ids
on a sample, the model's logits against the run's own model), and only then renamed into place, so
OUT holds a whole, checked export or nothing.

Refused with one line: a DIR that holds no run, a round the run has not reached (exit 2), an OUT that
exists and is not an empty folder (exit 2), and an export that fails its own check (exit 1).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from storage_client import CID, Manifest, lineage, strict_json
from trainer.codec.wire import Params
from trainer.config import RunConfig
from trainer.data.tokenizer import BpeTokenizer
from trainer.progress import Progress
from trainer.runstore.checkpoints import checkpoint_at
from trainer.runstore.run_dir import RunDir

SAFETENSORS_NAME = "model.safetensors"


class ExportError(ValueError):
    """A run or checkpoint that cannot be exported; the message names what is wrong."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory (its store/ and HEAD)")
    parser.add_argument("--round", required=True, type=int, metavar="N", help="the round whose checkpoint to export")
    parser.add_argument("--car", action="store_true",
                        help="write OUT as a CARv1 of the round instead (its manifest as the root, the run's "
                             "configuration, checkpoint and update records: what `dilocox store car` writes)")
    parser.add_argument("out", metavar="OUT", help="folder to write (must not exist, or be empty); with --car, the file")


def checkpoint_params(run_dir: RunDir, round_: int, progress: Progress | None = None) -> tuple[CID, Params]:
    """Round ``round_``'s manifest CID and its full parameters θ⁽ʳᵒᵘⁿᵈ⁾, after re-hashing the
    lineage from HEAD to genesis (``progress``: trainer.runstore.checkpoints.checkpoint_at's)."""
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

    if args.car:
        from cli.store import write_round_car

        return write_round_car(args)
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
    """Write the Hugging Face folder ``out`` for the round of ``manifest`` (see the module doc), checked
    as loaded back (:func:`check_export`) before it is renamed into place."""
    import torch
    from safetensors.torch import save_file

    from trainer.model.gpt import new_model
    from trainer.model.hf import export_state, exported_config_json

    config = RunConfig.from_json(run_dir.store.get_json(manifest.config))
    with torch.device("meta"):
        expected = {n: (p.dtype, tuple(p.shape)) for n, p in new_model(config.model).named_parameters()}
    got = {n: (t.dtype, tuple(t.shape)) for n, t in params.items()}
    if got != expected:
        wrong = sorted(set(got) ^ set(expected)) or sorted(n for n in got if got[n] != expected[n])
        raise ExportError(f"round {manifest.round}'s parameters do not fit the run's model: "
                          f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''}")
    hf = exported_config_json(config.model)
    files = {"config.json": b""}
    tokenizer = run_tokenizer(run_dir, config)
    # Byte tokens have no special token: no id is claimed for one.
    special = tokenizer.eos_id if tokenizer is not None else None
    hf["bos_token_id"] = hf["eos_token_id"] = hf["pad_token_id"] = special
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer.json_bytes
        files["tokenizer_config.json"] = (strict_json(tokenizer_config(tokenizer, config), indent=2, sort_keys=True)
                                          + "\n").encode("utf-8")
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
        save_file(export_state(config.model, params), str(partial / SAFETENSORS_NAME), metadata=metadata)
        for name in (*files, SAFETENSORS_NAME):
            with open(partial / name, "rb") as f:
                os.fsync(f.fileno())
        try:
            check_export(partial, config, params, tokenizer)
        except (ExportError, KeyboardInterrupt):
            raise
        except Exception as exc:  # transformers cannot load what was written: said in one line
            reason = " ".join(str(exc).split())[:300]
            raise ExportError(f"the export does not load back with transformers ({type(exc).__name__}: "
                              f"{reason})") from exc
        os.replace(partial, out)  # onto a missing or empty folder: atomic
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return [*files, SAFETENSORS_NAME]


def tokenizer_config(tokenizer: BpeTokenizer, config: RunConfig) -> dict:
    """tokenizer_config.json: the run's tokenizer.json as it stands (``PreTrainedTokenizerFast``), its
    end-of-text token as bos, eos and pad (a token of the vocabulary, so batches pad), padded on the
    left as a decoder's batched ``generate`` needs. transformers 5 gives a ``qwen2`` folder its own
    ``Qwen2Tokenizer`` whatever ``tokenizer_class`` says (it rebuilds the pre-tokenizer and adds a
    pad token of its own); an ``auto_map`` naming the class takes that path out, and transformers
    (4.4x and 5) load the named class, without remote code, because the folder has no code."""
    obj = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tokenizer.eos_token,
           "eos_token": tokenizer.eos_token, "pad_token": tokenizer.eos_token, "padding_side": "left",
           # a decoder takes no token_type_ids, which transformers 4's PreTrainedTokenizerFast adds otherwise
           "model_input_names": ["input_ids", "attention_mask"],
           "model_max_length": config.model.block_size, "clean_up_tokenization_spaces": False}
    if config.model.family == "qwen2":
        obj["auto_map"] = {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}
    return obj


# Encoded by the run's tokenizer and by the export's AutoTokenizer at export time: words, digits,
# punctuation, runs of spaces, newlines, and text that Unicode normalisation would change
# (a decomposed é, a ligature, full-width letters), where rebuilt tokenizers differ.
CHECK_TEXT = ("The 2024 report said: \"Count them again,\" 1234567 times!\n\n  Indented   lines\tand tabs; "
              "cafe\u0301 caf\u00e9 \ufb01ne \uff21\uff22 \u96ea 🙂 <|endoftext|> end.")
# Relative and absolute tolerance on the logits: float32, the same operations in another order.
LOGITS_TOLERANCE = 1e-4


def check_export(folder: Path, config: RunConfig, params: Params, tokenizer: BpeTokenizer | None) -> None:
    """The export as a user loads it: ``AutoTokenizer`` gives the run's ids on :data:`CHECK_TEXT`
    (special tokens inside the vocabulary), and ``AutoModelForCausalLM`` gives the run's model's
    logits on a batch of every position of the context (up to 256): RoPE, biases, tying and names
    included. ExportError, one line, when it does not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model.gpt import build_model
    from trainer.model.params import load_params

    if tokenizer is not None:
        loaded_tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        [want] = tokenizer.encode_batch([CHECK_TEXT])
        got = loaded_tokenizer(CHECK_TEXT, add_special_tokens=False)["input_ids"]
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise ExportError(f"the exported tokenizer, loaded by AutoTokenizer as {type(loaded_tokenizer).__name__}, "
                              f"encodes a sample differently from the run's tokenizer (first at token {first} "
                              f"of {len(want)})")
        for role in ("bos", "eos", "pad"):
            token_id = getattr(loaded_tokenizer, f"{role}_token_id")
            if token_id is None or not 0 <= token_id < config.model.vocab_size:
                raise ExportError(f"the exported tokenizer's {role} token id {token_id} is not in the model's "
                                  f"vocabulary of {config.model.vocab_size}")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the export's own progress says where it is; no second bar
    loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    model = build_model(config.model, config.seed)
    load_params(model, params)
    model.eval()
    loaded.eval()
    length = min(config.model.block_size, 256)
    sample = torch.randint(config.model.vocab_size, (2, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(sample)[0], loaded(sample).logits
    if theirs.shape != ours.shape or not torch.allclose(theirs, ours, rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE):
        diff = (theirs - ours).abs().max().item() if theirs.shape == ours.shape else float("nan")
        raise ExportError(f"the exported model, loaded by AutoModelForCausalLM as {type(loaded).__name__}, does not "
                          f"compute the run's logits (largest difference {diff:.3g})")


def run_tokenizer(run_dir: RunDir, config: RunConfig) -> BpeTokenizer | None:
    """The BPE tokenizer the run pinned (its token index, then tokenizer.json, both read from the
    run's store by CID, so verified), or None for byte tokens."""
    from trainer.data.dataset import TokenIndex

    if not config.data.tokens_cid:
        return None
    try:
        index = TokenIndex.from_bytes(run_dir.store.get(config.data.tokens_cid), "the run's token index")
        if index.kind != BpeTokenizer.kind or index.tokenizer_cid is None:
            return None
        return BpeTokenizer(run_dir.store.get(index.tokenizer_cid), what="the run's tokenizer.json")
    except (OSError, ValueError) as exc:  # StoreError, DataError, TokenizerError
        raise ExportError(f"the run's tokenizer cannot be read from its store: {exc}") from None
