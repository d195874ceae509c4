"""Per-replica XLA (tf_nvlink.training.install) on 2 logical CPU devices: XLA compiles for the CPU too.

TensorFlow fixes its device list at first use and tolerates one MirroredStrategy per process: the cases of each
strategy run in one scenario process (tests/scenarios.py). The stock-MirroredStrategy test reproduces
TensorFlow's failure, so the passing tests show it is the plugin's mechanism that fixes it.
"""


import numpy as np
import pytest

import scenarios
from conftest import FUSED_CPU_EMULATION

_PRELUDE = r"""
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink
from tf_nvlink.internals import trainer as trainer_seams
from tf_nvlink.distribute import base
from tf_nvlink.training import install, per_replica_steps
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 8, 8, 1)).astype("float32"); y = rng.integers(0, 4, 128).astype("int32")
def build():
    keras.utils.set_random_seed(5)
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(4)])
def compile_(model, jit=True):
    model.compile(optimizer=keras.optimizers.Adam(0.01), metrics=["accuracy"], jit_compile=jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
"""


STOCK = scenarios.Scenario("install: stock MirroredStrategy on 2 CPUs", _PRELUDE, {"fit with jit_compile": """
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())
with strategy.scope():
    model = build(); compile_(model)
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
"""})


def test_stock_mirrored_strategy_fails_with_jit_compile():
    error = STOCK.error("fit with jit_compile")
    assert "Trying to access resource" in error and "replica_1" in error, error[-3000:]


