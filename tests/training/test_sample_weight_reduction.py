"""A loss with `reduction="mean_with_sample_weight"` (divided by the sum of the sample weights) trains as on one
device under a tf_nvlink strategy: each replica's loss is scaled by its share of the step's weights
(tf_nvlink.training.exact_batches.replica_shares), in plain, split and fused (emulated) mode on 2 CPU replicas.
"""

import numpy as np
import pytest

from conftest import FUSED_CPU_EMULATION, ModeScript

_SCRIPT = FUSED_CPU_EMULATION + r"""
import json
import numpy as np, tensorflow as tf
mode = MODE
strategy = two_cpu_strategy(mode)
import keras
rng = np.random.default_rng(0)
x = rng.normal(size=(70, 8)).astype("float32"); y = rng.normal(size=(70, 1)).astype("float32")
weights = np.where(np.arange(70) % 32 < 16, 3.0, 0.5).astype("float32")  # replica 0 holds the heavy examples
with strategy.scope():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
                  jit_compile=mode in ("split", "fused"))
history = model.fit(x, y, sample_weight=weights, batch_size=32, epochs=2, shuffle=False, verbose=0)
print(json.dumps({"weights": [w.tolist() for w in model.get_weights()], "loss": history.history["loss"]}))
"""
_run = ModeScript(_SCRIPT).result


@pytest.mark.slow  # fused mode in the default run: tests/training/test_exact_batches.py
@pytest.mark.parametrize("mode", ["plain", "split", "fused"])
def test_mean_with_sample_weight_matches_one_device(mode):
    single, multi = _run("single"), _run(mode)
    for a, b in zip(single["weights"], multi["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(multi["loss"], single["loss"], rtol=1e-5)
