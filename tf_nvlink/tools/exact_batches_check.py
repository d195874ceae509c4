"""Does a strategy train every batch as one device does? Runs `model.fit` scenarios under a strategy and the
same training on one device in the same process, and reports how far apart the weights and logs end.

Each scenario is a small model (8 inputs, Dense 4 relu, a BatchNormalization for `batchnorm_1_plus_0`, then
Dense 1 with mean squared error, or a 3-class softmax for `class_weight`; SGD 0.1, clipping where named, float32) trained for one epoch (two with validation or a learning-rate
callback) without shuffling from the same initial weights; the numbers are the largest absolute differences
from the single-device run: `weights` (every weight), `loss` (the logged loss of every epoch), `metrics` (every
other logged value: the compiled metric, and `val_loss`/`val_*` with validation).

Example:
    >>> strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
    >>> run_scenarios(strategy, jit_compile=False)["last_batch_1"]["weights"] < 1e-5
    True
"""

from __future__ import annotations

import contextlib

import numpy as np

from tf_nvlink.util import atomic_files

# name -> fit settings. On 2 replicas the last batches split 1 + 0, 2 + 1, 17 + 16; 5 and 7 are global batches
# that are not a multiple of 2 (or 4) replicas.
SCENARIOS: dict[str, dict] = {
    "even_66": {"examples": 66, "batch_size": 32},
    "last_batch_1": {"examples": 65, "batch_size": 32},
    "last_batch_3": {"examples": 67, "batch_size": 32},
    "last_batch_33": {"examples": 100, "batch_size": 67},
    "batch_size_5": {"examples": 23, "batch_size": 5},
    "batch_size_7": {"examples": 30, "batch_size": 7},
    "accumulate_2": {"examples": 37, "batch_size": 8, "accumulation": 2},
    "accumulate_4": {"examples": 70, "batch_size": 8, "accumulation": 4},
    "sample_weight": {"examples": 67, "batch_size": 32, "sample_weight": True},
    "validation_split": {"examples": 80, "batch_size": 16, "validation_split": 0.2, "epochs": 2},
    "steps_per_execution_3": {"examples": 67, "batch_size": 8, "steps_per_execution": 3},
    "lr_schedule": {"examples": 67, "batch_size": 16, "schedule": True},
    "lr_callback": {"examples": 67, "batch_size": 16, "lr_callback": True, "epochs": 2},
    "class_weight": {"examples": 67, "batch_size": 16, "classes": 3, "class_weight": {0: 1.0, 1: 2.0, 2: 0.5}},
    "save_and_load": {"examples": 67, "batch_size": 32, "save_and_load": True},
    # Every step splits 1 + 0: BatchNormalization on a replica without examples (its moments 0, not 0 / 0).
    "batchnorm_1_plus_0": {"examples": 1, "batch_size": 32, "batchnorm": True, "epochs": 2},
    # Clipping acts on the all-reduced gradients, as on one device (the thresholds clip every step).
    "clipnorm": {"examples": 67, "batch_size": 32, "optimizer": {"clipnorm": 0.05}},
    "global_clipnorm": {"examples": 67, "batch_size": 32, "optimizer": {"global_clipnorm": 0.05}},
    "global_clipnorm_accumulate_2": {"examples": 37, "batch_size": 8, "accumulation": 2,
                                     "optimizer": {"global_clipnorm": 0.05}},
    "clipvalue": {"examples": 67, "batch_size": 32, "optimizer": {"clipvalue": 0.01}},
    "mean_with_sample_weight": {"examples": 67, "batch_size": 32, "sample_weight": True,
                                "reduction": "mean_with_sample_weight"},
}


def _data(examples: int, seed: int = 0, classes: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(examples, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 1)) + 0.1 * rng.normal(size=(examples, 1))).astype("float32")
    weights = rng.uniform(0.2, 2.0, size=(examples,)).astype("float32")
    if classes:  # labels 0..classes-1 from the regression target's quantiles
        y = np.digitize(y[:, 0], np.quantile(y[:, 0], np.linspace(0, 1, classes + 1)[1:-1])).astype("int64")
    return x, y, weights


def _train(settings: dict, initial_weights, jit_compile, strategy=None):
    import tempfile  # noqa: PLC0415

    import keras  # noqa: PLC0415

    def scope():
        return strategy.scope() if strategy is not None else contextlib.nullcontext()

    classes = settings.get("classes", 0)
    with scope():
        model = _model(classes, batchnorm=settings.get("batchnorm", False))
        model.set_weights(initial_weights)
        learning_rate = 0.1
        if settings.get("schedule"):
            learning_rate = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=2, decay_rate=0.5)
        optimizer = keras.optimizers.SGD(learning_rate,
                                         gradient_accumulation_steps=settings.get("accumulation"),
                                         **settings.get("optimizer", {}))
        loss = "sparse_categorical_crossentropy" if classes else "mse"
        if settings.get("reduction"):
            loss = keras.losses.MeanSquaredError(reduction=settings["reduction"])
        model.compile(optimizer=optimizer, loss=loss,
                      metrics=["accuracy" if classes else "mae"], jit_compile=jit_compile,
                      steps_per_execution=settings.get("steps_per_execution", 1))
    x, y, sample_weight = _data(settings["examples"], classes=classes)
    callbacks = [keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)] \
        if settings.get("lr_callback") else []

    def fit():
        return model.fit(x, y, batch_size=settings["batch_size"], epochs=settings.get("epochs", 1), shuffle=False,
                         verbose=0, sample_weight=sample_weight if settings.get("sample_weight") else None,
                         validation_split=settings.get("validation_split", 0.0), callbacks=callbacks,
                         class_weight=settings.get("class_weight")).history

    history = fit()
    if settings.get("save_and_load"):  # save, load under the same strategy, train on
        with tempfile.TemporaryDirectory() as folder:
            path = f"{folder}/model.keras"
            with atomic_files.atomic_path(path, suffix=".keras") as partial:
                model.save(partial)
            with scope():
                model = keras.saving.load_model(path)
        history = fit()
    return model.get_weights(), history


