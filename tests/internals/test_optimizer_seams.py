"""Pins of the Keras optimizer internals tf_nvlink.internals.optimizer relies on (Keras 3.12 to 3.16.dev,
TensorFlow 2.21)."""

import inspect


def test_apply_clip_and_the_gradient_all_reduce():
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from tf_nvlink.internals.registry import REGISTRY

    assert "self.apply(grads, trainable_variables)" in inspect.getsource(BaseOptimizer.apply_gradients)
    # clipping after the all-reduce: Keras clips before its TensorFlow optimizer's update step all-reduces
    apply_source = inspect.getsource(BaseOptimizer._backend_apply_gradients)
    assert apply_source.count("grads = self._clip_gradients(grads)") == 2
    assert apply_source.index("self._clip_gradients(grads)") < apply_source.index("self._backend_update_step(")
    assert "grads_and_vars = self._all_reduce_sum_gradients(grads_and_vars)" in inspect.getsource(
        TFOptimizer._backend_update_step)
    assert "def _clip_gradients(self, grads):" in inspect.getsource(
        REGISTRY.original(BaseOptimizer, "_clip_gradients", BaseOptimizer._clip_gradients))


def test_gradient_accumulation_and_the_merge_call_switch():
    """Keras' cond whose branches reach merge_call, and MirroredStrategy's no-merge_call switch."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from tensorflow.python.distribute import mirrored_strategy

    assert "ops.cond(" in inspect.getsource(BaseOptimizer._backend_apply_gradients)
    assert "if self._use_merge_call():" in inspect.getsource(mirrored_strategy.MirroredExtended._replica_ctx_update)