# The cases that share one tf_nvlink strategy on 2 logical CPUs, in one process (scenarios.py); each restores what
# it patches. "fit, evaluate, predict" comes first: it counts the strategy's per-replica predict functions.
_SHARED_CASES = {}
_SHARED_CASES["fit, evaluate, predict"] = """
made = []  # the per-replica steps fit and evaluate make
original_init = per_replica_steps.PerReplicaXlaStep.__init__
def spy(self, *args, **kwargs):
    original_init(self, *args, **kwargs); made.append(self)
per_replica_steps.PerReplicaXlaStep.__init__ = spy
try:
    strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build(); compile_(model)
    history = model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    loss, accuracy = model.evaluate(x, y, batch_size=32, verbose=0)
finally:
    per_replica_steps.PerReplicaXlaStep.__init__ = original_init
predictions = model.predict(x[:10], batch_size=4, verbose=0)
compiled = list(base.runner_of(strategy).per_replica_functions.values())  # predict's jit function, copied per replica
result = {"loss": history.history["loss"], "jit": bool(model.jit_compile), "eval": [loss, accuracy],
          "pred_shape": list(predictions.shape), "mode": strategy.xla_allreduce, "predict_copies": len(compiled),
          "steps": [{"kind": s.kind, "replicas": sorted(s.compiled.made()),
                     "xla": [bool(fn._jit_compile) for fn in s.compiled.made().values()]} for s in made]}
"""
_SHARED_CASES["auto jit"] = """
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = build(); compile_(model, jit="auto")
on_cpu = bool(model.jit_compile)
real_list_logical = tf.config.list_logical_devices
tf.config.list_logical_devices = lambda kind=None: ["fake GPU"] if kind == "GPU" else []
try:
    with strategy.scope():
        model2 = build(); compile_(model2, jit="auto")
finally:
    tf.config.list_logical_devices = real_list_logical
result = {"cpu_only": on_cpu, "with_gpu": bool(model2.jit_compile)}
"""
_SHARED_CASES["one distributed iterator"] = """
from tensorflow.python.distribute import input_lib
made = []
original_iter = input_lib.DistributedDataset.__iter__
def counting_iter(self):
    made.append(1)
    return original_iter(self)
input_lib.DistributedDataset.__iter__ = counting_iter
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.flatten, self.dense = keras.layers.Flatten(), keras.layers.Dense(4)
    def call(self, inputs):
        return self.dense(self.flatten(inputs))
counts, losses = {}, {}
try:
    for name, make in (("functional", build), ("subclassed", Subclassed)):
        with strategy.scope():
            model = make(); compile_(model, jit=False)
        # repeated, with steps: Keras also makes a look-ahead iterator after the last batch of a finite dataset
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
        for call in ("fit1", "fit2", "evaluate"):
            made.clear()
            if call == "evaluate":
                model.evaluate(ds, steps=4, verbose=0)
            else:
                losses[name + call] = model.fit(ds, steps_per_epoch=4, epochs=1, verbose=0).history["loss"][0]
            counts[name + "_" + call] = len(made)
finally:
    input_lib.DistributedDataset.__iter__ = original_iter
result = {"counts": counts, "losses": losses}
"""
_SHARED_CASES["input error at steps_per_execution=4"] = """
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
bad = x.copy(); bad[6 * 16 + 1, 0, 0, 0] = np.nan  # batch 6 of 8 (batch size 16): the second execution's third
def compiled():
    with strategy.scope():
        model = build()
        model.compile(optimizer=keras.optimizers.Adam(0.01), steps_per_execution=4, jit_compile=True,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
def fitted(data):
    model = compiled()
    try:
        model.fit(data, epochs=1, verbose=0)
        error = None
    except tf.errors.InvalidArgumentError as raised:
        error = "bad input batch" in str(raised)
    return error, int(model.optimizer.iterations.numpy()), [w.ravel().tolist() for w in model.get_weights()]
good = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
failing = tf.data.Dataset.from_tensor_slices((bad, y)).batch(16).map(
    lambda a, b: (tf.debugging.check_numerics(a, "bad input batch"), b))
result = {"good": fitted(good.take(6)), "failing": [fitted(failing) for _ in range(6)]}
model = compiled()  # `*_on_batch` hands the same train function a Python generator of one batch
losses = [float(model.train_on_batch(x[:16], y[:16], return_dict=True)["loss"]) for _ in range(3)]
result["on_batch"] = {"losses": losses, "iterations": int(model.optimizer.iterations.numpy())}
"""
_SHARED_CASES["train_step without the optimizer"] = """
class NoOptimizer(keras.Sequential):
    def train_step(self, data):
        x, y = data
        return {"loss": tf.reduce_mean(self(x))}
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(5)
    model = NoOptimizer([keras.Input((8, 8, 1)), keras.layers.Flatten(), keras.layers.Dense(4)]); compile_(model)
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
"""
_SHARED_CASES["unsupported Keras"] = """
install.reset_hooks_for_tests()  # as in a fresh process: the hooks are installed by the next strategy() call
real_check = trainer_seams.check_keras_support
trainer_seams.check_keras_support = lambda: "pretend this Keras lacks TensorFlowTrainer._make_function"
try:
    strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = build(); compile_(model)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
finally:
    trainer_seams.check_keras_support = real_check
    install.reset_hooks_for_tests()
    tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])  # the hooks back, for any later case
"""
_SHARED_CASES["batch ends"] = """
import threading
class Recorder(keras.callbacks.Callback):
    async_safe = True  # Keras' mark: its batch ends may run off the training thread
    def __init__(self):
        super().__init__()
        self.seen = []
    def on_train_batch_end(self, batch, logs=None):
        self.seen.append((int(batch), logs["loss"], threading.current_thread().name))
class NeedsBatchEnds(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        pass
import logging
said = []
handler = logging.Handler(); handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("tf_nvlink").addHandler(handler); logging.getLogger("tf_nvlink").setLevel(logging.INFO)
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
result = {"said": said}
for name, extra in (("async", []), ("sync", [NeedsBatchEnds()]), ("sync again", [NeedsBatchEnds()])):
    with strategy.scope():
        model = build(); compile_(model)
    recorder = Recorder()
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, callbacks=[recorder, *extra])
    result[name] = {"seen": recorder.seen, "history": history.history["loss"]}
"""
SHARED = scenarios.Scenario("install: one strategy on 2 CPUs", _PRELUDE, _SHARED_CASES, expected_s=21)


def test_plugin_compiles_one_function_per_replica_and_fit_evaluate_predict_work():
    out = SHARED.result("fit, evaluate, predict")
    assert out["jit"] and out["mode"] == "split"  # CPU replicas: fused all-reduce needs GPUs
    assert out["loss"][-1] < out["loss"][0]
    assert out["pred_shape"] == [10, 4] and out["predict_copies"] == 1


def test_batch_ends_run_off_the_training_thread_by_keras_rule_with_each_calls_own_logs():
    """Under a tf_nvlink strategy, batch ends follow Keras' JAX rule: with only async-safe callbacks they run on
    one callback thread, in order (the host launches the next call instead of waiting for this one's logs); a
    callback that needs batch ends keeps them on the training thread. Both see every call's own logs."""
    out = SHARED.result("batch ends")
    asynchronous, synchronous = out["async"], out["sync"]
    assert [batch for batch, _, _ in asynchronous["seen"]] == list(range(4)) * 2  # 2 epochs of 4 calls, in order
    assert {thread for _, _, thread in asynchronous["seen"]} == {"tf_nvlink_batch_ends_0"}  # one thread
    assert {thread for _, _, thread in synchronous["seen"]} == {"MainThread"}
    np.testing.assert_allclose([loss for _, loss, _ in asynchronous["seen"]],
                               [loss for _, loss, _ in synchronous["seen"]], rtol=1e-6)
    np.testing.assert_allclose(asynchronous["history"], synchronous["history"], rtol=1e-6)
    named = [line for line in out["said"] if "batch ends run on the training thread" in line]
    assert len(named) == 1 and "because NeedsBatchEnds define(s)" in named[0] and "async_safe = True" in named[0]


