"""The autotune cache: where `tf-nvlink tune` stores each machine's measured winner, and reading it back.

    $TF_NVLINK_CACHE_DIR/autotune.json, else $XDG_CACHE_HOME/tf_nvlink/autotune.json,
    else ~/.cache/tf_nvlink/autotune.json

Keyed by topology fingerprint, TensorFlow version and GPU set. Written atomically (temporary file in the same
folder, fsync, os.replace) under an exclusive `fcntl.flock` on `autotune.json.lock`, so concurrent processes never
lose each other's entries; mode 0o600 in a 0o700 folder. Parsed strictly (no NaN/Infinity, no duplicate keys,
every field type-checked); a corrupt file is ignored with one warning on the "tf_nvlink" logger and replaced by
the next store. No TensorFlow import (the installed version is read from the package metadata).

Example:
    >>> from tf_nvlink.plan import tune_cache
    >>> tune_cache.stored_choice(tf_nvlink.probe(), (0, 1))   # what cross_device_ops="auto" can use
    ('nccl', 1, 'autotuned on this machine: nccl:1 measured fastest ...')
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import os
import re
import sys
from stat import S_ISREG
from typing import Any, Iterator, Optional, Sequence, Union

from tf_nvlink.util import atomic_files

from tf_nvlink.plan import policy
from tf_nvlink.util.atomic_files import write_atomic
from tf_nvlink.plan.allreduce_sizes import MAX_PACKS, MAX_SIZE, format_size
from tf_nvlink.util.strict_json import strict_loads

try:
    import fcntl as _FCNTL  # POSIX only
except ImportError:  # pragma: no cover - Windows
    _FCNTL = None

log = logging.getLogger("tf_nvlink")

CACHE_FILE = "autotune.json"
FORMAT_VERSION = 1
MAX_CACHE_BYTES = 4 * 2**20
GpuSet = Union[Sequence[int], str]  # NVML indices, or "cpu:N" for logical CPU devices
# Ranges a hand-edited cache entry must stay within (beyond them it cannot be a measurement of this library's).
MAX_REPLICAS = 1024  # GPUs (or logical CPU devices) in one process
MAX_SCORE_GBPS = 1e6  # busbw; NVLink 5 is 900 GB/s per direction


class CacheError(ValueError):
    """A cache file or record that does not have the expected shape."""


def cache_dir() -> str:
    """$TF_NVLINK_CACHE_DIR, else $XDG_CACHE_HOME/tf_nvlink (when absolute, as the XDG spec requires), else
    ~/.cache/tf_nvlink."""
    explicit = os.environ.get("TF_NVLINK_CACHE_DIR")
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CACHE_HOME") or ""
    if not os.path.isabs(base):  # the XDG spec: a relative path is invalid and must be ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tf_nvlink")


def cache_path() -> str:
    """The autotune cache file (it may not exist yet)."""
    return os.path.join(cache_dir(), CACHE_FILE)


def gpus_key(gpus: GpuSet) -> str:
    """The device-set part of a key: "gpus:0,1" (sorted NVML indices) or "cpu:2".

    Example:
        >>> gpus_key((1, 0)), gpus_key("cpu:2")
        ('gpus:0,1', 'cpu:2')
    """
    if isinstance(gpus, str):
        text = gpus.strip().lower()
        if re.fullmatch(r"cpu:[1-9]\d*", text):
            return text
        if re.fullmatch(r"\d+(,\d+)*", text):
            gpus = [int(i) for i in text.split(",")]
        else:
            raise CacheError(f"gpus should be NVML indices such as [0, 1] or '0,1', or 'cpu:N'. Received: {gpus!r}")
    indices = list(gpus)
    if not indices or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in indices) or \
            len(set(indices)) != len(indices):
        raise CacheError(f"gpus should be distinct non-negative NVML indices such as [0, 1], or 'cpu:N'. "
                         f"Received: {gpus!r}")
    return "gpus:" + ",".join(map(str, sorted(indices)))


def make_key(fingerprint: str, tf_version: str, gpus: GpuSet) -> str:
    """The cache key: topology fingerprint, TensorFlow version and device set."""
    return f"{fingerprint}|tensorflow-{tf_version}|{gpus_key(gpus)}"


def _is_int(value, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


def validate_record(record: Any) -> dict:
    """Type-check one stored winner; returns it, or raises CacheError naming the bad field."""
    if not isinstance(record, dict):
        raise CacheError(f"a record should be a JSON object. Received: {type(record).__name__}")
    checks = {
        "fingerprint": lambda v: isinstance(v, str) and bool(v),
        "tf_version": lambda v: isinstance(v, str) and bool(v),
        "gpus": lambda v: (isinstance(v, str) and bool(re.fullmatch(r"cpu:[1-9]\d{0,3}", v))) or (
            isinstance(v, list) and 0 < len(v) <= MAX_REPLICAS and all(_is_int(i) and i < MAX_REPLICAS for i in v)
            and len(set(v)) == len(v)),
        "candidate": lambda v: isinstance(v, str) and bool(v),
        "cross_device_ops": lambda v: v in policy.OPS,
        "num_packs": lambda v: v is None or (_is_int(v) and v <= MAX_PACKS),
        "score": lambda v: _is_number(v) and v <= MAX_SCORE_GBPS,
        "sizes": lambda v: isinstance(v, list) and bool(v) and all(_is_int(s, 1) and s <= MAX_SIZE for s in v),
        "scores": lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_number(x) and x <= MAX_SCORE_GBPS
                                                        for k, x in v.items()),
        "n_replicas": lambda v: _is_int(v, 1) and v <= MAX_REPLICAS,
        "measured_at": lambda v: isinstance(v, str),
    }
    for field, ok in checks.items():
        if field not in record:
            raise CacheError(f"record lacks {field!r}")
        if not ok(record[field]):
            raise CacheError(f"record field {field!r} has a bad value: {record[field]!r}")
    if record["num_packs"] is not None and record["cross_device_ops"] not in policy.PACKED_OPS:
        raise CacheError(f"num_packs is set for {record['cross_device_ops']!r}, which does not pack")
    return record


_WARNED: set = set()


def _warn_once(path: str, stat: Optional[os.stat_result], message: str) -> None:
    """One warning per cache file content (a new file, even corrupt again, warns again)."""
    key = (path,) + ((stat.st_dev, stat.st_ino, stat.st_mtime_ns, stat.st_size) if stat else ())
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning("tf_nvlink: %s", message)


def _read_entries(path: str) -> dict[str, dict]:
    """The valid entries of the cache at `path` ({} when missing; corrupt content is ignored with one warning)."""
    try:
        # O_NONBLOCK: opening a FIFO planted at the cache path must not wait for a writer (checked just below).
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        return {}
    except OSError as exc:
        _warn_once(path, None, f"cannot read the autotune cache {path} ({exc}); ignoring it")
        return {}
    stat = os.fstat(fd)
    if not S_ISREG(stat.st_mode):  # checked before fdopen, which refuses a folder (IsADirectoryError)
        os.close(fd)
        _warn_once(path, stat, f"ignoring the autotune cache {path}: it is not a regular file (a FIFO, device or "
                               f"folder); the next `tf-nvlink tune` replaces it")
        return {}
    with os.fdopen(fd, "rb") as handle:
        try:
            raw = handle.read(MAX_CACHE_BYTES + 1)
        except OSError as exc:
            _warn_once(path, stat, f"cannot read the autotune cache {path} ({exc}); ignoring it")
            return {}
    what = f"the autotune cache {path}"
    try:
        if len(raw) > MAX_CACHE_BYTES:
            raise CacheError(f"it is larger than {MAX_CACHE_BYTES} bytes")
        data = strict_loads(raw.decode("utf-8"))
        if not isinstance(data, dict):
            raise CacheError(f"it holds a JSON {type(data).__name__}, not an object")
        if data.get("format") != FORMAT_VERSION or not isinstance(data.get("entries"), dict):
            raise CacheError(f"it is not a tf_nvlink autotune cache of format {FORMAT_VERSION}")
    except (CacheError, ValueError, UnicodeDecodeError, RecursionError) as exc:
        _warn_once(path, stat, f"ignoring {what}: {exc}; the next `tf-nvlink tune` overwrites it")
        return {}
    entries, bad = {}, []
    for key, record in data["entries"].items():
        try:
            validate_record(record)
            if key != make_key(record["fingerprint"], record["tf_version"], record["gpus"]):
                raise CacheError("its key does not match its fingerprint, TensorFlow version and GPUs")
        except CacheError as exc:
            bad.append(f"{key!r} ({exc})")
            continue
        entries[key] = record
    if bad:
        _warn_once(path, stat, f"ignoring {len(bad)} malformed entr{'y' if len(bad) == 1 else 'ies'} of {what}: "
                               f"{'; '.join(bad)[:500]}")
    return entries


def _ensure_dir(directory: str) -> None:
    """Make the cache's folder; CacheError naming the folder when it cannot be one (a regular file stands there
    or above it, no permission)."""
    try:
        os.makedirs(directory, mode=0o700)
    except FileExistsError:
        if not os.path.isdir(directory):
            raise CacheError(f"the autotune cache folder {directory} is not a folder (a file of that name exists): "
                             f"remove it, or set TF_NVLINK_CACHE_DIR to another folder") from None
        return  # an existing folder keeps its mode: it may be a shared one the user pointed us at
    except OSError as exc:
        raise CacheError(f"cannot make the autotune cache folder {directory} ({exc.filename or directory}: "
                         f"{exc.strerror or exc}): set TF_NVLINK_CACHE_DIR to a folder you can write") from None
    os.chmod(directory, 0o700)  # makedirs' mode is filtered by the umask; this only ever narrows it


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive advisory lock on `path`.lock for a read-modify-write (no-op where fcntl is missing)."""
    try:
        fcntl = _FCNTL
        if fcntl is None:
            raise ImportError
    except ImportError:  # pragma: no cover - Windows: atomic replace still prevents torn files
        yield
        return
    try:  # O_NOFOLLOW: a (dangling) symlink planted as the lock file must not create a file elsewhere
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except OSError as exc:
        raise CacheError(f"cannot open the autotune cache lock {path}.lock ({exc.strerror}); it should be a regular "
                         f"file (not a symbolic link): remove it, or set TF_NVLINK_CACHE_DIR to another folder") \
            from None
    if not S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CacheError(f"the autotune cache lock {path}.lock is not a regular file: remove it, or set "
                         f"TF_NVLINK_CACHE_DIR to another folder")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def cache_unusable_reason(path: str) -> Optional[str]:
    """Why the cache at `path` could not be stored (its folder cannot be made or written); None when it can.

    Example:
        >>> cache_unusable_reason("/etc/passwd/autotune.json")
        'the autotune cache folder /etc/passwd is not a folder (a file of that name exists): remove it, ...'
    """
    try:
        _ensure_dir(os.path.dirname(path))
    except CacheError as exc:
        return str(exc)
    return atomic_files.unwritable_reason(path)


