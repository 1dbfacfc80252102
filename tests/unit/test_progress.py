"""trainer.progress: the rate and ETA of a counter, its lines, and how often they are shown."""

from __future__ import annotations

import math

import pytest

from trainer.progress import (
    BYTES, DEFAULT_EVERY_S, EVERY_ENV, BarSink, LineSink, Progress, Snapshot, every_s, format_count, format_duration,
    format_rate,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_durations_read_as_minutes_and_seconds_then_hours() -> None:
    assert format_duration(0) == "00:00"
    assert format_duration(59.4) == "00:59"
    assert format_duration(61) == "01:01"
    assert format_duration(3599) == "59:59"
    assert format_duration(3600 * 2 + 61) == "2:01:01"
    assert format_duration(math.nan) == format_duration(math.inf) == format_duration(-1) == "--:--"


def test_counts_and_rates() -> None:
    assert format_count(1234567) == "1,234,567"
    assert format_count(12.345) == "12.3"
    assert format_count(0.456) == "0.46"
    assert format_count(3) == "3"
    assert format_count(2_500_000, BYTES) == "2.5 MB"
    assert format_count(999, BYTES) == "999 B"
    assert format_rate(1234.5, "tokens") == "1,234 tokens/s"
    assert format_rate(3.1e6, BYTES) == "3.1 MB/s"
    assert format_rate(0.25, "steps") == "0.25 steps/s"
    assert format_rate(math.nan, "steps") == "— steps/s"


def test_rate_and_eta_of_a_snapshot() -> None:
    snap = Snapshot("round 3 inner steps", done=12, total=48, amount=12 * 512, elapsed_s=6.0, unit="steps",
                    rate_unit="tokens")
    assert snap.rate == pytest.approx(1024)
    assert snap.eta_s == pytest.approx(18.0)  # 36 steps left at 2 steps/s
    assert snap.line() == "round 3 inner steps: 12/48 steps (25%), 1,024 tokens/s, ETA 00:18"
    assert snap.line(final=True) == "round 3 inner steps: 12/48 steps (25%), 1,024 tokens/s, done in 00:06"
    nothing = Snapshot("x", 0, 10, 0, 0.0)
    assert math.isnan(nothing.rate) and math.isnan(nothing.eta_s)
    assert nothing.line() == "x: 0/10 (0%), —/s, ETA --:--"
    unknown = Snapshot("scan", 5, None, 5, 65.0)
    assert unknown.line() == "scan: 5, 0.08/s, 01:05 so far"
    over = Snapshot("x", 12, 10, 12, 1.0)  # more done than expected: capped at 100%, ETA zero
    assert over.line() == "x: 12/10 (100%), 12/s, ETA 00:00"


def test_lines_come_once_a_period_and_once_at_the_end() -> None:
    clock, lines = Clock(), []
    with Progress("prepare", 100, unit=BYTES, sink=LineSink(lines.append, every=10.0), clock=clock) as progress:
        for _ in range(50):  # 50 updates over 25 s: a line at 10 s and 20 s
            clock.now += 0.5
            progress.advance(2)
    assert len(lines) == 3, lines
    assert lines[0] == "prepare: 40 B/100 B (40%), 4 B/s, ETA 00:15"
    assert lines[-1] == "prepare: 100 B/100 B (100%), 4 B/s, done in 00:25"
    with pytest.raises(KeyError), Progress("x", 4, sink=LineSink(lines.append, every=10.0), clock=clock) as failing:
        failing.advance()
        raise KeyError("failed half-way")
    assert lines[-1] == "x: 1/4 (25%), 1/s, stopped after 00:00".replace("1/s", "—/s")


def test_period_zero_shows_every_update_and_a_wait_ticks() -> None:
    clock, lines = Clock(), []
    progress = Progress("stages ready", 2, sink=LineSink(lines.append, every=0.0), clock=clock)
    clock.now += 1
    progress.tick()
    progress.advance(amount=0)
    progress.add_total(1)
    progress.advance()
    progress.close()
    progress.close()  # once only
    assert lines == ["stages ready: 0/2 (0%), 0/s, ETA --:--",
                     "stages ready: 1/2 (50%), 0/s, ETA 00:01",
                     "stages ready: 2/3 (67%), 1/s, ETA 00:00",
                     "stages ready: 2/3 (67%), 1/s, done in 00:01"]


@pytest.mark.parametrize("text, expected", [("0.2", 0.2), ("0", 0.0), ("x", DEFAULT_EVERY_S), ("-1", DEFAULT_EVERY_S),
                                            ("nan", DEFAULT_EVERY_S), ("1e9", DEFAULT_EVERY_S)])
def test_the_period_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, text: str, expected: float) -> None:
    monkeypatch.setenv(EVERY_ENV, text)
    assert every_s() == expected
    monkeypatch.delenv(EVERY_ENV)
    assert every_s() == DEFAULT_EVERY_S


def test_a_quick_inner_step_says_nothing_a_long_one_says_how_it_ended() -> None:
    clock, lines = Clock(), []
    with Progress("verifying a.bin", 10, sink=LineSink(lines.append, every=10.0), clock=clock,
                  final_if_shown=True) as quick:
        quick.advance(10)
    assert lines == []
    with Progress("verifying b.bin", 10, sink=LineSink(lines.append, every=10.0), clock=clock,
                  final_if_shown=True) as slow:
        clock.now += 11
        slow.advance(5)
        slow.advance(5)
    assert lines == ["verifying b.bin: 5/10 (50%), 0.45/s, ETA 00:11",
                     "verifying b.bin: 10/10 (100%), 0.91/s, done in 00:11"]


def test_a_bar_and_a_counter_started_under_it(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    outer = Progress("outer", 2, unit="steps", sink=BarSink(), clock=clock)
    clock.now += 1
    outer.advance()
    inner = Progress("inner", 1, sink=BarSink(), clock=clock)  # one live bar at a time: lines above it
    inner.advance()
    inner.close()
    outer.advance()
    outer.close()
    err = capsys.readouterr().err
    assert "inner: 1/1 (100%), " in err and "done in 00:00" in err
    assert "outer" in err and "2/2 steps (100%)" in err
    again = Progress("again", 1, sink=BarSink(), clock=clock)  # the bar is free again
    again.advance()
    again.close()
    assert again.sink._bar is None and "again" in capsys.readouterr().err
