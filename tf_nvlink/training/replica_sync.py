"""Replicas that agree: BatchNorm moving statistics and other non-trainable state identical on every replica.

Why this exists: Keras 3 creates BatchNormalization's `moving_mean`/`moving_variance` (and any layer state added
with `add_weight(trainable=False)`) with aggregation "none". Under a MirroredStrategy each replica then updates
only its own copy, from its own shard of the batch, so the copies drift apart: `model.evaluate` under the
strategy depends on which replica saw which data, and a saved model holds replica 0's statistics only
(tensorflow/tensorflow#46488). Keras 2 made these variables ON_READ/MEAN; PyTorch DDP broadcasts buffers.

What tf_nvlink does (on every multi-replica tf_nvlink strategy, in `model.fit`, every mode):
- while a replica's train step runs (or is traced), it records which Keras variables the step writes;
- after the step, the written ones that are the model's non-trainable floating-point variables with
  aggregation "none" are packed into one flat buffer per dtype, averaged across the replicas weighted by each
  replica's examples in the step (one small SUM all-reduce of the weighted values and the weight: ResNet-50's
  53k BatchNorm statistics are 212 KB), and written back to every replica's own copy. A replica without examples
  adds nothing (its BatchNorm moments are 0, not 0 / 0: `exact_batches.batch_norm_moments`), and an uneven
  split counts as its examples do. Variables nobody writes (a frozen backbone's weights) cost nothing.

Where the all-reduce runs, by mode (see tf_nvlink.training.install for the modes):
- plain (jit_compile=False) and split XLA: after the step, outside XLA, through the plan's cross-device ops;
- fused XLA (GPUs): inside each replica's XLA program, next to the gradient all-reduce (no merge_call);
- multi-worker: the same, through MultiWorkerMirroredStrategy's collectives, so every worker agrees too;
- custom training loops: `tf_nvlink.sync_non_trainable(model)` at the end of the replica function, or
  `strategy.run(tf_nvlink.synced_step(model, step_fn), ...)`.

Meaning of the result: each replica's moving statistic after a step is m * old + (1 - m) * s_r, where s_r is
its shard's batch statistic; the mean over replicas weighted by their examples n_r is
m * old + (1 - m) * sum_r(n_r s_r) / sum_r(n_r). For `moving_mean` that is exactly the update with the whole
global batch's mean, whatever the split. For `moving_variance` it is the mean of
the shards' variances, which leaves out the spread between shard means: the variance each replica actually
normalised with during training (Keras 2's ON_READ/MEAN gave the same). `BatchNormalization(synchronized=True)`
normalises with the global batch's statistics instead, and then the moving variance is the global batch's.

Switch it off with the environment variable TF_NVLINK_SYNC_NON_TRAINABLE=0 (read when Keras builds its train
function) to measure its cost; the replicas then drift as under stock MirroredStrategy.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterable, Optional

from tf_nvlink.internals import layers as layer_seams
from tf_nvlink.plan.execution import synchronized_batch_norm_possible
from tf_nvlink.training import thread_state
from tf_nvlink.training.exact_batches import examples_in
from tf_nvlink.training.execution_mode import step_facts

ENV_SWITCH = "TF_NVLINK_SYNC_NON_TRAINABLE"


class SynchronizedBatchNormError(ValueError):
    """`BatchNormalization(synchronized=True)` in a mode where its cross-replica all-reduce cannot run."""


def enabled() -> bool:
    """False when TF_NVLINK_SYNC_NON_TRAINABLE is "0"/"false"/"off"/"no" (default: on)."""
    value = os.environ.get(ENV_SWITCH, "1").strip().lower()
    if value in ("1", "true", "on", "yes", ""):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{ENV_SWITCH} should be 1 (keep replicas' non-trainable state identical, the default) or 0 "
                     f"(let each replica keep its own). Received: {ENV_SWITCH}={value!r}")


def _note_write(variable) -> None:
    written = thread_state.current().written
    if written is not None:
        written[id(variable)] = variable


@contextlib.contextmanager
def _recording():
    """Record, in this (the replica's) thread, which Keras variables are written while the block runs."""
    layer_seams.report_variable_writes(_note_write)
    outer = thread_state.current().written
    written: dict[int, Any] = {}
    try:
        with thread_state.setting(written=written):
            yield written
    finally:
        if outer is not None:
            outer.update(written)


def _is_float(variable) -> bool:
    import keras  # noqa: PLC0415

    return keras.backend.is_float_dtype(variable.dtype)


def state_variables(model) -> list:
    """The model's variables that `sync_non_trainable` averages: non-trainable, floating point, aggregation
    "none" (BatchNorm moving statistics and similar layer state), in the model's order."""
    return [v for v in model.non_trainable_variables
            if _is_float(v) and str(getattr(v, "aggregation", "none") or "none").lower() == "none"]


def sync_non_trainable(model_or_variables, variables: Optional[Iterable] = None, examples=None) -> None:
    """All-reduce MEAN non-trainable state across replicas and write it back to every replica's copy.

    `examples` (this replica's example count in the step, a scalar): the mean weights each replica by its
    examples, so a replica without examples adds nothing and an uneven split counts as its examples do (what
    `model.fit` under a tf_nvlink strategy passes). None: every replica counts the same.

    Call it in replica context (inside the function given to `strategy.run`), after the step that updated the
    state; every replica must call it with the same variables. With a model, it averages `state_variables(model)`
    (or the given subset `variables`: a frozen backbone's statistics, which nobody writes, need no all-reduce).
    Outside a multi-replica context it does nothing.

    Example (custom training loop):
        >>> def step_fn(x, y):
        ...     with tf.GradientTape() as tape:
        ...         loss = loss_fn(y, model(x, training=True))
        ...     optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        ...     tf_nvlink.sync_non_trainable(model)
        >>> strategy.run(step_fn, args=(x, y))
    """
    import tensorflow as tf  # noqa: PLC0415

    if variables is None:
        variables = (state_variables(model_or_variables) if hasattr(model_or_variables, "non_trainable_variables")
                     else list(model_or_variables))
    variables = list(variables)
    context = tf.distribute.get_replica_context()
    if not variables or context is None or context.num_replicas_in_sync < 2:
        return
    by_dtype: dict[str, list] = {}
    for variable in variables:
        by_dtype.setdefault(str(variable.dtype), []).append(variable)
    for group in by_dtype.values():  # one all-reduce per dtype (one in practice: BatchNorm keeps float32)
        values = [tf.reshape(tf.convert_to_tensor(v.value), [-1]) for v in group]
        packed = values[0] if len(values) == 1 else tf.concat(values, axis=0)
        if examples is None:
            mean = context.all_reduce(tf.distribute.ReduceOp.MEAN, packed)
        else:  # one all-reduce of the weighted values with the weight at the end
            weight = tf.cast(tf.reshape(examples, [1]), packed.dtype)
            total = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([packed * weight, weight], axis=0))
            mean = tf.math.divide_no_nan(total[:-1], total[-1])
        pieces = tf.split(mean, [_size(v) for v in group])
        for variable, piece in zip(group, pieces):
            variable.assign(tf.reshape(piece, variable.shape))