def _write_atomic(path: str, data: dict) -> None:
    """The cache as strict JSON, written atomically, mode 0o600."""
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n", mode=0o600)


def store(record: dict, path: Optional[str] = None) -> str:
    """Add or replace `record` (a tune winner) in the cache; returns its key. Safe across processes."""
    validate_record(record)
    json.dumps(record, allow_nan=False)  # ValueError now rather than a half-written cache later
    path = path or cache_path()
    key = make_key(record["fingerprint"], record["tf_version"], record["gpus"])
    _ensure_dir(os.path.dirname(path))
    with _locked(path):
        entries = _read_entries(path)
        entries[key] = record
        _write_atomic(path, {"format": FORMAT_VERSION, "entries": entries})
    return key


def lookup(fingerprint: str, tf_version: str, gpus: GpuSet, path: Optional[str] = None) -> Optional[dict]:
    """The stored winner for this topology fingerprint, TensorFlow version and GPU set, or None."""
    record = _read_entries(path or cache_path()).get(make_key(fingerprint, tf_version, gpus))
    return dict(record) if record is not None else None


def entries(path: Optional[str] = None) -> dict[str, dict]:
    """Every valid stored winner, by key."""
    return _read_entries(path or cache_path())


def _tf_version() -> str:
    """TensorFlow's version as the workers report it (imports TensorFlow unless already imported)."""
    module = sys.modules.get("tensorflow")
    if module is not None:
        return module.__version__
    try:  # the installed version without importing TensorFlow (keeps `tf-nvlink report --no-tf` instant)
        return importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        import tensorflow as module  # noqa: PLC0415 - a TensorFlow installed under another distribution name
        return module.__version__


