"""``DilocoxError``: the root of every error the product reports to its user in one line.

The CLI catches this one class (with the standard library's ``OSError`` and ``ValueError``) and
prints ``Name: message`` instead of a traceback; each package's user-facing errors (a bad
configuration, a corrupt object, refused evidence, a chain that reverts, ...) subclass it, keeping
their own names and, where they had one, their standard base (``ValueError``, ``RuntimeError``) so
that existing ``except`` clauses still catch them. It lives here, in the package every other one
may import (tests/unit/test_layering.py), so that every package can subclass it.
"""

from __future__ import annotations


class DilocoxError(Exception):
    """An error the product explains in one line: the message says what is wrong and where."""
