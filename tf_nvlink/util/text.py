"""Small text helpers every part shares: strict JSON, one-line error text, a plain-text table.

Example:
    >>> strict_loads('{"a": 1}')
    {'a': 1}
    >>> one_line_error(ValueError("in user code:\\n  File x\\n  ValueError: boom"))
    'ValueError: boom'
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Collection, Sequence


class StrictJsonError(ValueError):
    """JSON that Python's json module accepts but JSON does not (NaN, Infinity, overflow) or that is ambiguous
    (a key twice in one object). `kind` is "constant", "overflow" or "duplicate"; `detail` the offending text."""

    def __init__(self, kind: str, detail: str, message: str):
        super().__init__(message)
        self.kind, self.detail = kind, detail


def _reject_constant(name: str):
    raise StrictJsonError("constant", name, f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise StrictJsonError("overflow", text, f"number {text} overflows")
    return value


def _no_duplicates(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise StrictJsonError("duplicate", key, f"duplicate key {key!r}")
        result[key] = value
    return result


def strict_loads(text: str, overflow_ok: bool = False) -> Any:
    """json.loads that rejects NaN, Infinity, numbers that overflow to infinity (unless `overflow_ok`: the caller
    checks its numbers itself and names the bad one), and duplicate keys (StrictJsonError, a ValueError;
    malformed JSON raises json.JSONDecodeError as usual)."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=float if overflow_ok else _finite_float,
                      object_pairs_hook=_no_duplicates)


_EXCEPTION_LINE = re.compile(r"^[\w.]+(Error|Exception|Exit|Interrupt)\b")
_TRACEBACK_FRAMES = ("Traceback (most recent call last)", 'File "', "^", "~")


def one_line_error(error, limit: int = 400, empty: str = "unknown error") -> str:
    """An error as one line for a table row or a log line, never a traceback's frames.

    TensorFlow's "in user code:" errors put the actual message on their last line; for an exception that last
    line is taken, prefixed with the exception's type; text holding a Python traceback (a worker's stderr) gives
    its last exception line; other text keeps all its lines, joined. `empty` stands for no text at all.

    Example:
        >>> one_line_error('Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad')
        'ValueError: bad'
    """
    lines = [line.strip() for line in str(error if error is not None else "").splitlines() if line.strip()]
    if isinstance(error, BaseException):
        message = lines[-1] if lines else ""
        name = type(error).__name__
        text = message if message.startswith(name) else f"{name}: {message}"
    elif any(line.startswith(_TRACEBACK_FRAMES[:2]) for line in lines):
        exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
        text = (exceptions or [line for line in lines if not line.startswith(_TRACEBACK_FRAMES)] or lines)[-1]
    else:
        text = (lines[-1] if len(lines) > 1 and "in user code" in lines[0] else " ".join(lines)) or empty
    return text if len(text) <= limit else text[:limit - 3] + "..."


def write_failure(tool: str, what: str, path: str, error: BaseException,
                  kept: str = "the results are printed above") -> str:
    """The one error line of a command whose measurement is kept although its output file could not be written.

    Example:
        >>> write_failure("tf-nvlink bench", "write --json", "/ro/x.json", PermissionError(13, "Permission denied"))
        "tf-nvlink bench: error: could not write --json '/ro/x.json' (Permission denied); the results are printed above."
    """
    why = getattr(error, "strerror", None) or error
    return f"{tool}: error: could not {what} {path!r} ({why}); {kept}."


def table(rows: Sequence[Sequence[str]], right: Collection[int] = (), header_rows: int = 0) -> list[str]:
    """Rows of cells as aligned lines: each column as wide as its widest cell, those in `right` right-aligned.

    With `header_rows`, nccl-tests style: the first `header_rows` lines (names, units) start with "# ", the
    others with two spaces.

    Example:
        >>> table([["name", "GB/s"], ["nccl", "176"]], right={1}, header_rows=1)
        ['# name  GB/s', '  nccl   176']
    """
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))] if rows else []
    lines = []
    for r, row in enumerate(rows):
        cells = [cell.rjust(widths[c]) if c in right else cell.ljust(widths[c]) for c, cell in enumerate(row)]
        lead = ("# " if r < header_rows else "  ") if header_rows else ""
        lines.append(lead + "  ".join(cells).rstrip())
    return lines
