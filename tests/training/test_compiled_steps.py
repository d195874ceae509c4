"""CompiledSteps (tf_nvlink.training.compiled_steps): a custom loop's N steps as one program per replica.

`compiled_steps_cases.py` trains the same custom-loop step once per `strategy.run` and through CompiledSteps in
one process per layout; tests/test_gpu.py runs it under XLA on a GPU.
"""

import json
from pathlib import Path

import numpy as np
import pytest

import scenarios

_CASES = str(Path(__file__).resolve().parent / "compiled_steps_cases.py")


# Each layout's process starts in the background when the tests are collected (tests/scenarios.py).
_LAYOUTS = {"emulated2": scenarios.Background("compiled steps: emulated2", [_CASES, "emulated2"], expected_s=9),
            "split2": scenarios.Background("compiled steps: split2", [_CASES, "split2"], slow=True, expected_s=5)}


def _run(layout):
    proc = _LAYOUTS[layout].wait()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same_training(result, mode, programs):
    """Both runs' weights, optimizer steps and losses equal (float32, 1e-5); calls of 4, 2 and 1 steps an epoch
    (100 examples in batches of 15 at steps=4: a partial call, then the short batch alone)."""
    per_step, compiled = result["per_step"], result["compiled"]
    assert compiled["mode"] == mode
    assert compiled["calls"] == [4, 2, 1, 4, 2, 1]
    assert compiled["programs_run"] == programs
    assert compiled["iterations"] == per_step["iterations"] == 14
    for a, b in zip(per_step["weights"], compiled["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(compiled["losses"], per_step["losses"], rtol=1e-5)
    assert len(compiled["bad_steps"]) == 3  # steps=0, 2.5, True
    assert all("steps should be a positive integer" in e and "Received: steps=" in e for e in compiled["bad_steps"])


def test_fused_mode_runs_each_call_as_one_program_and_trains_as_per_step():
    assert_same_training(_run("emulated2"), "fused", programs=6)


@pytest.mark.slow  # the same exactness on the fallback path; fused mode above is the one-program path
def test_split_mode_runs_the_steps_one_by_one_with_the_same_result():
    assert_same_training(_run("split2"), "split", programs=0)


def test_bad_arguments_name_the_problem(tf):
    from tf_nvlink.training.compiled_steps import CompiledSteps

    with pytest.raises(TypeError, match="needs a tf_nvlink strategy"):
        CompiledSteps(tf.distribute.get_strategy(), lambda x: x, steps=4)
