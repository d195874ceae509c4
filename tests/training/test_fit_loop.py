"""Keras' fit loop under a tf_nvlink strategy (tf_nvlink.training.fit_loop): an OutOfRangeError that is not the
input's end never ends an epoch.

Keras (`TFEpochIterator.catch_stop_iteration`) takes every OutOfRangeError of a step for the end of the input.
TensorFlow also raises one for a compile-cache entry it cannot read, and for a `StopIteration` inside a step's
`py_function`: the epoch then stopped at that step, and fit returned as if the data had run out. Here a step
raises one at its 4th step, on the compiled execution (steps_per_execution=4) and the per-step path, in fused
mode on 2 CPU replicas (conftest.FUSED_CPU_EMULATION: no XLA, so a py_function can sit inside the step); a
dataset of unknown length still ends its epochs as Keras ends them.
"""

import pytest

import scenarios
from conftest import FUSED_CPU_EMULATION

_PRELUDE = r"""
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
""" + FUSED_CPU_EMULATION + r"""
strategy = fused_strategy_emulated_on_cpu()
import keras
rng = np.random.default_rng(0)
x = rng.normal(size=(64, 4)).astype("float32"); y = rng.normal(size=(64, 1)).astype("float32")

def fit(steps_per_execution, fail_at_step=None, data=None):
    calls = {"count": 0}
    def maybe_fail(values):
        calls["count"] += 1  # once per replica and step
        if fail_at_step is not None and calls["count"] > 2 * (fail_at_step - 1):
            raise StopIteration  # py_function turns it into an OutOfRangeError ("StopIteration")
        return values
    class MaybeFail(keras.layers.Layer):
        def call(self, values):
            out = tf.py_function(maybe_fail, [values], values.dtype)
            out.set_shape(values.shape)
            return out
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), MaybeFail(), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=True, steps_per_execution=steps_per_execution)
    error = None
    try:
        model.fit(data if data is not None else x, None if data is not None else y, batch_size=8, epochs=2,
                  verbose=0, shuffle=False)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"error": error, "iterations": int(model.optimizer.iterations.numpy())}
"""

_CASES = {
    "compiled execution": "result = fit(4, fail_at_step=4)",
    "per step": "result = fit(1, fail_at_step=4)",
    "unknown length": """
def batches():
    for start in range(0, 64, 8):
        yield x[start:start + 8], y[start:start + 8]
data = tf.data.Dataset.from_generator(batches, output_signature=(tf.TensorSpec((None, 4)), tf.TensorSpec((None, 1))))
result = fit(4, data=data)
""",
}
SCENARIO = scenarios.Scenario("fit loop: an OutOfRangeError inside the step", _PRELUDE, _CASES)


@pytest.mark.parametrize("path", ["compiled execution", "per step"])
def test_an_out_of_range_error_inside_the_step_stops_fit_instead_of_ending_the_epoch(path):
    out = SCENARIO.result(path)
    assert out["error"] is not None, out  # Keras alone: fit returns, 3 steps an epoch, with "ran out of data"
    assert out["error"].startswith("RuntimeError: tf_nvlink: a step failed with an OutOfRangeError that did not "
                                   "come from the input"), out["error"]
    assert "StopIteration" in out["error"] and "as if the data had run out" in out["error"]
    assert out["iterations"] < 8  # the first epoch's 8 steps were not all taken
    if path == "per step":
        # the 3 steps before the failing one, each its own call; the failing step's counter update on the replica
        # read here is not ordered against the other replica's error
        assert out["iterations"] in (3, 4)


def test_the_end_of_an_input_of_unknown_length_still_ends_the_epoch():
    assert SCENARIO.result("unknown length") == {"error": None, "iterations": 16}
