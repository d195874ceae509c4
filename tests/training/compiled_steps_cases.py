"""CompiledSteps against one strategy.run per step, in one process: `python compiled_steps_cases.py LAYOUT`.

LAYOUT: "emulated2" (2 CPU replicas in fused mode without XLA, conftest.FUSED_CPU_EMULATION), "split2"
(tf_nvlink.strategy() over 2 CPUs: split mode, the step without jit), "gpu1" (one real GPU, XLA). A custom loop's
jit step (forward, tf_nvlink.average_loss, gradients, SGD with momentum) trains 2 epochs of 100 examples in
batches of 15 (6 of 15 and one of 10), once per step and once through CompiledSteps(steps=4) (calls of 4, 2 and 1:
a partial execution, then the short batch), from the same initial weights. Prints one JSON line: both runs'
weights, optimizer iterations and summed losses, the CompiledSteps calls' step counts, its programs run and the errors
for bad `steps`.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

from conftest import FUSED_CPU_EMULATION  # noqa: E402

exec(FUSED_CPU_EMULATION)  # noqa: S102 - defines fused_strategy_emulated_on_cpu

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LAYOUT = sys.argv[1]
if LAYOUT.startswith("gpu"):
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32 matmuls in float32: 1e-5 holds
    import tf_nvlink  # noqa: E402

    strategy = tf_nvlink.strategy(gpus=[0])
else:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    if LAYOUT == "emulated2":
        strategy = fused_strategy_emulated_on_cpu()  # noqa: F821
    else:
        import tf_nvlink  # noqa: E402

        strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])

import keras  # noqa: E402

import tf_nvlink  # noqa: E402
from tf_nvlink.training.compiled_steps import CompiledSteps  # noqa: E402

JIT = LAYOUT != "split2"  # split mode cannot all-reduce average_loss's example count inside XLA
rng = np.random.default_rng(0)
x = rng.normal(size=(100, 8)).astype("float32")
y = rng.integers(0, 4, 100).astype("int32")
dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(15)


def build():
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(4)])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        optimizer.build(model.trainable_variables)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def step(features, labels):
        with tf.GradientTape() as tape:
            value = tf_nvlink.average_loss(loss(labels, model(features, training=True)))
        grads = tape.gradient(value, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return value

    return model, optimizer, tf.function(step, jit_compile=JIT)


def result(model, optimizer, losses):
    return {"weights": [w.numpy().tolist() for w in model.weights], "iterations": int(optimizer.iterations.numpy()),
            "losses": losses}


def per_step():
    model, optimizer, step = build()
    losses = []
    for _ in range(2):
        total = 0.0
        for batch in strategy.experimental_distribute_dataset(dataset):
            total += float(strategy.reduce("SUM", strategy.run(step, args=batch), axis=None))
        losses.append(total)
    return result(model, optimizer, losses)


def compiled():
    model, optimizer, step = build()
    bad_steps = []
    for steps in (0, 2.5, True):
        try:
            CompiledSteps(strategy, step, steps=steps)
        except ValueError as error:
            bad_steps.append(str(error))
    train = CompiledSteps(strategy, step, steps=4)
    losses, calls = [], []
    for _ in range(2):
        total, iterator = 0.0, iter(strategy.experimental_distribute_dataset(dataset))
        while True:
            outputs, ran = train(iterator)
            if not ran:
                break
            calls.append(ran)
            total += float(strategy.reduce("SUM", outputs, axis=None))
        losses.append(total)
    return {**result(model, optimizer, losses), "calls": calls, "programs_run": train.programs_run,
            "mode": train.mode, "bad_steps": bad_steps}


print(json.dumps({"per_step": per_step(), "compiled": compiled()}))
