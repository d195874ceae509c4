"""One command line: every `tf-nvlink` subcommand has --help, takes each flag with `-` or `_`, has true/false flags
in the one form `--flag/--no-flag` (absl's `--noflag` read too), ends a bad flag value with exit status 2 and one
line on stderr, and imports an optional dependency it will need (matplotlib for --plot) while reading the flags."""

from __future__ import annotations

import sys
import time

import pytest

from conftest import run_python
from tf_nvlink.__main__ import SUBCOMMANDS, build_parser, main

# One bad value per subcommand, and the words its one-line error must hold.
BAD_VALUES = {
    "report": (["--nvlink_traffic", "soon"], "--nvlink_traffic"),
    "bench": (["--iters", "0"], "argument --iters: should be a positive integer"),
    "tune": (["--grad_bytes", "lots"], "argument --grad_bytes"),
    "doctor": (["--window_steps", "0"], "argument --window_steps: should be a positive integer"),
    "train-bench": (["--steps", "-3"], "argument --steps: should be a positive integer"),
    "costmodel": (["--compute_ms", "fast", "--gradient_mib", "97.5"], "argument --compute_ms: should be a positive"),
    "cache": (["--dir", __file__], "argument --dir: should be a folder"),
}


def parse(argv):
    args, extra = build_parser().parse_known_args(argv)
    assert not extra, extra
    return args


def test_every_subcommand_is_listed_and_has_a_bad_value_case():
    assert set(SUBCOMMANDS) == {"report", "bench", "tune", "doctor", "train-bench", "costmodel", "cache"} == set(BAD_VALUES)


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_help_of_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and f"usage: tf-nvlink {command}" in out
    assert " ".join(SUBCOMMANDS[command].help.split())[:40] in " ".join(out.split())
    assert "'-' or '_' alike" in out


@pytest.mark.parametrize("command", sorted(SUBCOMMANDS))
def test_a_bad_value_exits_2_with_one_line_and_no_traceback(command, capsys):
    argv, words = BAD_VALUES[command]
    with pytest.raises(SystemExit) as info:
        main([command, *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.count("\n") == 1 and err.startswith(f"tf-nvlink {command}: error: ") and words in err, err
    assert "Traceback" not in err


def test_an_unknown_flag_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--modle", "resnet50"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "unrecognized arguments: --modle" in err


def test_flags_take_dashes_or_underscores():
    for spelling in ("--batch_per_replica", "--batch-per-replica"):
        assert parse(["doctor", spelling, "8"]).batch_per_replica == 8
        assert parse(["doctor", f"{spelling}=16"]).batch_per_replica == 16
    assert parse(["bench", "--max-size", "1M"]).max_size == parse(["bench", "--max_size", "1M"]).max_size == 2**20
    assert parse(["costmodel", "--compute-ms", "3", "--gradient-mib", "1"]).compute_ms == 3.0
    assert parse(["report", "--nvlink-traffic", "2"]).nvlink_traffic == 2.0
    assert parse(["doctor", "--log-dir", "logs"]).log_dir == "logs" and parse(["doctor"]).log_dir is None


@pytest.mark.parametrize("command, positive, attribute, default", [
    ("report", "tf", "tf", True), ("report", "json", "json", False), ("tune", "store", "store", True),
    ("bench", "compare_p2p", "compare_p2p", False), ("train-bench", "jit", "jit", True),
    ("train-bench", "mixed_precision", "mixed", None), ("cache", "clear", "clear", False), ("cache", "json", "json", False)])
def test_true_false_flags_have_one_form_and_read_the_absl_spelling(command, positive, attribute, default):
    assert getattr(parse([command]), attribute) is default
    assert getattr(parse([command, f"--{positive}"]), attribute) is True
    dashed = positive.replace("_", "-")
    for negative in (f"--no-{positive}", f"--no-{dashed}", f"--no_{positive}", f"--no{positive}"):
        assert getattr(parse([command, negative]), attribute) is False, negative


def test_python_dash_m_forms_keep_working(capsys):
    from tf_nvlink.tools.costmodel.table import main as costmodel_main
    from tf_nvlink.tools.doctor.command import main as doctor_main
    from tf_nvlink.tools.training_bench.cli import main as training_bench_main

    assert costmodel_main(["--compute_ms", "39.7", "--gradient-mib", "97.5", "--gpus", "1,2"]) == 0
    assert "nvswitch-h200" in capsys.readouterr().out
    for module_main, prog in ((doctor_main, "tf_nvlink.tools.doctor"),
                              (training_bench_main, "tf_nvlink.tools.training_bench")):
        with pytest.raises(SystemExit) as info:
            module_main(["--help"])
        assert info.value.code == 0 and f"usage: python -m {prog}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        training_bench_main(["--nojit", "--steps", "0"])  # the absl spelling is read; the bad value is refused
    assert info.value.code == 2 and "argument --steps" in capsys.readouterr().err


def test_a_broken_matplotlib_fails_bench_plot_while_reading_the_flags(tmp_path):
    """`import matplotlib` fails (as an install built against another numpy does): `tf-nvlink bench --plot` stops
    before any measuring, in one line naming matplotlib and the fix."""
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from tf_nvlink.__main__ import main\n"
            f"sys.exit(main(['bench', '--devices', 'cpu:2', '--plot', {str(tmp_path / 'busbw.png')!r}]))")
    began = time.monotonic()
    result = run_python(code, timeout=120)
    seconds = time.monotonic() - began
    print(f"bench --plot with a broken matplotlib failed in {seconds:.2f} s", file=sys.stderr)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "argument --plot: needs matplotlib, which cannot be imported" in result.stderr
    assert "pip install matplotlib" in result.stderr
    assert seconds < 20  # no worker started: the interpreter's start and the flags
    assert not (tmp_path / "busbw.png").exists()


@pytest.mark.parametrize("flags, rc", [([], 2), (["--chart"], 2), (["--no-chart"], None)])
def test_a_broken_matplotlib_stops_the_doctor_before_training_unless_no_chart(flags, rc, monkeypatch, capsys):
    """An installed matplotlib that fails to import stops `tf-nvlink doctor` before TensorFlow starts (exit 2, the
    fix named); --no-chart goes on without it."""
    import importlib.util as util

    from tf_nvlink.tools.doctor import command

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(util, "find_spec", lambda name, *a: object() if name == "matplotlib" else None)
    args = parse(["doctor", *flags])
    if rc is None:
        assert command.chart_wanted(args) is False
        return
    with pytest.raises(SystemExit) as info:
        command.chart_wanted(args)
    err = capsys.readouterr().err
    assert info.value.code == rc and err.count("\n") == 1 and "needs matplotlib" in err and "--no-chart" in err
