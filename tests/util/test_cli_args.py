"""tf_nvlink.util.cli_args: argparse types with messages for the user, the command-line header, usage errors."""

import argparse
import sys

import pytest

from tf_nvlink.util import cli_args


@pytest.mark.parametrize("convert, text, expected", [(cli_args.positive, "3", 3), (cli_args.non_negative, "0", 0)])
def test_integer_types_take_their_range(convert, text, expected):
    assert convert(text) == expected


@pytest.mark.parametrize("convert, bad, needle", [
    (cli_args.positive, "0", "should be a positive integer. Received: '0'"),
    (cli_args.positive, "-2", "should be a positive integer. Received: '-2'"),
    (cli_args.non_negative, "x", "should be a non-negative integer. Received: 'x'"),
])
def test_integer_types_refuse_naming_the_value(convert, bad, needle):
    with pytest.raises(argparse.ArgumentTypeError, match=needle):
        convert(bad)


def test_argtype_turns_value_errors_into_argparse_errors():
    def parse_sizes(text):
        raise ValueError(f"bad size {text!r}")

    convert = cli_args.argtype(parse_sizes)
    assert convert.__name__ == "sizes"
    with pytest.raises(argparse.ArgumentTypeError, match="bad size '9Q'"):
        convert("9Q")


def test_command_line_names_how_the_command_was_run(monkeypatch):
    assert cli_args.command_line(argparse.Namespace(command_line="tf-nvlink bench --sizes 1M")) == \
        "tf-nvlink bench --sizes 1M"
    monkeypatch.setattr(sys, "argv", ["/x/__main__.py", "bench", "--sizes", "1M 2M"])
    assert cli_args.command_line(argparse.Namespace()) == "python -m tf_nvlink bench --sizes '1M 2M'"
    monkeypatch.setattr(sys, "argv", ["/x/tune.py", "--list"])
    assert cli_args.command_line(argparse.Namespace()) == "python -m tf_nvlink.tune --list"


def test_usage_error_goes_through_the_subcommands_parser(capsys):
    parser = argparse.ArgumentParser(prog="tf-nvlink bench")
    with pytest.raises(SystemExit) as info:
        cli_args.usage_error(argparse.Namespace(subparser=parser), "--sizes: nothing to measure")
    assert info.value.code == 2 and "--sizes: nothing to measure" in capsys.readouterr().err
    assert cli_args.usage_error(argparse.Namespace(), "no parser") == 2
    assert "tf-nvlink bench: error: no parser" in capsys.readouterr().err


def test_parser_spellings_leave_unknown_tokens_and_everything_after_double_dash():
    parser = cli_args.Parser(prog="p")
    parser.add_argument("--max_size")
    parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("rest", nargs="*")
    assert parser.normalize(["--max-size=3", "--nojit", "--maxsize", "--", "--max-size"]) == [
        "--max_size=3", "--no-jit", "--maxsize", "--", "--max-size"]
    assert parser.normalize(["--nojit=1"]) == ["--nojit=1"]  # a value on a negative flag: argparse's error
    args = parser.parse_args(["--max-size", "1", "--no_jit", "--", "--max-size"])
    assert (args.max_size, args.jit, args.rest) == ("1", False, ["--max-size"])
