"""The persistent XLA compile cache: where TensorFlow keeps jit-compiled programs between processes, and its care.

TensorFlow 2.21 stores each program a `jit_compile=True` function compiles when `TF_XLA_FLAGS` holds
`--tf_xla_persistent_cache_directory=FOLDER`, and loads it back instead of compiling in a later process. This
module decides the folder and the flags and looks after the files. TensorFlow reads `TF_XLA_FLAGS` once, when it
first lists its devices (under absl's `app.run`, as soon as it is imported), so `tf_nvlink.strategy()` calls
`prepare_process` before it imports TensorFlow, and `distribute/single_host.strategy` again before its first
device listing (and finds out which folder TensorFlow read, when it has listed them already).

    $TF_NVLINK_CACHE_DIR/xla/<context key>/, else $XDG_CACHE_HOME/tf_nvlink/xla/<context key>/,
    else ~/.cache/tf_nvlink/xla/<context key>/   (compile_cache="auto"; a folder F gives F/<context key>/)

TensorFlow names an entry by the function's signature, the HLO fingerprint and the device type only: not by the
TensorFlow version, the XLA flags, the GPU model or the driver. The context key (`context_key`) is a hash of
those, so a program is only ever read back by a process of the same context. Entries are written by TensorFlow
atomically (a temporary file renamed), so concurrent writers never leave a torn entry; a corrupt or foreign one
would make TensorFlow fail when it reads it, so `drop_bad_entries` checks each entry's protobuf framing and its
key against its file name, and deletes the bad ones (one warning). The whole cache is kept under a size bound,
oldest entries (by modification time) removed first. No TensorFlow import here.

Example:
    >>> from tf_nvlink.plan import compile_cache
    >>> compile_cache.validate_setting("auto"), compile_cache.validate_setting(None)
    ('auto', 'off')
    >>> compile_cache.with_cache_flags("--tf_xla_auto_jit=2", "/c/xla/0123abcd")
    '--tf_xla_auto_jit=2 --tf_xla_persistent_cache_directory=/c/xla/0123abcd --tf_xla_persistent_cache_prefix=tf_nvlink'
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from typing import Iterable, Mapping, MutableMapping, Optional, Sequence

from tf_nvlink.plan import tune_cache
from tf_nvlink.plan.allreduce_sizes import GIB

log = logging.getLogger("tf_nvlink")

DEFAULT_MAX_BYTES = 2 * GIB
SETTINGS = ("auto", "off")  # or a folder path; None means "off"
ENV_SETTING = "TF_NVLINK_COMPILE_CACHE"  # "off" or a folder: what compile_cache="auto" means in this process tree
SUBFOLDER = "xla"
PREFIX = "tf_nvlink"  # the file-name prefix of tf_nvlink's entries; also how a process knows the flags are ours
FLAG_DIR = "--tf_xla_persistent_cache_directory"
FLAG_READ_ONLY = "--tf_xla_persistent_cache_read_only"
FLAG_PREFIX = "--tf_xla_persistent_cache_prefix"
FLAG_DEVICE_TYPES = "--tf_xla_persistent_cache_device_types"
CACHE_FLAGS = (FLAG_DIR, FLAG_READ_ONLY, FLAG_PREFIX, FLAG_DEVICE_TYPES)
_WARNED: set = set()  # each warning once per process (the strategy and a caller before it may both prepare)
_ENTRY_NAME = re.compile(r"^(?P<prefix>.+)__(?P<signature>\d+)__(?P<cluster>\d+)__(?P<device>[A-Za-z0-9_]+)\.pb$")
CLEAR_COMMAND = "tf-nvlink cache --clear"
_READ_FAILURE = "Read less bytes than requested"  # TensorFlow's text for an entry shorter than its framing says


class CompileCacheError(RuntimeError):
    """A step failed because TensorFlow could not read a compile-cache entry (TensorFlow returns that as the step's
    OutOfRangeError, which Keras would take for the end of the input). The message names the folder, the entries
    that look damaged and what to do."""


def validate_setting(compile_cache) -> str:
    """"auto", "off" or an absolute folder path; ValueError naming the valid choices for anything else.

    Example:
        >>> validate_setting("~/xla")
        '/home/me/xla'
    """
    if compile_cache is None or compile_cache is False:
        return "off"
    if isinstance(compile_cache, os.PathLike):
        compile_cache = os.fspath(compile_cache)
    if isinstance(compile_cache, str) and compile_cache.strip():
        text = compile_cache.strip()
        if text.lower() in SETTINGS:
            return text.lower()
        if "\0" not in text:
            return os.path.abspath(os.path.expanduser(text))
    raise ValueError(f"compile_cache should be 'auto' (the user's cache folder, {root_folder('auto')}), a folder "
                     f"path, or 'off' (None): valid choices {list(SETTINGS)} or a folder. "
                     f"Received: compile_cache={compile_cache!r}")


def root_folder(setting: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The folder that holds the context sub-folders for a validated setting (None when off). "auto" follows
    $TF_NVLINK_COMPILE_CACHE ("off" or a folder) when set, else the tune cache's folder + "/xla"."""
    environ = os.environ if environ is None else environ
    if setting == "auto":
        override = (environ.get(ENV_SETTING) or "").strip()
        if override:
            setting = validate_setting(override)
            if setting == "auto":
                return os.path.join(tune_cache.cache_dir(), SUBFOLDER)
        else:
            return os.path.join(tune_cache.cache_dir(), SUBFOLDER)
    return None if setting == "off" else setting