def _model(classes: int = 0, batchnorm: bool = False):
    import keras  # noqa: PLC0415

    head = keras.layers.Dense(classes, activation="softmax") if classes else keras.layers.Dense(1)
    middle = [keras.layers.BatchNormalization()] if batchnorm else []
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, activation="relu"), *middle, head])


_SINGLE_DEVICE: dict[str, tuple] = {}  # scenario -> (initial weights, final weights, logs) on one device


def run_scenarios(strategy, jit_compile, names=None) -> dict[str, dict]:
    """For each scenario (all of SCENARIOS, or `names`): {"weights", "loss", "metrics"} differences from one
    device, or {"error": "Type: message"} when training under `strategy` failed."""
    import keras  # noqa: PLC0415

    unknown = sorted(set(names or ()) - set(SCENARIOS))
    if unknown:
        raise ValueError(f"Unknown scenario(s) {unknown}; the scenarios are {sorted(SCENARIOS)}")
    results = {}
    for name in names or SCENARIOS:
        settings = SCENARIOS[name]
        if name not in _SINGLE_DEVICE:  # the same for every strategy and mode in this process
            keras.utils.set_random_seed(1)
            initial = _model(settings.get("classes", 0), settings.get("batchnorm", False)).get_weights()
            _SINGLE_DEVICE[name] = (initial, *_train(settings, initial, jit_compile=False))
        initial, single_weights, single_logs = _SINGLE_DEVICE[name]
        try:
            weights, logs = _train(settings, initial, jit_compile, strategy)
        except Exception as error:  # noqa: BLE001 - reported per scenario
            results[name] = {"error": f"{type(error).__name__}: {str(error)[:400]}"}
            continue
        metric_keys = [k for k in single_logs if k != "loss"]
        if not all(np.all(np.isfinite(w)) for w in weights):
            results[name] = {"error": "NonFinite: a weight is NaN or Inf after training"}
            continue
        results[name] = {
            "weights": float(max(np.max(np.abs(a - b)) for a, b in zip(weights, single_weights))),
            "loss": float(np.max(np.abs(np.array(logs["loss"]) - single_logs["loss"]))),
            "metrics": float(max(np.max(np.abs(np.array(logs[k]) - single_logs[k])) for k in metric_keys)),
        }
    return results


def run_custom_loop(strategy, jit_compile, examples=67, batch_size=32, global_batch_size_known=False) -> dict:
    """A custom training loop in TensorFlow's guide shape (a replica step calling `optimizer.apply_gradients`,
    passed to `strategy.run` in a plain tf.function, over a distributed dataset), its loss from
    `tf_nvlink.average_loss`, against the same loop on one device: {"weights": max difference} or {"error"}.
    `global_batch_size_known`: pass each step's global batch size to `average_loss` (split-mode jit steps)."""
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from tf_nvlink.training.exact_batches import average_loss  # noqa: PLC0415

    keras.utils.set_random_seed(1)
    initial = _model().get_weights()
    x, y, _ = _data(examples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)

    def train(distribute):
        scope = distribute.scope() if distribute is not None else contextlib.nullcontext()
        with scope:
            model = _model()
            model.set_weights(initial)
            optimizer = keras.optimizers.SGD(0.1)

        def step(features, labels, size):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(labels, model(features, training=True))
                loss = average_loss(per_example, global_batch_size=size if global_batch_size_known else None)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss

        replica_step = tf.function(step, jit_compile=jit_compile) if jit_compile else step

        @tf.function
        def outer(features, labels, size):
            if distribute is None:
                return replica_step(features, labels, size)
            return distribute.run(replica_step, args=(features, labels, size))

        for _ in range(2):
            if distribute is None:
                for features, labels in dataset:
                    outer(features, labels, tf.shape(features)[0])
            else:
                for (features, labels), size in zip(distribute.experimental_distribute_dataset(dataset),
                                                    dataset.map(lambda f, _: tf.shape(f)[0])):
                    outer(features, labels, size)
        return model.get_weights()

    single = train(None)
    try:
        weights = train(strategy)
    except Exception as error:  # noqa: BLE001 - reported
        return {"error": f"{type(error).__name__}: {str(error)[-600:]}"}
    return {"weights": float(max(np.max(np.abs(a - b)) for a, b in zip(weights, single)))}
