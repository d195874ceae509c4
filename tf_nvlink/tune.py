"""Measure the all-reduce candidates on this machine, keep the fastest, and remember it (`tf-nvlink tune`).

`tune()` runs `tf_nvlink.bench`'s per-process workers at the sizes that matter (the model's total gradient bytes
when known, otherwise 16 MiB and 256 MiB), scores each candidate by the geometric mean of its bus bandwidth over
those sizes (each size counts alike, whatever its scale; a candidate with a wrong sum or a failure at any size
is out), and stores the winner in a JSON cache keyed by topology fingerprint, TensorFlow version and GPU set:

    $TF_NVLINK_CACHE_DIR/autotune.json, else $XDG_CACHE_HOME/tf_nvlink/autotune.json,
    else ~/.cache/tf_nvlink/autotune.json

The cache is written atomically (temporary file in the same folder, fsync, os.replace) under an exclusive
`fcntl.flock` on `autotune.json.lock`, so concurrent processes never lose each other's entries; the file is
mode 0o600 in a 0o700 folder. It is parsed strictly (no NaN/Infinity, no duplicate keys, every field
type-checked); a corrupt file is ignored with one warning on the "tf_nvlink" logger and replaced by the next
store.

Example:
    >>> from tf_nvlink import tune
    >>> result = tune.tune(gpus="0,1")                 # minutes: one worker process per candidate
    >>> result.winner, round(result.score)
    ('nccl:1', 231)
    >>> tune.stored_choice(tf_nvlink.probe(), (0, 1))  # what "auto" can use from now on
    ('nccl', 1, 'autotuned on this machine: nccl:1 measured fastest ...')
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import logging
import math
import os
import re
import sys
from stat import S_ISREG
from typing import Any, Iterator, Optional, Sequence, TextIO, Union

from tf_nvlink import atomic, bench, policy
from tf_nvlink.atomic import write_atomic

log = logging.getLogger("tf_nvlink")

HELP = "measure the all-reduce candidates at your model's sizes and store the fastest for this machine"
CACHE_FILE = "autotune.json"
FORMAT_VERSION = 1
DEFAULT_SIZES = (16 * bench.MIB, 256 * bench.MIB)
DEFAULT_CANDIDATES = "collective,nccl:1,nccl:4,hierarchical:1,reduce_to_one"
NOT_CROSS_DEVICE_OPS = ("xla",)  # bench candidates that are not a cross_device_ops choice tune could store
MAX_CACHE_BYTES = 4 * bench.MIB
METRIC = "geometric mean over sizes of busbw (GB/s)"
GpuSet = Union[Sequence[int], str]  # NVML indices, or "cpu:N" for logical CPU devices


# Ranges a hand-edited cache entry must stay within (beyond them it cannot be a measurement of this library's).
MAX_REPLICAS = 1024  # GPUs (or logical CPU devices) in one process
MAX_SCORE_GBPS = 1e6  # busbw; NVLink 5 is 900 GB/s per direction


class CacheError(ValueError):
    """A cache file or record that does not have the expected shape."""


# ------------------------------------------------------------------------------------------------- the cache
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


def _reject_constant(name: str):
    raise CacheError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise CacheError(f"number {text} overflows")
    return value


def _no_duplicates(pairs):
    result = {}
    for key, value in pairs:
        if key in result:
            raise CacheError(f"duplicate key {key!r}")
        result[key] = value
    return result


def strict_loads(text: str) -> Any:
    """json.loads that rejects NaN, Infinity, numbers that overflow to infinity, and duplicate keys."""
    return json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float,
                      object_pairs_hook=_no_duplicates)


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
        "num_packs": lambda v: v is None or (_is_int(v) and v <= bench.MAX_PACKS),
        "score": lambda v: _is_number(v) and v <= MAX_SCORE_GBPS,
        "sizes": lambda v: isinstance(v, list) and bool(v) and all(_is_int(s, 1) and s <= bench.MAX_SIZE
                                                                   for s in v),
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
    with os.fdopen(fd, "rb") as handle:
        stat = os.fstat(fd)
        if not S_ISREG(stat.st_mode):
            _warn_once(path, stat, f"ignoring the autotune cache {path}: it is not a regular file (a FIFO, device or "
                                   f"folder); the next `tf-nvlink tune` replaces it")
            return {}
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
    try:
        os.makedirs(directory, mode=0o700)
    except FileExistsError:
        return  # an existing folder keeps its mode: it may be a shared one the user pointed us at
    os.chmod(directory, 0o700)  # makedirs' mode is filtered by the umask; this only ever narrows it


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """An exclusive advisory lock on `path`.lock for a read-modify-write (no-op where fcntl is missing)."""
    try:
        import fcntl  # noqa: PLC0415 - POSIX only
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


# ------------------------------------------------------------------------------------------- measuring
@dataclasses.dataclass
class TuneResult:
    """What `tune()` measured and chose. `record` is what was (or, with store=False, would be) stored."""

    winner: str  # candidate label, e.g. "nccl:4"
    cross_device_ops: str  # a key of policy.OPS
    num_packs: Optional[int]
    score: float  # METRIC of the winner, GB/s
    scores: dict[str, float]  # METRIC per qualified candidate
    disqualified: dict[str, str]  # label -> why it could not win
    skipped: list[tuple[str, str]]  # (label, reason) not run on this machine
    sizes: list[int]
    records: list[dict]  # tf_nvlink.bench records
    record: dict
    key: str
    target: bench.Target
    cache_path: Optional[str] = None  # set when stored

    def summary(self) -> str:
        sizes = ", ".join(bench.format_size(s) for s in self.sizes)
        return f"{self.winner} is fastest: {self.score:.2f} GB/s busbw (geometric mean over {sizes})"


def tuning_sizes(sizes=None, grad_bytes: Optional[int] = None) -> list[int]:
    """The sizes to measure: `sizes` if given, plus the gradient total (rounded up to whole float32s) if known;
    16 MiB and 256 MiB when neither is known."""
    chosen: set[int] = set()
    if sizes:
        chosen.update(bench.parse_sizes(sizes) if isinstance(sizes, str) else
                      (bench.parse_size(s) if isinstance(s, str) else int(s) for s in sizes))
    if grad_bytes is not None:
        if isinstance(grad_bytes, bool) or not isinstance(grad_bytes, int) or grad_bytes <= 0:
            raise bench.BenchError(f"grad_bytes should be a positive number of bytes. Received: {grad_bytes!r}")
        chosen.add(-(-grad_bytes // bench.DTYPE_BYTES) * bench.DTYPE_BYTES)
    bad = [s for s in chosen if s <= 0 or s % bench.DTYPE_BYTES]
    if bad:
        raise bench.BenchError(f"sizes should be positive multiples of {bench.DTYPE_BYTES} bytes. Received: {bad}")
    return sorted(chosen) if chosen else list(DEFAULT_SIZES)


def score_candidates(records: Sequence[dict], sizes: Sequence[int]) -> tuple[dict[str, float], dict[str, str]]:
    """METRIC per candidate label, and why the others are out (a wrong sum, a failure, a missing size)."""
    scores: dict[str, float] = {}
    disqualified: dict[str, str] = {}
    for label in dict.fromkeys(r["label"] for r in records):
        rows = {r["size_bytes"]: r for r in records if r["label"] == label}
        problems = []
        for size in sizes:
            row = rows.get(size)
            if row is None or row["status"] == "failed":
                problems.append(f"failed at {bench.format_size(size)}" + (f": {row['error']}" if row else ""))
            elif row["status"] == "wrong":
                problems.append(f"{row['wrong']} wrong elements at {bench.format_size(size)}")
            elif not row["busbw"] or row["busbw"] <= 0:
                problems.append(f"no bandwidth at {bench.format_size(size)}")
        if problems:
            disqualified[label] = "; ".join(problems)
            continue
        scores[label] = math.exp(sum(math.log(rows[s]["busbw"]) for s in sizes) / len(sizes))
    return scores, disqualified


def tune(gpus="all", sizes=None, grad_bytes: Optional[int] = None, *, candidates=None, devices: str = "gpu",
         iters: int = 10, warmup: int = 2, repeats: int = 3, env: Optional[dict] = None, store_result: bool = True,
         path: Optional[str] = None, topology=None, timeout: float = 1800,
         progress: Optional[TextIO] = sys.stderr, spawn=None) -> TuneResult:
    """Measure the candidates on `gpus`, pick the fastest, store it (unless store_result=False).

    Args:
        gpus: as for tf_nvlink.strategy ("all", "auto", [0, 1], "0,1").
        sizes: all-reduce sizes (bytes or "16M" strings); default 16 MiB and 256 MiB, or only the gradient size
            when `grad_bytes` is given.
        grad_bytes: the model's total gradient bytes (sum of trainable variables' sizes), if known.
        candidates: labels or bench.Candidate objects; default DEFAULT_CANDIDATES (those valid here run).
        devices: "gpu", or "cpu:N" for N logical CPU devices (tests).
        spawn: the worker runner (tests inject fakes); default bench.spawn_worker.

    Raises bench.BenchError for requests that cannot run, RuntimeError when no candidate measured correctly.
    Call it before this process initialises its GPUs with TensorFlow: the workers need the GPUs' memory.
    """
    target = bench.resolve_target(devices, gpus, topology)
    if target.n < 2:
        raise bench.BenchError(f"tuning needs at least 2 devices; {target.describe()} has {target.n}, where no "
                               f"all-reduce happens.")
    chosen_sizes = tuning_sizes(sizes, grad_bytes)
    chosen = bench.parse_candidates(candidates or DEFAULT_CANDIDATES) if candidates is None or isinstance(
        candidates, str) else [c if isinstance(c, bench.Candidate) else bench.parse_candidate(c) for c in candidates]
    not_ops = [c.label for c in chosen if c.name in NOT_CROSS_DEVICE_OPS]
    if not_ops:
        raise bench.BenchError(
            f"tune picks cross_device_ops, and {', '.join(not_ops)} is not one: 'xla' is the all-reduce "
            f"jit_compile=True models use whatever the ops (measure it with tf-nvlink bench). Valid candidates: "
            f"collective, nccl[:PACKS], hierarchical[:PACKS], reduce_to_one, auto.")
    records, skipped = bench.measure(chosen, target, chosen_sizes, iters=iters, warmup=warmup, repeats=repeats,
                                     env=env, timeout=timeout, progress=progress, spawn=spawn)
    scores, disqualified = score_candidates(records, chosen_sizes)
    if not scores:
        details = "; ".join(f"{k}: {v}" for k, v in disqualified.items()) or "no candidate ran"
        raise RuntimeError(f"tune: no candidate all-reduced correctly at every size on {target.describe()} "
                           f"({details}); nothing stored.")
    winner = max(scores, key=lambda label: scores[label])  # ties go to the earlier candidate
    first = next(r for r in records if r["label"] == winner)
    record = {
        "fingerprint": target.fingerprint, "tf_version": first["tf_version"] or "unknown",
        "gpus": target.gpus_key, "candidate": winner, "cross_device_ops": first["ops"],
        "num_packs": first["num_packs"] if first["ops"] in policy.PACKED_OPS else None,
        "score": scores[winner], "metric": METRIC, "sizes": chosen_sizes, "scores": scores,
        "n_replicas": target.n, "env": dict(env or {}), "iters": iters,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tf_nvlink_version": _package_version(),
    }
    validate_record(record)
    key = make_key(record["fingerprint"], record["tf_version"], record["gpus"])
    stored_at = None
    if store_result:
        stored_at = path or cache_path()
        store(record, stored_at)
    return TuneResult(winner=winner, cross_device_ops=record["cross_device_ops"], num_packs=record["num_packs"],
                      score=scores[winner], scores=scores, disqualified=disqualified, skipped=list(skipped),
                      sizes=chosen_sizes, records=records, record=record, key=key, target=target,
                      cache_path=stored_at)


def _package_version() -> str:
    import tf_nvlink  # noqa: PLC0415

    return tf_nvlink.__version__


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


# ------------------------------------------------------------------------------ for policy / strategies
def with_stored_choice(plan, topology, path: Optional[str] = None):
    """`plan` with a stored tune winner for its GPUs swapped in, if there is one (what cross_device_ops="auto"
    does, and what the report shows). Plans of fewer than 2 GPUs come back unchanged.

    Example:
        >>> with_stored_choice(policy.make_plan(topo), topo).reason
        'autotuned on this machine: nccl:4 measured fastest ...'
    """
    choice = stored_choice(topology, plan.gpus, path=path) if len(plan.gpus) > 1 else None
    if choice is None:
        return plan
    ops, packs, reason = choice
    return dataclasses.replace(plan, cross_device_ops=ops, num_packs=packs, reason=reason,
                               gpus=policy.replica_order(topology, plan.gpus, ops))


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
    sizes = ", ".join(bench.format_size(s) for s in record["sizes"])
    reason = (f"autotuned on this machine: {record['candidate']} measured fastest ({record['score']:.1f} GB/s "
              f"busbw, geometric mean over {sizes}) on {record['measured_at']} with TensorFlow "
              f"{record['tf_version']}; stored in {path or cache_path()} (`tf-nvlink tune` measures again)")
    return ops, packs, reason


def autotune_choice(topology, gpus: Sequence[int], grad_bytes: Optional[int] = None,
                    **tune_kwargs) -> tuple[str, Optional[int], str]:
    """For cross_device_ops="autotune": the stored winner, else measure now (minutes), store, and return it.

    Returns (cross_device_ops, num_packs, reason) like `stored_choice`. Must run before this process initialises
    its GPUs with TensorFlow (before device_lib / tf.config device setup), because the measuring happens in
    worker processes that need the GPUs' memory.
    """
    gpus = tuple(gpus)
    choice = stored_choice(topology, gpus, tune_kwargs.get("tf_version"), tune_kwargs.get("path"))
    if choice is not None:
        return choice
    tune_kwargs.pop("tf_version", None)
    log.warning("tf_nvlink: no autotune result for GPUs %s on this machine; measuring the candidates now "
                "(one process each, minutes)", list(gpus))
    result = tune(gpus=list(gpus), grad_bytes=grad_bytes, topology=topology, **tune_kwargs)
    reason = f"autotuned just now: {result.summary()}"
    return result.cross_device_ops, result.num_packs, reason


# ------------------------------------------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink tune` options."""
    bench.add_common_arguments(parser, DEFAULT_CANDIDATES, None)
    parser.add_argument("--grad_bytes", "--grad-bytes", dest="grad_bytes", type=bench._argtype(bench.parse_size),
                        default=None, help="the model's total gradient size (e.g. 98M for ResNet-50 in float32); "
                                           "measured instead of the default sizes")
    parser.add_argument("--nostore", "--no-store", dest="store", action="store_false",
                        help="measure and print the winner, but do not store it")
    parser.add_argument("--list", action="store_true", help="print the stored winners and the cache path, and exit")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of text")