def test_an_input_error_comes_after_the_updates_of_the_steps_before_it():
    """Split mode at steps_per_execution=4, the input failing at batch 6: the 6 steps before it are applied in
    full, every time (`step_assembly.sequenced_steps_function`; `train_on_batch` trains through it too). Keras'
    own loop takes the next batch while a step runs, so the error could abort step 6's update after its step
    counter moved: one fit in two on this setup."""
    out = SHARED.result("input error at steps_per_execution=4")
    assert out["on_batch"]["iterations"] == 3 and out["on_batch"]["losses"] == sorted(out["on_batch"]["losses"],
                                                                                       reverse=True)
    error, iterations, weights = out["good"]
    assert error is None and iterations == 6
    for error, iterations, failed_weights in out["failing"]:
        assert error is True and iterations == 6
        for got, expected in zip(failed_weights, weights):
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)


def test_each_replica_gets_its_own_xla_compiled_step():
    out = SHARED.result("fit, evaluate, predict")["steps"]
    assert [s["kind"] for s in out] == ["train", "test"]
    for step in out:
        assert step["replicas"] == [0, 1] and step["xla"] == [True, True]


def test_auto_jit_compile_follows_keras_rule_under_the_plugin():
    assert SHARED.result("auto jit") == {"cpu_only": False, "with_gpu": True}


def test_unsupported_keras_fails_loudly():
    error = SHARED.error("unsupported Keras")
    assert "UnsupportedKerasError" in error and "jit_compile=False" in error
    assert "pretend this Keras" in error


def test_train_step_without_optimizer_call_gets_a_clear_error():
    assert "optimizer.apply_gradients" in SHARED.error("train_step without the optimizer")


def test_fit_makes_one_distributed_iterator():
    """Keras makes a distributed iterator at every fit/evaluate under a strategy, only to take one batch for a
    symbolic build (about 100 ms of MultiDeviceIterator tracing per call on a CPU), and that batch advances the
    user's input. Under tf_nvlink a model not built yet is built from the input's element spec, and a built one is
    not built again: every call makes the one iterator it trains or evaluates with. Subclassed models, built by
    the first call, train the same."""
    out = SHARED.result("one distributed iterator")
    for name in ("functional", "subclassed"):
        assert out["counts"][f"{name}_fit1"] == 1, out  # the epoch's: the build takes no batch
        assert out["counts"][f"{name}_fit2"] == 1 and out["counts"][f"{name}_evaluate"] == 1, out
        assert out["losses"][f"{name}fit2"] < out["losses"][f"{name}fit1"]


FUSED = scenarios.Scenario("install: fused (emulated) on 2 CPUs, and one device", _PRELUDE + FUSED_CPU_EMULATION + r"""
strategy = fused_strategy_emulated_on_cpu()
def fit(strategy, jit):
    with strategy.scope():
        model = build(); compile_(model, jit=jit)
    history = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    counter = model.optimizer.iterations.value
    return {"loss": history.history["loss"], "weights": [w.ravel().tolist() for w in model.get_weights()],
            "iterations": [int(v.numpy()) for v in getattr(counter, "values", [counter])]}
""", {"single": "result = fit(tf.distribute.get_strategy(), jit=False)",  # no scope: one device
      "fused": "result = fit(strategy, jit=True)"}, slow=True)


# The default run's fused fit against one device, per-replica iterations included:
# test_per_replica_steps.py::test_mixed_precision_fit_skips_overflowing_steps_on_every_replica[fused].
@pytest.mark.slow
def test_fused_mode_semantics_match_single_device_training():
    """Fused mode's logic without XLA itself (XLA on CPU cannot compile collectives): TensorFlow's no-merge_call
    path, which it takes under XLA on GPUs, is switched on for CPU replicas, and the per-replica functions are
    built exactly as in fused mode but without jit. Gradients all-reduced in replica context, the optimizer
    applied per replica, and the replica-local `iterations` counters must reproduce single-device training."""
    single, fused = FUSED.result("single"), FUSED.result("fused")
    assert fused["iterations"] == [12, 12] and single["iterations"] == [12]  # 128 / 32 x 3 epochs, every replica
    np.testing.assert_allclose(fused["loss"], single["loss"], rtol=1e-5)
    for a, b in zip(single["weights"], fused["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
