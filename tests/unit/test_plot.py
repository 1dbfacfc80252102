"""cli.plot: what a line of rounds.jsonl must hold to be plotted, and what is said when it does not."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from cli.plot import MAX_LINE_BYTES, MAX_SKIPS_NAMED, PlotError, RoundPoint, parse_line, read_rounds

GOOD = {"round": 2, "eval_loss": 1.5, "mean_train_loss": 1.7, "bytes_up": 10, "bytes_down": 20, "seconds": 3.5,
        "participants": ["w0"], "phases": {"store": 0.1}}


def line(**changes: object) -> bytes:
    return json.dumps({**GOOD, **changes}).encode()


def test_a_summary_line_gives_its_round() -> None:
    assert parse_line(line()) == RoundPoint(2, 1.5, 1.7, 10, 20, 3.5)
    assert parse_line(line(mean_train_loss=None)).train_loss is None  # genesis


@pytest.mark.parametrize("changes, said", [
    ({"round": -1}, '"round" is not a whole number >= 0'),
    ({"round": True}, '"round" is not a whole number >= 0'),
    ({"bytes_up": 1.5}, '"bytes_up" is not a whole number >= 0'),
    ({"eval_loss": "1.5"}, '"eval_loss" is not a finite number'),
    ({"seconds": -2.0}, '"seconds" is negative'),
    ({"mean_train_loss": "x"}, '"mean_train_loss" is neither a finite number nor null'),
])
def test_a_field_out_of_shape_is_named(changes: dict, said: str) -> None:
    with pytest.raises(ValueError, match=said):
        parse_line(line(**changes))


@pytest.mark.parametrize("data, said", [
    (b'{"round": 1, "eval_loss": NaN, "bytes_up": 1, "bytes_down": 1, "seconds": 1}', '"eval_loss" is not a finite'),
    (b"[1, 2]", "not a JSON object"),
    (b"{", "not JSON"),
    (b"\xff\xfe", "not UTF-8"),
    (b'{"a": "' + b"x" * MAX_LINE_BYTES + b'"}', "more than"),
])
def test_a_line_that_is_not_a_summary_is_named_without_quoting_it(data: bytes, said: str) -> None:
    with pytest.raises(ValueError, match=said) as caught:
        parse_line(data)
    assert len(str(caught.value)) < 200


def test_bad_lines_are_skipped_and_a_round_logged_twice_keeps_its_last(tmp_path: Path,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "rounds.jsonl"
    bad = [b"{cut short"] * (MAX_SKIPS_NAMED + 3)
    path.write_bytes(b"\n".join([line(round=0, mean_train_loss=None), line(round=1), *bad, line(round=1, seconds=9.0),
                                 b""]))
    with caplog.at_level(logging.WARNING, logger="dilocox.plot"):
        points = read_rounds(path)
    assert [(p.round, p.seconds) for p in points] == [(0, 3.5), (1, 9.0)]
    named = [r.getMessage() for r in caplog.records]
    assert len(named) == MAX_SKIPS_NAMED + 1 and named[0].startswith("rounds.jsonl line 3 skipped: ")
    assert named[-1] == "rounds.jsonl: 3 more malformed lines skipped"
    with pytest.raises(PlotError, match="does not exist"):
        read_rounds(tmp_path / "none.jsonl")
