"""Every batch trains as on one device: each replica's loss weighted by its share of the global batch.

Why this exists: Keras 3 scales each replica's mean loss by 1/num_replicas whatever the number of examples the
replica got, so a step whose global batch does not split evenly (the last batch of most data sets: 65 examples
at batch_size=32 leave a 1 + 0 split on 2 replicas) takes another step than one device would; with a 1 + 0
split the gradient is half the single-device one. Stock MirroredStrategy does the same.

The rule, in every mode of `model.fit` (plain, split and fused XLA, multi-worker): replica r with n_r of the
step's N examples scales its mean loss by n_r / N. The gradients summed over the replicas are then those of the
global batch's mean loss, exactly as on one device, whatever the split; a replica with no examples takes part
in the all-reduces (no hang) and adds zero. N is one all-reduced float32 scalar per train step, taken outside
XLA in split mode and inside each replica's program in fused mode. Regularisation losses (counted once over
the replicas), `gradient_accumulation_steps`, metrics and the logged loss then match one device too, and so
does gradient clipping, which acts on the all-reduced gradients (tf_nvlink.training.gradient_allreduce). A loss
with `reduction="mean_with_sample_weight"` divides by the sum of the sample weights, so its replica scale is the
replica's share of the step's weights instead (`replica_shares`).

Custom training loops: `average_loss(per_example_loss)` is the same rule for a user-written loss.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Callable, Optional

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import tf_runtime
from tf_nvlink.training import thread_state

__all__ = ["average_loss", "batch_opened", "examples_in", "loss_share_while_tracing", "open_batch_dimension",
           "replica_share", "replica_shares", "split_over_replicas", "static_batch_size", "weighted_by_examples",
           "with_metrics_across_replicas"]

log = logging.getLogger("tf_nvlink")


def examples_in(data) -> tf.Tensor:
    """The number of examples in one replica's batch `data` (x, (x, y) or (x, y, sample_weight)): the first
    dimension of its first tensor, as Keras counts them for the logged loss.

    Example:
        >>> examples_in((tf.zeros([3, 8]), tf.zeros([3, 1]))).numpy()
        3
    """
    for leaf in tf.nest.flatten(data):
        if isinstance(leaf, (tf.Tensor, tf.Variable)) or hasattr(leaf, "shape"):
            return tf.shape(leaf)[0]
    raise ValueError(f"Cannot count the examples of a batch without tensors: {data!r}")


def with_metrics_across_replicas(model, logs):
    """A train/test function's `logs` (its last step's, each value reduced over the replicas) with every value that
    is one of the model's metrics (the loss tracker, each output's loss, compiled metrics) read over all replicas:
    the metric's state summed over the replicas, its result computed once, as one device computes it. Other
    values and logs that are not a dict stay as they are. Call it eagerly, after the function: the reads run as a
    tf.function of their own (their all-reduces in the function that ran the step could wait on the step's).

    Why: Keras' function reduces each replica's result with a mean, so a step split 3 + 2 (or 1 + 0) logs the
    mean of the replicas' means, not the global one: what `train_on_batch`/`test_on_batch` return and what
    batch-end callbacks and the progress bar see (fit's epoch logs read the metrics across replicas already).

    Example:
        >>> logs = with_metrics_across_replicas(model, train_function(iterator))
    """
    if not isinstance(logs, dict) or model.distribute_strategy.num_replicas_in_sync < 2:
        return logs
    metrics = tuple(id(metric) for metric in model.metrics)  # compile() makes new ones
    if _METRIC_READS.get(model, (None,))[0] != metrics:
        _METRIC_READS[model] = (metrics, tf.function(lambda: _metric_results(model), autograph=False))
    results = _METRIC_READS[model][1]()
    return {key: results[key] if key in results else value for key, value in logs.items()}


_METRIC_READS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its metrics' ids, their reads)


def _metric_results(model) -> dict:
    results = {}
    for metric in model.metrics:
        result = metric.result()
        results.update(result if isinstance(result, dict) else {metric.name: result})
    return results


def split_over_replicas(strategy, batch):
    """`batch` (a nest of numpy arrays or tensors of one batch size) split along its first dimension over the
    strategy's replicas, in order, the first replicas one example more where it does not divide (as tf.data splits
    a global batch): a nest of per-replica values for `strategy.run`. None when the batch cannot be split (no
    arrays, a scalar, parts of different batch sizes): then it is not.

    Example:
        >>> split_over_replicas(strategy, (np.zeros((5, 4)), np.zeros((5, 1))))   # 3 + 2 rows on 2 replicas
    """
    leaves = tf.nest.flatten(batch)
    sizes = {int(leaf.shape[0]) if getattr(leaf, "shape", None) is not None and len(leaf.shape) else None
             for leaf in leaves}
    if not leaves or len(sizes) != 1 or None in sizes:
        return None
    (size,) = sizes
    replicas = strategy.num_replicas_in_sync
    base, extra = divmod(size, replicas)
    starts = [replica * base + min(replica, extra) for replica in range(replicas + 1)]

    def share(context):
        replica = context.replica_id_in_sync_group
        return tf.nest.map_structure(lambda leaf: leaf[starts[replica]:starts[replica + 1]], batch)

    return strategy.experimental_distribute_values_from_function(share)


def open_batch_dimension(data):
    """Inside a traced step: one replica's batch `data` with the leading dimension of each dense tensor unknown
    to the trace, as Keras' own train function sees a batch it takes from a dataset whose batches may differ in
    size. Inside XLA this is an identity (the program is compiled for the real shapes).

    Why: a replica's step traced with its exact batch shape makes Keras log other numbers than one device. A
    replica without examples has a fixed batch of 0: Keras' loss is then an empty array and its loss tracker
    records NaN (an open 0 gives a loss of 0 that counts for nothing). And Keras weights each output's loss
    metric (`<output>_loss`) by the batch size where the trace fixes it, by the step where it is open, so the
    epoch's per-output losses of a fixed-shape trace weight a short last batch differently from one device's.

    Example:
        >>> step = lambda data: model.train_step(open_batch_dimension(data))   # inside strategy.run
    """

    if tf.executing_eagerly():  # `run_eagerly`: nothing is traced
        return data

    def open_leaf(leaf):
        if isinstance(leaf, tf.Tensor) and leaf.shape.rank and leaf.shape[0] is not None:
            return tf.compat.v1.placeholder_with_default(leaf, tf.TensorShape([None]).concatenate(leaf.shape[1:]))
        return leaf

    return tf.nest.map_structure(open_leaf, data)


def static_batch_size(data) -> Optional[int]:
    """The batch size of a replica's batch `data` as its trace knows it before `open_batch_dimension`: the leading
    dimension its dense tensors share, or None (unknown, or not one size).

    Example:
        >>> static_batch_size((tf.zeros([8, 512]), tf.zeros([8, 512])))
        8
    """
    sizes = {leaf.shape[0] for leaf in tf.nest.flatten(data) if isinstance(leaf, tf.Tensor) and leaf.shape.rank}
    return next(iter(sizes)) if len(sizes) == 1 and None not in sizes else None


@contextlib.contextmanager
def batch_opened(data):
    """`open_batch_dimension(data)` for the step traced in the block, the batch size it hides kept in the thread
    state (`static_batch`) for the rules that need it (fused attention).

    Example:
        >>> with batch_opened(data) as opened:
        ...     logs = model.train_step(opened)
    """
    with thread_state.setting(static_batch=static_batch_size(data)):
        yield open_batch_dimension(data)


def replica_share(examples) -> tf.Tensor:
    """In a replica context: this replica's `examples` (a count, or a sum of sample weights) over all replicas'
    (float32; 0.0 when the step has none).

    Example:
        >>> share = strategy.run(lambda x: replica_share(tf.shape(x)[0]), args=(batch,))
    """
    local = tf.cast(examples, tf.float32)
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync < 2:
        return tf.ones_like(local)
    return tf.math.divide_no_nan(local, context.all_reduce(tf.distribute.ReduceOp.SUM, local))


def replica_shares(data) -> tuple:
    """In a replica context, for one replica's batch `data`: (its share of the step's examples, its share of the
    step's sample weights). Without sample weights (`data` is not (x, y, sample_weight)) both are the first.
    The weight share is the scale of a `reduction="mean_with_sample_weight"` loss, whose divisor is the sum of the
    weights, as the example share is of the other reductions'. With one weight tensor per output (a model with
    several outputs) no single share is right for every output: the weight share is None, and such a loss gets
    the example share and a warning (`loss_share_while_tracing`).

    Example:
        >>> shares = strategy.run(replica_shares, args=(batch,))
    """
    share = replica_share(examples_in(data))
    weights = data[2] if isinstance(data, (tuple, list)) and len(data) == 3 else None
    if weights is not None and len(tf.nest.flatten(weights)) > 1:
        return share, None  # per-output weights: see above
    if weights is None or not hasattr(weights, "dtype") or not weights.dtype.is_floating:
        return share, share
    return share, replica_share(tf.reduce_sum(tf.cast(weights, tf.float32)))


def weighted_by_examples(step_function: Callable) -> Callable:
    """`model.train_step` (or `test_step`) with each replica's loss scaled by its share of the global batch
    (plain mode: the share's all-reduce sits in the same graph as the step), its batch dimension open
    (`open_batch_dimension`). In a test step only the logged per-output losses change: each replica's counts by its
    share, so a step counts once, as on one device.

    Example:
        >>> strategy.run(weighted_by_examples(model.train_step), args=(batch,))
    """

    def step(data):
        with batch_opened(data) as data, loss_share_while_tracing(*replica_shares(data)):
            return step_function(data)

    return step


def average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """The loss of a custom training loop's replica step: the sum of its per-example losses over the GLOBAL
    batch's example count, so the gradients all-reduced with SUM are the global batch's mean-loss gradients
    whatever the split (uneven last batches, batch sizes not a multiple of the replica count).

    `global_batch_size=None` all-reduces this replica's example count (one float32 scalar), which a split-mode
    jit step (CPU replicas, or xla_allreduce="split") cannot hold inside XLA: there pass the number, e.g.
    `global_batch_size=tf.shape(x_global)[0]`, or compile the step with jit_compile=False.
    Outside a replica context it is the plain mean (sum over the local count).

    Example:
        >>> def step(x, y):
        ...     with tf.GradientTape() as tape:
        ...         per_example = keras.losses.mean_squared_error(y, model(x, training=True))
        ...         loss = tf_nvlink.average_loss(per_example)
        ...     optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
        ...                                   model.trainable_variables))
        >>> strategy.run(step, args=(x, y))
    """
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    if not per_example_loss.dtype.is_floating:
        raise ValueError(f"per_example_loss should be a floating-point tensor of one loss per example. Received "
                         f"dtype {per_example_loss.dtype.name}")
    if per_example_loss.shape.rank == 0:
        raise ValueError("per_example_loss should hold one loss per example (rank >= 1), not an already "
                         "averaged scalar. Received a scalar.")
    if sample_weight is not None:
        per_example_loss = per_example_loss * tf.cast(sample_weight, per_example_loss.dtype)
    if per_example_loss.shape.rank > 1:
        per_example_loss = tf.reduce_mean(per_example_loss, axis=list(range(1, per_example_loss.shape.rank)))
    total = tf.reduce_sum(per_example_loss)
    if global_batch_size is None:
        local = tf.cast(tf.shape(per_example_loss)[0], tf.float32)
        context = tf.distribute.get_replica_context()
        if context is not None and context.num_replicas_in_sync > 1:
            if tf_runtime.in_xla_context() and tf_runtime.uses_merge_call(tf.distribute.get_strategy()):
                raise ValueError(
                    "tf_nvlink.average_loss(per_example_loss) all-reduces the replicas' example counts, which a "
                    "jit_compile=True step in split mode (CPU replicas, or xla_allreduce='split') cannot do inside "
                    "XLA. Pass the global batch's size: average_loss(per_example_loss, global_batch_size=n), or "
                    "compile the step with jit_compile=False, or use fused mode (all-GPU replicas).")
            global_batch_size = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
        else:
            global_batch_size = local
    return tf.math.divide_no_nan(total, tf.cast(global_batch_size, per_example_loss.dtype))


# ---- the rules the loss and layer seams call (tf_nvlink.internals.losses, tf_nvlink.internals.layers) ----------


@contextlib.contextmanager
def loss_share_while_tracing(share, weight_share=None):
    """While one replica's train step is traced: Keras scales that replica's mean loss by `share` (a float32
    scalar tensor, the replica's examples over the global batch's) instead of 1/num_replicas, and a
    `reduction="mean_with_sample_weight"` loss (divided by the replica's sum of sample weights) by `weight_share`
    (the replica's sample weights over the step's; default `share`).

    Why: Keras 3 scales every replica's mean loss by 1/num_replicas in `scale_loss_for_distribution` (the compiled
    loss, the regularisation losses) and undoes it for the logged loss with `unscale_loss_for_distribution`; with
    a last batch split 1 + 0 the step's gradient is then half the single-device one. `weight_share=None` means the
    step's weights have no single share (one tensor per output): such a loss takes `share` and a warning is logged.

    Example:
        >>> with loss_share_while_tracing(*replica_shares(data)):
        ...     logs = model.train_step(data)
    """
    with thread_state.setting(loss_share=share, weight_share=share if weight_share is None else weight_share,
                              weight_share_unknown=weight_share is None):
        yield


def scale_loss(value, keras_scale: Callable):
    """Keras' per-replica loss scale: the replica's share while its step is traced, else Keras' 1/num_replicas."""
    share = thread_state.current().loss_share
    if share is None:
        return keras_scale(value)
    return value * tf.cast(share, value.dtype)