_FLAG_TOKEN = re.compile(r'(?:[^\s"]+|"[^"]*")+')


def split_flags(text: str) -> list[str]:
    """The flags of a `TF_XLA_FLAGS`/`XLA_FLAGS` value, split on whitespace outside double quotes (TensorFlow's
    parser keeps `--a="x y"` whole)."""
    return _FLAG_TOKEN.findall(text or "")


def flag_value(text: str, name: str) -> Optional[str]:
    """The value of `--name=value` in a flags string (the last one wins, as TensorFlow parses), or None."""
    value = None
    for part in split_flags(text):
        key, sep, rest = part.partition("=")
        if key == name:
            value = (rest[1:-1] if len(rest) >= 2 and rest[0] == rest[-1] == '"' else rest) if sep else "true"
    return value


def _flag(name: str, value: str) -> str:
    """`--name=value`, the value in double quotes when it holds whitespace."""
    return f'{name}="{value}"' if any(char.isspace() for char in value) else f"{name}={value}"


def without_cache_flags(text: str) -> str:
    """`TF_XLA_FLAGS` without the persistent cache's own flags (what the context key hashes)."""
    return " ".join(part for part in split_flags(text) if part.partition("=")[0] not in CACHE_FLAGS)


def with_cache_flags(text: str, folder: str, read_only: bool = False) -> str:
    """`text` (a `TF_XLA_FLAGS` value) with any cache flags replaced by tf_nvlink's for `folder`."""
    flags = [without_cache_flags(text), _flag(FLAG_DIR, folder), f"{FLAG_PREFIX}={PREFIX}"]
    if read_only:
        flags.append(f"{FLAG_READ_ONLY}=true")
    return " ".join(flag for flag in flags if flag)


def users_cache_folder(text: str) -> Optional[str]:
    """The cache folder the user set in `TF_XLA_FLAGS` themselves (None when unset or when it is tf_nvlink's,
    recognised by tf_nvlink's prefix flag: a child process inherits its parent's and sets its own)."""
    folder = flag_value(text, FLAG_DIR)
    if not folder or flag_value(text, FLAG_PREFIX) == PREFIX:
        return None
    return folder


def context_key(tf_version: str, tf_nvlink_version: str, xla_flags: str, tf_xla_flags: str,
                gpu_names: Sequence[str] = (), driver_version: Optional[str] = None, request: str = "") -> str:
    """16 hex digits naming everything TensorFlow's own entry names leave out: the TensorFlow and tf_nvlink
    versions, the user's XLA flags (`XLA_FLAGS`, and `TF_XLA_FLAGS` less the cache's flags), the strategy
    arguments that choose the XLA flags tf_nvlink adds (`request_text`), and on GPUs their models (in order) and
    the driver ("cpu" without GPUs). The CUDA libraries are TensorFlow's build's (its version names them).

    Example:
        >>> context_key("2.21.0", "0.1.0", "", "")
        '225adac06655bc3b'
    """
    hardware = ("gpus=" + ",".join(gpu_names) + f";driver={driver_version}") if gpu_names else "cpu"
    text = "\n".join((f"tensorflow={tf_version}", f"tf_nvlink={tf_nvlink_version}",
                      "XLA_FLAGS=" + " ".join(sorted(split_flags(xla_flags))),
                      "TF_XLA_FLAGS=" + " ".join(sorted(split_flags(without_cache_flags(tf_xla_flags)))),
                      f"request={request}", hardware))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def request_text(gpus="all", devices=None, xla_allreduce="auto", xla_flags="auto") -> str:
    """The `tf_nvlink.strategy()` arguments that decide which XLA flags tf_nvlink adds to `XLA_FLAGS` (after this
    cache is set up: TensorFlow reads `TF_XLA_FLAGS` before tf_nvlink has decided them), for the context key.

    Example:
        >>> request_text(gpus="0,1")
        "gpus='0,1' devices=None xla_allreduce='auto' xla_flags='auto'"
    """
    gpus = gpus.strip().lower() if isinstance(gpus, str) else list(gpus) if isinstance(gpus, (list, tuple)) else gpus
    flags = list(xla_flags) if isinstance(xla_flags, (list, tuple)) else xla_flags
    return (f"gpus={gpus!r} devices={list(devices) if devices else None!r} xla_allreduce={xla_allreduce!r} "
            f"xla_flags={flags!r}")


