"""argparse helpers the subcommands share (`tf-nvlink bench`, `tf-nvlink tune`).

Example:
    >>> parser.add_argument("--sizes", type=argtype(parse_sizes))
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys


def argtype(parse):
    """An argparse `type=` from a parser that raises ValueError with a message for the user."""
    def convert(text):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__.replace("parse_", "")
    return convert


def positive(text: str) -> int:
    if not str(text).isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"should be a positive integer. Received: {text!r}")
    return int(text)


def non_negative(text: str) -> int:
    if not str(text).isdigit():
        raise argparse.ArgumentTypeError(f"should be a non-negative integer. Received: {text!r}")
    return int(text)


def command_line(args: argparse.Namespace) -> str:
    """The exact command that ran, for the output header."""
    if getattr(args, "command_line", None):
        return args.command_line
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "tf-nvlink"
    if prog == "__main__.py":
        prog = "python -m tf_nvlink"
    elif prog in ("bench.py", "tune.py"):
        prog = "python -m tf_nvlink." + prog[:-3]
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def usage_error(args: argparse.Namespace, message: str) -> int:
    """Exit 2 through the subcommand's parser (its usage line, then `message`); 2 where there is no parser."""
    parser = getattr(args, "subparser", None)
    if parser is not None:
        parser.error(message)  # exits with status 2 and the usage line
    print(f"tf-nvlink bench: error: {message}", file=sys.stderr)
    return 2


def run_as_module(prog: str, description: str, add_arguments, run, argv=None) -> int:
    """`python -m <prog> ...` of a `tf-nvlink` subcommand: its arguments parsed from `argv`, the exact command line
    kept for the output header, usage errors through this parser.

    Example:
        >>> run_as_module("tf_nvlink.tools.tune", HELP, add_arguments, run, ["--list"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=f"python -m {prog}", description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["python", "-m", prog, *argv])
    args.subparser = parser
    return run(args)