def unscale_loss(value, keras_unscale: Callable):
    """The logged loss unscaled by the same share (a replica with 0 examples logs 0)."""
    share = thread_state.current().loss_share
    if share is None:
        return keras_unscale(value)
    return tf.math.divide_no_nan(value, tf.cast(share, value.dtype))


_WARNED_PER_OUTPUT_WEIGHTS: list = []  # one warning per process


def reduce_values(values, sample_weight, reduction, keras_reduce: Callable):
    """Keras' weighted reduction of a loss: an empty replica's loss reduces to 0 (with a gradient of zeros; Keras
    returns the empty array itself), and "mean_with_sample_weight" with weights is scaled by the replica's share of
    the weights (its divisor is the replica's weights)."""
    state = thread_state.current()
    if state.loss_share is not None and reduction not in (None, "none") and tuple(values.shape) == (0,):
        return tf.reduce_sum(values)
    if state.weight_share is None or reduction != "mean_with_sample_weight" or sample_weight is None:
        return keras_reduce(values, sample_weight, reduction)
    if state.weight_share_unknown and not _WARNED_PER_OUTPUT_WEIGHTS:
        _WARNED_PER_OUTPUT_WEIGHTS.append(True)
        log.warning("tf_nvlink: a reduction='mean_with_sample_weight' loss of a model with several outputs, "
                    "given sample weights: each replica's loss is scaled by its share of the examples, not "
                    "of the weights, so steps whose weights are uneven across the replicas differ from one "
                    "device. Use the default reduction (sum_over_batch_size) to train exactly as on one "
                    "device.")
    with thread_state.setting(loss_share=state.weight_share):  # its divisor is the replica's weights
        return keras_reduce(values, sample_weight, reduction)


