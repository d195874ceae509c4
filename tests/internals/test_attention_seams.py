"""Pins of what tf_nvlink.internals.attention relies on: Keras' TensorFlow `dot_product_attention`, reached from
`keras.ops` and `MultiHeadAttention` by attribute lookup, and TensorFlow's XlaCustomCallV2 op."""

import inspect


def keras_version():
    import keras

    return tuple(int(part) for part in keras.__version__.split(".")[:2])


def _original(owner, name):
    from tf_nvlink.internals.registry import REGISTRY

    return REGISTRY.original(owner, name, getattr(owner, name))


def test_keras_attention_is_looked_up_on_the_tensorflow_backend_at_each_call():
    from keras.src.layers.attention import multi_head_attention
    from keras.src.ops import nn as ops_nn

    from tf_nvlink.internals.attention import keras_attention_module

    tensorflow_nn = keras_attention_module()

    keras_attention = _original(tensorflow_nn, "dot_product_attention")
    parameters = list(inspect.signature(keras_attention).parameters)
    assert parameters[:8] == ["query", "key", "value", "bias", "mask", "scale", "is_causal", "flash_attention"]
    source = inspect.getsource(keras_attention)
    assert "Flash attention is not supported in tensorflow backend." in source
    assert "_dot_product_attention_xla(" in source  # softmax(QK^T)V in separate ops
    looked_up = "backend.nn." if keras_version() < (3, 16) else "backend.ops.nn."  # by attribute, at each call
    assert f"return {looked_up}dot_product_attention(" in inspect.getsource(ops_nn)
    assert tensorflow_nn.__name__ == ("keras.src.backend.tensorflow.nn" if keras_version() < (3, 16)
                                      else "keras.src.backend.tensorflow.ops.nn")
    compute = inspect.getsource(multi_head_attention.MultiHeadAttention._compute_attention)
    called = "ops." if keras_version() < (3, 16) else "backend.ops.nn."  # keras.ops, or the module itself
    assert f"{called}dot_product_attention(" in compute
    assert "self._dropout > 0.0" in compute  # dropout keeps MultiHeadAttention on its own path
    if keras_version() >= (3, 15):  # use_causal_mask=True reaches the kernel as is_causal=True
        assert "is_causal=True" in compute
    else:  # Keras 3.12 to 3.14 pass the causal mask as a tensor: the rule leaves that to Keras' attention
        assert "is_causal=False" in compute and "is_causal=True" not in compute


def test_the_custom_call_op_takes_several_results_of_known_shapes():
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    parameters = inspect.signature(gen_xla_ops.xla_custom_call_v2).parameters
    assert list(parameters)[:6] == ["operands", "call_target_name", "backend_config", "has_side_effect",
                                    "result_dtypes", "result_shapes"]
