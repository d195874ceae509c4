"""Errors as one line, for table rows and log lines: never a traceback's frames.

Example:
    >>> one_line_error(ValueError("in user code:\\n  File x\\n  ValueError: boom"))
    'ValueError: boom'
"""

from __future__ import annotations

import re


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
