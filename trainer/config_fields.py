"""How a run-configuration field declares itself, so that it is described in one place.

A field of a configuration section (trainer.config, trainer.codec.CompressionConfig) says
what it is with its type and :func:`setting`: a ``Literal[...]`` type lists its choices, and the
field's metadata holds its one-line help and its accepted :class:`Range`. The validation of a
configuration, the reading of ``--set section.field=value`` and the field list of ``dilocox config
--help`` are derived from these declarations (trainer.config), never written out a second time.

This module imports nothing from the rest of the project, so that every section can use it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, NamedTuple, get_args, get_origin


class Range(NamedTuple):
    """The accepted values of a numeric field: ``[low, high]``, either end open.

    ``off`` is one more accepted value outside the interval that turns the field's feature off
    (``rounds.clip_multiple = 0``: no clipping), ``off_means`` says what it does. A range
    ``with_relations`` is checked with the relations between fields, after every field is known to
    be finite: its refusal reads ``must be in`` (or ``must be 0 (...) or in``) without ``is out of
    range``, and a NaN or infinity there is refused as not finite (the messages of the fields that
    were checked that way when runs already existed).
    """

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    off: float | None = None
    off_means: str = ""
    with_relations: bool = False

    def __str__(self) -> str:
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"

    def admits(self, value: float) -> bool:
        """Whether ``value`` is accepted: finite, and ``off`` or inside the interval."""
        if not math.isfinite(value):
            return False
        if self.off is not None and value == self.off:
            return True
        above = self.low < value if self.low_open else self.low <= value
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def refusal(self, name: str, value: Any) -> str:
        """The problem of ``name = value`` outside the range, naming the field, value and range."""
        accepted = f"{self.off:g} ({self.off_means}) or in {self}" if self.off is not None else f"in {self}"
        if self.with_relations:
            return f"{name} = {value!r} must be {accepted}"
        return f"{name} = {value!r} is out of range: must be {accepted}"

    def describe(self) -> str:
        """For the field list of --help: the interval, and the off value when there is one."""
        return f"{self.off:g} or {self}" if self.off is not None else str(self)


def setting(default: Any, help: str, accepted: Range | None = None, *, omitted_at_default: bool = False,
            **metadata: Any) -> Any:
    """A configuration field: its default, its one-line help and its accepted range.

    ``omitted_at_default``: the field is left out of the configuration's JSON while it holds its
    default (added after runs existed, it keeps the CIDs of configurations that do not use it).
    Further ``metadata`` is the section's own: the RoPE types that read a model field
    (``rope_types``), or, for a choice field whose other values exist elsewhere, why they are
    refused as not supported (``unsupported``, see :func:`choice_refusal`).
    """
    metadata = {"help": help, **metadata}
    if accepted is not None:
        metadata["range"] = accepted
    if omitted_at_default:
        metadata["omitted_at_default"] = True
    return dataclasses.field(default=default, metadata=metadata)


def choices_of(kind: Any) -> tuple[str, ...] | None:
    """The values a ``Literal[...]`` field type allows; None for any other type."""
    return tuple(get_args(kind)) if get_origin(kind) is Literal else None


def choice_refusal(name: str, value: Any, choices: tuple[str, ...], unsupported: str | None = None) -> str:
    """The problem of a choice field holding ``value``, with at most 40 characters of it.

    ``unsupported``, for a field whose other values exist outside the project (another model
    family, another RoPE type) and are refused as not supported: None for a closed set of choices,
    else why no more are offered ("" to say nothing more)."""
    shown = f"{name} = {str(value)[:40]!r}"
    if unsupported is None:
        return f"{shown} must be one of {', '.join(choices)}"
    because = f" ({unsupported})" if unsupported else ""
    return f"{shown} is not supported: must be one of {', '.join(choices)}{because}"
