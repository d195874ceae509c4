"""Replicas that agree (tf_nvlink/replica_sync.py): BatchNorm statistics identical on every replica after fit.

Two logical CPU replicas, and shards that differ on purpose: in every global batch of 64, replica 0's half is
centred at 0 and replica 1's at 3 with twice the spread, so replicas that kept their own statistics would end
far apart (the test with the switch off shows by how much). The first layer is a BatchNormalization on the raw
input, so its moving statistics can be computed in NumPy from the data alone and compared exactly.
One strategy per process: the cases of each strategy run in one scenario process (tests/scenarios.py).
"""

import json

import numpy as np
import pytest

import scenarios
from conftest import FUSED_CPU_EMULATION

_PRELUDE = FUSED_CPU_EMULATION + r"""
import os, tempfile
import numpy as np
strategy = two_cpu_strategy(MODE)
import tensorflow as tf, keras, tf_nvlink
from tf_nvlink.training import replica_sync
from tf_nvlink.training import per_replica_steps
N, BATCH, EPOCHS, MOMENTUM = 256, 64, 2, 0.9
rng = np.random.default_rng(0)
x = rng.normal(size=(N, 6, 6, 2)).astype("float32")
for start in range(0, N, BATCH):  # replica 1's half of every global batch: another mean and spread
    x[start + BATCH // 2:start + BATCH] = 3.0 + 2.0 * x[start + BATCH // 2:start + BATCH]
y = rng.integers(0, 3, N).astype("int32")
made = []
original_init = per_replica_steps.PerReplicaXlaStep.__init__
def spy(self, *args, **kwargs):
    original_init(self, *args, **kwargs); made.append(self)
per_replica_steps.PerReplicaXlaStep.__init__ = spy

def fit_and_check(jit, synchronized=False):
    made.clear()
    with strategy.scope():
        keras.utils.set_random_seed(1)
        # named as in a fresh process, whatever this process built before
        model = keras.Sequential([
            keras.Input((6, 6, 2)),
            keras.layers.BatchNormalization(momentum=MOMENTUM, synchronized=synchronized, name="batch_normalization"),
            keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(synchronized=synchronized,
                                                                       name="batch_normalization_1"),
            keras.layers.ReLU(), keras.layers.Dropout(0.2), keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3)], name="sequential")
        model.compile(optimizer=keras.optimizers.SGD(0.05), metrics=["accuracy"], jit_compile=jit,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    in_strategy = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    predictions = model.predict(x, batch_size=BATCH, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "model.keras")
    model.save(path)
    with tf.device("/cpu:0"):
        reloaded = keras.models.load_model(path)
        on_one_device = reloaded.evaluate(x, y, batch_size=BATCH, verbose=0)
        reloaded_predictions = reloaded.predict(x, batch_size=BATCH, verbose=0)
    first_bn = model.layers[0]
    return {
        "diff": replica_sync.replicas_max_difference(model),
        "moving_mean": first_bn.moving_mean.numpy().tolist(),
        "moving_variance": first_bn.moving_variance.numpy().tolist(),
        "evaluate": in_strategy, "reloaded_evaluate": on_one_device,
        "predict_diff": float(np.max(np.abs(predictions - reloaded_predictions))),
        "jit": bool(model.jit_compile),
        "synced_inside": [type(s.step_function).__name__ == "SyncedStep" for s in made if s.kind == "train"]}
"""
_SWITCH_OFF = """
before = os.environ.get(replica_sync.ENV_SWITCH)
os.environ[replica_sync.ENV_SWITCH] = "0"  # read when Keras builds the train function
try:
    result = fit_and_check(jit=False)
finally:
    if before is None:
        del os.environ[replica_sync.ENV_SWITCH]
    else:
        os.environ[replica_sync.ENV_SWITCH] = before
"""
_SYNC_BN_REFUSED = """
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4),
                              keras.layers.BatchNormalization(synchronized=True), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
model.fit(np.ones((16, 4), "float32"), np.ones((16, 1), "float32"), batch_size=8, epochs=1, verbose=0)
"""
_CUSTOM_LOOP = r"""
x = np.random.default_rng(0).normal(size=(64, 5)).astype("float32"); x[32:] += 4.0
with strategy.scope():
    model = keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(64))
result = {}
for sync in (False, True):
    @tf.function
    def train(batch):
        def step_fn(inputs):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(inputs, training=True)))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            if sync:
                tf_nvlink.sync_non_trainable(model)
        strategy.run(step_fn, args=(batch,))
    for batch in dataset:
        train(batch)
    result[str(sync)] = max(replica_sync.replicas_max_difference(model).values())
wrapped = tf.function(lambda batch: strategy.run(tf_nvlink.synced_step(model, lambda b: model(b, training=True)),
                                                 args=(batch,)))
x[:32] -= 7.0
for batch in strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(x).batch(64)):
    wrapped(batch)
result["synced_step"] = max(replica_sync.replicas_max_difference(model).values())
"""
# Started in the background when the tests are collected (tests/scenarios.py), one process per strategy.
FUSED = scenarios.Scenario("replica_sync: fused (emulated) on 2 CPUs", _PRELUDE.replace("MODE", '"fused"'), {
    "fit": "result = fit_and_check(jit=True)"})
