"""JSON read strictly: no NaN, no infinities, no numbers that overflow, no key twice in one object.

Example:
    >>> strict_loads('{"a": 1}')
    {'a': 1}
"""

from __future__ import annotations

import json
import math
from typing import Any


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
