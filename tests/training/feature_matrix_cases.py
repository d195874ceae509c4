"""Keras features against one device, one process per layout: `python feature_matrix_cases.py LAYOUT [ROWS]`.

LAYOUT:
- "emulated1" / "emulated2": 1 or 2 CPU replicas in fused mode (conftest.FUSED_CPU_EMULATION: the GPU path
  without XLA), each row on both paths: "per_step" (the plan's `compiled_execution` off) and "compiled";
- "split2": 2 CPU replicas, `jit_compile=True` (XLA per replica, the all-reduce outside), the per-step path;
- "plain2": 2 CPU replicas, `jit_compile=False`, the per-step path;
- "workers2": one of 2 worker processes (TF_CONFIG set by the caller), one CPU device each, `jit_compile=True`
  (split mode across workers), the per-step path;
- "gpu1" / "gpu2": `tf_nvlink.strategy()` over 1 or 2 real GPUs (XLA), both paths.

Each row (a function below, named in ROWS) trains, evaluates or predicts once per path under the layout's
strategy and once on one device (no strategy, no XLA, the same `steps_per_execution`), from the same initial
weights, and returns {"close": numbers, "exact": counts, orders and names}; a row that cannot run in a layout
returns {"cannot": why}. The script prints one JSON line: {row: {"one_device": ..., path: ...}}.
tests/training/test_feature_matrix.py compares every path's result with one device's.

Adding a Keras feature: write a row function (data from `_data`, the model from `_model`, results through
`_summary`), add it to ROWS, and name it in test_feature_matrix.py's tier lists.
"""

import contextlib
import dataclasses
from functools import partial
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: conftest

from conftest import FUSED_CPU_EMULATION  # noqa: E402

exec(FUSED_CPU_EMULATION)  # noqa: S102 - defines fused_strategy_emulated_on_cpu

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

LAYOUT = sys.argv[1] if len(sys.argv) > 1 else "emulated2"
REPLICAS = int(LAYOUT[-1])
STEPS = 2  # steps_per_execution of the models (each epoch ends with a partial execution: 33 examples at batch 8)
BATCH = 8

if LAYOUT == "workers2":  # this process is one of 2 workers (TF_CONFIG), one CPU device each
    import tf_nvlink  # noqa: E402

    strategy = tf_nvlink.strategy(peer_timeout_s=120)
elif LAYOUT.startswith("gpu"):
    tf.config.experimental.enable_tensor_float_32_execution(False)  # float32 matmuls in float32: 1e-5 holds
    import tf_nvlink  # noqa: E402

    strategy = tf_nvlink.strategy(gpus=list(range(REPLICAS)))
else:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    if LAYOUT.startswith("emulated"):
        strategy = fused_strategy_emulated_on_cpu(devices=[f"/cpu:{i}" for i in range(REPLICAS)])  # noqa: F821
    else:
        import tf_nvlink  # noqa: E402

        strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])

import keras  # noqa: E402

from tf_nvlink.distribute import base  # noqa: E402

PATHS = ("per_step", "compiled") if LAYOUT.startswith(("emulated", "gpu")) else ("per_step",)
JIT = LAYOUT != "plain2"
FUSED = LAYOUT.startswith(("emulated", "gpu"))


@dataclasses.dataclass
class Where:
    """Where a row runs: `path` is "one_device" (no strategy, no XLA) or a path of the layout's strategy."""

    path: str

    @property
    def one_device(self) -> bool:
        return self.path == "one_device"

    def scope(self):
        if self.one_device:
            return contextlib.nullcontext()
        if hasattr(strategy.plan, "compiled_execution"):  # a multi-worker plan has no compiled path
            base.attach_plan(strategy, dataclasses.replace(strategy.plan,
                                                           compiled_execution=self.path == "compiled"))
        return strategy.scope()

    def compile(self, model, optimizer=None, steps_per_execution=STEPS, **kwargs):
        """`model.compile` in the strategy's scope, the optimizer made there (SGD with momentum by default)."""
        kwargs.setdefault("loss", "mse")
        with self.scope():
            model.compile(optimizer=optimizer() if optimizer else keras.optimizers.SGD(0.05, momentum=0.9),
                          jit_compile=JIT and not self.one_device, steps_per_execution=steps_per_execution,
                          **kwargs)
        return model


