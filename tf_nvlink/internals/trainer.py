"""Seams in Keras' TensorFlow trainer: `fit`'s functions, its model build, its epochs and the `*_on_batch` calls.

Checked against Keras 3.12 to 3.15.1 (`TESTED_KERAS`, setup.cfg's range) and keras-nightly 3.16.0.dev2026102704
(the trainer class is renamed `Trainer` there; `keras_trainer_class` finds either), TensorFlow 2.21. The pins
are in tests/internals/test_trainer_seams.py. Each patch calls a rule of `tf_nvlink.training` (the `rules` given
to `install_trainer_seams`); models under another strategy run Keras' own code.

Example:
    >>> from tf_nvlink.internals import trainer
    >>> trainer.check_keras_support() is None      # this Keras has the trainer internals tf_nvlink hooks
    True
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tf_nvlink.internals.registry import REGISTRY

# Keras versions whose trainer internals the pins check (first, last tested minor version).
TESTED_KERAS = ((3, 12), (3, 15))


def keras_trainer_class():
    """Keras' TensorFlow trainer, the class `keras.Model` inherits fit's machinery from: `TensorFlowTrainer` in
    `keras.src.backend.tensorflow.trainer` (Keras 3.12 to 3.15.1), renamed `Trainer` in the same module by Keras
    3.16 (keras-nightly 3.16.0.dev2026102704 checked; no alias; its base became `BaseTrainer`)."""
    from keras.src.backend.tensorflow import trainer as module  # noqa: PLC0415

    for name in ("TensorFlowTrainer", "Trainer"):
        trainer = getattr(module, name, None)
        if isinstance(trainer, type):
            return trainer
    raise ImportError(f"no TensorFlowTrainer (or Trainer) in {module.__name__}")


def _keras_epoch_iterator_class():
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    return EpochIterator


def check_keras_support() -> str | None:
    """None when this Keras has the trainer internals the seams patch, else the reason it has not."""
    try:
        import keras  # noqa: PLC0415

        trainer = keras_trainer_class()
    except Exception as exc:  # noqa: BLE001 - any import problem means "not supported"
        return f"cannot import Keras' TensorFlow trainer ({exc})"
    version = tuple(int(p) for p in keras.__version__.split(".")[:2] if p.isdigit())
    present = {"_make_function": hasattr(trainer, "_make_function"), "train_step": hasattr(trainer, "train_step"),
               "_resolve_auto_jit_compile": hasattr(trainer, "_resolve_auto_jit_compile"),
               "test_step": hasattr(trainer, "test_step")}
    missing = [name for name, there in present.items() if not there]
    if missing:
        return f"Keras {keras.__version__} has no {trainer.__name__}.{', '.join(missing)}"
    if version[:1] != (3,):
        return f"Keras {keras.__version__} is not Keras 3"
    return None


def install_trainer_seams(rules) -> str | None:
    """Patch Keras' trainer once; returns None when patched (or already), else why not (nothing is changed then).

    `rules` (tf_nvlink.training.keras_rules) answers, for a model under a tf_nvlink strategy (`is_ours(strategy)`):
    - `_make_function` -> `make_function(model, step_function, keras_make_function)`, where
      `keras_make_function(step, outer_jit=True)` is Keras' own, with the model's `_jit_compile` off around it when
      `outer_jit` is False (the function spanning the replicas must not be one XLA cluster);
    - `_resolve_auto_jit_compile` -> `auto_jit_compile(model)` (Keras turns "auto" off under any strategy);
    - `_maybe_symbolic_build` (where it exists) -> `symbolic_build(model, epoch_iterator, data_batch)`;
    - `train_on_batch`, `test_on_batch`, `predict_on_batch` -> `split_batch(strategy, batch)` where
      `splits_batches(strategy)`: the batch (x, y, sample_weight; `class_weight` made sample weights first, as
      Keras does) is split over the replicas (None from the rule: Keras' call runs as it is);
    - `EpochIterator._enumerate_iterator` -> `epoch_executions(epoch_iterator, keras_executions)`;
    - `TFEpochIterator.catch_stop_iteration` -> `input_end_or_raise(error)` for each OutOfRangeError, which Keras
      takes for the end of the input: the rule returns when it is, and raises its own error otherwise.
    """
    with REGISTRY.lock:
        problem = check_keras_support()
        if problem:
            return problem
        trainer = keras_trainer_class()
        if REGISTRY.patched(trainer, "_make_function"):
            return None
        is_ours = rules.is_ours

        def make_function(keras_make):
            def _make_function(self, step_function):
                if not is_ours(self.distribute_strategy):
                    return keras_make(self, step_function)

                def keras_make_function(step, outer_jit=True):
                    if outer_jit:
                        return keras_make(self, step)
                    saved = self._jit_compile
                    self._jit_compile = False
                    try:
                        return keras_make(self, step)
                    finally:
                        self._jit_compile = saved

                return rules.make_function(self, step_function, keras_make_function)

            return _make_function

        def resolve_auto_jit(keras_resolve):
            def _resolve_auto_jit_compile(self):
                if not is_ours(self._distribute_strategy):
                    return keras_resolve(self)
                return rules.auto_jit_compile(self)

            return _resolve_auto_jit_compile

        def symbolic_build(keras_build):
            def _maybe_symbolic_build(self, iterator=None, data_batch=None):
                if not is_ours(self.distribute_strategy):
                    return keras_build(self, iterator=iterator, data_batch=data_batch)
                return rules.symbolic_build(self, iterator, data_batch)

            return _maybe_symbolic_build

        REGISTRY.patch(trainer, "_make_function", make_function)
        REGISTRY.patch(trainer, "_resolve_auto_jit_compile", resolve_auto_jit)
        if hasattr(trainer, "_maybe_symbolic_build"):
            REGISTRY.patch(trainer, "_maybe_symbolic_build", symbolic_build)
        _patch_on_batch_calls(trainer, rules)
        _patch_epoch_executions(rules)
        _patch_input_end(rules)
        return None


_ON_BATCH_ARGUMENTS = {"train_on_batch": ("x", "y", "sample_weight", "class_weight"),
                       "test_on_batch": ("x", "y", "sample_weight"), "predict_on_batch": ("x",)}


def _patch_on_batch_calls(trainer, rules) -> None:
    """`TensorFlowTrainer.train_on_batch`, `test_on_batch`, `predict_on_batch` (Keras 3.12 to 3.16.dev): Keras hands
    their batch to `strategy.run` as it is, so every replica gets the whole batch (`predict_on_batch` on 5 rows
    returns 10 rows on 2 replicas; stock MirroredStrategy too). Private Keras touched besides the methods:
    `data_adapter_utils.class_weight_to_sample_weights`."""
    from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: PLC0415

    for name, arguments in _ON_BATCH_ARGUMENTS.items():
        def split_calls(original, _arguments=arguments):
            def on_batch(self, *args, **kwargs):
                strategy = self.distribute_strategy
                if not rules.splits_batches(strategy):
                    return original(self, *args, **kwargs)
                given = dict(zip(_arguments, args), **kwargs)
                if given.get("class_weight") is not None and given.get("sample_weight") is None:
                    given["sample_weight"] = data_adapter_utils.class_weight_to_sample_weights(
                        given["y"], given.pop("class_weight"))
                names = [key for key in ("x", "y", "sample_weight") if given.get(key) is not None]
                split = rules.split_batch(strategy, tuple(given[key] for key in names))
                if split is not None:
                    given.update(zip(names, split))
                return original(self, **given)

            return on_batch

        REGISTRY.patch(trainer, name, split_calls)


def _patch_epoch_executions(rules) -> None:
    """`EpochIterator._enumerate_iterator` (Keras 3.12 to 3.16.dev), which hands out (first step, last step,
    iterator) per execution: `rules.epoch_executions(epoch_iterator, keras_executions)` yields them instead."""
    def executions(keras_enumerate):
        def _enumerate_iterator(self):
            yield from rules.epoch_executions(self, lambda: keras_enumerate(self))

        return _enumerate_iterator

    REGISTRY.patch(_keras_epoch_iterator_class(), "_enumerate_iterator", executions)


def _patch_input_end(rules) -> None:
    """`TFEpochIterator.catch_stop_iteration` (Keras 3.12 to 3.16.dev) turns every `tf.errors.OutOfRangeError` of a
    step, or of the wait for the steps after it (`tf_sync`), into the end of the epoch's input; but TensorFlow also
    returns OutOfRangeError for a compile-cache entry it cannot read ("Read less bytes than requested"), and every
    epoch then stopped at its first step without a word. Under a tf_nvlink strategy each one goes to
    `rules.input_end_or_raise(error)` first."""
    from keras.src.backend.tensorflow.trainer import TFEpochIterator  # noqa: PLC0415

    def checked(keras_catch):
        @contextlib.contextmanager
        def catch_stop_iteration(self):
            if not rules.is_ours(epoch_strategy(self)):
                with keras_catch(self):
                    yield
                return
            with keras_catch(self):
                try:
                    yield
                    self.tf_sync()  # Keras waits here too, inside its own handler: an error of the wait comes here
                except tf.errors.OutOfRangeError as error:
                    rules.input_end_or_raise(error)
                    raise

        return catch_stop_iteration

    REGISTRY.patch(TFEpochIterator, "catch_stop_iteration", checked)


def epoch_strategy(epoch_iterator):
    """The strategy an `EpochIterator` distributes for (its private `_distribute_strategy`; None without one)."""
    return getattr(epoch_iterator, "_distribute_strategy", None)


def epoch_step_limit(epoch_iterator) -> int:
    """The steps the epoch asks for, as Keras reads it when the epoch starts (`steps_per_epoch or _num_batches`,
    -1: until the input ends)."""
    return epoch_iterator.steps_per_epoch or epoch_iterator._num_batches or -1  # noqa: SLF001


def uncount_epoch_steps(epoch_iterator, steps: int) -> None:
    """Take `steps` off Keras' count of the steps the epoch took (`EpochIterator._steps_seen`): an execution cut
    short ran fewer than `steps_per_execution`."""
    epoch_iterator._steps_seen -= steps  # noqa: SLF001


def model_supports_jit(model) -> bool:
    """Keras' rule for `jit_compile="auto"` without a strategy (`keras.src.trainers.trainer.model_supports_jit`)."""
    from keras.src.trainers.trainer import model_supports_jit as supports  # noqa: PLC0415

    return supports(model)


def has_own_strategy(model) -> bool:
    """Whether `model` was made under a strategy (`model._distribute_strategy`; without one Keras builds the model
    when its step is traced)."""
    return model._distribute_strategy is not None  # noqa: SLF001


def symbolic_build(model, data_batch) -> None:
    """Keras' build of every part of `model` from one batch's structure (`model._symbolic_build`), in the model's
    strategy scope."""
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


def fully_built(model) -> bool:
    """True when `model`'s layers, compiled loss and metrics and optimizer are all built: then Keras'
    `_symbolic_build` would build nothing (the attributes it checks, read the same way)."""
    compiled = [getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None),
                getattr(model, "optimizer", None)]
    return all(layer.built for layer in model._flatten_layers()) and all(  # noqa: SLF001
        part is None or part.built for part in compiled)


