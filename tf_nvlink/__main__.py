"""`tf-nvlink` (also `python -m tf_nvlink`): the command line.

    tf-nvlink                      # same as `tf-nvlink report`
    tf-nvlink report --no-tf       # NVML only, instant
    tf-nvlink report --json        # the same data as JSON
    tf-nvlink bench | tune         # all-reduce busbw per candidate | measure once, store the winner
    tf-nvlink doctor --model resnet50          # one fit with the step doctor
    tf-nvlink train-bench --model resnet50     # training throughput per strategy candidate
    tf-nvlink costmodel --compute_ms 39.7 --gradient_mib 97.5   # predicted scaling

Every flag is taken with `-` or `_` alike; a true/false flag is `--flag/--no-flag` (tf_nvlink.util.cli_args.Parser).

Adding a subcommand: write a module with `HELP` (one line), `add_arguments(parser)` and `run(args) -> int`,
keep its top level free of TensorFlow imports (the parser is built for every call, `--no-tf` must stay instant),
and add one entry to `SUBCOMMANDS` below.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, NamedTuple, Optional, Sequence

import tf_nvlink
from tf_nvlink.tools import compile_cache_cli, report, tune
from tf_nvlink.tools.allreduce_bench import cli
from tf_nvlink.tools.costmodel import table as costmodel_table
from tf_nvlink.tools.doctor import command as doctor_command
from tf_nvlink.tools.training_bench import cli as training_bench_cli
from tf_nvlink.util.cli_args import Parser


class Subcommand(NamedTuple):
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# name -> Subcommand; the first one is what a bare `tf-nvlink` (or `tf-nvlink --json`) runs.
SUBCOMMANDS: dict[str, Subcommand] = {
    "report": Subcommand(report.HELP, report.add_arguments, report.run),
    "bench": Subcommand(cli.HELP, cli.add_arguments, cli.run),
    "tune": Subcommand(tune.HELP, tune.add_arguments, tune.run),
    "doctor": Subcommand(doctor_command.HELP, doctor_command.add_arguments, doctor_command.run),
    "train-bench": Subcommand(training_bench_cli.HELP, training_bench_cli.add_arguments, training_bench_cli.run),
    "costmodel": Subcommand(costmodel_table.HELP, costmodel_table.add_arguments, costmodel_table.run),
    "cache": Subcommand(compile_cache_cli.HELP, compile_cache_cli.add_arguments, compile_cache_cli.run),
}
DEFAULT_SUBCOMMAND = "report"


def build_parser() -> argparse.ArgumentParser:
    """The `tf-nvlink` parser, one subparser per entry of SUBCOMMANDS."""
    parser = Parser(
        prog="tf-nvlink",
        description="TensorFlow MirroredStrategy chosen from the machine's real NVLink/PCIe topology.",
        epilog=f"Without a subcommand, runs `{DEFAULT_SUBCOMMAND}`.")
    parser.add_argument("--version", action="version", version=f"tf-nvlink {tf_nvlink.__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, command in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_arguments(sub)
        sub.set_defaults(run=command.run, subparser=sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line with `argv` (default: sys.argv[1:]); returns the exit code.

    Bad arguments exit through argparse (status 2, one line on stderr: `cli_args.Parser.error`).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = [DEFAULT_SUBCOMMAND, *argv]  # `tf-nvlink --json` means `tf-nvlink report --json`
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # reported by the subcommand's parser, so the usage shown is that subcommand's
        args.subparser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:  # `tf-nvlink report | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