def _size(variable) -> int:
    size = 1
    for dim in variable.shape:
        size *= int(dim)
    return size


def check_synchronized_batch_norm(model, jit: bool) -> None:
    """Refuse `BatchNormalization(synchronized=True)` where its all-reduce cannot run: inside XLA on replicas
    that are not all GPUs (TensorFlow needs a merge_call there, which XLA cannot hold), or across workers (an
    all-reduce compiled into XLA cannot span processes)."""
    strategy = model.distribute_strategy
    facts = step_facts(strategy, model)
    if not jit or synchronized_batch_norm_possible(facts):
        return
    several_workers = facts.workers > 1  # XLA's NCCL cannot span processes
    synced = [layer.name for layer in layer_seams.nested_layers(model) if getattr(layer, "synchronized", False)]
    if synced:
        raise SynchronizedBatchNormError(
            f"BatchNormalization(synchronized=True) ({', '.join(synced)}) cannot all-reduce its batch statistics "
            f"inside XLA on replicas that are not all GPUs of one process (devices: "
            f"{list(strategy.extended.worker_devices)}{', several workers' if several_workers else ''}). "
            f"Compile with jit_compile=False, or use synchronized=False: tf_nvlink averages the moving "
            f"statistics across replicas after every step.")


class SyncedStep:
    """Runs a replica's step, then averages the non-trainable state it wrote (`sync_non_trainable`).

    Example (custom loop; what `model.fit` does for you under a tf_nvlink strategy):
        >>> strategy.run(tf_nvlink.synced_step(model, step_fn), args=(batch,))
    """

    def __init__(self, model, step: Callable):
        self.model = model
        self.step = step

    def __call__(self, *args, **kwargs):
        with _recording() as written:
            result = self.step(*args, **kwargs)
        sync_non_trainable(self.model, [v for v in state_variables(self.model) if id(v) in written],
                           examples=_examples_or_none(args))  # weighted: an empty replica adds nothing
        return result

    def __getattr__(self, name):  # kind, fused, ... of a wrapped PerReplicaXlaStep
        return getattr(self.step, name)


def _examples_or_none(args):
    try:
        return examples_in(args)
    except ValueError:  # a step called without tensors: every replica counts the same
        return None


def synced_step(model, step: Callable) -> Callable:
    """`step` for `strategy.run` that leaves the model's written non-trainable state identical on every replica.

    Example:
        >>> strategy.run(tf_nvlink.synced_step(model, step_fn), args=(batch,))
    """
    return SyncedStep(model, step)


def keep_replicas_in_sync(model, step: Callable) -> Callable:
    """The train step Keras' `_make_function` runs under a tf_nvlink strategy (the hook in tf_nvlink.training.install).

    `step` is `model.train_step` (plain mode) or a `PerReplicaXlaStep`. Test steps and single-replica
    strategies are returned unchanged. In fused XLA mode the averaging goes inside each replica's XLA program
    (wrapping the step the program compiles); elsewhere it runs after the step, outside XLA.
    """
    kind = getattr(step, "kind", "train" if step == model.train_step else "test")
    strategy = model.distribute_strategy
    if kind != "train" or strategy.num_replicas_in_sync < 2:
        return step
    check_synchronized_batch_norm(model, jit=hasattr(step, "kind"))
    if not enabled():
        return step
    if getattr(step, "fused", False) and hasattr(step, "step_function"):
        step.step_function = SyncedStep(model, step.step_function)  # traced inside the replica's XLA program
        return step
    return SyncedStep(model, step)


def replicas_max_difference(model) -> dict[str, float]:
    """For each non-trainable variable, the largest absolute difference between any replica's copy and the
    first one (0.0 everywhere when the replicas agree). Eager; for tests and checks after `fit`.

    Example:
        >>> max(tf_nvlink.training.replica_sync.replicas_max_difference(model).values())
        0.0
    """
    import numpy as np  # noqa: PLC0415

    out = {}
    for variable in model.non_trainable_variables:
        value = variable.value
        copies = [np.asarray(c.numpy(), dtype=np.float64) for c in getattr(value, "values", [value])]
        out[variable.path] = max(float(np.max(np.abs(c - copies[0]))) if c.size else 0.0 for c in copies)
    return out
