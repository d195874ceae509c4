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

from typing import Callable

import tensorflow as tf

from tf_nvlink.internals import cross_replica_sum_impossible_here, loss_share_while_tracing

__all__ = ["average_loss", "examples_in", "replica_share", "replica_shares", "weighted_by_examples"]


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
    the example share and a warning (`internals.loss_share_while_tracing`).

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
    (plain mode: the share's all-reduce sits in the same graph as the step). In a test step only the logged
    per-output losses change: each replica's counts by its share, so a step counts once, as on one device.

    Example:
        >>> strategy.run(weighted_by_examples(model.train_step), args=(batch,))
    """

    def step(data):
        with loss_share_while_tracing(*replica_shares(data)):
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
            if cross_replica_sum_impossible_here():
                raise ValueError(
                    "tf_nvlink.average_loss(per_example_loss) all-reduces the replicas' example counts, which a "
                    "jit_compile=True step in split mode (CPU replicas, or xla_allreduce='split') cannot do inside "
                    "XLA. Pass the global batch's size: average_loss(per_example_loss, global_batch_size=n), or "
                    "compile the step with jit_compile=False, or use fused mode (all-GPU replicas).")
            global_batch_size = context.all_reduce(tf.distribute.ReduceOp.SUM, local)
        else:
            global_batch_size = local
    return tf.math.divide_no_nan(total, tf.cast(global_batch_size, per_example_loss.dtype))
