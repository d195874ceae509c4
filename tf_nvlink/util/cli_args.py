"""argparse helpers the subcommands share (`tf-nvlink report`, `bench`, `tune`, `doctor`, `train-bench`,
`costmodel`).

`Parser` is the parser of every `tf-nvlink` command (and of each one's `python -m` form): a long flag is taken
with `-` or `_` alike (`--batch_per_replica`, `--batch-per-replica`), a true/false flag has the one form
`--flag/--no-flag` (`argparse.BooleanOptionalAction`; absl's `--noflag` is read as `--no-flag`), and a bad flag or
value ends the command with exit status 2 and one line on stderr, no traceback.

Example:
    >>> parser = Parser(prog="tf-nvlink doctor")
    >>> parser.add_argument("--sizes", type=argtype(parse_sizes))
    >>> parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=True)
"""

from __future__ import annotations

import argparse
import importlib
import os
import shlex
import sys
from typing import Sequence

SPELLING_NOTE = "Every flag is taken with '-' or '_' alike (--batch_per_replica, --batch-per-replica)."


def _flag_key(name: str) -> str:
    return name.replace("-", "_")


class Parser(argparse.ArgumentParser):
    """argparse with tf-nvlink's spellings and one-line errors (the module docstring says which)."""

    def __init__(self, *args, **kwargs):
        self.flag_actions: dict[str, argparse.Action] = {}  # every option string added, to its action
        kwargs.setdefault("epilog", SPELLING_NOTE)
        super().__init__(*args, **kwargs)

    def add_argument(self, *args, **kwargs):
        action = super().add_argument(*args, **kwargs)
        self.flag_actions.update(dict.fromkeys(action.option_strings, action))
        return action

    def normalize(self, args: Sequence[str]) -> list[str]:
        """`args` with each long flag spelled as this parser registered it: `-`/`_` swapped, absl's `--noflag`
        as `--no-flag`; tokens it does not know (and everything after `--`) are left for argparse to judge."""
        known = {}
        negatives = {}
        for option, action in self.flag_actions.items():
            if option.startswith("--"):
                known.setdefault(_flag_key(option[2:]), option)
                if isinstance(action, argparse.BooleanOptionalAction) and not option.startswith("--no-"):
                    negatives[_flag_key(option[2:])] = "--no-" + option[2:]
        out = []
        for index, token in enumerate(args):
            if token == "--":
                return out + list(args[index:])
            if token.startswith("--") and len(token) > 2:
                name, sep, value = token[2:].partition("=")
                key = _flag_key(name)
                if "--" + name not in self.flag_actions:
                    if key in known:
                        token = known[key] + sep + value
                    elif key.startswith("no") and key[2:] in negatives and not sep:
                        token = negatives[key[2:]]  # absl's --noflag
            out.append(token)
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(self.normalize(args), namespace)

    def error(self, message: str):
        """Exit 2 with one line: the command, the problem and where the flags are listed."""
        message = " ".join(str(message).split())
        self.exit(2, f"{self.prog}: error: {message} (flags: {self.prog} --help)\n")


def require_module(module: str, flag: str, fix: str):
    """Import `module` now, while the arguments are read; an argparse error naming `flag`, the package and the fix
    when it cannot be imported (missing, or installed but broken: e.g. built against another numpy).

    Example:
        >>> require_module("matplotlib.pyplot", "--plot", "pip install matplotlib")
    """
    try:
        if module.startswith("matplotlib"):
            importlib.import_module("matplotlib").use("Agg")
        return importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything; say so in one line
        detail = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        raise argparse.ArgumentTypeError(f"{flag + ' ' if flag else ''}needs {module.split('.')[0]}, which cannot be "
                                         f"imported ({detail}): {fix}") from None


def plot_file(text: str) -> str:
    """An argparse `type=` for a PNG path that needs matplotlib: matplotlib is imported now, not after the run."""
    require_module("matplotlib.pyplot", "", "pip install matplotlib (or pip install 'tf-nvlink[plot]')")
    return text


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
    parser = Parser(prog=f"python -m {prog}", description=description)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["python", "-m", prog, *argv])
    args.subparser = parser
    return run(args)