def has_distributed_input(epoch_iterator) -> bool:
    """Whether `epoch_iterator` is Keras' `TFEpochIterator`, which holds its distributed dataset in the private
    `_distributed_dataset` (set in its `__init__` from the strategy's `experimental_distribute_dataset`)."""
    return hasattr(epoch_iterator, "_distributed_dataset")


def set_distributed_input(epoch_iterator, distributed) -> None:
    """Make the epoch iterate `distributed` (a distributed dataset) before any of its iterators exists."""
    epoch_iterator._distributed_dataset = distributed  # noqa: SLF001


def is_user_tf_dataset(epoch_iterator) -> bool:
    """Whether the epoch's input is a tf.data dataset the user passed (Keras' `TFDatasetAdapter`): the same object
    again in a later call means the same input."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter  # noqa: PLC0415

    return isinstance(getattr(epoch_iterator, "data_adapter", None), TFDatasetAdapter)


def reduce_step_outputs(outputs, strategy):
    """A step's per-replica outputs (logs) reduced as Keras' train function reduces them
    (`keras.src.backend.tensorflow.trainer.reduce_per_replica`, reduction "auto"): Keras has no public name for it."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica  # noqa: PLC0415

    return reduce_per_replica(outputs, strategy, reduction="auto")


def with_optionals_converted(model, function):
    """`function` taking a batch whose optional values Keras converts as in its own step functions
    (`TensorFlowTrainer._autoconvert_optionals`)."""
    return model._autoconvert_optionals(function)  # noqa: SLF001


def set_initial_epoch(model, epoch: int) -> None:
    """Make the next `model.fit()` start at `epoch` (the private `model._initial_epoch`, which Keras' own
    `BackupAndRestore` sets; tf_nvlink's backup callback restores the same way)."""
    model._initial_epoch = epoch  # noqa: SLF001
