"""What Keras' optimizers do under a tf_nvlink strategy: `apply` inside per-replica steps, gradient accumulation
without merge_call, the agreed finite check of loss scaling, and clipping after the all-reduce.

The seams (`tf_nvlink.internals.optimizer`) call `optimizer_apply` for every `optimizer.apply` and
`clip_gradients` for every clip; optimizers under other strategies run Keras' code.

Example:
    >>> with optimizer_calls("catch") as caught:
    ...     logs = step(data)                  # the optimizer's apply calls are recorded, not run
"""

from __future__ import annotations

import contextlib
from typing import Callable

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import layers, optimizer as optimizer_seams, tf_runtime
from tf_nvlink.training import sharded_states, thread_state


class OptimizerNotBuiltWhileTracing(Exception):  # noqa: N818 - a signal to the step, not an error for users
    """An optimizer without variables was reached while one replica's copy of a custom-loop step was traced.

    Keras builds an optimizer in its first `apply`, so the step would create its variables: in split mode the
    trace would hold constants for them (LossScaleOptimizer's `initial_scale` in place of `dynamic_scale`, so the
    scale never changed), in fused mode TensorFlow's variable-initialisation cond ("You must feed a value for
    placeholder tensor ... cond/Placeholder"). `PerReplicaCustomStep` stops that trace, builds the optimizer
    outside it (`build_optimizer(error.optimizer, error.variables)`) and traces again. No own __init__: AutoGraph
    re-raises such exceptions as the same type (others become a StagingError), though as a new object."""

    optimizer = None
    variables: list = []


def build_optimizer(optimizer, variables: list) -> None:
    """From one replica of a step (not inside XLA): build `optimizer` on `variables` as Keras' `apply` does when
    first called, but eagerly in the strategy's cross-replica context, as `model.fit` does. Every replica must
    call it (a merge_call): they all stop at the same unbuilt optimizer. Variables created while a function is
    traced would make TensorFlow initialise them in a cond, which fails on MirroredStrategy's no-merge_call path.

    Example:
        >>> build_optimizer(error.optimizer, error.variables)     # in PerReplicaCustomStep, after the signal
    """
    import keras  # noqa: PLC0415

    def build(strategy):
        if not optimizer.built:
            with tf.init_scope(), strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
            optimizer.built = True

    tf.distribute.get_replica_context().merge_call(build)


@contextlib.contextmanager
def optimizer_calls(mode: str):
    """While tracing one replica's copy of a custom-loop step: "catch" records every outermost
    `optimizer.apply(grads, variables)` instead of running it (split mode, the update runs after XLA);
    "replica_local" runs it with the optimizer's step counters kept per replica (fused mode). Yields the list of
    caught (optimizer, grads, variables).

    Example:
        >>> with optimizer_calls("catch") as caught:
        ...     outputs = python_step(*args)
    """
    with thread_state.setting(optimizer_mode=mode, caught_updates=[], inside_apply=False) as state:
        yield state.caught_updates


def only_first_replica_variables(optimizer) -> list:
    """The optimizer's step counters (aggregation ONLY_FIRST_REPLICA: `iterations`, loss-scale counters).

    Example:
        >>> [v.name for v in only_first_replica_variables(model.optimizer)]
        ['iteration']
    """
    if optimizer is None:
        return []
    return [v for v in optimizer.variables if str(getattr(v, "aggregation", "")) == "only_first_replica"]


def replica_local_counters(optimizer):
    """While tracing one replica's fused step, the optimizer's ONLY_FIRST_REPLICA variables point at that
    replica's own copy. TensorFlow broadcasts replica 0's value for such variables with a `merge_call`, even in
    its no-merge-call XLA mode, and a `merge_call` cannot live inside XLA. Every replica computes the same value for
    these counters (iterations + 1), so updating each replica's own copy keeps them identical without it.

    Example:
        >>> with replica_local_counters(model.optimizer):
        ...     logs = model.train_step(data)
    """
    return layers.replica_local(only_first_replica_variables(optimizer))


