"""Compiled execution against per-step training, in one process: `python compiled_execution_cases.py LAYOUT`.

LAYOUT: "emulated1" / "emulated2" (1 or 2 CPU replicas in fused mode without XLA, conftest.FUSED_CPU_EMULATION),
"gpu1" / "gpu2" (`tf_nvlink.strategy()` over 1 or 2 real GPUs, XLA). Each case trains one model per step
(steps_per_execution=1, the reference) and one with steps_per_execution=4 on the compiled path, from the same
initial weights, under the same strategy (the plan's `compiled_execution` switched between the two builds), and
prints one JSON line (case "memory_check": the error a too-small device gives): per case, both runs' weights, optimizer iterations, losses, evaluate results, the batch ends
the callbacks saw, and how many programs the compiled run traced and ran.
"""

import dataclasses
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

from conftest import FUSED_CPU_EMULATION  # noqa: E402

exec(FUSED_CPU_EMULATION)  # noqa: S102 - defines fused_strategy_emulated_on_cpu

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LAYOUT = sys.argv[1]
REPLICAS = int(LAYOUT[-1])
if LAYOUT.startswith("emulated"):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = fused_strategy_emulated_on_cpu(devices=[f"/cpu:{i}" for i in range(REPLICAS)])  # noqa: F821
else:
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32 matmuls in float32: 1e-5 holds
    import tf_nvlink  # noqa: E402

    strategy = tf_nvlink.strategy(gpus=list(range(REPLICAS)))

import keras  # noqa: E402

from tf_nvlink.distribute import base  # noqa: E402

STEPS = 4
BATCH = 15  # 70 examples: 4 batches of 15 (split 8 + 7 on 2 replicas) and one of 10
rng = np.random.default_rng(0)
x = rng.normal(size=(70, 8)).astype("float32")
y = rng.integers(0, 4, 70).astype("int32")


class BatchEnds(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.ends = []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(int(batch))


def build(case):
    keras.utils.set_random_seed(5)
    layers = [keras.Input((8,)), keras.layers.Dense(16)]
    if case != "no_batchnorm":
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.ReLU(), keras.layers.Dense(4)]
    model = keras.Sequential(layers)
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9,
                                     gradient_accumulation_steps=2 if case == "accumulate" else None)
    if case == "loss_scale":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 4)
    return model, optimizer


def _count_stagings():
    """Counts how often the compiled path builds its staged input from here on; returns the reader (which stops
    counting)."""
    from tf_nvlink.training import compiled_execution, input_staging

    count, pinned = [0], input_staging.pinned_batches

    def counted(dataset):
        count[0] += 1
        return pinned(dataset)

    def read():
        input_staging.pinned_batches = pinned
        return count[0]

    input_staging.pinned_batches = counted
    return read


def fits(case, model, callback):
    """The fits of one case; returns the losses of every epoch."""
    if case == "steps_per_epoch":  # 7 steps an epoch at N=4: executions of 4 and 3; two fits of the same tf.data
        # datasets (validation too): the compiled path stages each dataset once, not at every fit and epoch
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).repeat()
        validation = tf.data.Dataset.from_tensor_slices((x[:30], y[:30])).batch(BATCH)
        stagings = _count_stagings()
        first = model.fit(data, steps_per_epoch=7, epochs=2, verbose=0, callbacks=[callback],
                          validation_data=validation)
        history = model.fit(data, steps_per_epoch=7, epochs=1, verbose=0, callbacks=[callback],
                            validation_data=validation)
        model.stagings = stagings()
        return first.history["loss"] + history.history["loss"] + first.history["val_loss"] + history.history["val_loss"]
    elif case == "unknown_length":  # the dataset's length is unknown until it ends, mid-execution
        data = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH)
        history = model.fit(data, epochs=2, verbose=0, callbacks=[callback])
    elif case == "rest_of_fit":  # validation, atomic checkpoints, a backup a second fit resumes from
        import tempfile

        from tf_nvlink.training import callbacks as safe_callbacks

        folder = tempfile.mkdtemp()
        extra = [safe_callbacks.EpochCheckpoint(os.path.join(folder, "ckpt")),
                 safe_callbacks.AtomicBackupAndRestore(os.path.join(folder, "backup"))]
        history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, validation_data=(x, y),
                            callbacks=[callback, *extra])
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, validation_data=(x, y),
                            callbacks=[callback, *extra])  # resumes at epoch 2
        model.predictions = model.predict(x, batch_size=BATCH, verbose=0).ravel().tolist()
        model.checkpoints = sorted(os.listdir(os.path.join(folder, "ckpt")))
        return history.history["loss"] + history.history["val_loss"]
    elif case == "host_input":  # numpy arrays prefetched to the devices, then a second fit with its batches kept
        # in host memory (not prefetched): each full execution copies the next one's batches while it runs; at
        # steps_per_epoch=7 an epoch's partial execution takes 3 of them and the next full one 1 copied + 3 not
        first = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[callback])
        if hasattr(model.train_function, "input_to_device"):
            model.train_function.input_to_device = False
        data = tf.data.Dataset.from_tensor_slices((x[:60], y[:60])).batch(BATCH).repeat()
        second = model.fit(data, steps_per_epoch=7, epochs=2, verbose=0, callbacks=[callback])
        return first.history["loss"] + second.history["loss"]
    else:  # numpy arrays: per epoch 4 batches of 15 (one execution) and one of 10 (its own program)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
    return history.history["loss"]


