"""Atomic file writes: a reader, or a rerun after a kill, sees the old file or the new one, never a torn one.

Every file tf_nvlink and its examples write goes through here (the autotune cache, benchmark JSON and plots,
checkpoints, the saved model, the resume backup).

Example:
    >>> from tf_nvlink.util import atomic_files
    >>> atomic_files.write_atomic("results.json", json.dumps(records), mode=None)
    >>> with atomic_files.atomic_path("model.keras", suffix=".keras") as partial:
    ...     model.save(partial)
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Iterator, Optional, Union


def write_atomic(path: str, data: Union[str, bytes], mode: Optional[int] = 0o600) -> None:
    """Replace `path` with `data` so that readers (and a later run after a kill) see the old file or the new one,
    never a torn one: a temporary file beside `path`, fsync, os.replace, fsync of the folder.

    `mode` 0o600 (the default) makes the file readable by its user only, whatever the umask; None gives the
    permissions a plain open() would (0o666 less the umask), for results meant to be shared.

    Example:
        >>> write_atomic("results.json", json.dumps(records), mode=None)
    """
    with atomic_path(path, mode=mode) as temporary:
        with open(temporary, "wb" if isinstance(data, bytes) else "w",
                  **({} if isinstance(data, bytes) else {"encoding": "utf-8"})) as handle:
            handle.write(data)


@contextlib.contextmanager
def atomic_path(path: str, suffix: str = "", mode: Optional[int] = None) -> Iterator[str]:
    """A fresh temporary path beside `path` for a writer that wants a file name (Keras' model.save, savefig);
    once the block ends without an exception the file is fsynced and renamed over `path`.

    The temporary name is hidden (".name.<random>.tmp<suffix>") and ends with `suffix`, for writers that check
    the extension (Keras wants ".keras" or ".weights.h5"). On an exception it is deleted and `path` is left as it
    was; after a kill it can stay behind, never under `path`'s name. `mode` as for `write_atomic` (None: 0o666 less
    the umask).

    Example:
        >>> with atomic_path("model.keras", suffix=".keras") as partial:
        ...     model.save(partial)
    """
    directory = os.path.dirname(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".tmp" + suffix)
    try:
        try:
            os.fchmod(fd, mode if mode is not None else 0o666 & ~_umask())
        finally:
            os.close(fd)
        yield temporary
        with open(temporary, "rb+") as handle:  # the writer may have replaced the file: sync what is there now
            os.fsync(handle.fileno())
        if mode is not None:
            os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def unwritable_reason(path: str) -> Optional[str]:
    """Why `write_atomic(path, ...)` would fail, found by creating (and removing) a temporary file beside `path`;
    None when it would work. Check before minutes of measuring, not after.

    Example:
        >>> unwritable_reason("/proc/results.json")
        "cannot write in /proc (Permission denied)"
    """
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder, not a file name"
    if not os.path.isdir(directory):
        what = "is not a folder" if os.path.exists(directory) else "does not exist"
        return f"{directory} {what}"
    try:
        fd, probe = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".", suffix=".probe")
    except OSError as exc:
        return f"cannot write in {directory} ({exc.strerror or exc})"
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else by setting it back at once."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    current = os.umask(0o022)
    os.umask(current)
    return current
