"""`tf-nvlink bench` / `python -m tf_nvlink.tools.allreduce_bench`: the options, and a run from them."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from tf_nvlink.util import atomic_files
from tf_nvlink.util.cli_args import (argtype, command_line, non_negative, plot_file, positive, run_as_module,
                                     usage_error)
from tf_nvlink.tools.allreduce_bench.render import (check_plot_available, exit_code, plot, record_problem, render_p2p_ratio,
                                    render_summary, render_text, result_line)
from tf_nvlink.tools.allreduce_bench.runner import measure, skipped_records
from tf_nvlink.plan.allreduce_sizes import format_size
from tf_nvlink.tools.allreduce_bench.specs import (DEFAULT_CANDIDATES, DEFAULT_SIZES, P2P_ENV, P2P_VARIANT, BenchError,
                                   parse_candidates, parse_env, parse_size, parse_sizes, plan_runs,
                                   resolve_target, skip_reason)
from tf_nvlink.util.error_lines import write_failure

HELP = "all-reduce time, algbw and busbw per cross-device-ops candidate, each in its own process (like nccl-tests)"

def add_common_arguments(parser: argparse.ArgumentParser, default_candidates: str, default_sizes: Optional[str],
                         default_iters: int = 10) -> None:
    """Options `tf-nvlink bench` and `tf-nvlink tune` share (`default_sizes` None: the caller decides)."""
    parser.add_argument("--gpus", default="all",
                        help="'all', 'auto' (largest NVLink group) or nvidia-smi indices such as '0,1' "
                             "(as tf_nvlink.strategy)")
    parser.add_argument("--devices", default="gpu",
                        help="'gpu' (default: the GPUs --gpus names) or 'cpu:N' (N logical CPU devices, for "
                             "machines without GPUs and tests)")
    parser.add_argument("--candidates", type=argtype(parse_candidates), default=default_candidates,
                        help=f"comma list from collective, nccl[:PACKS], hierarchical[:PACKS], reduce_to_one, auto, xla "
                             f"(default {default_candidates})")
    parser.add_argument("--sizes", type=argtype(parse_sizes), default=default_sizes,
                        help="comma list of all-reduce sizes with K/M/G suffixes (binary), default "
                             + (default_sizes or "16M,256M, or only --grad_bytes when given"))
    parser.add_argument("--iters", type=positive, default=default_iters,
                        help="all-reduces chained inside one timed tf.function call (default %(default)s)")
    parser.add_argument("--warmup", type=non_negative, default=2,
                        help="warm-up calls before timing; the first traces (default %(default)s, at least 1 runs)")
    parser.add_argument("--repeats", type=positive, default=3, help="timed calls per size (default %(default)s)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the workers, repeatable (e.g. NCCL_P2P_DISABLE=1)")
    parser.add_argument("--timeout", type=positive, default=1800, help="seconds per worker (default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink bench` options."""
    add_common_arguments(parser, DEFAULT_CANDIDATES, ",".join(format_size(s) for s in DEFAULT_SIZES))
    parser.add_argument("--max_size", type=argtype(parse_size), default=None,
                        help="drop sizes above this (e.g. 256M on small GPUs)")
    parser.add_argument("--compare_p2p", action=argparse.BooleanOptionalAction, default=False,
                        help="run each candidate twice, normally and with NCCL_P2P_DISABLE=1, and print the NVLink "
                             "speed-up per size")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the records as JSON to FILE; bare --json prints JSON instead of the table")
    parser.add_argument("--plot", type=plot_file, default=None, metavar="FILE.png",
                        help="plot busbw against size, one line per candidate (needs matplotlib: "
                             "pip install tf-nvlink[plot]; imported when the flags are read)")
    parser.add_argument("--from_json", default=None, metavar="FILE",
                        help="measure nothing: print the summary (and --plot) from records an earlier --json FILE "
                             "wrote, e.g. on a machine with matplotlib")


def _listify(value, parse):
    return parse(value) if isinstance(value, str) else list(value)


