"""tf_nvlink.strategy() on logical CPU devices: real TensorFlow training, one strategy per process.

The strategy here mirrors over conftest's N_LOGICAL_CPUS logical CPU devices (a GPU-less machine mirrors over
its CPU devices); each test that needs another layout or another strategy runs in a subprocess.
"""

import json

import numpy as np
import pytest

from conftest import N_LOGICAL_CPUS, run_python


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 20)).astype("float32")
    w = rng.normal(size=(20, 3)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def _build(keras):
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def _compile(model, keras, jit=False):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  jit_compile=jit)


@pytest.fixture(scope="module")
def trained(tf, tmp_path_factory):
    """One strategy for the whole module (one per process): train, evaluate, predict, save."""
    import keras

    import tf_nvlink

    strategy = tf_nvlink.strategy()
    x, y = _data()
    with strategy.scope():
        model = _build(keras)
        _compile(model, keras)
    history = model.fit(x, y, batch_size=64, epochs=4, shuffle=False, verbose=0)
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    model.save(path)
    return {"strategy": strategy, "model": model, "history": history.history, "x": x, "y": y, "path": path}


def test_strategy_is_a_real_mirrored_strategy_over_cpu_devices(trained, tf):
    import tf_nvlink

    strategy = trained["strategy"]
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == N_LOGICAL_CPUS
    plan = tf_nvlink.current_plan()
    assert plan is strategy.plan and plan.on_cpu and plan.cross_device_ops == "reduce_to_one"
    assert len(plan.devices) == N_LOGICAL_CPUS and all("CPU" in d for d in plan.devices)
    assert "NCCL does not run on CPU" in plan.reason and plan.summary().startswith("tf_nvlink plan: CPU")
    json.dumps(plan.to_dict())


def test_same_request_returns_same_strategy_and_different_one_raises(trained):
    import tf_nvlink

    assert tf_nvlink.strategy() is trained["strategy"]
    with pytest.raises(RuntimeError, match="one MirroredStrategy per process.*own process"):
        tf_nvlink.strategy(cross_device_ops="collective")


def test_training_lowers_loss_and_keeps_replicas_identical(trained):
    losses = trained["history"]["loss"]
    assert losses[-1] < losses[0] * 0.8
    for variable in trained["model"].trainable_variables:
        replicas = variable.value.values
        assert len(replicas) == N_LOGICAL_CPUS
        for replica in replicas[1:]:
            np.testing.assert_array_equal(replicas[0].numpy(), replica.numpy())


def test_evaluate_predict_save_and_load(trained):
    import keras

    model = trained["model"]
    loss, accuracy = model.evaluate(trained["x"], trained["y"], batch_size=64, verbose=0)
    assert loss == pytest.approx(trained["history"]["loss"][-1], rel=0.3) and accuracy > 0.5
    predictions = model.predict(trained["x"][:37], batch_size=8, verbose=0)  # 37: a ragged last batch
    assert predictions.shape == (37, 3)
    reloaded = keras.models.load_model(trained["path"])
    np.testing.assert_allclose(reloaded.predict(trained["x"][:37], verbose=0), predictions, rtol=1e-5, atol=1e-6)


_EQUIVALENCE = r"""
import json, os, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink
mode, jit = sys.argv[1], sys.argv[2] == "jit"
rng = np.random.default_rng(0)
x = rng.normal(size=(256, 8, 8, 1)).astype("float32"); y = rng.integers(0, 4, 256).astype("int32")
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"]) if mode == "plugin" else tf.distribute.get_strategy()
with strategy.scope():
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
h = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
print(json.dumps({"loss": h.history["loss"], "weights": [w.ravel().tolist() for w in model.get_weights()],
                  "jit": bool(model.jit_compile)}))
"""


def _run_equivalence(mode, jit):
    proc = run_python(["-c", _EQUIVALENCE, mode, "jit" if jit else "nojit"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("jit", [False, True], ids=["no_xla", "xla"])
def test_two_replicas_match_single_device_training_with_the_same_global_batch(jit):
    single, plugin = _run_equivalence("single", jit), _run_equivalence("plugin", jit)
    assert plugin["jit"] == jit
    assert plugin["loss"][-1] < plugin["loss"][0]
    np.testing.assert_allclose(plugin["loss"], single["loss"], rtol=1e-4)
    for a, b in zip(single["weights"], plugin["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_without_nccl_kernels_the_plan_falls_back_and_says_so(tf):
    from fake_nvml import FakeNvml, h200_x2

    from tf_nvlink.machine import nvml


    from tf_nvlink.plan import policy

    from tf_nvlink import internals
    assert internals.nccl_kernels_registered() is True  # PyPI's TensorFlow is a CUDA build: NCCL's GPU kernel is there
    plan = policy.make_plan(nvml.probe(FakeNvml(h200_x2())))
    assert (plan.cross_device_ops, plan.xla_allreduce) == ("nccl", "fused")
    degraded, warning = policy.without_nccl(plan)
    assert (degraded.cross_device_ops, degraded.num_packs, degraded.xla_allreduce) == ("reduce_to_one", None, "split")
    assert "no NCCL GPU kernels" in warning and "reduce_to_one instead of nccl" in warning
    assert degraded.reason.startswith("NCCL kernels missing") and degraded.gpus == plan.gpus