def _data(examples=33, features=4, seed=0, classes=None):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, features)).astype("float32")
    if classes:
        return x, rng.integers(0, classes, examples).astype("int32")
    return x, (x @ rng.normal(size=(features, 1)) + 0.1 * rng.normal(size=(examples, 1))).astype("float32")


_INPUT = partial(keras.Input, (4,))


def _dense(units, **kwargs):
    return partial(keras.layers.Dense, units, **kwargs)


def _model(where, *layers, seed=3):
    """A Sequential model of `layers` (classes or `functools.partial`s of them, made after the seed is set: a
    Keras initializer draws its seed when it is made), built in the strategy's scope."""
    with where.scope():
        keras.utils.set_random_seed(seed)
        return keras.Sequential([layer() for layer in layers])


def _copies(variable):
    value = getattr(variable, "value", variable)
    return [np.asarray(v.numpy()) for v in getattr(value, "values", [value])]


def _summary(model, history=None, evaluate=None, **close):
    """The weights (every replica's copy must agree), the epoch logs, evaluate's results and `close` numbers."""
    weights, agree = [], True
    for variable in model.weights:
        copies = _copies(variable)
        agree = agree and all(np.array_equal(copies[0], other) for other in copies[1:])
        weights.append(copies[0].astype("float64").ravel().tolist())
    result = {"close": {"weights": weights, **close}, "exact": {"replica_copies_agree": agree}}
    if history is not None:
        result["close"]["logs"] = {key: [float(v) for v in values] for key, values in history.history.items()}
        result["exact"]["epochs"] = len(history.epoch)
    if evaluate is not None:
        result["close"]["evaluate"] = {key: float(value) for key, value in evaluate.items()}
    return result


# ==== rows ======================================================================================================


# BatchNorm's batch statistics are each replica's own under any MirroredStrategy (Keras' and TensorFlow's rule):
# synchronized=True computes them over the global batch, as one device does, so rows compare that. Split mode
# cannot hold its all-reduce inside a replica's XLA program (CrossReplicaCallInXlaError; test_replica_sync).
_NO_SYNCHRONIZED_BN = "split mode cannot all-reduce BatchNorm(synchronized=True)'s statistics inside XLA"
_NO_SYNCHRONIZED_BN_ACROSS_WORKERS = ("an all-reduce inside XLA cannot span worker processes: BatchNorm(synchronized="
                                      "True) is refused there (SynchronizedBatchNormError)")


def _batch_norm():
    return keras.layers.BatchNormalization(synchronized=REPLICAS > 1)


def bn_unknown_length(where):
    """BatchNorm, a dataset of unknown length: 33 examples at batch 8 end mid-execution with a 1 + 0 step. Also
    BatchNorm with each replica's own statistics (differs from one device by design): its logs are finite."""
    if LAYOUT == "split2" and not where.one_device:
        return {"cannot": _NO_SYNCHRONIZED_BN}
    if LAYOUT == "workers2" and not where.one_device:
        return {"cannot": _NO_SYNCHRONIZED_BN_ACROSS_WORKERS}
    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH)
    model = where.compile(_model(where, _INPUT, _dense(8), _batch_norm,
                                 keras.layers.ReLU, _dense(1)))
    history = model.fit(data, epochs=2, verbose=0)
    result = _summary(model, history, model.evaluate(data, verbose=0, return_dict=True))
    own = where.compile(_model(where, _INPUT, keras.layers.BatchNormalization,
                               _dense(1)))
    logs = own.fit(data, epochs=2, verbose=0).history
    result["exact"]["own_statistics_logs_finite"] = bool(np.isfinite(logs["loss"]).all()) and bool(
        np.isfinite(own.evaluate(data, verbose=0)))
    return result


def _classifier(where, metrics=("accuracy",)):
    model = _model(where, _INPUT, _dense(8, activation="relu"), _dense(3))
    return where.compile(model, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         metrics=list(metrics))