def prepare_process(compile_cache="auto", request: str = "", topology=None,
                    environ: Optional[MutableMapping[str, str]] = None,
                    max_bytes: int = DEFAULT_MAX_BYTES, tensorflow_started: bool = False) -> CacheState:
    """`prepare` for this process, without TensorFlow: the context key from the installed TensorFlow's version,
    tf_nvlink's, the environment's XLA flags, `request` (`request_text` of the strategy's arguments) and this
    machine's GPUs (`topology`, default: NVML probed now). `tf_nvlink.strategy()` calls it before it imports
    TensorFlow: under absl's `app.run`, importing TensorFlow lists its devices at once (an init callback of
    TensorFlow's), and TensorFlow reads `TF_XLA_FLAGS` then. `tensorflow_started`: it has read them already.

    Example:
        >>> prepare_process("auto", request_text(devices=["/cpu:0", "/cpu:1"])).folder
        '/home/me/.cache/tf_nvlink/xla/3f0c...'
    """
    from tf_nvlink.machine import nvml  # noqa: PLC0415 - NVML is loaded when asked
    from tf_nvlink.util.version import __version__  # noqa: PLC0415

    setting = validate_setting(compile_cache)
    environ = os.environ if environ is None else environ
    topology = topology if topology is not None else nvml.probe()
    context = context_key(_tf_version(), __version__, environ.get("XLA_FLAGS", ""),
                          environ.get("TF_XLA_FLAGS", ""), [gpu.name for gpu in topology.gpus],
                          topology.driver_version, request)
    return prepare(setting, context, environ, max_bytes, tensorflow_started)


@dataclasses.dataclass(frozen=True)
class Entry:
    path: str
    size: int
    mtime: float


def entries(folder: str) -> list[Entry]:
    """The entries (`*.pb` files named as TensorFlow names them) in `folder` and in its direct sub-folders (the
    context folders; never deeper, so a folder given by hand is not walked whole), oldest first."""
    found = []
    for directory in [folder] + _subfolders(folder):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if _ENTRY_NAME.match(name):
                path = os.path.join(directory, name)
                with contextlib.suppress(OSError):
                    stat = os.stat(path)
                    found.append(Entry(path, stat.st_size, stat.st_mtime))
    return sorted(found, key=lambda entry: (entry.mtime, entry.path))


def _subfolders(folder: str) -> list[str]:
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    return [os.path.join(folder, name) for name in names
            if os.path.isdir(os.path.join(folder, name)) and not os.path.islink(os.path.join(folder, name))]


def total_bytes(found: Iterable[Entry]) -> int:
    return sum(entry.size for entry in found)


def _varint(read) -> Optional[int]:
    """A protobuf varint from `read(1)`; None at a clean end of data."""
    result = shift = 0
    while True:
        byte = read(1)
        if not byte:
            if shift == 0:
                return None
            raise ValueError("truncated varint")
        result |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return result
        shift += 7
        if shift > 63:
            raise ValueError("varint over 10 bytes")


def _fields(handle, size: int, keep: Sequence[int] = ()):
    """(number, wire type, value) of each top-level field of the protobuf message in `handle`; a length-delimited
    value is read only for field numbers in `keep` (else skipped, value None)."""
    while True:
        tag = _varint(handle.read)
        if tag is None:
            return
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise ValueError("field number 0")
        if wire == 0:
            value = _varint(handle.read)
            if value is None:
                raise ValueError("truncated varint")
        elif wire in (1, 5, 2):
            length = {1: 8, 5: 4}.get(wire) or _varint(handle.read)
            if length is None or handle.tell() + length > size:
                raise ValueError(f"field {number} runs past the end of the file")
            if wire == 2 and number in keep:
                value = handle.read(length)
            else:
                handle.seek(length, os.SEEK_CUR)
                value = None
        else:
            raise ValueError(f"wire type {wire} of field {number}")
        yield number, wire, value


class _Bytes:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def read(self, count: int) -> bytes:
        chunk = self.data[self.pos:self.pos + count]
        self.pos += len(chunk)
        return chunk

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int) -> None:
        self.pos += offset


