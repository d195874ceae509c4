"""A replica without examples takes part and changes nothing (tf_nvlink.internals' BatchNormalization hook and the
examples-weighted replica sync of tf_nvlink.training.replica_sync).

65 examples at batch_size=32 on 2 replicas end with a 1 + 0 step: under stock MirroredStrategy the empty replica's
batch statistics are 0 / 0 = NaN and the model predicts NaN from then on. Each mode runs in its own process.
"""

import numpy as np
import pytest

from conftest import FUSED_CPU_EMULATION, SLOW_PLAIN_AND_SPLIT, ModeScript

_SCRIPT = FUSED_CPU_EMULATION + r"""
import json
import numpy as np, tensorflow as tf
mode = MODE
strategy = two_cpu_strategy(mode)
import keras

def copies(variable):
    value = getattr(variable, "value", variable)
    return [np.asarray(v.numpy()).tolist() for v in getattr(value, "values", [value])]

def model_with_batchnorm():
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(momentum=0.9),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", jit_compile=mode in ("split", "fused"))
    return model

rng = np.random.default_rng(0)
many = model_with_batchnorm()  # 65 examples, 2 epochs: the last step of each is 1 + 0
x = rng.normal(size=(65, 4)).astype("float32"); y = rng.normal(size=(65, 1)).astype("float32")
many.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
result = {"weights": [w.tolist() for w in many.get_weights()],
          "predictions": many.predict(x, batch_size=32, verbose=0).tolist()}
if mode != "stock":  # stock Keras cannot even build a model from a first batch split 1 + 0 (AddN of [1,4], [0,4])
    one = model_with_batchnorm()  # one example: the step splits 1 + 0
    x1 = np.array([[1.0, 2.0, -3.0, 4.0]], "float32")
    one.fit(x1, np.ones((1, 1), "float32"), batch_size=32, epochs=1, verbose=0)
    bn = one.layers[0]
    result.update(moving_mean=copies(bn.moving_mean), moving_variance=copies(bn.moving_variance),
                  one_weights=[w.tolist() for w in one.get_weights()])
print(json.dumps(result))
"""
_run = ModeScript(_SCRIPT).result


@pytest.mark.parametrize("mode", SLOW_PLAIN_AND_SPLIT)
def test_a_replica_without_examples_changes_nothing(mode):
    """After a 1 + 0 step the moving statistics on both replicas are the one example's update alone
    (momentum 0.9: 0.1 x the example; the variance of one example is 0), every weight is finite, and a model whose
    every epoch ends with a 1 + 0 step predicts finite values."""
    result = _run(mode)
    for replica in result["moving_mean"]:
        np.testing.assert_allclose(replica, [0.1, 0.2, -0.3, 0.4], rtol=1e-6)
    for replica in result["moving_variance"]:
        np.testing.assert_allclose(replica, [0.9] * 4, rtol=1e-6)
    for weights in (result["one_weights"], result["weights"]):
        assert all(np.isfinite(np.array(w)).all() for w in weights)
    assert np.isfinite(np.array(result["predictions"])).all()


@pytest.mark.slow
def test_stock_mirrored_strategy_turns_the_same_model_nan():
    """What the hooks fix: the same script under stock MirroredStrategy (no XLA) leaves NaN behind."""
    result = _run("stock")
    assert not np.isfinite(np.array(result["predictions"])).all() or not all(
        np.isfinite(np.array(w)).all() for w in result["weights"])