_CLASS_WEIGHT = {0: 1.0, 1: 2.0, 2: 0.5}


def class_weight_numpy(where):
    """`class_weight` with numpy input (33 examples at batch 8: the last step 1 + 0 on 2 replicas)."""
    x, y = _data(classes=3)
    model = _classifier(where)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, class_weight=_CLASS_WEIGHT, verbose=0)
    return _summary(model, history, model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True))


def class_weight_dataset(where):
    """`class_weight` with a tf.data dataset."""
    x, y = _data(classes=3)
    model = _classifier(where)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = model.fit(data, epochs=2, class_weight=_CLASS_WEIGHT, verbose=0)
    return _summary(model, history)


def sample_weight_dataset(where):
    """(x, y, sample_weight) batches from a tf.data dataset, and the same in evaluate."""
    x, y = _data()
    weights = np.random.default_rng(1).uniform(0.5, 2.0, len(x)).astype("float32")
    model = where.compile(_model(where, _INPUT, _dense(1)), weighted_metrics=["mae"])
    data = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(BATCH)
    history = model.fit(data, epochs=2, verbose=0)
    return _summary(model, history, model.evaluate(data, verbose=0, return_dict=True))


def validation_callbacks(where):
    """A validation set of 33 at batch 8 and callbacks that act on its logs: EarlyStopping, ModelCheckpoint
    (save_best_only), TerminateOnNaN, ReduceLROnPlateau."""
    if LAYOUT == "split2" and not where.one_device:
        return {"cannot": _NO_SYNCHRONIZED_BN}
    if LAYOUT == "workers2" and not where.one_device:
        return {"cannot": _NO_SYNCHRONIZED_BN_ACROSS_WORKERS}
    x, y = _data(64, seed=1)
    vx, vy = _data(33, seed=2)
    model = where.compile(_model(where, _INPUT, _dense(8), _batch_norm,
                                 _dense(1)), optimizer=lambda: keras.optimizers.SGD(0.01))
    folder = tempfile.mkdtemp()
    try:
        callbacks = [keras.callbacks.EarlyStopping(monitor="val_loss", patience=0),
                     keras.callbacks.ModelCheckpoint(os.path.join(folder, "best_{epoch}.weights.h5"),
                                                     monitor="val_loss", save_best_only=True, save_weights_only=True),
                     keras.callbacks.TerminateOnNaN(),
                     keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=0, factor=0.5)]
        history = model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, validation_data=(vx, vy),
                            callbacks=callbacks, verbose=0)
        saved = sorted(os.listdir(folder))
    finally:
        shutil.rmtree(folder)
    result = _summary(model, history)
    result["exact"]["checkpoints"] = saved
    return result


def validation_freq(where):
    """`validation_freq=2`: validation after epochs 2 and 4 only, with a validation batch split 1 + 0."""
    x, y = _data(64, seed=1)
    vx, vy = _data(17, seed=2)
    model = where.compile(_model(where, _INPUT, _dense(1)), metrics=["mae"])
    history = model.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, validation_data=(vx, vy),
                        validation_freq=2, verbose=0)
    result = _summary(model, history)
    result["exact"]["log_lengths"] = {key: len(values) for key, values in history.history.items()}
    return result


