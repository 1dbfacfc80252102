"""Progress of long work: one counter, shown as a bar on a terminal or as periodic lines.

A long step (tokenizing a corpus, a worker's inner steps, the pipeline stages' start, the audit's
replay, an export) counts its work with a :class:`Progress`: ``done`` of ``total`` units (steps,
bytes, rounds), and optionally an ``amount`` whose rate is shown instead (tokens for inner steps).
Rate and ETA are computed here and nowhere else, over the time t since the counter started:

    rate = amount / t                      (amount = done unless the step counts one)
    ETA  = (total − done) · t / done        (unknown while done = 0, or without a total)

and read, as a line (:meth:`Snapshot.line`),

    <what>: i/N (x%), <rate>, ETA mm:ss        while it runs
    <what>: N/N (100%), <rate>, done in mm:ss  at the end ("stopped after mm:ss" on a failure)

Where it goes (a *sink*): long-running processes (workers, stage processes, the coordinator) log
the line through ``logging`` at most every P seconds, and once at the end; a command's console
(:func:`use_console`, set by the CLI) draws a rich bar on stderr when stderr is a terminal, and
writes the same plain lines to stderr when it is piped, so stdout keeps what the command prints.
P is ``DILOCOX_PROGRESS_EVERY`` seconds (default :data:`DEFAULT_EVERY_S`; 0 shows every update,
which tests use to read the lines of short runs).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

EVERY_ENV = "DILOCOX_PROGRESS_EVERY"
DEFAULT_EVERY_S = 10.0
MAX_EVERY_S = 86_400.0
# The plain log format of long-running processes (the CLI's when piped, and the stage processes').
PLAIN_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger("dilocox.progress")


def every_s() -> float:
    """P: seconds between periodic lines, from ``DILOCOX_PROGRESS_EVERY`` (a number in [0, 86400];
    anything else is named once and the default used)."""
    text = os.environ.get(EVERY_ENV)
    if text is None:
        return DEFAULT_EVERY_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= MAX_EVERY_S:  # also refuses NaN
        _warn_once(f"{EVERY_ENV}={text[:40]!r} is not a number of seconds in [0, {MAX_EVERY_S:g}]; "
                   f"using {DEFAULT_EVERY_S:g}")
        return DEFAULT_EVERY_S
    return value


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def format_duration(seconds: float) -> str:
    """mm:ss, or h:mm:ss from an hour on; "--:--" when unknown (NaN, infinite or negative)."""
    if not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


BYTES = "B"  # the unit whose counts and rates are shown in kB, MB, GB


def format_count(value: float, unit: str = "") -> str:
    """A count as people read it: bytes in kB/MB/GB (decimal), other counts with thousands
    separators, or with one or two decimals below 100."""
    if unit == BYTES:
        for size, name in ((1e9, "GB"), (1e6, "MB"), (1e3, "kB")):
            if abs(value) >= size:
                return f"{value / size:.1f} {name}"
        return f"{value:.0f} B"
    if abs(value) >= 100 or float(value).is_integer():
        return f"{value:,.0f}"
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def format_rate(per_s: float, unit: str) -> str:
    """``1,234 tokens/s``, ``3.1 MB/s``, ``0.45 steps/s``; "—/s" when unknown."""
    if not math.isfinite(per_s):
        return f"— {unit}/s" if unit and unit != BYTES else "—/s"
    if unit == BYTES:
        return f"{format_count(per_s, BYTES)}/s"
    return f"{format_count(per_s)} {unit}/s" if unit else f"{format_count(per_s)}/s"


@dataclass(frozen=True)
class Snapshot:
    """Where a counter stands: what it has done of what, in how long."""

    what: str
    done: float
    total: float | None
    amount: float  # what the rate is of: ``done``, or a separate count (tokens)
    elapsed_s: float
    unit: str = ""  # of done and total ("B": shown as bytes)
    rate_unit: str = ""  # of the rate: the amount's unit
    stopped: bool = False  # ended by a failure or an interruption, not by finishing

    @property
    def rate(self) -> float:
        return self.amount / self.elapsed_s if self.elapsed_s > 0 else math.nan

    @property
    def eta_s(self) -> float:
        if self.total is None or self.done <= 0 or self.elapsed_s <= 0:
            return math.nan
        return max(0.0, self.total - self.done) * self.elapsed_s / self.done

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(1.0, max(0.0, self.done / self.total))

    def counts(self) -> str:
        """``i/N (x%)``, or ``i`` without a total."""
        done = format_count(self.done, self.unit)
        if self.total is None:
            return done
        suffix = f" {self.unit}" if self.unit and self.unit != BYTES else ""
        return f"{done}/{format_count(self.total, self.unit)}{suffix} ({100 * (self.fraction or 0):.0f}%)"

    def detail(self, final: bool = False) -> str:
        """Everything after ``<what>: ``."""
        when = (f"stopped after {format_duration(self.elapsed_s)}" if final and self.stopped
                else f"done in {format_duration(self.elapsed_s)}" if final
                else f"ETA {format_duration(self.eta_s)}" if self.total is not None
                else f"{format_duration(self.elapsed_s)} so far")
        return f"{self.counts()}, {format_rate(self.rate, self.rate_unit)}, {when}"

    def line(self, final: bool = False) -> str:
        return f"{self.what}: {self.detail(final)}"


class Sink(Protocol):
    """Where a counter's state is shown. ``every_s``: the least time between two ``show`` calls
    while it runs (0: every update); ``close`` is called once, with the final state."""

    every_s: float

    def show(self, snapshot: Snapshot) -> None: ...

    def close(self, snapshot: Snapshot) -> None: ...


class LineSink:
    """Plain lines through ``emit`` (a logger's ``info``, or a write to stderr), every P seconds."""

    def __init__(self, emit: Callable[[str], None], every: float | None = None) -> None:
        self.emit = emit
        self.every_s = every_s() if every is None else every

    def show(self, snapshot: Snapshot) -> None:
        self.emit(snapshot.line())

    def close(self, snapshot: Snapshot) -> None:
        self.emit(snapshot.line(final=True))


_live_bar = threading.Lock()  # rich draws one live display at a time


class BarSink:
    """A rich progress bar on stderr (a terminal), redrawn by rich at its own bounded rate; a counter
    started while another bar is drawn prints its lines above that bar instead."""

    every_s = 0.0

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(stderr=True)
        self._bar = None
        self._task = None
        self._lines: LineSink | None = None
        self._next_line_at = 0.0

    def _start(self, snapshot: Snapshot) -> None:
        from rich.progress import BarColumn, Progress as RichProgress, TextColumn

        if not _live_bar.acquire(blocking=False):
            self._lines = LineSink(lambda text: self.console.print(text, markup=False, highlight=False))
            return
        self._bar = RichProgress(TextColumn("{task.description}", markup=False), BarColumn(),
                                 TextColumn("{task.fields[detail]}", markup=False), console=self.console)
        self._bar.start()
        self._task = self._bar.add_task(snapshot.what, total=snapshot.total, detail="")

    def show(self, snapshot: Snapshot) -> None:
        if self._bar is None and self._lines is None:
            self._start(snapshot)
        if self._lines is not None:
            if snapshot.elapsed_s >= self._next_line_at:
                self._next_line_at = snapshot.elapsed_s + self._lines.every_s
                self._lines.show(snapshot)
            return
        self._bar.update(self._task, total=snapshot.total, completed=snapshot.done, detail=snapshot.detail())

    def close(self, snapshot: Snapshot) -> None:
        if self._lines is not None:
            self._lines.close(snapshot)
            return
        if self._bar is None:
            self._start(snapshot)
            if self._lines is not None:
                self._lines.close(snapshot)
                return
        self._bar.update(self._task, total=snapshot.total, completed=snapshot.done, detail=snapshot.detail(True))
        self._bar.stop()
        self._bar = None
        _live_bar.release()


def log_sink(logger: logging.Logger = log) -> LineSink:
    """Lines through ``logger.info``: what workers and other long-running processes use."""
    return LineSink(logger.info)


def console_sink() -> Sink:
    """A command's console: a bar when stderr is a terminal, plain lines on stderr when piped."""
    if sys.stderr.isatty():
        return BarSink()

    def write(text: str) -> None:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()

    return LineSink(write)


_default_sink: Callable[[], Sink] = log_sink


def use_console() -> None:
    """Show this process's progress on its console (a CLI command) instead of in its log."""
    global _default_sink
    _default_sink = console_sink


class Progress:
    """A counter of ``what`` toward ``total`` (None: unknown) in ``unit``s, shown on ``sink`` (the
    process's default: its log, or its console after :func:`use_console`). Use it as a context
    manager (an exception makes the final line say "stopped after"), or call :meth:`close` once:
    the final line is shown then (with ``final_if_shown``, only after a periodic line: a quick
    step inside a longer one says nothing). ``rate_unit`` names what the
    rate counts when :meth:`advance` is given an ``amount`` (tokens), else the rate is of ``unit``s."""

    def __init__(self, what: str, total: float | None = None, *, unit: str = "", rate_unit: str | None = None,
                 sink: Sink | None = None, clock: Callable[[], float] = time.monotonic,
                 final_if_shown: bool = False) -> None:
        self.what, self.total, self.unit = what, total, unit
        self.final_if_shown = final_if_shown  # a step inside another: its final line only if it was long
        self.shown = False
        self.rate_unit = unit if rate_unit is None else rate_unit
        self.sink = sink if sink is not None else _default_sink()
        self.clock = clock
        self.started = clock()
        self.done = 0.0
        self.amount = 0.0
        self._shown_at = self.started  # the first line comes one period in (a bar draws at once) ...
        # ... but a step inside another draws no bar either until it has taken one period.
        self._quiet_until = self.started + (every_s() if final_if_shown else 0.0)
        self.closed = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(stopped=exc_type is not None)

    def snapshot(self, stopped: bool = False) -> Snapshot:
        return Snapshot(self.what, self.done, self.total, self.amount, self.clock() - self.started, self.unit,
                        self.rate_unit, stopped)

    def advance(self, n: float = 1, amount: float | None = None) -> None:
        """``n`` more units done (``amount`` more of what the rate counts; default ``n``)."""
        self.done += n
        self.amount += n if amount is None else amount
        self.tick()

    def add_total(self, n: float) -> None:
        """The work turned out ``n`` units larger (negative: smaller)."""
        self.total = (self.total or 0) + n

    def tick(self) -> None:
        """Show the state if the sink's period has passed (also when nothing advanced: a wait)."""
        if self.closed:
            return
        now = self.clock()
        if now >= self._quiet_until and now - self._shown_at >= self.sink.every_s:
            self._shown_at, self.shown = now, True
            self.sink.show(self.snapshot())

    def close(self, stopped: bool = False) -> None:
        """The final line: ``done in``, or ``stopped after`` when the work ended otherwise."""
        if not self.closed:
            self.closed = True
            if self.shown or not self.final_if_shown:
                self.sink.close(self.snapshot(stopped))


__all__ = ["BYTES", "DEFAULT_EVERY_S", "EVERY_ENV", "PLAIN_LOG_FORMAT", "LineSink", "Progress", "Snapshot",
           "console_sink", "every_s", "format_count", "format_duration", "format_rate", "log_sink", "use_console"]
