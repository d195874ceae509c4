"""tf_nvlink.tools.training_bench.cli: one-line errors in tables (never a traceback), and the candidates a
GPU-less machine can run."""

import pytest

from tf_nvlink.tools.training_bench import candidates
from tf_nvlink.tools.training_bench import cli as training_bench


TRACEBACK = ('Traceback (most recent call last):\n  File "/x/training_bench.py", line 12, in <module>\n'
             '    strategy = build()\n    ^^^^^^^^^^^^^^^^\n'
             'tensorflow.python.framework.errors_impl.InvalidArgumentError: No OpKernel was registered to support '
             'Op \'NcclAllReduce\'\n')


@pytest.mark.parametrize("error, expected", [
    (TRACEBACK, "tensorflow.python.framework.errors_impl.InvalidArgumentError: No OpKernel was registered"),
    ("worker timed out after 900 s", "worker timed out after 900 s"),
    ("", "(no message)"),
])
def test_error_lines_and_tables_carry_no_traceback_text(error, expected):
    line = training_bench.error_line(error)
    assert line.startswith(expected[:60]) and "Traceback" not in line and "\n" not in line and len(line) <= 150
    table = training_bench.render_table([{"candidate": "nccl", "error": error}])
    assert "Traceback" not in table and 'File "' not in table


def test_cpu_candidates_leave_out_what_needs_gpus():
    kept, dropped = training_bench.cpu_candidates(candidates.parse_list(
        "1gpu,stock,auto,collective,nccl,reduce_to_one,hierarchical,auto@nop2p,auto@fused,auto@split"))
    assert [c.label for c in kept] == ["1gpu", "stock", "auto", "collective", "reduce_to_one", "auto@split"]
    assert [c.label for c in dropped] == ["nccl", "hierarchical", "auto@nop2p", "auto@fused"]


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "0"], "argument --steps: should be a positive integer"),
    (["--steps", "10", "--long_steps", "5"], "--long_steps should be 0 or more than --steps=10"),
    (["--candidates", "auto@turbo"], "turbo"),
])
def test_bad_arguments_are_usage_errors_naming_the_problem(argv, needle, capsys):
    with pytest.raises(SystemExit) as info:
        training_bench.main(argv)
    assert info.value.code == 2 and needle in capsys.readouterr().err
