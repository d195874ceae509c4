"""Pins of the Keras loss and metric internals tf_nvlink.internals.losses relies on (Keras 3.12 to 3.16.dev)."""

import inspect


def test_keras_scales_each_replicas_loss_in_the_patched_module_functions():
    from keras.src.losses import loss as loss_module
    from keras.src.trainers import compile_utils

    from tf_nvlink.internals import trainer
    from tf_nvlink.internals.registry import REGISTRY

    def original(owner, name):
        return REGISTRY.original(owner, name, getattr(owner, name))

    TensorFlowTrainer = trainer.keras_trainer_class()
    assert "1.0 / num_replicas" in inspect.getsource(original(loss_module, "scale_loss_for_distribution"))
    reduce_values = inspect.getsource(original(loss_module, "reduce_values"))
    assert "scale_loss_for_distribution(loss)" in reduce_values
    assert 'if reduction == "mean_with_sample_weight" and sample_weight is not None:' in reduce_values
    assert "reduce_values(values, sample_weight, reduction)" in inspect.getsource(loss_module.reduce_weighted_values)
    assert "loss_module.unscale_loss_for_distribution(loss)" in inspect.getsource(TensorFlowTrainer.train_step)
    assert "loss_module.scale_loss_for_distribution(loss)" in inspect.getsource(
        TensorFlowTrainer._aggregate_additional_loss)
    compile_loss_call = inspect.getsource(original(compile_utils.CompileLoss, "call"))
    assert "loss_module.unscale_loss_for_distribution(value)" in compile_loss_call
    assert "sample_weight=tree.flatten(y_p)[0].shape[0]" in compile_loss_call  # the static batch size