def entry_problem(path: str) -> Optional[str]:
    """Why TensorFlow could not load the entry at `path` (None when it looks sound): the framing of an
    `XlaSerializedCacheEntry` (key, HLO module, executable) read to the last byte, and its key (signature and
    cluster fingerprints, device type) the same as its file name's. Reads the key only, not the program."""
    match = _ENTRY_NAME.match(os.path.basename(path))
    if not match:
        return "not named as TensorFlow names its entries"
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as handle:
            fields = {number: (wire, value) for number, wire, value in _fields(handle, size, keep=(1,))}
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except ValueError as exc:
        return f"not an XLA cache entry ({exc})"
    if any(fields.get(number, (None,))[0] != 2 for number in (1, 2, 3)):
        return "not an XLA cache entry (key, HLO module or executable missing)"
    try:
        key = {number: value for number, _, value in _fields(_Bytes(fields[1][1]), len(fields[1][1]), keep=(3, 4))}
    except ValueError as exc:
        return f"not an XLA cache entry (its key: {exc})"
    if (str(key.get(1)), str(key.get(2))) != (match["signature"], match["cluster"]) or \
            (key.get(3) or b"").decode("utf-8", "replace") != match["device"] or \
            (key.get(4) or b"").decode("utf-8", "replace") != match["prefix"]:
        # TensorFlow compares the whole key with the one it expects and fails the step on a difference
        return "its key is not the one its file name says (a foreign or renamed entry)"
    return None


def drop_bad_entries(folder: str) -> list[tuple[str, str]]:
    """Delete the entries under `folder` TensorFlow could not load (`entry_problem`); returns (path, problem)
    of each. Another process may delete the same file at the same time: that is fine."""
    dropped = []
    for entry in entries(folder):
        problem = entry_problem(entry.path)
        if problem is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            dropped.append((entry.path, problem))
    return dropped


def bad_entries(folder: str) -> list[tuple[str, str]]:
    """(path, problem) of each entry directly in `folder` that TensorFlow could not load (`entry_problem`), without
    changing anything: the check for folders tf_nvlink may not change (read-only ones, the user's own).

    Example:
        >>> bad_entries("/shared/xla")
        [('/shared/xla/tf_nvlink__1__2__GPU.pb', 'not an XLA cache entry (field 3 runs past the end of the file)')]
    """
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        path = os.path.join(folder, name)
        if _ENTRY_NAME.match(name) and os.path.isfile(path):
            problem = entry_problem(path)
            if problem is not None:
                found.append((path, problem))
    return found


def reading_folder(source: str, leave_out: Iterable[str] = (), folder: Optional[str] = None) -> str:
    """A private folder of this process holding a link to each entry of `source` but those in `leave_out` (paths):
    TensorFlow reads `source`'s programs from it, read-only, without ever seeing the entries left out, and a link
    can be dropped later (`recheck`) while `source` stays as it is. Made in the temporary folder and removed when
    the process exits; `folder`, one made before, is brought up to date instead. OSError when it cannot be made.

    Example:
        >>> reading_folder("/shared/xla/9c1e", leave_out=["/shared/xla/9c1e/tf_nvlink__1__2__GPU.pb"])
        '/tmp/tf_nvlink_xla_read_k2j3'
    """
    skipped = {os.path.abspath(path) for path in leave_out}
    made = folder is None
    if made:
        folder = tempfile.mkdtemp(prefix="tf_nvlink_xla_read_")
        creator = os.getpid()
        # a forked child that exits through Python must not remove its parent's folder
        atexit.register(lambda: os.getpid() == creator and shutil.rmtree(folder, ignore_errors=True))
    try:
        wanted = {name for name in os.listdir(source) if _ENTRY_NAME.match(name)
                  and os.path.abspath(os.path.join(source, name)) not in skipped
                  and os.path.isfile(os.path.join(source, name))}
        for name in os.listdir(folder):
            if name not in wanted:
                os.unlink(os.path.join(folder, name))
        for name in sorted(wanted - set(os.listdir(folder))):
            os.symlink(os.path.abspath(os.path.join(source, name)), os.path.join(folder, name))
    except OSError:
        if made:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def evict(root: str, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Entry]:
    """Delete the oldest entries (by modification time) under `root`, every context folder included, until the
    rest fit in `max_bytes`; then remove context folders left empty. Returns the deleted entries."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes should be a whole number of bytes >= 0. Received: max_bytes={max_bytes!r}")
    found = entries(root)
    excess = total_bytes(found) - max_bytes
    removed = []
    for entry in found:
        if excess <= 0:
            break
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
        removed.append(entry)
        excess -= entry.size
    if removed:
        _remove_empty_folders(root)
    return removed


def drop_stale_temporaries(root: str, older_than_s: float = 3600.0, now: Optional[float] = None) -> int:
    """Delete the temporary files TensorFlow writes an entry to before renaming it (`*.tmp`) that are older than
    `older_than_s` under `root` and its context folders: left by a process killed while writing (a live writer's
    is seconds old). Returns how many."""
    now = time.time() if now is None else now
    removed = 0
    for directory in [root] + _subfolders(root):
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if name.endswith(".tmp") and os.path.isfile(path) and now - os.path.getmtime(path) > older_than_s:
                    os.unlink(path)
                    removed += 1
    return removed


def _remove_empty_folders(root: str) -> None:
    for directory in _subfolders(root):
        with contextlib.suppress(OSError):
            os.rmdir(directory)  # fails (and is left) unless empty


def clear(root: str) -> tuple[int, int]:
    """Delete every entry under `root` (`entries`: nothing else, so a folder given by hand keeps its other files)
    and the context folders left empty; returns (entries, bytes) deleted."""
    found = entries(root)
    for entry in found:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
    drop_stale_temporaries(root, older_than_s=60.0)
    _remove_empty_folders(root)
    return len(found), total_bytes(found)


def folder_problem(folder: str) -> tuple[Optional[str], bool]:
    """(why entries cannot be written in `folder`, whether it can still be read); (None, True) when writable.
    Creates the folder (0o700) when it does not exist."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as exc:
        return f"cannot create it ({exc.strerror or exc})", False
    if not os.path.isdir(folder):
        return "it is not a folder", False
    readable = os.access(folder, os.R_OK | os.X_OK)
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".probe.")
    except OSError as exc:
        return f"cannot write in it ({exc.strerror or exc})", readable
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)
    return None, readable


