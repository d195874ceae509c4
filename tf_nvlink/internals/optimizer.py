"""Seams in Keras' optimizers: `apply`, the clip, the TensorFlow optimizer's gradient all-reduce, and what an
optimizer keeps privately (its strategy, its variables).

Checked against Keras 3.12 to 3.15.1 and keras-nightly 3.16.0.dev2026102704, TensorFlow 2.21; pinned in
tests/internals/test_optimizer_seams.py. Each patch calls a rule of `tf_nvlink.training.optimizer_rules`.

Example:
    >>> from tf_nvlink.internals import optimizer
    >>> optimizer.optimizer_strategy(model.optimizer)          # the strategy it was made under
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tf_nvlink.internals.registry import REGISTRY


def _keras_optimizer_classes() -> list[type]:
    """Keras' optimizers that define `apply` themselves: every optimizer's base, and the loss-scale wrapper."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: PLC0415
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer  # noqa: PLC0415

    return [BaseOptimizer, LossScaleOptimizer]


def install_optimizer_seams(rules) -> None:
    """Patch `BaseOptimizer.apply`, `LossScaleOptimizer.apply` and `BaseOptimizer._clip_gradients` once.

    - `apply(grads, trainable_variables)` -> `rules.optimizer_apply(optimizer, grads, trainable_variables,
      keras_apply)`, `keras_apply(grads, variables)` being the class's own `apply`.
    - `_clip_gradients(grads)` -> `rules.clip_gradients(optimizer, grads, keras_clip)`: Keras clips (`clipnorm`,
      `global_clipnorm`, `clipvalue`) in `_backend_apply_gradients`, before its TensorFlow optimizer all-reduces
      the gradients in `_backend_update_step`, so under a MirroredStrategy each replica clips its own share.
    """
    for cls in _keras_optimizer_classes():
        def apply_patch(original):
            def apply(self, grads, trainable_variables=None):
                return rules.optimizer_apply(self, grads, trainable_variables,
                                             lambda g, v: original(self, g, v))

            return apply

        REGISTRY.patch(cls, "apply", apply_patch)

    def clip_patch(original):
        def _clip_gradients(self, grads):
            return rules.clip_gradients(self, grads, lambda g: original(self, g))

        return _clip_gradients

    REGISTRY.patch(_keras_optimizer_classes()[0], "_clip_gradients", clip_patch)


def clip_as_keras(optimizer, grads: list) -> list:
    """Keras' clipping of `optimizer` (its `_clip_gradients`, through the patch: the rule decides)."""
    return optimizer._clip_gradients(grads)  # noqa: SLF001


def _tf_optimizer_class():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer  # noqa: PLC0415

    return TFOptimizer


def replace_gradient_allreduce(replacement: Callable) -> bool:
    """Replace `TFOptimizer._all_reduce_sum_gradients` (Keras' TensorFlow optimizer's gradient all-reduce, in fit
    with and without XLA and in custom loops) by `replacement(optimizer, grads_and_vars, keras_all_reduce)`;
    returns False when it already is. Keras has no public hook there."""
    def patch(original):
        def _all_reduce_sum_gradients(self, grads_and_vars):
            return replacement(self, grads_and_vars, lambda pairs: original(self, pairs))

        return _all_reduce_sum_gradients

    return REGISTRY.patch(_tf_optimizer_class(), "_all_reduce_sum_gradients", patch)


def install_sharded_state_seams(rules) -> None:
    """Patch Keras' TensorFlow optimizer's slot creation and per-variable update once (sharded optimizer states):

    - `add_variable_from_reference(reference, name, initializer)` (every slot: momentums, velocities, gradient
      accumulators, EMA averages) -> `rules.optimizer_slot(optimizer, reference, name, initializer, keras_add)`,
      `keras_add()` being Keras' own (a variable colocated with the reference: mirrored on every replica).
    - `_distributed_tf_update_step(distribution, grads_and_vars, learning_rate)` (the loop of
      `distribution.extended.update(var, update_step)` over the variables, in merge_call's cross-replica context or
      on the no-merge_call path in each replica) -> `rules.optimizer_update(optimizer, distribution, grads_and_vars,
      learning_rate, keras_update)`, `keras_update()` being Keras' own.
    """
    cls = _tf_optimizer_class()

    def slot_patch(original):
        def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
            return rules.optimizer_slot(self, reference_variable, name, initializer,
                                        lambda: original(self, reference_variable, name=name, initializer=initializer))

        return add_variable_from_reference

    def update_patch(original):
        def _distributed_tf_update_step(self, distribution, grads_and_vars, learning_rate):
            return rules.optimizer_update(self, distribution, grads_and_vars, learning_rate,
                                          lambda: original(self, distribution, grads_and_vars, learning_rate))

        return _distributed_tf_update_step

    REGISTRY.patch(cls, "add_variable_from_reference", slot_patch)
    REGISTRY.patch(cls, "_distributed_tf_update_step", update_patch)