def multi_output_dict(where):
    """Two inputs and two outputs as dicts, a loss and a metric per output, loss weights: every `<output>_loss`
    and metric in fit's and evaluate's logs."""
    rng = np.random.default_rng(4)
    xa, xb = rng.normal(size=(33, 4)).astype("float32"), rng.normal(size=(33, 2)).astype("float32")
    y_cls, y_reg = rng.integers(0, 3, 33).astype("int32"), rng.normal(size=(33, 1)).astype("float32")
    with where.scope():
        keras.utils.set_random_seed(3)
        a, b = keras.Input((4,), name="a"), keras.Input((2,), name="b")
        hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Concatenate()([a, b]))
        model = keras.Model({"a": a, "b": b}, {"cls": keras.layers.Dense(3, name="cls")(hidden),
                                               "reg": keras.layers.Dense(1, name="reg")(hidden)})
    where.compile(model, loss={"cls": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "reg": "mse"},
                  loss_weights={"cls": 1.0, "reg": 0.5}, metrics={"cls": ["accuracy"], "reg": ["mae"]})
    inputs, targets = {"a": xa, "b": xb}, {"cls": y_cls, "reg": y_reg}
    history = model.fit(inputs, targets, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    evaluated = model.evaluate(inputs, targets, batch_size=BATCH, verbose=0, return_dict=True)
    return _summary(model, history, evaluated)


def unbuilt_reshuffle(where):
    """A model not built before fit and a seeded dataset reshuffled every epoch: the same order each epoch as one
    device (building the model takes no batch from the user's input)."""
    x, y = _data()
    model = where.compile(_model(where, _dense(8, activation="relu"), _dense(1)))
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(33, seed=7, reshuffle_each_iteration=True).batch(BATCH)
    history = model.fit(data, epochs=3, verbose=0)
    return _summary(model, history)


def generator_passes(where):
    """A `from_generator` dataset and a model not built yet: the generator runs once per epoch, as on one device."""
    x, y = _data()
    passes = [0]

    def generate():
        passes[0] += 1
        yield from zip(x, y)

    data = tf.data.Dataset.from_generator(generate, output_signature=(
        tf.TensorSpec((4,), tf.float32), tf.TensorSpec((1,), tf.float32))).batch(BATCH)
    model = where.compile(_model(where, _dense(1)))
    history = model.fit(data, epochs=3, verbose=0)
    result = _summary(model, history)
    result["exact"]["generator_passes"] = passes[0]
    return result


def python_generator(where):
    """A Python generator given to fit (steps_per_epoch, 2 epochs): the batches drawn from it, and the training."""
    if LAYOUT == "plain2" and not where.one_device:
        return {"cannot": "plain mode runs Keras' own loop over a Python generator, which the distributed input "
                          "reads ahead from several threads: its order is not one device's (stock too)"}
    x, y = _data(64)
    drawn = [0]

    def batches():
        while True:
            for start in range(0, 64, BATCH):
                drawn[0] += 1
                yield x[start:start + BATCH], y[start:start + BATCH]

    model = where.compile(_model(where, _INPUT, _dense(1)))
    history = model.fit(batches(), steps_per_epoch=8, epochs=2, verbose=0)
    result = _summary(model, history)
    result["exact"]["drawn_at_least_trained"] = drawn[0] >= 16
    return result


class _ShuffledSequence(keras.utils.PyDataset):
    """A PyDataset that reshuffles its order in `on_epoch_end` from a seeded generator, and records what it served."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.rng = np.random.default_rng(11)
        self.order = np.arange(len(x))
        self.served = []

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, index):
        picked = self.order[index * BATCH:(index + 1) * BATCH]
        self.served.append(int(index))
        return self.x[picked], self.y[picked]

    def on_epoch_end(self):
        self.rng.shuffle(self.order)


def pydataset_shuffle(where):
    """A `keras.utils.PyDataset` reshuffled in `on_epoch_end`: the same batches every epoch as one device."""
    x, y = _data()
    data = _ShuffledSequence(x, y)
    model = where.compile(_model(where, _INPUT, _dense(1)))
    history = model.fit(data, epochs=3, verbose=0)
    return _summary(model, history)


def numpy_shuffle(where):
    """`shuffle=True` on numpy arrays, seeded with `keras.utils.set_random_seed`."""
    x, y = _data()
    model = where.compile(_model(where, _INPUT, _dense(1)))
    keras.utils.set_random_seed(21)
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0)
    return _summary(model, history)


def on_batch_calls(where):
    """`train_on_batch`, `test_on_batch`, `predict_on_batch` on 5 rows (not divisible by 2 replicas), and
    `predict` of 7 rows at batch 3."""
    x, y = _data(7)
    model = where.compile(_model(where, _INPUT, _dense(3), _dense(1)),
                          metrics=["mae"])
    trained = [model.train_on_batch(x[:5], y[:5], return_dict=True) for _ in range(2)]
    tested = model.test_on_batch(x[:5], y[:5], return_dict=True)
    predicted = model.predict_on_batch(x[:5])
    predicted_all = model.predict(x, batch_size=3, verbose=0)
    result = _summary(model, train_on_batch=[{k: float(v) for k, v in logs.items()} for logs in trained],
                      test_on_batch={k: float(v) for k, v in tested.items()},
                      predict_on_batch=np.asarray(predicted).tolist(), predict=np.asarray(predicted_all).tolist())
    result["exact"].update(predict_on_batch_shape=list(np.shape(predicted)),
                           predict_shape=list(np.shape(predicted_all)))
    return result


def input_error(where):
    """An input error at batch 6 of an epoch at steps_per_execution=4: the steps before it are applied, then
    the error comes through. On one device the weights are those of the 6 good batches trained without the bad
    one: Keras' own multi-step loop may cut the update of the step before the error short (TensorFlow aborts the
    execution while it runs; seen on one GPU and on CPU replicas without XLA)."""
    x, y = _data(64)
    good = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    x[6 * BATCH + 1, 0] = np.nan
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).map(
        lambda a, b: (tf.debugging.check_numerics(a, "bad input batch"), b))
    model = where.compile(_model(where, _INPUT, _dense(1)), steps_per_execution=4)
    try:
        model.fit(data, epochs=1, verbose=0)
        error = None
    except Exception as raised:  # noqa: BLE001 - the row records which
        error = [type(raised).__name__, "bad input batch" in str(raised)]
    steps_applied = int(model.optimizer.iterations.numpy())
    if where.one_device:
        model = where.compile(_model(where, _INPUT, _dense(1)), steps_per_execution=4)
        model.fit(good.take(6), epochs=1, verbose=0)
    result = _summary(model)
    result["exact"].update(error=error, steps_applied=steps_applied)
    if LAYOUT == "plain2":  # Keras' own multi-step loop runs the replicas too: the same cut (stock MirroredStrategy)
        del result["close"]["weights"]
    return result


def batchnorm_synchronized(where):
    """`BatchNormalization(synchronized=True)`: the statistics over the whole global batch."""
    if LAYOUT == "split2" and not where.one_device:
        return {"cannot": _NO_SYNCHRONIZED_BN}
    if LAYOUT == "workers2" and not where.one_device:
        return {"cannot": _NO_SYNCHRONIZED_BN_ACROSS_WORKERS}
    x, y = _data(32)
    model = where.compile(_model(where, _INPUT, _dense(8), partial(keras.layers.BatchNormalization,
                                                                                  synchronized=True), _dense(1)))
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return _summary(model, history, model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True))


def mixed_precision(where):
    """`mixed_float16` with a LossScaleOptimizer, float16 compute, compared at float16's precision. The scale
    starts where no step overflows: each replica's float16 gradients are its share's, smaller than one device's, so
    a scale that overflows one device's gradients may not overflow the replicas' (docs/architecture.md)."""
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = where.compile(_model(where, _INPUT, _dense(8, activation="relu"),
                                     _dense(1, dtype="float32")),
                              optimizer=lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05),
                                                                                    initial_scale=2.0 ** 4))
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        return _summary(model, history)
    finally:
        keras.mixed_precision.set_global_policy("float32")


class _BatchLogs(keras.callbacks.Callback):
    """Records the logs every batch end of fit and evaluate gives (what the progress bar shows)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append({"train": 1.0, **{k: float(v) for k, v in (logs or {}).items()}})

    def on_test_batch_end(self, batch, logs=None):
        self.seen.append({"test": 1.0, **{k: float(v) for k, v in (logs or {}).items()}})