def _render_entries(path: str) -> str:
    stored = entries(path)
    lines = [f"# autotune cache: {path} ({len(stored)} entr{'y' if len(stored) == 1 else 'ies'})"]
    if stored:
        lines.append(f"#{'fingerprint':>13} {'tensorflow':>11} {'devices':>12} {'winner':>15} {'busbw':>8} "
                     f"{'measured at':>26}")
        lines.append(f"#{'':>13} {'':>11} {'':>12} {'':>15} {'(GB/s)':>8} {'':>26}")
    for record in stored.values():
        devices = gpus_key(record["gpus"])
        lines.append(f"{record['fingerprint']:>14} {record['tf_version']:>11} {devices:>12} "
                     f"{record['candidate']:>15} {record['score']:>8.2f} {record['measured_at']:>26}")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink tune`: measure, print the table and the winner, store it; 1 when some sum was wrong or failed."""
    if args.list:
        sys.stdout.write(_render_entries(cache_path()))
        return 0
    store_error = None
    try:
        env = bench.parse_env(args.env)
        if args.store:
            problem = cache_unusable_reason(cache_path())
            if problem:  # now, not after minutes of measuring
                raise bench.BenchError(f"the autotune cache {cache_path()} cannot be written: {problem}. Set "
                                       f"TF_NVLINK_CACHE_DIR to a writable folder, or pass --nostore.")
        result = tune(gpus=args.gpus, sizes=args.sizes, grad_bytes=args.grad_bytes, candidates=args.candidates,
                      devices=args.devices, iters=args.iters, warmup=args.warmup, repeats=args.repeats, env=env,
                      store_result=False, timeout=args.timeout)
        if args.store:
            try:
                store(result.record, cache_path())
                result.cache_path = cache_path()
            except (OSError, CacheError) as exc:  # the folder changed while measuring: keep the measurement
                store_error = (f"tf-nvlink tune: error: could not store the winner in {cache_path()} "
                               f"({getattr(exc, 'strerror', None) or exc}); the results are printed above.")
    except bench.BenchError as exc:
        return bench._error(args, str(exc))
    except RuntimeError as exc:
        print(f"tf-nvlink tune: {exc}", file=sys.stderr)
        return 1
    code = _print_result(args, result, env)
    if store_error:
        print(store_error, file=sys.stderr)
        return 1
    return code


def cache_unusable_reason(path: str) -> Optional[str]:
    """Why the cache at `path` could not be stored (its folder cannot be made or written); None when it can.

    Example:
        >>> cache_unusable_reason("/etc/passwd/autotune.json")
        '/etc/passwd is not a folder'
    """
    try:
        _ensure_dir(os.path.dirname(path))
    except OSError as exc:
        return f"{exc.filename or os.path.dirname(path)}: {exc.strerror or exc}"
    return atomic.unwritable_reason(path)


def _print_result(args: argparse.Namespace, result: TuneResult, env: dict) -> int:
    if args.json:
        print(json.dumps({"winner": result.winner, "cross_device_ops": result.cross_device_ops,
                          "num_packs": result.num_packs, "score": result.score, "metric": METRIC,
                          "scores": result.scores, "disqualified": result.disqualified,
                          "skipped": [list(s) for s in result.skipped], "sizes": result.sizes, "key": result.key,
                          "cache_path": result.cache_path, "record": result.record, "records": result.records},
                         indent=1, allow_nan=False))
        return bench.exit_code(result.records)
    text = bench.render_text(bench.command_line(args), result.target, result.records, result.skipped, args.iters,
                             args.warmup, args.repeats, env, title="tf-nvlink tune")
    ranking = ", ".join(f"{label} {score:.2f}" for label, score in
                        sorted(result.scores.items(), key=lambda item: -item[1]))
    lines = [f"# tune: winner {result.winner} -> cross_device_ops={result.cross_device_ops!r}"
             + (f", num_packs={result.num_packs}" if result.num_packs is not None else ""),
             f"#   {result.summary()}",
             f"#   ranking ({METRIC}): {ranking}"]
    lines += [f"#   out: {label}: {why}" for label, why in result.disqualified.items()]
    if result.cache_path:
        lines += [f"# stored under {result.key}",
                  f"#   in {result.cache_path}",
                  "#   tf_nvlink uses it for this topology fingerprint, TensorFlow version and GPU set"]
    elif args.store:
        lines.append(f"# not stored: the cache {cache_path()} could not be written (the error follows)")
    else:
        lines.append(f"# not stored (--nostore); the cache is {cache_path()}")
    sys.stdout.write(text + "#\n" + "\n".join(lines) + "\n")
    return bench.exit_code(result.records)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tune ...`: the same as `tf-nvlink tune ...`."""
    import shlex  # noqa: PLC0415

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m tf_nvlink.tune", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["python", "-m", "tf_nvlink.tune", *argv])
    args.subparser = parser
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
