"""``dilocox data prepare``: tokenize text, directories of text and JSON-lines files once into flat
token shards and an index (trainer.data.prepare; the format is in trainer.data.dataset).

    dilocox data prepare INPUT... --out DIR [--tokenizer byte|bpe|PATH/tokenizer.json]
                         [--vocab-size N] [--shards N] [--eval-fraction F] [--eval-input FILE...]

A run trains on it with ``--set data.tokens=DIR``; the index's CID is pinned in
``data.tokens_cid`` when the run is created.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cli.main import HelpFormatter


def add_arguments(p: argparse.ArgumentParser) -> None:
    action = p.add_subparsers(dest="action", required=True)
    prep = action.add_parser("prepare", help="tokenize a corpus into token shards and an index",
                             description=__doc__, formatter_class=HelpFormatter)
    prep.add_argument("inputs", nargs="+", type=Path, metavar="INPUT",
                      help="text files, JSON-lines files (.jsonl, a \"text\" field a line) or directories of them")
    prep.add_argument("--out", type=Path, required=True, help="the directory to write (new or empty)")
    prep.add_argument("--tokenizer", default="byte",
                      help="byte (UTF-8 bytes, vocabulary 256), bpe (byte-level BPE trained on the train documents) "
                           "or the path of a local tokenizer.json")
    prep.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of a trained BPE tokenizer")
    prep.add_argument("--shards", type=int, default=1, help="train shard files (at least the run's workers)")
    prep.add_argument("--eval-fraction", type=float, default=None,
                      help="share of documents held out, spread evenly (default 0.05; not with --eval-input)")
    prep.add_argument("--eval-input", type=Path, nargs="+", default=None, metavar="FILE",
                      help="held-out files (e.g. WikiText-2 test.txt); every input document then trains")


def run(args: argparse.Namespace) -> int:
    from trainer.data.dataset import DataError
    from trainer.data.prepare import prepare

    if args.eval_input and args.eval_fraction is not None:
        raise DataError("--eval-fraction and --eval-input do not go together: the held-out documents are "
                        "either the --eval-input files or a fraction of the inputs")
    done = prepare(args.inputs, args.out, tokenizer=args.tokenizer, vocab_size=args.vocab_size, shards=args.shards,
                   eval_fraction=0.05 if args.eval_fraction is None else args.eval_fraction,
                   eval_inputs=args.eval_input)
    index = done.index
    print(f"inputs: {len(done.sources.files)} files"
          + (f" ({len(done.sources.skipped)} skipped: not .txt .text .md .jsonl, hidden or links)"
             if done.sources.skipped else ""))
    for source in done.sources.files[:20]:
        print(f"  {source.path} ({'json lines' if source.jsonl else 'text'})")
    if len(done.sources.files) > 20:
        print(f"  ... and {len(done.sources.files) - 20} more")
    if done.eval_sources:
        print(f"held out: {len(done.eval_sources.files)} files (--eval-input)")
    print(f"tokenizer: {index.kind}, vocabulary {index.vocab_size}"
          + (f", end-of-text id {index.eos_id}, {index.tokenizer_cid}" if index.kind == "bpe" else ""))
    print(f"dtype {index.dtype}; {index.train_documents} train documents in {len(index.train)} shards, "
          f"{sum(f.tokens for f in index.train):,} tokens; {index.eval_documents} held-out documents, "
          f"{index.eval.tokens:,} tokens")
    print(f"index {args.out / 'index.json'}: {index.cid}")
    print(f"train on it with: --set data.tokens={args.out.resolve()} --set model.vocab_size={index.vocab_size}")
    return 0