def batch_logs(where):
    """The logs batch-end callbacks (and the progress bar) see in fit and evaluate, 33 examples at batch 8: every
    execution's last step's running loss and metrics, over all replicas. (The batch numbers differ at an epoch's
    last execution: Keras numbers a short one as a full one; tf_nvlink by the steps it ran, test_compiled_execution.)"""
    x, y = _data()
    model = where.compile(_model(where, _INPUT, _dense(8, activation="relu"), _dense(1)), metrics=["mae"])
    recorder = _BatchLogs()
    model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, validation_data=(x[:17], y[:17]), verbose=0,
              callbacks=[recorder])
    model.evaluate(x, y, batch_size=BATCH, verbose=0, callbacks=[recorder])
    return _summary(model, batch_logs=recorder.seen)


def fit_arguments(where):
    """`validation_split`, `initial_epoch`, `validation_steps`, `validation_batch_size`, numpy `sample_weight`
    in fit; `steps` in evaluate and predict (multiples of steps_per_execution: Keras runs whole executions where
    tf_nvlink runs the steps asked for)."""
    x, y = _data(50, seed=5)
    weights = np.random.default_rng(6).uniform(0.5, 2.0, len(x)).astype("float32")
    model = where.compile(_model(where, _INPUT, _dense(8, activation="relu"), _dense(1)), metrics=["mae"],
                          weighted_metrics=["mse"])
    history = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=3, initial_epoch=1, shuffle=False,
                        validation_split=0.3, validation_steps=4, validation_batch_size=3, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=BATCH, steps=4, verbose=0, return_dict=True)
    predicted = model.predict(x, batch_size=5, steps=4, verbose=0)
    result = _summary(model, history, evaluated, predict=np.asarray(predicted).tolist())
    result["exact"]["predict_shape"] = list(np.shape(predicted))
    return result