SPLIT = scenarios.Scenario("replica_sync: tf_nvlink on 2 CPUs", _PRELUDE.replace("MODE", '"split"'), {
    "custom loop": _CUSTOM_LOOP,
    "synchronized BatchNorm in split mode": _SYNC_BN_REFUSED,
})
SPLIT_SLOW = scenarios.Scenario("replica_sync: tf_nvlink on 2 CPUs (slow tier)", _PRELUDE.replace("MODE", '"split"'), {
    "plain": "result = fit_and_check(jit=False)",
    "split": "result = fit_and_check(jit=True)",
    "plain, synchronized": "result = fit_and_check(jit=False, synchronized=True)",
    "plain, switch off": _SWITCH_OFF,
}, slow=True)


def _expected_first_bn(synchronized, n=256, batch=64, epochs=2, momentum=0.9):
    """The first BatchNormalization's moving statistics, from the data: the mean of the replicas' updates."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 6, 6, 2)).astype("float64")
    for start in range(0, n, batch):
        x[start + batch // 2:start + batch] = 3.0 + 2.0 * x[start + batch // 2:start + batch]
    mean, variance = np.zeros(2), np.ones(2)
    for _ in range(epochs):
        for start in range(0, n, batch):
            shards = [x[start:start + batch // 2], x[start + batch // 2:start + batch]]
            if synchronized:  # every replica normalises with the whole global batch's statistics
                batch_mean, batch_variance = x[start:start + batch].mean((0, 1, 2)), x[start:start + batch].var((0, 1, 2))
            else:  # the mean over replicas of each shard's statistics
                batch_mean = np.mean([s.mean((0, 1, 2)) for s in shards], axis=0)
                batch_variance = np.mean([s.var((0, 1, 2)) for s in shards], axis=0)
            mean = momentum * mean + (1 - momentum) * batch_mean
            variance = momentum * variance + (1 - momentum) * batch_variance
    return mean, variance


def _check_agreement(out, synchronized=False):
    assert set(out["diff"]) >= {"sequential/batch_normalization/moving_mean",
                                "sequential/batch_normalization_1/moving_variance"}
    assert max(out["diff"].values()) < 1e-6, out["diff"]
    mean, variance = _expected_first_bn(synchronized)
    np.testing.assert_allclose(out["moving_mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["moving_variance"], variance, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["reloaded_evaluate"], out["evaluate"], rtol=1e-5, atol=1e-6)
    assert out["predict_diff"] < 1e-5


@pytest.mark.parametrize("mode", [pytest.param("plain", marks=pytest.mark.slow), pytest.param("split", marks=pytest.mark.slow),
                                  "fused"])
def test_replicas_agree_on_batch_norm_statistics_after_fit(mode):
    out = FUSED.result("fit") if mode == "fused" else SPLIT_SLOW.result(mode)
    assert out["jit"] == (mode != "plain")
    # fused: the averaging is part of the step each replica compiles (inside XLA on GPUs); split: after it
    assert out["synced_inside"] == ([True] if mode == "fused" else [False] if mode == "split" else [])
    _check_agreement(out)


@pytest.mark.slow  # the control run: the synchronized runs above are the behaviour
def test_without_the_sync_replicas_drift_apart():
    """The switch off (TF_NVLINK_SYNC_NON_TRAINABLE=0) gives stock MirroredStrategy's behaviour on these shards."""
    out = SPLIT_SLOW.result("plain, switch off")
    assert out["diff"]["sequential/batch_normalization/moving_mean"] > 0.5
    assert out["diff"]["sequential/batch_normalization/moving_variance"] > 0.5


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_synchronized_batch_norm_works_without_xla_and_uses_global_batch_statistics():
    _check_agreement(SPLIT_SLOW.result("plain, synchronized"), synchronized=True)


