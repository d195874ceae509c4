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


def test_slot_creation_and_the_per_variable_update_sharded_states_replace():
    """Sharded optimizer states: Keras creates every slot in `add_variable_from_reference` (the TensorFlow optimizer
    colocating it with the reference), updates each variable in `_distributed_tf_update_step` through
    `extended.update` (per component in merge_call's cross-replica context, the replica's own component without
    merge_call), and MirroredStrategy creates a plain variable on one device for a `SingleDevice` colocation."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from tensorflow.python.distribute import mirrored_strategy, numpy_dataset

    from tf_nvlink.internals.registry import REGISTRY

    slot = inspect.getsource(REGISTRY.original(TFOptimizer, "add_variable_from_reference",
                                               TFOptimizer.add_variable_from_reference))
    assert "colocate_vars_with(" in slot and "super().add_variable_from_reference(" in slot
    assert "return self.add_variable(" in inspect.getsource(BaseOptimizer.add_variable_from_reference)
    update = inspect.getsource(REGISTRY.original(TFOptimizer, "_distributed_tf_update_step",
                                                 TFOptimizer._distributed_tf_update_step))
    assert "distribution.extended.update(" in update and "self.update_step(grad, var, learning_rate)" in update
    assert "self._distributed_tf_update_step," in inspect.getsource(TFOptimizer._backend_update_step)
    assert "return self._trainable_variables_indices[self._var_key(variable)]" in inspect.getsource(
        BaseOptimizer._get_variable_index)
    create = inspect.getsource(mirrored_strategy.MirroredExtended._create_variable)
    assert "isinstance(colocate_with, numpy_dataset.SingleDevice)" in create
    assert "return next_creator(**kwargs)" in create and numpy_dataset.SingleDevice("/cpu:0").device == "/cpu:0"
    assert "var._get_replica(replica_id)" in inspect.getsource(mirrored_strategy.MirroredExtended._replica_ctx_update)