def dense_gradients_in_xla(grads):
    """Inside XLA, sparse gradients (tf.IndexedSlices, from Embedding layers) made dense; elsewhere unchanged.

    An all-reduce of IndexedSlices is an all-gather (CollectiveGatherV2), which XLA cannot compile: on 1x H200 a
    Transformer LM's jit-compiled fit under a one-GPU tf_nvlink strategy failed with "No registered
    'CollectiveGatherV2' OpKernel for XLA_GPU_JIT". A dense all-reduce is what XLA compiles (and combines). The
    update from a dense gradient is also the optimizer's definition where ids repeat: Keras' TensorFlow backend
    squares each row of a sparse one before it sums an id's rows (Adam and its kin; docs/architecture.md).

    Example:
        >>> grads = dense_gradients_in_xla(tape.gradient(loss, variables))
    """
    if not tf_runtime.in_xla_context():
        return grads
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _under_tf_nvlink(optimizer) -> bool:
    return base.is_tf_nvlink_strategy(optimizer_seams.optimizer_strategy(optimizer))


def optimizer_apply(optimizer, grads, trainable_variables, keras_apply: Callable):
    """The rule for every `optimizer.apply(grads, trainable_variables)` (`keras_apply(grads, variables)`: Keras'
    own). Outside a traced custom step, under a tf_nvlink strategy: accumulation without merge_call where Keras'
    would need it, else Keras' apply with the agreed finite check and dense gradients inside XLA. Inside a traced
    custom step (`optimizer_calls`): the call caught, or run with replica-local step counters."""
    state = thread_state.current()
    if state.inside_apply:
        return keras_apply(grads, trainable_variables)
    if state.optimizer_mode is None:  # any update under a tf_nvlink strategy: fit with or without XLA, split updates
        if not _under_tf_nvlink(optimizer):
            return keras_apply(grads, trainable_variables)
        if getattr(optimizer, "gradient_accumulation_steps", None) and optimizer_seams.merge_call_in_use(optimizer):
            return _accumulate_without_merge_call(optimizer, keras_apply, grads, trainable_variables)
        with agreed_finite_check(optimizer):
            return keras_apply(dense_gradients_in_xla(grads), trainable_variables)
    if not optimizer.built and trainable_variables is not None:
        error = OptimizerNotBuiltWhileTracing(f"optimizer {optimizer.name!r} is not built yet")
        error.optimizer, error.variables = optimizer, list(trainable_variables)
        raise error
    if state.optimizer_mode == "catch":
        state.caught_updates.append((optimizer, list(grads), trainable_variables))
        return None
    with thread_state.setting(inside_apply=True), replica_local_counters(optimizer), agreed_finite_check(optimizer):
        return keras_apply(dense_gradients_in_xla(grads), trainable_variables)


def _accumulate_without_merge_call(optimizer, keras_apply: Callable, grads, trainable_variables):
    """`gradient_accumulation_steps` under a merge_call MirroredStrategy (plain mode, split mode's update).

    Why: Keras 3 (3.12 to 3.15 checked) decides between "accumulate" and "accumulate and update" in a `tf.cond`
    inside `BaseOptimizer._backend_apply_gradients`, and both branches reach `merge_call` (the gradient
    all-reduce, `maybe_merge_call` around the variable updates): "RuntimeError: Exception encountered when calling
    Cond.call(). `merge_call` called while defining a new graph". Stock MirroredStrategy fails the same way.
    Here the gradients are all-reduced first, outside the cond (every replica then holds the same global-batch
    gradients), and Keras' `apply` runs on them with this replica thread on MirroredStrategy's no-merge_call path:
    each replica updates its own copy of every accumulator and variable with the same values, so the copies stay
    identical, and the optimizer's step counters are kept per replica. The optimizer's gradient all-reduce passes
    these gradients through rather than all-reducing them again."""
    variables = trainable_variables if trainable_variables is not None \
        else optimizer_seams.optimizer_trainable_variables(optimizer)
    with thread_state.setting(clip_later=True):  # Keras clips the accumulated mean, once these are global
        reduced = optimizer_seams.all_reduce_gradients(optimizer, list(zip(grads, variables)))
    optimizer_seams.apply_without_reducing_again(optimizer, lambda: thread_state.current().gradients_reduced)
    sharded = sharded_states.shards(optimizer)
    with thread_state.setting(gradients_reduced=True, send_weights_later=sharded), replica_local_counters(optimizer):
        applied = keras_apply([g for g, _ in reduced], None if trainable_variables is None else [v for _, v in reduced])
    if sharded:  # the owners updated inside Keras' cond; their weights reach every replica here
        sharded_states.send_owned_weights(optimizer, variables)
    return applied


