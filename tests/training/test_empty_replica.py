"""A replica without examples takes part and changes nothing (tf_nvlink.internals' BatchNormalization and
per-output loss metric hooks and the examples-weighted replica sync of tf_nvlink.training.replica_sync).

65 examples at batch_size=32 on 2 replicas end with a 1 + 0 step: under stock MirroredStrategy the empty replica's
batch statistics are 0 / 0 = NaN and the model predicts NaN from then on. The other places of Keras that divide by
the batch (docs/architecture.md, "A replica without examples") are checked against one device: each case trains
under the strategy and, in the same process, without one (same initial weights). Each mode runs in its own process.
"""

import numpy as np
import pytest

from conftest import FUSED_CPU_EMULATION, SLOW_PLAIN_AND_SPLIT, ModeScript

_SCRIPT = FUSED_CPU_EMULATION + r"""
import contextlib, json
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

    # The other places that divide by the batch, each model under the strategy and on one device (no strategy).
    from keras import layers

    def masked():  # masked BatchNorm moments, the masked loss's mean (apply_mask), the activity regularizer
        return keras.Sequential([keras.Input((5, 4)), layers.Masking(0.0), layers.BatchNormalization(momentum=0.9),
                                 layers.Dense(3, activity_regularizer=keras.regularizers.L1L2(0.01, 0.02)),
                                 layers.Dense(1)]), "mse", None

    def renorm_dice():  # batch renormalization (the moments hook), a loss over the whole batch (Dice), metrics
        return keras.Sequential([keras.Input((4,)), layers.BatchNormalization(momentum=0.9, renorm=True),
                                 layers.Dense(1, activation="sigmoid")]), keras.losses.Dice(), [
            "accuracy", keras.metrics.AUC(name="auc"), keras.metrics.R2Score(name="r2")]

    def two_outputs():  # per-output loss metrics (the output-loss metric hooks), with sample weights
        inputs = keras.Input((4,))
        model = keras.Model(inputs, [layers.Dense(1, name="a")(inputs), layers.Dense(1, name="b")(inputs)])
        return model, ["mse", "mae"], None

    xs = rng.normal(size=(1, 5, 4)).astype("float32")
    xs[0, 3:] = 0.0  # the one example of the 1 + 0 step: 2 of its 5 timesteps masked
    cases = {"masked": (masked, xs, rng.normal(size=(1, 5, 1)).astype("float32"), None),  # one example: 1 + 0
             "renorm_dice": (renorm_dice, x[:1], np.ones((1, 1), "float32"), None),
             "two_outputs": (two_outputs, x, (y, -y), rng.uniform(0.5, 2.0, size=65).astype("float32"))}
    result["cases"] = {}
    for name, (make, cx, cy, weights) in cases.items():
        trained = {}
        for where in ("strategy", "one_device"):  # the same initial weights; one device without XLA (faster)
            with strategy.scope() if where == "strategy" else contextlib.nullcontext():
                keras.utils.set_random_seed(3)
                model, loss, metrics = make()
                model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics,
                              jit_compile=where == "strategy" and mode in ("split", "fused"))
            history = model.fit(cx, cy, sample_weight=weights, batch_size=32, epochs=1, shuffle=False, verbose=0)
            evaluated = model.evaluate(cx, cy, sample_weight=weights, batch_size=32, verbose=0, return_dict=True)
            trained[where] = {"variables": [[v.path, copies(v)] for v in model.variables],
                              "logs": {k: float(v[-1]) for k, v in history.history.items()},
                              "evaluate": {k: float(v) for k, v in evaluated.items()}}
        result["cases"][name] = trained
print(json.dumps(result))
"""
_run = ModeScript(_SCRIPT, background={"fused": 11}).result


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


def _assert_as_on_one_device(case):
    """Every replica's copy of every variable finite and equal to the one-device model's (1e-5), the logs and
    `evaluate`'s results (its last step splits 1 + 0 too) as well."""
    multi, single = case["strategy"], case["one_device"]
    assert len(multi["variables"]) == len(single["variables"])
    for (path, replicas), (_, (expected,)) in zip(multi["variables"], single["variables"]):
        for replica in replicas:
            assert np.isfinite(np.array(replica)).all(), path
            np.testing.assert_allclose(replica, expected, rtol=1e-5, atol=1e-5, err_msg=path)
    for results in ("logs", "evaluate"):
        assert multi[results].keys() == single[results].keys()
        for key, value in single[results].items():
            np.testing.assert_allclose(multi[results][key], value, rtol=1e-5, atol=1e-6, err_msg=f"{results} {key}")


@pytest.mark.parametrize("mode", SLOW_PLAIN_AND_SPLIT)
def test_masked_batchnorm_masked_loss_and_activity_regularizer_as_on_one_device(mode):
    """A 1 + 0 step through masked BatchNorm moments, a masked loss and an activity regularizer (each divides by
    a count of the replica's batch, guarded in Keras against 0): the same model as on one device."""
    _assert_as_on_one_device(_run(mode)["cases"]["masked"])


@pytest.mark.parametrize("mode", SLOW_PLAIN_AND_SPLIT)
def test_batch_renorm_dice_loss_and_metrics_as_on_one_device(mode):
    """A 1 + 0 step through BatchNormalization(renorm=True) (its corrections from the moments the hook makes 0 on
    the empty replica), a Dice loss (over the whole batch) and accuracy, AUC and R2 metrics."""
    _assert_as_on_one_device(_run(mode)["cases"]["renorm_dice"])


@pytest.mark.parametrize("mode", SLOW_PLAIN_AND_SPLIT)
def test_per_output_loss_metrics_count_each_step_once(mode):
    """65 examples, two outputs: `a_loss`/`b_loss` are one device's mean of the steps' losses in fit and in
    evaluate (without the hooks each replica counts the 1 + 0 step once, the empty one with loss 0: evaluate's
    `a_loss` 5.10 where one device gives 7.52); the weights and `loss` match too."""
    case = _run(mode)["cases"]["two_outputs"]
    assert {"a_loss", "b_loss"} <= case["one_device"]["logs"].keys()
    _assert_as_on_one_device(case)