def compile_loss_call(compile_loss, keras_call: Callable):
    """A compiled loss's call while a replica's step is traced: its per-output loss metrics count by the share
    (`mean_update_state`)."""
    if thread_state.current().loss_share is None:
        return keras_call()
    with thread_state.setting(compile_loss=compile_loss):  # its metrics exist once it is built
        return keras_call()


def mean_update_state(metric, values, sample_weight, keras_update: Callable):
    """A `Mean` metric's update. For a model with several outputs Keras keeps one `Mean` per output loss and updates
    it in `CompileLoss.call` with the STATIC batch size, None when batches vary in size: every replica then counts
    the step once, the replica without examples too, so a 1 + 0 step enters `<output>_loss` at half its value.
    While a replica's step is traced, such an update is weighted by the replica's share of the step's examples
    instead: the replicas add up to one count per step, and a replica without examples adds nothing."""
    state = thread_state.current()
    if sample_weight is None and state.loss_share is not None and state.compile_loss is not None \
            and any(owned is metric for owned in state.compile_loss.metrics):
        sample_weight = tf.cast(state.loss_share, metric.dtype)  # replicas' shares add up to 1: the step counts once
    return keras_update(sample_weight)


def batch_norm_moments(layer, inputs, mask, keras_moments: Callable):
    """BatchNormalization's batch moments. A step whose global batch leaves a replica without examples (65
    examples at batch_size=32 on 2 replicas: 1 + 0) has that replica compute its batch mean and variance over
    nothing, 0 / 0 = NaN; the NaN reaches the moving statistics and, through the replica sync, every replica (stock
    MirroredStrategy does the same). Under a multi-replica tf_nvlink strategy an empty batch's moments are 0
    instead, selected with `tf.where` (a batch with examples gets Keras' own values, bit for bit); its
    moving-statistics update then counts for nothing in the sync, which weights replicas by their examples.
    `synchronized=True` and masked inputs already divide by a count that cannot be 0."""
    mean, variance = keras_moments()
    context = tf.distribute.get_replica_context()
    if mask is not None or layer.synchronized or context is None or context.num_replicas_in_sync < 2 \
            or not base.is_tf_nvlink_strategy(tf.distribute.get_strategy()):
        return mean, variance
    has_examples = tf.size(inputs) > 0
    return (tf.where(has_examples, mean, tf.zeros_like(mean)),
            tf.where(has_examples, variance, tf.zeros_like(variance)))