@contextlib.contextmanager
def agreed_finite_check(optimizer):
    """LossScaleOptimizer: every replica skips or applies the step together, on all replicas' gradients.

    Keras checks the gradients for inf/NaN before they are all-reduced: with merge_call (split mode) it keeps
    replica 0's verdict for all ("Each replica computed the same `finite` value, since `grads` is all-reduced",
    which it is not), so an overflow on another replica reaches the all-reduced update (NaN weights: seen in
    fit without XLA and in split mode, on 2 CPU replicas; stock MirroredStrategy does the same); without
    merge_call (fused mode) each replica decides alone, and one that skips leaves the others' all-reduce waiting.
    The check is all-reduced instead: the step is applied only when every replica's gradients are finite, which
    is when the all-reduced gradients are. Replica threads take turns while tracing, so the override reads the
    replica context when it is called and the class's own check.

    Example:
        >>> with agreed_finite_check(model.optimizer):
        ...     model.optimizer.apply(grads, variables)
    """
    context = tf.distribute.get_replica_context()
    if not hasattr(optimizer, "inner_optimizer") or not hasattr(type(optimizer), "check_finite") \
            or context is None or context.num_replicas_in_sync < 2:
        yield
        return
    check_finite = type(optimizer).check_finite

    def agreed(grads):
        not_finite = tf.cast(tf.logical_not(check_finite(optimizer, grads)), tf.float32)
        replica = tf.distribute.get_replica_context()  # split mode: a replica of Keras' merge_call
        return tf.equal(replica.all_reduce(tf.distribute.ReduceOp.SUM, not_finite), 0.0)

    optimizer.check_finite = agreed
    try:
        yield
    finally:
        optimizer.__dict__.pop("check_finite", None)


def _clip_after_allreduce(optimizer) -> bool:
    context = tf.distribute.get_replica_context()
    return context is not None and context.num_replicas_in_sync > 1 and _under_tf_nvlink(optimizer)


def clip_gradients(optimizer, grads, keras_clip: Callable):
    """The rule for Keras' clip (`clipnorm`, `global_clipnorm`, `clipvalue`), which Keras applies to each replica's
    share before the all-reduce: under a multi-replica tf_nvlink strategy it is deferred, and
    `clip_reduced_gradients` clips the all-reduced gradients instead (one device's update). Gradients all-reduced
    already (accumulation under merge_call) are clipped where Keras clips them."""
    state = thread_state.current()
    if state.clipping_reduced or state.gradients_reduced or not _clip_after_allreduce(optimizer):
        return keras_clip(grads)
    return list(grads)  # clipped once all-reduced


def clip_reduced_gradients(optimizer, grads: list) -> list:
    """Keras' clipping of `optimizer` applied to all-reduced gradients; unchanged while gradient accumulation
    reduces them before Keras clips the mean.

    Example:
        >>> grads = clip_reduced_gradients(optimizer, [g for g, _ in reduced])
    """
    if thread_state.current().clip_later or not _clip_after_allreduce(optimizer):
        return grads
    with thread_state.setting(clipping_reduced=True):
        return optimizer_seams.clip_as_keras(optimizer, grads)
