"""Sharded optimizer states against one device, in one process: `python sharded_states_cases.py LAYOUT CASES`.

LAYOUT: "single" (TensorFlow's default strategy, one device: the reference), or MODE + N: "fused2", "fused4" (fused
mode on N CPU replicas without XLA, as conftest.FUSED_CPU_EMULATION), "split2", "split4" (jit_compile=True, the
update outside XLA on the merge_call path), "plain2" (jit_compile=False), each with optimizer_states="sharded".
CASES: comma-separated names of CASES below, or of the checks "memory", "save", "resume", "refused_*". Prints one
JSON line: per case, the weights after training (and whether every replica's copy is the same), the train function's
class, or the check's numbers, or the error's text.
"""

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LAYOUT = sys.argv[1]
MODE, REPLICAS = (LAYOUT, 1) if LAYOUT == "single" else (LAYOUT[:-1], int(LAYOUT[-1]))
cpu = tf.config.list_physical_devices("CPU")[0]  # ("plain1": one replica, sharded asked: the replicated path)
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * max(REPLICAS, 2))

import keras  # noqa: E402
import tf_nvlink  # noqa: E402

STATES = os.environ.get("STATES", "sharded")  # STATES=replicated: the same cases without sharding, to compare
if MODE == "single":
    strategy = tf.distribute.get_strategy()
else:
    devices = [f"/cpu:{i}" for i in range(REPLICAS)]
    if MODE == "fused":
        import dataclasses  # noqa: E402

        from tf_nvlink.distribute import base  # noqa: E402
        from tf_nvlink.internals import tf_runtime  # noqa: E402

        tf_runtime.emulate_fused_mode_on_cpu()
        strategy = tf_nvlink.strategy(devices=devices, cross_device_ops="collective", optimizer_states=STATES)
        base.attach_plan(strategy, dataclasses.replace(strategy.plan, xla_allreduce="fused"))
    else:
        strategy = tf_nvlink.strategy(devices=devices, optimizer_states=STATES)

O = keras.optimizers
# name: (optimizer, steps_per_execution, with BatchNorm)
CASES = {
    "sgd_momentum": (lambda: O.SGD(0.05, momentum=0.9), 1, False),
    "adam": (lambda: O.Adam(0.01), 1, False),
    "adamw": (lambda: O.AdamW(0.01, weight_decay=0.05), 1, False),
    "adamw_global_clipnorm": (lambda: O.AdamW(0.01, weight_decay=0.05, global_clipnorm=0.5), 1, False),
    "sgd_momentum_spe3": (lambda: O.SGD(0.05, momentum=0.9), 3, False),
    "adam_spe3": (lambda: O.Adam(0.01), 3, False),
    "adamw_global_clipnorm_spe3": (lambda: O.AdamW(0.01, weight_decay=0.05, global_clipnorm=0.5), 3, False),
    "rmsprop": (lambda: O.RMSprop(0.01, momentum=0.5, centered=True), 1, False),
    "adagrad": (lambda: O.Adagrad(0.05), 1, False),
    "lion": (lambda: O.Lion(0.001), 1, False),
    "lamb": (lambda: O.Lamb(0.01), 1, False),
    "adamax": (lambda: O.Adamax(0.01), 1, False),
    "nadam": (lambda: O.Nadam(0.01), 1, False),
    "nadam_accumulate_spe3": (lambda: O.Nadam(0.01, gradient_accumulation_steps=2), 3, False),
    "adadelta": (lambda: O.Adadelta(1.0), 1, False),
    "ftrl": (lambda: O.Ftrl(0.05, l1_regularization_strength=0.001), 1, False),
    "clipnorm": (lambda: O.Adam(0.01, clipnorm=0.1), 1, False),
    "clipvalue": (lambda: O.Adam(0.01, clipvalue=0.01), 1, False),
    "accumulate": (lambda: O.Adam(0.01, gradient_accumulation_steps=2), 1, False),
    "accumulate_spe3": (lambda: O.Adam(0.01, gradient_accumulation_steps=2), 3, False),
    "loss_scale": (lambda: O.LossScaleOptimizer(O.Adam(0.01), initial_scale=2.0 ** 10), 1, False),
    "loss_scale_accumulate": (lambda: O.LossScaleOptimizer(O.Adam(0.01, gradient_accumulation_steps=2),
                                                           initial_scale=2.0 ** 10), 1, False),
    "batchnorm": (lambda: O.Adam(0.01), 1, True),
    "batchnorm_spe3": (lambda: O.Adam(0.01), 3, True),
}
class MyAdam(O.Adam):
    """An optimizer of the user's own (a subclass): its update may read anything."""


REFUSED = {"refused_adafactor": lambda: O.Adafactor(0.01), "refused_subclass": lambda: MyAdam(0.01),
           "refused_ema": lambda: O.Adam(0.01, use_ema=True)}

rng = np.random.default_rng(0)
x = rng.normal(size=(100, 8)).astype("float32")  # batches of 25: 13 + 12 on 2 replicas, 7 + 6 + 6 + 6 on 4
y = rng.normal(size=(100, 4)).astype("float32")


def build(make_optimizer, batchnorm=False, spe=1, scope=None):
    with scope or strategy.scope():
        optimizer = make_optimizer()
        keras.utils.set_random_seed(5)
        layers = [keras.Input((8,)), keras.layers.Dense(32, activation="relu")]
        if batchnorm:
            layers.append(keras.layers.BatchNormalization(synchronized=MODE in ("fused", "plain")))
        layers += [keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
        model = keras.Sequential(layers)
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe,
                      jit_compile=MODE in ("split", "fused"))
    return model