@dataclasses.dataclass(frozen=True)
class CacheState:
    """What `prepare` did: `folder` is the folder TensorFlow reads (and writes, unless `read_only`; None: no cache
    this process), `note` one line for the log and the report. When TensorFlow reads another folder's entries
    through a private folder of links (`reading_folder`: a read-only folder, or the user's own holding entries
    TensorFlow could not load), `source` is that folder and `skipped` the (path, problem) of the entries left out."""

    setting: str
    folder: Optional[str]
    read_only: bool = False
    users: bool = False  # the folder is the user's own TF_XLA_FLAGS choice
    note: str = ""
    dropped: int = 0
    evicted: int = 0
    source: Optional[str] = None
    skipped: tuple = ()

    @property
    def active(self) -> bool:
        return self.folder is not None

    @property
    def entries_folder(self) -> Optional[str]:
        """The folder the entries really are in: `source` when read through links, else `folder`."""
        return self.source or self.folder


_READ_THROUGH: dict = {}  # a private reading folder of this process -> the CacheState that made it


def prepare(setting: str, context: str, environ: Optional[MutableMapping[str, str]] = None,
            max_bytes: int = DEFAULT_MAX_BYTES, tensorflow_started: bool = False) -> CacheState:
    """Set up the cache for this process before TensorFlow starts: resolve the folder (`root_folder`), respect a
    folder the user put in `TF_XLA_FLAGS`, check the folder can be written, drop bad entries (one warning), keep
    the size bound, and write the flags into `environ["TF_XLA_FLAGS"]` (default os.environ). `context` is
    `context_key(...)`.

    No entry TensorFlow could not load is ever given to it: a folder tf_nvlink may not change (a read-only one, or
    the user's own holding such entries; the user's is never written to by tf_nvlink) is read through a private
    folder of links to its sound entries, read-only (`reading_folder`); one warning names the entries left out.
    An unwritable folder that cannot be read means no cache (one warning). `tensorflow_started`: TensorFlow has
    read `TF_XLA_FLAGS` already, so it reads the user's folder itself, whatever is set now (the warning says so).

    A folder whose path holds spaces goes into `TF_XLA_FLAGS` in double quotes (TensorFlow's parser keeps a quoted
    value whole); one holding a double quote, a tab or a newline cannot: one warning, and no cache.
    """
    environ = os.environ if environ is None else environ
    current = environ.get("TF_XLA_FLAGS", "")
    theirs = users_cache_folder(current)
    if theirs is not None:
        made = _READ_THROUGH.get(theirs)
        if made is not None:  # this process already reads the user's folder through links: keep them current
            return _read_through(made.setting, made.source, environ, current, users=True)
        bad = bad_entries(theirs)
        if bad and not tensorflow_started:
            return _read_through(setting, theirs, environ, current, users=True)
        if bad:
            note = (f"compile cache: the folder TF_XLA_FLAGS names ({FLAG_DIR}={theirs}) holds "
                    f"{_count(bad)} TensorFlow could not load ({_named(bad)}), and TensorFlow read TF_XLA_FLAGS "
                    f"before tf_nvlink.strategy() (under absl's app.run, importing TensorFlow does): it reads them "
                    f"itself, and the step that reads one stops with an error naming it. tf_nvlink does not change "
                    f"that folder: delete {'it' if len(bad) == 1 else 'them'}")
            warn_once(note)
            return CacheState(setting, theirs, users=True, note=note, skipped=tuple(bad))
        note = (f"compile cache: TF_XLA_FLAGS already sets {FLAG_DIR}={theirs}; tf_nvlink keeps it and does not "
                f"manage that folder")
        warn_once(note, logging.INFO)
        return CacheState(setting, theirs, users=True, note=note)
    root = root_folder(setting, environ)
    if root is None:
        _set_flags(environ, without_cache_flags(current))  # an inherited tf_nvlink flag goes too
        return CacheState(setting, None, note="compile cache off")
    folder = os.path.join(root, context)
    if '"' in folder or any(char.isspace() and char != " " for char in folder):
        _set_flags(environ, without_cache_flags(current))
        note = (f"compile cache off: its folder {folder!r} holds a double quote or a tab/newline, which "
                f"TF_XLA_FLAGS cannot carry; pass compile_cache= another folder, or set {ENV_SETTING}")
        warn_once(note)
        return CacheState(setting, None, note=note)
    problem, readable = folder_problem(folder)
    if problem is not None:
        if readable and os.path.isdir(folder):
            return _read_through(setting, folder, environ, current, users=False, problem=problem)
        _set_flags(environ, without_cache_flags(current))
        note = f"compile cache folder {folder} is not writable ({problem}): training goes on uncached"
        warn_once(note)
        return CacheState(setting, None, note=note)
    dropped = drop_bad_entries(folder)
    if dropped:
        log.warning("tf_nvlink: compile cache: deleted %d entr%s TensorFlow could not load, compiled again when "
                    "needed: %s", len(dropped), "y" if len(dropped) == 1 else "ies",
                    "; ".join(f"{os.path.basename(path)}: {why}" for path, why in dropped[:3])
                    + (" ..." if len(dropped) > 3 else ""))
    drop_stale_temporaries(root)
    evicted = evict(root, max_bytes)
    _set_flags(environ, with_cache_flags(current, folder))
    kept = entries(folder)
    note = (f"compile cache {folder} ({len(kept)} entr{'y' if len(kept) == 1 else 'ies'}, "
            f"{total_bytes(kept) / 2**20:.1f} MiB; bound {max_bytes / 2**30:g} GiB"
            + (f", {len(evicted)} oldest evicted" if evicted else "") + ")")
    return CacheState(setting, folder, note=note, dropped=len(dropped), evicted=len(evicted))


