"""Every number Keras shows, and every input as Keras reads it, as on one device: Keras features x modes x
replicas x paths (tests/training/feature_matrix_cases.py holds the rows and says how to add one).

Each layout runs every row in one process (one strategy per process), started in the background when the tests
are collected. Compared with one device: weights, epoch logs (loss, each output's loss, metrics, `val_*`),
evaluate's results and the rows' own numbers at float32's 1e-5 (float16 rows at float16's precision); counts,
orders, file names and errors exactly. The default run has fused mode (the GPU path, through the CPU emulation)
on 2 replicas, both paths, for `DEFAULT_ROWS`; the slow tier has the other rows there, and every row on 1
replica, in split mode and in plain mode (no XLA) on 2, and in 2 worker processes (multi-worker mode). `pytest -m
gpu` runs the rows on the real GPUs (tests/test_gpu.py).
"""

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import scenarios

_CASES = str(Path(__file__).resolve().parent / "feature_matrix_cases.py")


def _layout_body(layout, rows):
    return (f"import runpy, sys\n"
            f"sys.argv = [{_CASES!r}, {layout!r}]\n"
            f"result = runpy.run_path({_CASES!r}, run_name='__matrix__')['run']({rows!r})\n")


ROWS = ["bn_unknown_length", "class_weight_numpy", "class_weight_dataset", "sample_weight_dataset",
        "validation_callbacks", "validation_freq", "multi_output_dict", "unbuilt_reshuffle", "generator_passes",
        "python_generator", "pydataset_shuffle", "numpy_shuffle", "on_batch_calls", "input_error",
        "batchnorm_synchronized", "mixed_precision", "batch_logs", "fit_arguments", "optimizer_options",
        "custom_train_step", "run_eagerly", "embedding_repeated_ids", "attention_masks"]
# The default run: fused mode on 2 replicas (the GPU path), both paths, one row per fix (NaN logs of an empty
# replica, per-output losses, the build that takes no batch, *_on_batch, input errors, eager steps); every other
# cell is in the slow tier. About 50 s of one core.
DEFAULT_ROWS = ["class_weight_numpy", "validation_freq", "multi_output_dict", "unbuilt_reshuffle",
                "generator_passes", "python_generator", "on_batch_calls", "input_error", "custom_train_step",
                "run_eagerly"]
# float16 compute: the replicas' partial sums round differently from one device's sum.
_TOLERANCE = {"mixed_precision": (2e-3, 2e-4)}
_PATHS = {"emulated2": ("per_step", "compiled"), "emulated1": ("per_step", "compiled"), "split2": ("per_step",),
          "plain2": ("per_step",)}


def _scenario(layout, rows, slow):
    return scenarios.Scenario(f"feature_matrix_{layout}{'_slow' if slow else ''}", prelude="",
                              cases={"all": _layout_body(layout, rows)}, timeout=1200, slow=slow,
                              expected_s=40 if layout == "emulated2" and not slow else 60)


_DEFAULT = _scenario("emulated2", DEFAULT_ROWS, slow=False)
_SLOW = {layout: _scenario(layout, [row for row in ROWS if layout != "emulated2" or row not in DEFAULT_ROWS],
                           slow=True) for layout in _PATHS}


def _scenario_of(layout, row):
    return _DEFAULT if layout == "emulated2" and row in DEFAULT_ROWS else _SLOW[layout]


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
    for layout, paths in _PATHS.items():
        for row in ROWS:
            marks = [pytest.mark.slow] if _scenario_of(layout, row).slow else []
            for path in paths:
                yield pytest.param(layout, row, path, marks=marks, id=f"{layout}-{row}-{path}")


@pytest.mark.parametrize("layout,row,path", list(_cells()))
def test_as_on_one_device(layout, row, path):
    assert_as_on_one_device(_scenario_of(layout, row).result("all")[row], row, path)


@functools.lru_cache(maxsize=None)
def _two_workers() -> tuple:
    """Every row in 2 worker processes on this host (TF_CONFIG, one CPU device each, split mode across workers);
    each worker's results, its own one-device results included."""
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            ports.append(probe.getsockname()[1])
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    root = Path(__file__).resolve().parents[2]
    workers = []
    for index in range(2):
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
                   CUDA_VISIBLE_DEVICES="", PYTHONPATH=os.pathsep.join([str(root), str(root / "tests"),
                                                                          os.environ.get("PYTHONPATH", "")]))
        workers.append(subprocess.Popen([sys.executable, _CASES, "workers2"], env=env, cwd=root, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    outputs = []
    try:
        for worker in workers:
            out, err = worker.communicate(timeout=1200)
            assert worker.returncode == 0, err[-3000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
    return tuple(outputs)


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
def test_two_workers_as_on_one_device(row):
    """Multi-worker mode: 2 worker processes, each a replica; every row as on one device on both workers."""
    for results in _two_workers():
        assert_as_on_one_device(results[row], row, "per_step")


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


def test_every_row_of_the_cases_is_tested():
    """The rows feature_matrix_cases.py defines (its ROWS, read without running it: it builds a strategy) are the
    rows this module tests, and the default ones are among them."""
    import ast

    tree = ast.parse(Path(_CASES).read_text())
    defined = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "ROWS" for t in node.targets))
    rows = [element.id for element in defined.generators[0].iter.elts]
    assert rows == ROWS
    assert set(DEFAULT_ROWS) <= set(ROWS)
