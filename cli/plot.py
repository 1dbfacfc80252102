"""``dilocox plot --run DIR [--out FILE.png]``: a run's rounds as one PNG, from ``DIR/rounds.jsonl``.

Three panels against the round number, from the coordinator's summary line of each published round
(trainer.runstore.run_dir.RunDir.log_round):

    loss        the held-out loss of each checkpoint (``eval_loss``, genesis included) and the mean
                train loss its participants reported (``mean_train_loss``)
    traffic     bytes up (the round's pushes) and down (its global states fetched), all workers
    time        seconds from the round's opening to its publication (``seconds``)

``rounds.jsonl`` is read as untrusted input: at most :data:`MAX_FILE_BYTES`, lines of at most
:data:`MAX_LINE_BYTES`. A line that is not a JSON object with a whole ``round`` >= 0, a finite
``eval_loss``, whole ``bytes_up``/``bytes_down`` >= 0 and finite ``seconds`` >= 0 (and a finite or
null ``mean_train_loss``) is named by its number and skipped (a crash can cut the last line short);
a round logged twice (a restarted coordinator) keeps its last line. Default ``--out``:
``DIR/rounds.png``. Drawn with matplotlib's Agg backend: no display is needed.
"""

from __future__ import annotations

import argparse
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from storage_client import JSONBoundsError, loads_bounded
from trainer.runstore.run_dir import ROUNDS_LOG

MAX_FILE_BYTES = 64 << 20
MAX_LINE_BYTES = 1 << 20
MAX_SKIPS_NAMED = 10  # skipped lines named one by one; the rest counted

log = logging.getLogger("dilocox.plot")


class PlotError(ValueError):
    """No run to plot: the message names what is missing."""


@dataclass(frozen=True)
class RoundPoint:
    round: int
    eval_loss: float
    train_loss: float | None  # None for genesis
    bytes_up: int
    bytes_down: int
    seconds: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", required=True, metavar="DIR", help="run directory (its rounds.jsonl)")
    parser.add_argument("--out", metavar="FILE.png", help="the PNG to write (default: DIR/rounds.png)")


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_line(line: bytes) -> RoundPoint:
    """One summary line; ValueError saying what is wrong with it (never quoting it)."""
    try:
        obj = loads_bounded(line, max_bytes=MAX_LINE_BYTES, what="the line")
    except JSONBoundsError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    for key in ("round", "bytes_up", "bytes_down"):
        if not _whole(obj.get(key)):
            raise ValueError(f'"{key}" is not a whole number >= 0')
    for key in ("eval_loss", "seconds"):
        if not _finite(obj.get(key)):
            raise ValueError(f'"{key}" is not a finite number')
    if obj["seconds"] < 0:
        raise ValueError('"seconds" is negative')
    train = obj.get("mean_train_loss")
    if train is not None and not _finite(train):
        raise ValueError('"mean_train_loss" is neither a finite number nor null')
    return RoundPoint(obj["round"], float(obj["eval_loss"]), None if train is None else float(train),
                      obj["bytes_up"], obj["bytes_down"], float(obj["seconds"]))


def read_rounds(path: Path) -> list[RoundPoint]:
    """The rounds of ``path`` in round order (the last line of a round wins); bad lines named, skipped."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise PlotError(f"{str(path)[:300]} does not exist: is this a run directory (the coordinator's --run-dir)?") \
            from None
    if size > MAX_FILE_BYTES:
        raise PlotError(f"{str(path)[:300]} is {size} bytes, more than the {MAX_FILE_BYTES} read")
    points: dict[int, RoundPoint] = {}
    skipped = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                point = parse_line(line)
            except ValueError as exc:
                skipped += 1
                if skipped <= MAX_SKIPS_NAMED:
                    log.warning("%s line %d skipped: %s", path.name, number, exc)
                continue
            points[point.round] = point
    if skipped > MAX_SKIPS_NAMED:
        log.warning("%s: %d more malformed lines skipped", path.name, skipped - MAX_SKIPS_NAMED)
    return [points[r] for r in sorted(points)]


def _byte_scale(largest: float) -> tuple[float, str]:
    for size, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
        if largest >= size:
            return size, name
    return 1.0, "bytes"


def plot_rounds(points: list[RoundPoint], out: Path, title: str) -> None:
    """The three panels (module docstring) as one PNG at ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, bytes_ax, time_ax) = plt.subplots(3, 1, figsize=(8, 9), dpi=120, sharex=True)
    rounds = [p.round for p in points]
    loss_ax.plot(rounds, [p.eval_loss for p in points], marker="o", markersize=3, label="held-out (eval)")
    trained = [(p.round, p.train_loss) for p in points if p.train_loss is not None]
    if trained:
        loss_ax.plot(*zip(*trained), marker="s", markersize=3, linestyle="--", label="train (mean of workers)")
    loss_ax.set_ylabel("loss (nats/token)")
    loss_ax.legend(fontsize=8)
    published = [p for p in points if p.round > 0]  # genesis moves no bytes and takes no round time
    scale, unit = _byte_scale(max((max(p.bytes_up, p.bytes_down) for p in published), default=0))
    xs = [p.round for p in published]
    width = 0.4
    bytes_ax.bar([x - width / 2 for x in xs], [p.bytes_up / scale for p in published], width, label="up (pushes)")
    bytes_ax.bar([x + width / 2 for x in xs], [p.bytes_down / scale for p in published], width,
                 label="down (global states)")
    bytes_ax.set_ylabel(f"{unit} per round, all workers")
    bytes_ax.set_ylim(0, bytes_ax.get_ylim()[1] * 1.25)  # room for the legend above the bars
    bytes_ax.legend(fontsize=8, ncol=2, loc="upper center")
    time_ax.bar(xs, [p.seconds for p in published], 0.6, color="tab:gray")
    time_ax.set_ylabel("round time (s)")
    time_ax.set_xlabel("round")
    loss_ax.set_title(title)
    for ax in (loss_ax, bytes_ax, time_ax):
        ax.grid(True, alpha=0.3)
    time_ax.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    fig.savefig(out, format="png")
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    path = Path(args.run)
    if not path.is_dir():
        raise PlotError(f"--run {str(path)[:300]}: not a directory")
    points = read_rounds(path / ROUNDS_LOG)
    if not points:
        raise PlotError(f"{str(path / ROUNDS_LOG)[:300]} holds no readable round")
    out = Path(args.out) if args.out else path / "rounds.png"
    last = points[-1]
    plot_rounds(points, out, f"run {path.name}: {len(points) - 1 if points[0].round == 0 else len(points)} "
                             f"round(s), held-out loss {points[0].eval_loss:.3f} → {last.eval_loss:.3f}")
    print(f"wrote {out} ({len(points)} rounds from {path / ROUNDS_LOG})")
    return 0
