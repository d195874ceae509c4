"""Gradient clipping as on one device (tf_nvlink.internals' clip hook, applied after the all-reduce in
tf_nvlink.training.gradient_allreduce): `clipnorm`, `global_clipnorm` and `clipvalue`, alone and with
`gradient_accumulation_steps`, under a tf_nvlink strategy on 2 CPU replicas in plain, split and fused (emulated)
mode, against the same training on one device. Each mode runs in its own process, every optimizer in it.
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
x = rng.normal(size=(96, 8)).astype("float32"); y = (3 * rng.normal(size=(96, 4))).astype("float32")
OPTIMIZERS = {"clipnorm": dict(clipnorm=0.05), "global_clipnorm": dict(global_clipnorm=0.05),
              "clipvalue": dict(clipvalue=0.002),
              "global_clipnorm_accumulate": dict(global_clipnorm=0.05, gradient_accumulation_steps=2)}
results = {}
for name, options in OPTIMIZERS.items():
    if mode == "stock" and "gradient_accumulation_steps" in options:
        continue  # stock MirroredStrategy fails on it: merge_call inside Keras' accumulation cond
    with strategy.scope():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, **options), loss="mse",
                      jit_compile=mode in ("split", "fused"))
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    results[name] = [w.tolist() for w in model.get_weights()]
print(json.dumps(results))
"""
_weights = ModeScript(_SCRIPT).result


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.array(p) - np.array(q)))) for p, q in zip(a, b))


@pytest.mark.slow  # fused mode in the default run: tests/training/test_exact_batches.py
@pytest.mark.parametrize("mode", ["plain", "split", "fused"])
@pytest.mark.parametrize("optimizer", ["clipnorm", "global_clipnorm", "clipvalue", "global_clipnorm_accumulate"])
def test_clipping_acts_on_the_all_reduced_gradient(mode, optimizer):
    single, multi = _weights("single")[optimizer], _weights(mode)[optimizer]
    for a, b in zip(single, multi):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6, err_msg=optimizer)


@pytest.mark.slow
def test_stock_mirrored_strategy_clips_each_replicas_share():
    """What the hook fixes: stock MirroredStrategy's weights differ from one device's with the same clipping."""
    single, stock = _weights("single"), _weights("stock")
    assert all(_max_difference(single[name], stock[name]) > 1e-4
               for name in ("clipnorm", "global_clipnorm", "clipvalue"))