def train(case, compiled):
    base.attach_plan(strategy, dataclasses.replace(strategy.plan, compiled_execution=compiled))
    with strategy.scope():
        model, optimizer = build(case)
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=True, steps_per_execution=STEPS if compiled else 1)
    callback = BatchEnds()
    losses = fits(case, model, callback)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    function = model.train_function
    programs = function.programs.traced() if hasattr(function, "programs") else None
    gc.collect()  # fit's iterator is gone: the compiled execution must not keep its input pipeline running
    holds_input = bool(getattr(function, "_taken_ahead", None)) or (
        hasattr(function, "_ahead_of") and function._ahead_of() is not None)
    return {
        "function": type(function).__name__,
        "weights": [w.ravel().tolist() for w in model.get_weights()],
        "iterations": int(model.optimizer.iterations.numpy()),
        "loss": losses, "evaluate": evaluated, "batch_ends": callback.ends,
        "programs_traced": programs, "programs_run": getattr(function, "programs_run", None),
        "copied_ahead": getattr(function, "copied_ahead", None),
        "holds_input_after_fit": holds_input,
        "test_function": type(model.test_function).__name__,
        "predictions": getattr(model, "predictions", None), "checkpoints": getattr(model, "checkpoints", None),
        "stagings": getattr(model, "stagings", None),
    }


def staged_memory_check():
    """The compiled path's memory check, with a device that has 1000 bytes free: the error before training."""
    from tf_nvlink.internals import tf_runtime as internals
    from tf_nvlink.training import compiled_execution, input_staging

    base.attach_plan(strategy, dataclasses.replace(strategy.plan, compiled_execution=True))
    free, internals.device_bytes_free = internals.device_bytes_free, lambda device: 1000
    try:
        with strategy.scope():
            model, optimizer = build("no_batchnorm")
            model.compile(optimizer=optimizer, loss="mse", jit_compile=True, steps_per_execution=STEPS)
        before = [w.copy() for w in model.get_weights()]
        try:
            model.fit(x, np.eye(4, dtype="float32")[y], batch_size=BATCH, epochs=1, verbose=0)
        except input_staging.StagedBatchesTooLarge as error:
            unchanged = all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
            return {"error": str(error), "weights_unchanged": unchanged}
        return {"error": None}
    finally:
        internals.device_bytes_free = free


CASES = ("numpy", "steps_per_epoch", "unknown_length", "accumulate", "loss_scale", "no_batchnorm", "rest_of_fit")
selected = sys.argv[2].split(",") if len(sys.argv) > 2 else CASES
results = {case: {"per_step": train(case, False), "compiled": train(case, True)} for case in selected
           if case != "memory_check"}
if "memory_check" in selected:
    results["memory_check"] = staged_memory_check()
print(json.dumps(results))