def _read_through(setting: str, source: str, environ: MutableMapping[str, str], current: str, users: bool,
                  problem: str = "") -> CacheState:
    """`source` read, read-only, through a private folder of links to its sound entries (one per process and
    source, brought up to date when prepared again: entries damaged since are left out)."""
    bad = bad_entries(source)
    previous = next((made.folder for made in _READ_THROUGH.values() if made.source == source), None)
    whose = (f"the folder TF_XLA_FLAGS names ({FLAG_DIR}={source})" if users
             else f"compile cache folder {source} is not writable ({problem}):")
    left_out = (f"{len(bad)} entr{'y' if len(bad) == 1 else 'ies'} there TensorFlow could not load "
                f"({_named(bad)}) {'is' if len(bad) == 1 else 'are'} not read" if bad else "")
    try:
        folder = reading_folder(source, [path for path, _ in bad], folder=previous)
    except OSError as exc:
        _set_flags(environ, without_cache_flags(current))
        note = (f"compile cache: {whose} {left_out + '; ' if left_out else ''}no private folder could be made to "
                f"read it through ({exc.strerror or exc}): training goes on uncached")
        warn_once(note)
        return CacheState(setting, None, users=users, note=note, source=source, skipped=tuple(bad))
    _set_flags(environ, _reading_flags(current, folder, users))
    if users:
        note = (f"compile cache: {whose}: {left_out}. tf_nvlink does not change that folder: this process reads "
                f"its other entries read-only, through links in {folder}, and stores no new program; delete "
                f"the damaged entr{'y' if len(bad) == 1 else 'ies'} to store programs there again")
    else:
        note = (f"compile cache folder {source} is not writable ({problem}): its programs are read, new ones are "
                f"not kept" + (f"; {left_out} (`{CLEAR_COMMAND} --dir {os.path.dirname(source)}` by a user who "
                               f"can write it deletes them)" if bad else ""))
    warn_once(note)
    state = CacheState(setting, folder, read_only=True, users=users, note=note, source=source, skipped=tuple(bad))
    _READ_THROUGH[folder] = state
    return state


def _reading_flags(text: str, folder: str, users: bool) -> str:
    """`TF_XLA_FLAGS` pointing TensorFlow at a private reading folder, read-only; the user's own prefix and device
    types are kept (a child process takes the result for the user's folder, which it then checks itself)."""
    if not users:
        return with_cache_flags(text, folder, read_only=True)
    kept = [part for part in split_flags(text) if part.partition("=")[0] not in (FLAG_DIR, FLAG_READ_ONLY)]
    return " ".join(kept + [_flag(FLAG_DIR, folder), f"{FLAG_READ_ONLY}=true"])