def test_synchronized_batch_norm_in_split_xla_on_cpus_is_refused_with_the_alternatives():
    """SyncBatchNorm all-reduces its batch statistics with a merge_call on CPU replicas, which XLA cannot hold:
    tf_nvlink names the layer and the ways out before training instead of TensorFlow's 'merge_call called while
    defining' (`replicas.SynchronizedBatchNormError`; `CrossReplicaCallInXlaError` catches other such calls)."""
    error = SPLIT.error("synchronized BatchNorm in split mode")
    assert "SynchronizedBatchNormError" in error, error[-3000:]  # tf_nvlink.training.replica_sync checks it first
    assert "BatchNormalization(synchronized=True)" in error and "jit_compile=False" in error
    assert "synchronized=False" in error


def test_custom_loop_sync_non_trainable():
    out = SPLIT.result("custom loop")
    assert out["False"] > 0.02  # one step, momentum 0.99: 0.01 x 4.0 apart; the first pass drifts; the second pass's sync brings them back together
    assert out["True"] < 1e-6 and out["synced_step"] < 1e-6


def test_switch_values(monkeypatch):
    from tf_nvlink.training import replica_sync

    for value, expected in (("1", True), ("0", False), ("off", False), ("", True)):
        monkeypatch.setenv(replica_sync.ENV_SWITCH, value)
        assert replica_sync.enabled() is expected
    monkeypatch.setenv(replica_sync.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="TF_NVLINK_SYNC_NON_TRAINABLE='maybe'"):
        replica_sync.enabled()


_WORKER = r"""
import json, os, sys
import tf_nvlink
strategy = tf_nvlink.strategy()  # TF_CONFIG: 2 CPU workers on localhost; first, before any TensorFlow op
import numpy as np, tensorflow as tf, keras
from tf_nvlink.training import replica_sync
worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
rng = np.random.default_rng(worker)
x = (3.0 * worker + rng.normal(size=(128, 5))).astype("float32")  # each worker's own data, another mean
y = rng.normal(size=(128, 1)).astype("float32")
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(64).with_options(options)
with strategy.scope():
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((5,)), keras.layers.BatchNormalization(momentum=0.5), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=sys.argv[1] == "jit")
model.fit(dataset, epochs=2, verbose=0)
print(json.dumps({"moving_mean": model.layers[0].moving_mean.numpy().tolist(),
                  "moving_variance": model.layers[0].moving_variance.numpy().tolist()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sync, jit", [("1", "nojit"), ("0", "nojit"), ("1", "jit")])
def test_multi_worker_replicas_agree(sync, jit):
    """Two CPU workers (MultiWorkerMirroredStrategy over localhost), each with its own data: with the sync the
    workers end with the same moving statistics; without it each keeps its own."""
    import os
    import subprocess
    import sys

    from conftest import ROOT
    from tf_nvlink.util.json_workers import free_ports

    cluster = {"worker": [f"localhost:{port}" for port in free_ports(2)]}
    processes = []
    for index in range(2):
        env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
                   TF_NVLINK_SYNC_NON_TRAINABLE=sync,
                   TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}))
        processes.append(subprocess.Popen([sys.executable, "-c", _WORKER, jit], env=env, cwd=ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, stderr[-3000:]
            outputs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for name in ("moving_mean", "moving_variance"):
        gap = float(np.max(np.abs(np.array(outputs[0][name]) - np.array(outputs[1][name]))))
        assert gap < 1e-6 if sync == "1" else gap > 0.5, (name, outputs)