def optimizer_options(where):
    """AdamW with `global_clipnorm`, `gradient_accumulation_steps` and an exponential moving average of the
    weights (`use_ema`), a kernel regularizer (its loss counted once over the replicas)."""
    x, y = _data(40, seed=8)
    model = where.compile(
        _model(where, _INPUT, _dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(0.01)),
               _dense(1)),
        optimizer=lambda: keras.optimizers.AdamW(0.01, global_clipnorm=1.0, gradient_accumulation_steps=2,
                                                 use_ema=True, ema_momentum=0.9))
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return _summary(model, history, optimizer=[np.asarray(_copies(v)[0], "float64").ravel().tolist()
                                               for v in model.optimizer.variables])


class CustomStepModel(keras.Model):
    """A subclassed model with its own `train_step` (GradientTape, `optimizer.apply`, its own metrics)."""

    def __init__(self):
        super().__init__()
        self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae = keras.metrics.MeanAbsoluteError(name="mae")

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            predicted = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=predicted)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        self.loss_tracker.update_state(loss)
        self.mae.update_state(y, predicted)
        return {"loss": self.loss_tracker.result(), "mae": self.mae.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae]


def custom_train_step(where):
    """A subclassed model with its own `train_step` and metrics (`compute_loss`, `optimizer.apply`), as Keras'
    guide writes one: the weights and its metric as on one device."""
    x, y = _data(32, seed=9)
    with where.scope():
        keras.utils.set_random_seed(3)
        model = CustomStepModel()
    where.compile(model)
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    result = _summary(model, history)
    # The step's own tracker is given `compute_loss`'s value, which Keras scales for distribution (each replica's
    # share of the mean): it logs the share, under any MirroredStrategy (docs/architecture.md).
    del result["close"]["logs"]["loss"]
    return result


def run_eagerly(where):
    """`compile(run_eagerly=True)`: Keras' eager loop, under the strategy as on one device."""
    x, y = _data()
    model = _model(where, _INPUT, _dense(1))
    with where.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", run_eagerly=True, metrics=["mae"])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return _summary(model, history, model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True))


class _OneHotEmbedding(keras.layers.Embedding):
    """An Embedding that looks its rows up as a one-hot matmul: its table's gradient is dense, the rows of repeated
    ids summed, so the optimizer sees the gradient its definition names (as Keras' JAX backend gives Embedding)."""

    def call(self, inputs):
        return keras.ops.matmul(keras.ops.one_hot(inputs, self.input_dim, dtype=self.embeddings.dtype),
                                self.embeddings)