def load_records(path: str) -> list[dict]:
    """The records a `--json FILE` run wrote, checked enough to render; BenchError naming the problem otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--from_json {path!r} cannot be read as JSON: {exc}") from None
    needed = ("label", "candidate", "variant", "size_bytes", "status", "busbw", "wrong")
    if not isinstance(records, list) or not all(isinstance(r, dict) and all(k in r for k in needed)
                                                for r in records):
        raise BenchError(f"--from_json {path!r} is not a list of tf-nvlink bench records (each with "
                         f"{', '.join(needed)}): write one with tf-nvlink bench --json FILE")
    for number, record in enumerate(records):
        problem = record_problem(record)
        if problem:
            raise BenchError(f"--from_json {path!r}: record {number} (label {record.get('label')!r}) {problem}; "
                             f"write the file again with tf-nvlink bench --json FILE")
    return [r for r in records if r["status"] != "skipped"]


def run_from_json(args: argparse.Namespace) -> int:
    """`tf-nvlink bench --from_json FILE [--plot P.png]`: the summary (and plot) of earlier records."""
    try:
        records = load_records(args.from_json)
        if args.plot:
            check_plot_available()
    except BenchError as exc:
        return usage_error(args, str(exc))
    blocks = [f"# tf-nvlink bench: records from {args.from_json}", render_summary(records)]
    if any(r["variant"] == P2P_VARIANT for r in records):
        blocks.append(render_p2p_ratio(records))
    blocks.append(result_line(records))
    sys.stdout.write("\n#\n".join(blocks) + "\n")
    if args.plot:
        plot(records, args.plot, title=f"all-reduce busbw ({os.path.basename(args.from_json)})")
        print(f"# plot written to {args.plot}")
    return exit_code(records)


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink bench`: measure, print the tables (or JSON), write --json/--plot files; 1 on wrong sums."""
    if getattr(args, "from_json", None):
        return run_from_json(args)
    try:
        candidates = _listify(args.candidates, parse_candidates)
        sizes = _listify(args.sizes, parse_sizes)
        if args.max_size:
            sizes = [s for s in sizes if s <= args.max_size]
            if not sizes:
                raise BenchError(f"--max_size {format_size(args.max_size)} leaves no size to measure.")
        env = parse_env(args.env)
        if args.compare_p2p and "NCCL_P2P_DISABLE" in env:
            raise BenchError("--compare_p2p sets NCCL_P2P_DISABLE itself; drop it from --env.")
        if args.plot:
            check_plot_available()
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            problem = atomic_files.unwritable_reason(path) if path and path != "-" else None
            if problem:  # now, not after minutes of measuring
                raise BenchError(f"{flag} {path!r} cannot be written: {problem}.")
        target = resolve_target(args.devices, args.gpus)
    except BenchError as exc:
        return usage_error(args, str(exc))
    runs, _ = plan_runs(candidates, target)
    if not runs:
        skipped = "; ".join(f"{c.label}: {skip_reason(c, target)}" for c in candidates)
        return usage_error(args, f"no candidate can run on {target.describe()} ({skipped}).")
    options = dict(iters=args.iters, warmup=args.warmup, repeats=args.repeats, timeout=args.timeout)
    records, skipped = measure(candidates, target, sizes, env=env, **options)
    if args.compare_p2p:
        more, _ = measure(candidates, target, sizes, env=dict(env, **P2P_ENV), variant=P2P_VARIANT, **options)
        records += more
    command = command_line(args)
    if args.json == "-":
        for label, reason in skipped:
            print(f"# skipped {label}: {reason}", file=sys.stderr)
        print(json.dumps(records + skipped_records(skipped, target), indent=1, allow_nan=False))
    else:
        sys.stdout.write(render_text(command, target, records, skipped, args.iters, args.warmup, args.repeats, env,
                                     args.compare_p2p))
        if args.json:
            text = json.dumps(records + skipped_records(skipped, target), indent=1, allow_nan=False)
            try:
                atomic_files.write_atomic(args.json, text, mode=None)
                print(f"# JSON records written to {args.json}")
            except OSError as exc:  # the folder changed while measuring: keep the measurement, say why
                print(text)
                print(write_failure("tf-nvlink bench", "write --json", args.json, exc,
                                    "the records are printed above instead"), file=sys.stderr)
                return 1
    if args.plot:
        try:
            plot(records, args.plot, title=f"all-reduce busbw, {target.describe().split(';')[0]}")
        except OSError as exc:
            print(write_failure("tf-nvlink bench", "write --plot", args.plot, exc), file=sys.stderr)
            return 1
        if args.json != "-":
            print(f"# plot written to {args.plot}")
    return exit_code(records)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tools.allreduce_bench ...`: the same as `tf-nvlink bench ...` (the workers: `tf_nvlink.tools.allreduce_bench.worker`)."""
    return run_as_module("tf_nvlink.tools.allreduce_bench", HELP, add_arguments, run, argv)