def add_variable_on_one_device(optimizer, reference, name, initializer, device: str):
    """Keras' slot of `reference` (BaseOptimizer's `add_variable_from_reference`: its name, shape, dtype, tracking)
    created as one plain variable on `device`: MirroredStrategy's variable creator makes a variable colocated with
    a `numpy_dataset.SingleDevice` on that device alone (`MirroredExtended._create_variable`, TensorFlow 2.21; the
    creator is what `extended.colocate_vars_with` installs, whose check accepts only the strategy's variables)."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: PLC0415
    from tensorflow.python.distribute.numpy_dataset import SingleDevice  # noqa: PLC0415

    def on_one_device(next_creator, **kwargs):
        kwargs.update(use_resource=True, colocate_with=SingleDevice(device))
        return next_creator(**kwargs)

    with tf.variable_creator_scope(on_one_device):
        return BaseOptimizer.add_variable_from_reference(optimizer, reference, name=name, initializer=initializer)


def variable_index(optimizer, variable) -> int:
    """The index of `variable` (a Keras or tf.Variable, a mirrored one's component too) in the optimizer's list of
    trainable variables (`_get_variable_index`, keyed by the mirrored container)."""
    return optimizer._get_variable_index(variable)  # noqa: SLF001


def restore_gradient_allreduce() -> None:
    """Put Keras' own `TFOptimizer._all_reduce_sum_gradients` back."""
    REGISTRY.restore(_tf_optimizer_class(), "_all_reduce_sum_gradients")


def all_reduce_gradients(optimizer, grads_and_vars) -> list:
    """The optimizer's gradient all-reduce (`_all_reduce_sum_gradients`, tf_nvlink's replacement included)."""
    return optimizer._all_reduce_sum_gradients(grads_and_vars)  # noqa: SLF001


def apply_without_reducing_again(optimizer, already_reduced: Callable[[], bool]) -> None:
    """While `already_reduced()` is true in the calling thread, make `optimizer` skip its gradient all-reduce (an
    instance `_all_reduce_sum_gradients` passing the gradients through) and its strategy's `merge_call`
    (`MirroredExtended._use_merge_call`, the switch TensorFlow itself turns off under XLA on GPUs, which the fused
    mode relies on). Set once per optimizer and strategy; TensorFlow 2.21."""
    if "_all_reduce_sum_gradients" not in optimizer.__dict__:
        reduce_sum = optimizer._all_reduce_sum_gradients  # noqa: SLF001
        optimizer._all_reduce_sum_gradients = lambda grads_and_vars: (
            list(grads_and_vars) if already_reduced() else reduce_sum(grads_and_vars))
    extended = optimizer._distribution_strategy.extended  # noqa: SLF001
    if "_use_merge_call" not in extended.__dict__:
        merge_call_default = extended._use_merge_call  # noqa: SLF001
        extended._use_merge_call = lambda: (not already_reduced()) and merge_call_default()


def merge_call_in_use(optimizer) -> bool:
    """Whether `optimizer`'s updates in this replica context go through `merge_call` (several replicas, a traced
    function, and the strategy's private `extended._use_merge_call()`)."""
    context = tf.distribute.get_replica_context()
    strategy = optimizer_strategy(optimizer)
    return (context is not None and context.num_replicas_in_sync > 1 and not tf.executing_eagerly()
            and strategy is not None and strategy.extended._use_merge_call())  # noqa: SLF001


def optimizer_strategy(optimizer):
    """The distribution strategy a Keras optimizer was created under (None: none recorded): the private
    `_distribution_strategy`, which Keras' TensorFlow optimizer sets in `__init__`."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_trainable_variables(optimizer) -> list:
    """The variables a built Keras optimizer updates when `apply(grads)` gets none (`optimizer._trainable_variables`,
    set by `BaseOptimizer.build`; no public accessor exists)."""
    return list(optimizer._trainable_variables)  # noqa: SLF001


def check_gradients_present(grads_and_vars) -> None:
    """Keras' own check of (gradient, variable) pairs: all None raises, some None warns
    (`keras.src.backend.tensorflow.optimizer.filter_empty_gradients`, no public name)."""
    from keras.src.backend.tensorflow.optimizer import filter_empty_gradients  # noqa: PLC0415

    filter_empty_gradients(grads_and_vars)