def _count(found: Sequence) -> str:
    return f"{len(found)} entr{'y' if len(found) == 1 else 'ies'}"


def _named(found: Sequence[tuple[str, str]], limit: int = 3) -> str:
    return "; ".join(f"{os.path.basename(path)}: {why}" for path, why in found[:limit]) + (
        " ..." if len(found) > limit else "")


def what_tensorflow_read(state: CacheState, read: Optional[str]) -> CacheState:
    """The cache of a process whose TensorFlow read `TF_XLA_FLAGS` before `prepare` set them: the folder it read
    (`read`, its value then; None: no cache) replaces `state`'s, with a note saying so.

    Example:
        >>> what_tensorflow_read(state, None).note[:39]
        'compile cache not used in this process:'
    """
    if read is None:
        return dataclasses.replace(state, folder=None, source=None, note=(
            f"compile cache not used in this process: TensorFlow listed its devices before tf_nvlink.strategy() "
            f"set TF_XLA_FLAGS. To use it, call tf_nvlink.strategy() before any tf.config call or TensorFlow op (in "
            f"a notebook: restart the kernel, then build the strategy in the first cell); under absl's app.run, "
            f"which lists the devices before main, import tf_nvlink at the top of the script, after "
            f"`from absl import app`; or export TF_XLA_FLAGS='{os.environ.get('TF_XLA_FLAGS', '')}' before Python "
            f"starts"))
    made = _READ_THROUGH.get(read)
    if made is not None:  # an earlier `prepare` of this process made that reading folder
        return made
    bad = bad_entries(read)
    note = (f"compile cache {read}: TensorFlow read TF_XLA_FLAGS before tf_nvlink.strategy() (this process's own "
            f"folder would be {state.folder}); its programs go to the folder it read")
    if bad:
        note += (f"; {_count(bad)} there TensorFlow could not load ({_named(bad)}) would stop the step that reads "
                 f"{'it' if len(bad) == 1 else 'them'}: delete {'it' if len(bad) == 1 else 'them'}")
    return CacheState(state.setting, read, note=note, skipped=tuple(bad))


def recheck(state: Optional[CacheState]) -> list[tuple[str, str, str]]:
    """The entries of the folder TensorFlow reads that it could not load now (damaged since `prepare`), each made
    harmless where tf_nvlink may: deleted from its own writable folder (compiled again), its link dropped from a
    private reading folder; an entry of the user's folder read directly is left as it is (a step that reads it
    stops with `CompileCacheError`). Returns (path, problem, what was done) of each. Called before a function's
    first execution, when TensorFlow looks its programs up.

    Example:
        >>> recheck(single_host.current_compile_cache())
        [('/home/me/.cache/tf_nvlink/xla/9c1e/tf_nvlink__1__2__CPU.pb', 'not an XLA cache entry (...)', 'deleted: ...')]
    """
    if state is None or not state.active:
        return []
    known = {path for path, _ in state.skipped}  # named when the state was made
    found = [(path, problem) for path, problem in bad_entries(state.folder) if path not in known]
    done = []
    for path, problem in found:
        if state.source is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
            done.append((os.path.join(state.source, os.path.basename(path)), problem,
                         "not read: its link is dropped from this process's private reading folder"))
        elif state.users or state.read_only:
            done.append((path, problem, "left in place (tf_nvlink does not change this folder): the step that "
                                        "reads it stops with an error naming it"))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            done.append((path, problem, "deleted: its program is compiled again"))
    return done


def tensorflow_cause(message: str) -> str:
    """The line of a TensorFlow error's text that says what failed: after "OUT_OF_RANGE:" when it names its root
    errors, else the line before the first `[[node ...]]`, else its first line.

    Example:
        >>> tensorflow_cause("Graph execution error:\n\n  (0) OUT_OF_RANGE:  Read less bytes than requested\n")
        'Read less bytes than requested'
    """
    message = message or ""
    cause = re.search(r"OUT_OF_RANGE:[ \t]*(\S[^\n]*)", message) or re.search(r"([^\n]*\S[^\n]*)\n\s*\[\[", message)
    if cause:
        return cause.group(1).strip()
    return next((line.strip() for line in message.splitlines() if line.strip()), "")


