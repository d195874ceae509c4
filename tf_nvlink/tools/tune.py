"""Measure the all-reduce candidates on this machine, keep the fastest, and remember it (`tf-nvlink tune`).

`tune()` runs `tf_nvlink.tools.allreduce_bench`'s per-process workers at the sizes that matter (the model's total gradient bytes
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
    >>> from tf_nvlink.tools import tune
    >>> result = tune.tune(gpus="0,1")                 # minutes: one worker process per candidate
    >>> result.winner, round(result.score)
    ('nccl:1', 231)
    >>> tune_cache.stored_choice(tf_nvlink.probe(), (0, 1))  # what "auto" can use from now on
    ('nccl', 1, 'autotuned on this machine: nccl:1 measured fastest ...')
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import math
import sys
from typing import Optional, Sequence, TextIO

from tf_nvlink.plan import allreduce_sizes, policy
from tf_nvlink.plan.tune_cache import (CacheError, cache_path, cache_unusable_reason, entries, gpus_key, make_key,
                                       store, stored_choice, validate_record)
from tf_nvlink.tools.allreduce_bench import cli, render, runner, specs
from tf_nvlink.util.cli_args import argtype, command_line, run_as_module, usage_error
from tf_nvlink.util.error_lines import write_failure
from tf_nvlink.util.version import __version__

log = logging.getLogger("tf_nvlink")

HELP = "measure the all-reduce candidates at your model's sizes and store the fastest for this machine"
DEFAULT_SIZES = (16 * allreduce_sizes.MIB, 256 * allreduce_sizes.MIB)
DEFAULT_CANDIDATES = "collective,nccl:1,nccl:4,hierarchical:1,reduce_to_one"
NOT_CROSS_DEVICE_OPS = ("xla",)  # bench candidates that are not a cross_device_ops choice tune could store
METRIC = "geometric mean over sizes of busbw (GB/s)"


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
    records: list[dict]  # tf_nvlink.tools.allreduce_bench records
    record: dict
    key: str
    target: specs.Target
    cache_path: Optional[str] = None  # set when stored

    def summary(self) -> str:
        sizes = ", ".join(allreduce_sizes.format_size(s) for s in self.sizes)
        return f"{self.winner} is fastest: {self.score:.2f} GB/s busbw (geometric mean over {sizes})"


def tuning_sizes(sizes=None, grad_bytes: Optional[int] = None) -> list[int]:
    """The sizes to measure: `sizes` if given, plus the gradient total (rounded up to whole float32s) if known;
    16 MiB and 256 MiB when neither is known."""
    chosen: set[int] = set()
    if sizes:
        chosen.update(specs.parse_sizes(sizes) if isinstance(sizes, str) else
                      (specs.parse_size(s) if isinstance(s, str) else int(s) for s in sizes))
    if grad_bytes is not None:
        if isinstance(grad_bytes, bool) or not isinstance(grad_bytes, int) or grad_bytes <= 0:
            raise specs.BenchError(f"grad_bytes should be a positive number of bytes. Received: {grad_bytes!r}")
        chosen.add(-(-grad_bytes // specs.DTYPE_BYTES) * specs.DTYPE_BYTES)
    bad = [s for s in chosen if s <= 0 or s % specs.DTYPE_BYTES]
    if bad:
        raise specs.BenchError(f"sizes should be positive multiples of {specs.DTYPE_BYTES} bytes. Received: {bad}")
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
                problems.append(f"failed at {allreduce_sizes.format_size(size)}" + (f": {row['error']}" if row else ""))
            elif row["status"] == "wrong":
                problems.append(f"{row['wrong']} wrong elements at {allreduce_sizes.format_size(size)}")
            elif not row["busbw"] or row["busbw"] <= 0:
                problems.append(f"no bandwidth at {allreduce_sizes.format_size(size)}")
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
        candidates: labels or specs.Candidate objects; default DEFAULT_CANDIDATES (those valid here run).
        devices: "gpu", or "cpu:N" for N logical CPU devices (tests).
        spawn: the worker runner (tests inject fakes); default runner.spawn_worker.

    Raises specs.BenchError for requests that cannot run, RuntimeError when no candidate measured correctly.
    Call it before this process initialises its GPUs with TensorFlow: the workers need the GPUs' memory.
    """
    target = specs.resolve_target(devices, gpus, topology)
    if target.n < 2:
        raise specs.BenchError(f"tuning needs at least 2 devices; {target.describe()} has {target.n}, where no "
                               f"all-reduce happens.")
    chosen_sizes = tuning_sizes(sizes, grad_bytes)
    chosen = specs.parse_candidates(candidates or DEFAULT_CANDIDATES) if candidates is None or isinstance(
        candidates, str) else [c if isinstance(c, specs.Candidate) else specs.parse_candidate(c) for c in candidates]
    not_ops = [c.label for c in chosen if c.name in NOT_CROSS_DEVICE_OPS]
    if not_ops:
        raise specs.BenchError(
            f"tune picks cross_device_ops, and {', '.join(not_ops)} is not one: 'xla' is the all-reduce "
            f"jit_compile=True models use whatever the ops (measure it with tf-nvlink bench). Valid candidates: "
            f"collective, nccl[:PACKS], hierarchical[:PACKS], reduce_to_one, auto.")
    records, skipped = runner.measure(chosen, target, chosen_sizes, iters=iters, warmup=warmup, repeats=repeats,
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
    return __version__


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
    cli.add_common_arguments(parser, DEFAULT_CANDIDATES, None)
    parser.add_argument("--grad_bytes", type=argtype(specs.parse_size),
                        default=None, help="the model's total gradient size (e.g. 98M for ResNet-50 in float32); "
                                           "measured instead of the default sizes")
    parser.add_argument("--store", action=argparse.BooleanOptionalAction, default=True,
                        help="store the winner (default); --no-store: measure and print it only")
    parser.add_argument("--list", action=argparse.BooleanOptionalAction, default=False,
                        help="print the stored winners and the cache path, and exit")
    parser.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                        help="print the result as JSON instead of text")


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
        env = specs.parse_env(args.env)
        if args.store:
            problem = cache_unusable_reason(cache_path())
            if problem:  # now, not after minutes of measuring
                raise specs.BenchError(f"the autotune cache {cache_path()} cannot be written: {problem}. Set "
                                       f"TF_NVLINK_CACHE_DIR to a writable folder, or pass --no-store.")
        result = tune(gpus=args.gpus, sizes=args.sizes, grad_bytes=args.grad_bytes, candidates=args.candidates,
                      devices=args.devices, iters=args.iters, warmup=args.warmup, repeats=args.repeats, env=env,
                      store_result=False, timeout=args.timeout)
        if args.store:
            try:
                store(result.record, cache_path())
                result.cache_path = cache_path()
            except (OSError, CacheError) as exc:  # the folder changed while measuring: keep the measurement
                store_error = write_failure("tf-nvlink tune", "store the winner in", str(cache_path()), exc)
    except specs.BenchError as exc:
        return usage_error(args, str(exc))
    except RuntimeError as exc:
        print(f"tf-nvlink tune: {exc}", file=sys.stderr)
        return 1
    code = _print_result(args, result, env)
    if store_error:
        print(store_error, file=sys.stderr)
        return 1
    return code


def _print_result(args: argparse.Namespace, result: TuneResult, env: dict) -> int:
    """The result as JSON (--json) or as the table, the winner and where it is stored; 1 on wrong sums."""
    if args.json:
        print(json.dumps({"winner": result.winner, "cross_device_ops": result.cross_device_ops,
                          "num_packs": result.num_packs, "score": result.score, "metric": METRIC,
                          "scores": result.scores, "disqualified": result.disqualified,
                          "skipped": [list(s) for s in result.skipped], "sizes": result.sizes, "key": result.key,
                          "cache_path": result.cache_path, "record": result.record, "records": result.records},
                         indent=1, allow_nan=False))
        return render.exit_code(result.records)
    text = render.render_text(command_line(args), result.target, result.records, result.skipped, args.iters,
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
        lines.append(f"# not stored (--no-store); the cache is {cache_path()}")
    sys.stdout.write(text + "#\n" + "\n".join(lines) + "\n")
    return render.exit_code(result.records)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tools.tune ...`: the same as `tf-nvlink tune ...`."""
    return run_as_module("tf_nvlink.tools.tune", HELP, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