# Inside an XLA program tf_nvlink makes an Embedding's sparse gradient dense before the update
# (optimizer_rules.dense_gradients_in_xla): the GPU layouts' update runs there. Every other layout's update runs
# outside XLA (plain mode; split mode, whose update follows the program; the fused mode emulated without XLA) on
# the sparse gradient, as Keras' own on one device does.
_DENSE_EMBEDDING_UPDATE = LAYOUT.startswith("gpu")


def embedding_repeated_ids(where):
    """A next-token model (Embedding, Dense over the vocabulary) on sequences whose ids repeat in every batch, with
    Adam. Keras' TensorFlow backend squares each lookup's gradient row before it sums the rows of an id, so Adam's
    second moment differs from its definition's (docs/architecture.md). The one-device run trains the update the
    layout's paths compute: plain Adam (a one-hot lookup) where the update runs inside XLA, Keras' Embedding
    elsewhere."""
    tokens = np.random.default_rng(12).integers(0, 12, (33, 7)).astype("int32")
    embedding = _OneHotEmbedding if where.one_device and _DENSE_EMBEDDING_UPDATE else keras.layers.Embedding
    model = where.compile(_model(where, partial(keras.Input, (6,), dtype="int32"), partial(embedding, 12, 4),
                                 _dense(12)),
                          optimizer=lambda: keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    history = model.fit(tokens[:, :-1], tokens[:, 1:], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return _summary(model, history)


def attention_masks(where):
    """Self-attention over padded sequences (Embedding(mask_zero=True): right padding, a hole, a sequence with no
    token), causal MultiHeadAttention and GroupQueryAttention, with Adam: the masks the layers make from their
    inputs' Keras masks pass through tf_nvlink's attention seams (fused only for bfloat16 or float16 on GPUs). No
    projection biases: the key's is zero in exact arithmetic, and Adam would turn its rounding noise into steps."""
    tokens = np.random.default_rng(13).integers(1, 12, (33, 7)).astype("int32")
    for row, length in enumerate(np.random.default_rng(14).integers(0, 8, 33)):
        tokens[row, length:] = 0
    tokens[2, 1] = 0
    with where.scope():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((6,), dtype="int32")
        hidden = keras.layers.Embedding(12, 8, mask_zero=True)(inputs)
        hidden = keras.layers.Add()([hidden, keras.layers.MultiHeadAttention(2, 4, use_bias=False)(
            hidden, hidden, use_causal_mask=True)])
        hidden = keras.layers.Add()([hidden, keras.layers.GroupQueryAttention(4, 2, 1, use_bias=False)(hidden, hidden)])
        model = keras.Model(inputs, keras.layers.Dense(12)(hidden))
    model = where.compile(model, optimizer=lambda: keras.optimizers.Adam(0.01),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(tokens[:, :-1], tokens[:, 1:], batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return _summary(model, history)


ROWS = {row.__name__: row for row in (
    bn_unknown_length, class_weight_numpy, class_weight_dataset, sample_weight_dataset, validation_callbacks,
    validation_freq, multi_output_dict, unbuilt_reshuffle, generator_passes, python_generator, pydataset_shuffle,
    numpy_shuffle, on_batch_calls, input_error, batchnorm_synchronized, mixed_precision, batch_logs, fit_arguments,
    optimizer_options, custom_train_step, run_eagerly, embedding_repeated_ids, attention_masks)}


def run(selected):
    import time
    import traceback

    results = {}
    for name in selected:
        results[name] = {}
        for path in ("one_device",) + PATHS:
            started = time.perf_counter()
            try:
                results[name][path] = ROWS[name](Where(path))
            except Exception:  # noqa: BLE001 - the test shows the traceback of the row that failed
                results[name][path] = {"error": traceback.format_exc()[-3000:]}
            print(f"feature matrix {LAYOUT}: {name} {path} {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return results


if __name__ == "__main__":
    results = run(sys.argv[2].split(",") if len(sys.argv) > 2 and sys.argv[2] else list(ROWS))
    print(json.dumps(results))
