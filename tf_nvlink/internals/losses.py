"""Seams in Keras' losses and metrics: the per-replica loss scale, the weighted reduction, and the per-output loss
metrics of a compiled loss.

Checked against Keras 3.12 to 3.15.1 and keras-nightly 3.16.0.dev2026102704, TensorFlow 2.21; pinned in
tests/internals/test_losses_seams.py. Each patch calls a rule of `tf_nvlink.training.exact_batches`.

Example:
    >>> from tf_nvlink.internals import losses
    >>> losses.install_loss_seams(exact_batches.LOSS_RULES)       # tf_nvlink.strategy() does this
"""

from __future__ import annotations

from tf_nvlink.internals.registry import REGISTRY


def _keras_loss_module():
    from keras.src.losses import loss as loss_module  # noqa: PLC0415

    return loss_module


def _keras_compile_loss_class():
    from keras.src.trainers.compile_utils import CompileLoss  # noqa: PLC0415

    return CompileLoss


def _keras_mean_metric_class():
    from keras.src.metrics.reduction_metrics import Mean  # noqa: PLC0415

    return Mean


def install_loss_seams(rules) -> None:
    """Patch, once, the module functions of `keras.src.losses.loss` that Keras looks up at every call, and two
    methods:

    - `scale_loss_for_distribution(value)` -> `rules.scale_loss(value, keras_scale)`: Keras scales every replica's
      mean loss by 1/num_replicas there (the compiled loss, the regularisation losses);
    - `unscale_loss_for_distribution(value)` -> `rules.unscale_loss(value, keras_unscale)` (the logged loss);
    - `reduce_values(values, sample_weight, reduction)` -> `rules.reduce_values(values, sample_weight, reduction,
      keras_reduce)`;
    - `CompileLoss.call(y_true, y_pred, sample_weight)` -> `rules.compile_loss_call(compile_loss, keras_call)`,
      `keras_call()` running Keras' own call with the same arguments;
    - `Mean.update_state(values, sample_weight)` -> `rules.mean_update_state(metric, values, sample_weight,
      keras_update)`: Keras updates each output's loss metric in `CompileLoss.call` with the static batch size.
    """
    module = _keras_loss_module()

    def scale_patch(original):
        return lambda value: rules.scale_loss(value, original)

    def unscale_patch(original):
        return lambda value: rules.unscale_loss(value, original)

    def reduce_patch(original):
        def reduce_values(values, sample_weight=None, reduction="sum_over_batch_size"):
            return rules.reduce_values(values, sample_weight, reduction, original)

        return reduce_values

    def call_patch(original):
        def call(self, y_true, y_pred, sample_weight=None):
            return rules.compile_loss_call(self, lambda: original(self, y_true, y_pred, sample_weight))

        return call

    def update_patch(original):
        def update_state(self, values, sample_weight=None):
            return rules.mean_update_state(self, values, sample_weight,
                                           lambda weight: original(self, values, weight))

        return update_state

    REGISTRY.patch(module, "scale_loss_for_distribution", scale_patch)
    REGISTRY.patch(module, "unscale_loss_for_distribution", unscale_patch)
    REGISTRY.patch(module, "reduce_values", reduce_patch)
    REGISTRY.patch(_keras_compile_loss_class(), "call", call_patch)
    REGISTRY.patch(_keras_mean_metric_class(), "update_state", update_patch)