def read_failure(state: Optional[CacheState], tensorflow_message: str) -> RuntimeError:
    """The error for a step that failed with an OutOfRangeError not from its input (`tensorflow_message`: its
    text): with the cache on, a `CompileCacheError` naming the folder, the entries that look damaged now and what
    to do (in tf_nvlink's own writable folder they are deleted, so that the next run compiles them again); with
    it off, a RuntimeError saying the cache is not the cause.

    Example:
        >>> raise read_failure(state, "Read less bytes than requested") from error
    """
    first_line = tensorflow_cause(tensorflow_message)
    where = state.entries_folder if state is not None and state.active else None
    found = bad_entries(where) if where else []
    text = (f"tf_nvlink: a step failed with an OutOfRangeError that did not come from the input (TensorFlow: "
            f"{first_line!r}); Keras would have ended the epoch as if the data had run out. ")
    if where is None:
        return RuntimeError(text + "The compile cache is off in this process, so it is not the cause.")
    if not found and _READ_FAILURE not in (tensorflow_message or ""):
        return RuntimeError(text + f"No entry of the compile cache folder {where} looks damaged, and TensorFlow's "
                                   f"message does not point at it; if it does come from the cache, "
                                   f"`{CLEAR_COMMAND}` empties it and tf_nvlink.strategy(compile_cache='off') "
                                   f"trains without it.")
    text += f"TensorFlow reads XLA programs from the compile cache folder {where}"
    if state.source is not None:
        text += f" (through links in {state.folder})"
    if found:
        text += f"; entries it cannot load there now: {_named(found, limit=5)}. "
    else:
        text += ("; no entry there looks damaged now (damage inside a program's bytes is not seen by the check). ")
    if state.users:
        remedy = (f"tf_nvlink does not change that folder (TF_XLA_FLAGS names it): delete the damaged entries "
                  f"({', '.join(path for path, _ in found) or 'or the folder'}), or leave {FLAG_DIR} out of "
                  f"TF_XLA_FLAGS, then run again.")
    elif state.read_only:
        remedy = (f"Its folder is read-only to this process: `{CLEAR_COMMAND} --dir {os.path.dirname(where)}` by a "
                  f"user who can write it, or tf_nvlink.strategy(compile_cache='off'), then run again.")
    else:
        for path, _ in found:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        remedy = ("Those entries are deleted now: run again (their programs are compiled again). "
                  if found else f"`{CLEAR_COMMAND}` empties the cache; ") + \
            "tf_nvlink.strategy(compile_cache='off') trains without it."
    return CompileCacheError(text + remedy)


def _tf_version() -> str:
    """The TensorFlow version, without importing it when it is not imported yet (the package metadata)."""
    module = sys.modules.get("tensorflow")
    if module is not None:
        return module.__version__
    try:
        return importlib.metadata.version("tensorflow")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("tf-nightly") if _installed("tf-nightly") else "unknown"


def _installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def warn_once(note: str, level: int = logging.WARNING) -> None:
    """Log `note` on the \"tf_nvlink\" logger once per process."""
    if note not in _WARNED:
        _WARNED.add(note)
        log.log(level, "tf_nvlink: %s", note)


def _set_flags(environ: MutableMapping[str, str], value: str) -> None:
    if value:
        environ["TF_XLA_FLAGS"] = value
    else:
        environ.pop("TF_XLA_FLAGS", None)


def summary(root: Optional[str] = None) -> dict:
    """The cache as plain data, for `tf-nvlink cache` and the report: its root folder (default: "auto"'s), whether
    it exists, the context folders and their entries and bytes, the size bound, and the folder this process's
    context would use when the environment chooses it (`TF_NVLINK_COMPILE_CACHE`).

    Example:
        >>> summary()["entries"], summary()["bytes"]
        (4, 37748736)
    """
    root = root if root is not None else root_folder("auto")
    if root is None:
        return {"folder": None, "enabled": False, "exists": False, "entries": 0, "bytes": 0, "contexts": [],
                "max_bytes": DEFAULT_MAX_BYTES}
    contexts = []
    found = entries(root) if os.path.isdir(root) else []
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        mine = [entry for entry in found if os.path.dirname(entry.path) == os.path.join(root, name)]
        if os.path.isdir(os.path.join(root, name)):
            contexts.append({"context": name, "entries": len(mine), "bytes": total_bytes(mine),
                             "newest": max((entry.mtime for entry in mine), default=None)})
    return {"folder": root, "enabled": True, "exists": os.path.isdir(root), "entries": len(found),
            "bytes": total_bytes(found), "contexts": contexts, "max_bytes": DEFAULT_MAX_BYTES}


def summary_line(data: dict) -> str:
    """One line for the report: "XLA compile cache: /home/me/.cache/tf_nvlink/xla, 4 entries, 36.0 MiB (bound 2 GiB)".
    """
    if not data.get("enabled"):
        return f"XLA compile cache: off ({ENV_SETTING}=off)"
    count = data["entries"]
    return (f"XLA compile cache: {data['folder']}, {count} entr{'y' if count == 1 else 'ies'} in "
            f"{len(data['contexts'])} context folder{'s' if len(data['contexts']) != 1 else ''}, "
            f"{data['bytes'] / 2**20:.1f} MiB (bound {data['max_bytes'] / 2**30:g} GiB; `tf-nvlink cache --clear` "
            f"empties it)")