def stored_choice(topology, gpus: Sequence[int], tf_version: Optional[str] = None,
                  path: Optional[str] = None) -> Optional[tuple[str, Optional[int], str]]:
    """The stored tune winner for these GPUs on this machine, as (cross_device_ops, num_packs, reason); or None.

    The shape is what policy's rules produce, so "auto" can prefer a measured answer. None when nothing is stored
    for (topology.fingerprint(), TensorFlow version, set of `gpus`), when `gpus` has fewer than 2 GPUs, or when the
    stored choice cannot work for them (say hierarchical on an odd count after the GPUs changed).
    `tf_version` defaults to the imported TensorFlow's.

    Example:
        >>> stored_choice(tf_nvlink.probe(), (0, 1))
        ('nccl', 4, 'autotuned on this machine: nccl:4 measured fastest ...')
    """
    gpus = tuple(gpus)
    if len(gpus) < 2:
        return None
    record = lookup(topology.fingerprint(), tf_version or _tf_version(), gpus, path)
    if record is None:
        return None
    ops, packs = record["cross_device_ops"], record["num_packs"]
    if ops == "hierarchical" and len(gpus) % 2:
        return None
    if ops in policy.PACKED_OPS and packs is None:
        packs = 1
    sizes = ", ".join(format_size(s) for s in record["sizes"])
    reason = (f"autotuned on this machine: {record['candidate']} measured fastest ({record['score']:.1f} GB/s "
              f"busbw, geometric mean over {sizes}) on {record['measured_at']} with TensorFlow "
              f"{record['tf_version']}; stored in {path or cache_path()} (`tf-nvlink tune` measures again)")
    return ops, packs, reason


