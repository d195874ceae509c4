"""Every number Keras shows, and every input as Keras reads it, as on one device: Keras features x modes x
replicas x paths (tests/training/feature_matrix_cases.py holds the rows and says how to add one).

Each layout runs every row in one process (one strategy per process), started in the background when the tests
are collected. Compared with one device: weights, epoch logs (loss, each output's loss, metrics, `val_*`),
evaluate's results and the rows' own numbers at float32's 1e-5 (float16 rows at float16's precision); counts,
orders, file names and errors exactly. The default run has fused mode (the GPU path, through the CPU emulation)
on 2 replicas, both paths; the slow tier adds 1 replica, split mode and plain (no XLA) on 2. `pytest -m gpu`
runs the rows on the real GPUs (tests/test_gpu.py).
"""

from pathlib import Path

import numpy as np
import pytest

import scenarios

_CASES = str(Path(__file__).resolve().parent / "feature_matrix_cases.py")


def _layout_body(layout):
    return (f"import runpy, sys\n"
            f"sys.argv = [{_CASES!r}, {layout!r}]\n"
            f"cases = runpy.run_path({_CASES!r}, run_name='__matrix__')\n"
            f"result = cases['run'](list(cases['ROWS']))\n")


ROWS = ["bn_unknown_length", "class_weight_numpy", "class_weight_dataset", "sample_weight_dataset",
        "validation_callbacks", "validation_freq", "multi_output_dict", "unbuilt_reshuffle", "generator_passes",
        "python_generator", "pydataset_shuffle", "numpy_shuffle", "on_batch_calls", "input_error",
        "batchnorm_synchronized", "mixed_precision"]
# float16 compute: the replicas' partial sums round differently from one device's sum.
_TOLERANCE = {"mixed_precision": (2e-3, 2e-4)}

LAYOUTS = {layout: scenarios.Scenario(f"feature_matrix_{layout}", prelude="", cases={"all": _layout_body(layout)},
                                      timeout=1200, slow=layout != "emulated2", long=True)
           for layout in ("emulated2", "emulated1", "split2", "plain2")}
_PATHS = {"emulated2": ("per_step", "compiled"), "emulated1": ("per_step", "compiled"), "split2": ("per_step",),
          "plain2": ("per_step",)}


def _compare(row, path, result, reference, where=""):
    if isinstance(reference, dict):
        assert isinstance(result, dict) and result.keys() == reference.keys(), (
            f"{row} {path}{where}: keys {sorted(result)} != one device's {sorted(reference)}")
        for key in reference:
            _compare(row, path, result[key], reference[key], f"{where}.{key}")
    elif isinstance(reference, list) and reference and isinstance(reference[0], (list, dict)):
        assert len(result) == len(reference), f"{row} {path}{where}: {len(result)} items, one device {len(reference)}"
        for index, (got, expected) in enumerate(zip(result, reference)):
            _compare(row, path, got, expected, f"{where}[{index}]")
    else:
        rtol, atol = _TOLERANCE.get(row, (1e-5, 1e-6))
        got, expected = np.asarray(result, dtype="float64"), np.asarray(reference, dtype="float64")
        assert got.shape == expected.shape, f"{row} {path}{where}: shape {got.shape}, one device {expected.shape}"
        assert np.isfinite(got).all() == np.isfinite(expected).all(), f"{row} {path}{where}: {got} vs {expected}"
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol, err_msg=f"{row} {path}{where}")


def _cells():
    for layout, scenario in LAYOUTS.items():
        marks = [pytest.mark.slow] if scenario.slow else []
        for row in ROWS:
            for path in _PATHS[layout]:
                yield pytest.param(layout, row, path, marks=marks, id=f"{layout}-{row}-{path}")


@pytest.mark.parametrize("layout,row,path", list(_cells()))
def test_as_on_one_device(layout, row, path):
    assert_as_on_one_device(LAYOUTS[layout].result("all")[row], row, path)


def assert_as_on_one_device(results, row, path):
    """One row's `path` result against its one-device result (tests/test_gpu.py uses it for the GPU layouts)."""
    reference, result = results["one_device"], results[path]
    assert "error" not in reference, reference.get("error")
    if "cannot" in result:
        pytest.skip(f"{row} cannot run here: {result['cannot']}")
    assert "error" not in result, result["error"]
    exact = dict(result["exact"])
    assert exact.pop("replica_copies_agree"), f"{row} {path}: the replicas' copies of a variable differ"
    assert exact == {k: v for k, v in reference["exact"].items() if k != "replica_copies_agree"}, f"{row} {path}"
    _compare(row, path, result["close"], reference["close"])