def replicas_agree(model) -> bool:
    """Every replica's copy of every weight and non-trainable variable is the same, bit for bit."""
    if MODE == "single":
        return True
    for variable in model.variables:
        parts = [np.asarray(p) for p in strategy.experimental_local_results(variable.value)]
        if any(not np.array_equal(parts[0], p) for p in parts[1:]):
            return False
    return True


def state_variables(optimizer):
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    return {v.path: v for v in inner.variables if v.path.split("/")[-1] not in ("iteration", "learning_rate")}


def train(name):
    make, spe, batchnorm = CASES[name]
    model = build(make, batchnorm, spe)
    model.fit(x, y, batch_size=25, epochs=2, shuffle=False, verbose=0)
    return {"weights": [w.tolist() for w in model.get_weights()], "agree": replicas_agree(model),
            "function": type(model.train_function).__name__,
            "iterations": int(np.asarray(model.optimizer.iterations))}


def memory():
    """Optimizer-state bytes on each device, from each variable's (each mirrored component's) placement."""
    model = build(lambda: O.Adam(0.01))
    model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    held = {}
    per_variable = {}
    for path, variable in state_variables(model.optimizer).items():
        size = int(np.prod(variable.shape)) * 4
        for part in strategy.experimental_local_results(variable.value):
            device = tf.DeviceSpec.from_string(part.device).device_index
            held[device] = held.get(device, 0) + size
        reference = path.rsplit("_", 1)[0]
        per_variable[reference] = per_variable.get(reference, 0) + size
    from tf_nvlink.training import sharded_states  # noqa: PLC0415

    return {"held": [held.get(i, 0) for i in range(REPLICAS)], "replicated": sum(per_variable.values()),
            "largest": max(per_variable.values()), "table": sharded_states.memory_table(model.optimizer),
            "counters": sum(int(np.prod(v.shape)) * v.value.dtype.size for v in model.optimizer.variables
                            if v.path.split("/")[-1] in ("iteration", "learning_rate"))}


def memory_log():
    """The INFO lines of tf_nvlink's logger while two models train twice each: one memory line per sharded optimizer."""
    import logging  # noqa: PLC0415

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("tf_nvlink")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for _ in range(2):
            model = build(lambda: O.Adam(0.01))
            for _ in range(2):
                model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [line for line in lines if line.startswith("optimizer states")]


def save():
    """A sharded run saved whole (model.save), loaded on one device without a strategy: the same slots."""
    model = build(lambda: O.Adam(0.01))
    model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert not isinstance(loaded.optimizer.iterations.value, tf.distribute.DistributedValues)
    mine, theirs = list(state_variables(model.optimizer).values()), list(state_variables(loaded.optimizer).values())
    assert [v.shape for v in mine] == [v.shape for v in theirs] and len(mine) == 12  # Keras loads them in order
    return {"slots": len(mine), "difference": max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                                                  for a, b in zip(mine, theirs)),
            "weights": max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), loaded.get_weights()))}


def resume():
    """A one-device (replicated) run's saved model loaded under the sharded strategy continues as one device does."""
    default = tf.distribute.get_strategy()
    one = build(lambda: O.Adam(0.01), scope=default.scope())
    one.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "m.keras")
    one.save(path)
    one.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    with strategy.scope():
        sharded = keras.models.load_model(path)
    sharded.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    devices = sorted({v.value.device for v in state_variables(sharded.optimizer).values()})
    return {"difference": max(float(np.max(np.abs(a - b))) for a, b in zip(one.get_weights(),
                                                                          sharded.get_weights())),
            "agree": replicas_agree(sharded), "slot_devices": len(devices)}


def slot_kinds():
    """The classes of the slots' TensorFlow variables (one replica: Keras' own, mirrored)."""
    model = build(lambda: O.Adam(0.01))
    model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    return sorted({type(v.value).__name__ for v in state_variables(model.optimizer).values()})


def save_weights():
    """What BackupAndRestore and tf_nvlink's AtomicBackupAndRestore write and read (`save_weights`/`load_weights`,
    the optimizer's variables included): a sharded run restored into another sharded model, slots and all, and
    both continue alike."""
    first = build(lambda: O.Adam(0.01))
    first.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(tempfile.mkdtemp(), "backup.weights.h5")
    first.save_weights(path)
    second = build(lambda: O.Adam(0.02))
    second.fit(x[:25], y[:25], batch_size=25, epochs=1, shuffle=False, verbose=0)  # built, its slots elsewhere
    second.load_weights(path)
    mine, theirs = list(state_variables(first.optimizer).values()), list(state_variables(second.optimizer).values())
    slots = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(mine, theirs))
    for model in (first, second):
        model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    return {"slots": slots, "agree": replicas_agree(second),
            "difference": max(float(np.max(np.abs(a - b))) for a, b in zip(first.get_weights(), second.get_weights()))}


def request_key():
    """optimizer_states is part of the request: the same returns the strategy, the other one raises."""
    same = tf_nvlink.strategy(devices=devices, cross_device_ops="collective", optimizer_states="sharded")
    try:
        tf_nvlink.strategy(devices=devices, cross_device_ops="collective")
    except RuntimeError as error:
        return {"same": same is strategy, "other": str(error)}
    return {"same": same is strategy, "other": None}


def refused(name):
    model = build(REFUSED[name])
    try:
        model.fit(x, y, batch_size=25, epochs=1, shuffle=False, verbose=0)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


results = {}
for case in sys.argv[2].split(","):
    if case in CASES:
        results[case] = train(case)
    elif case.startswith("refused_"):
        results[case] = refused(case)
    else:
        results[case] = {"memory": memory, "memory_log": memory_log, "save": save, "resume": resume, "slot_kinds": slot_kinds,
                         "request_key": request_key, "save_weights": save_weights}[case]()
print(json.dumps(results))
