"""``dilocox gc --run DIR [--dry-run]``: remove the store objects the run no longer references.

What the run needs is what trainer.runstore.gc reaches from HEAD's manifest chain, the open round's
journal and the admission records; everything else (refused or abandoned pushes, a manifest HEAD
never moved to) is removed. Refused while a coordinator serves the run (it holds
``coordinator.lock``); gc holds that lock while it works, so no coordinator starts meanwhile.

Exit status: 0 when collected (or, with --dry-run, counted), 2 when it could not run.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

EXIT_OK, EXIT_ERROR = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory (its store/ and HEAD)")
    parser.add_argument("--dry-run", action="store_true", help="count what would be removed; remove nothing")


def run(args: argparse.Namespace) -> int:
    from storage_client import RUN_STORE_DIR
    from trainer.coordinator.server import RunDirBusy, lock_run_dir
    from trainer.runstore.gc import collect
    from trainer.runstore.run_dir import RunDir, RunDirError

    if not (Path(args.run) / RUN_STORE_DIR).is_dir():
        print(f"gc: {args.run} is not a run directory (no store/)")
        return EXIT_ERROR
    run_dir = RunDir(args.run)
    try:
        lock = lock_run_dir(run_dir)
    except RunDirBusy as exc:
        print(f"gc: refused: {exc}")
        return EXIT_ERROR
    try:
        done = collect(run_dir, dry_run=args.dry_run)
    except (RunDirError, ValueError, OSError) as exc:
        print(f"gc: {str(exc)[:300]}")
        return EXIT_ERROR
    finally:
        os.close(lock)
    verb = "would remove" if args.dry_run else "removed"
    print(f"gc: {verb} {done.removed} unreferenced object(s), {done.freed_bytes} bytes; kept {done.kept}")
    return EXIT_OK
