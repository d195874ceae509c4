"""Pins of what tf_nvlink.internals.attention relies on: Keras' TensorFlow `dot_product_attention`, reached from
`keras.ops` and `MultiHeadAttention` by attribute lookup, and TensorFlow's XlaCustomCallV2 op."""

import inspect
import re


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
    else:  # Keras 3.12 to 3.14 pass the causal mask as a tensor, made by _compute_attention_mask (pinned below)
        assert "is_causal=False" in compute and "is_causal=True" not in compute


def test_the_custom_call_op_takes_several_results_of_known_shapes():
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops

    parameters = inspect.signature(gen_xla_ops.xla_custom_call_v2).parameters
    assert list(parameters)[:6] == ["operands", "call_target_name", "backend_config", "has_side_effect",
                                    "result_dtypes", "result_shapes"]


def test_the_layers_make_their_attention_mask_from_their_inputs_keras_masks():
    """`MultiHeadAttention` and `GroupedQueryAttention` build the mask they pass to `dot_product_attention` in
    `_compute_attention_mask(query, value, query_mask, value_mask, key_mask, attention_mask, use_causal_mask)` (the
    mask seam reads those arguments), from the Keras masks `call` reads off its inputs; GroupedQueryAttention repeats
    key and value heads with `ops.repeat` along axis 2 before the call."""
    from keras.src.layers.attention import grouped_query_attention, multi_head_attention

    for layer_class in (multi_head_attention.MultiHeadAttention, grouped_query_attention.GroupedQueryAttention):
        method = _original(layer_class, "_compute_attention_mask")
        assert list(inspect.signature(method).parameters) == [
            "self", "query", "value", "query_mask", "value_mask", "key_mask", "attention_mask", "use_causal_mask"]
        call = inspect.getsource(layer_class.call)
        assert "self._compute_attention_mask(" in call and "query_mask=query_mask" in call
        assert "value_mask=value_mask" in call and "use_causal_mask=use_causal_mask" in call
    gqa_call = inspect.getsource(grouped_query_attention.GroupedQueryAttention.call)
    # keras.ops.repeat up to 3.15, backend.ops.numpy.repeat from 3.16: TensorFlow's tf.repeat either way
    for name in ("key", "value"):
        assert re.search(rf"{name} = [\w.]*repeat\(\s*{name}, self.num_repeats, axis=2", gqa_call), name


def test_the_mask_seam_reports_what_the_mask_was_made_of():
    import numpy as np
    import keras

    from tf_nvlink.internals import attention
    from tf_nvlink.internals.registry import REGISTRY

    from keras.src.layers.attention import grouped_query_attention, multi_head_attention

    owners = (multi_head_attention.MultiHeadAttention, grouped_query_attention.GroupedQueryAttention)
    installed = any(REGISTRY.patched(owner, "_compute_attention_mask") for owner in owners)
    for owner in owners:
        REGISTRY.restore(owner, "_compute_attention_mask")
    seen = []
    rules = type("Rules", (), {"attention_mask_made": staticmethod(lambda mask, arguments: seen.append(arguments))})
    attention.install_attention_mask_seam(rules)
    try:
        layer = keras.layers.MultiHeadAttention(2, 4)
        x = keras.layers.Masking(0.0)(np.ones((2, 3, 8), "float32"))
        layer(x, x, use_causal_mask=True)
    finally:
        for owner in owners:
            REGISTRY.restore(owner, "_compute_attention_mask")
        if installed:
            from tf_nvlink.training import install

            attention.install_attention_mask_seam(install.KERAS_RULES)
    (arguments,) = seen
    assert arguments["use_causal_mask"] is True and arguments["attention_mask"] is None
    assert arguments["query_mask"] is not None and arguments["sliding_window"] is None
