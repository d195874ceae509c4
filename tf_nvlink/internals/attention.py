"""Seams of attention: Keras' TensorFlow `dot_product_attention` (what `keras.ops.dot_product_attention`,
`MultiHeadAttention` and `GroupedQueryAttention` call), the attention masks those two layers make from their inputs'
Keras masks (`_compute_attention_mask`), and TensorFlow's op for an XLA custom call with several results.

Checked against Keras 3.12 to 3.15.1 (`keras.src.backend.tensorflow.nn`) and keras-nightly 3.16.0.dev2026102704
(`keras.src.backend.tensorflow.ops.nn`), whose `dot_product_attention` `keras.src.ops.nn` looks up at each call
(`backend.nn.`, then `backend.ops.nn.`), TensorFlow 2.21
(`tensorflow.compiler.tf2xla.ops.gen_xla_ops.xla_custom_call_v2`: `tf.raw_ops` does not export XlaCustomCallV2,
and the older XlaCustomCall aborts the process on a call with several results). The layers'
`_compute_attention_mask(query, value, query_mask, value_mask, key_mask, attention_mask, use_causal_mask)`: Keras
3.12 to 3.15.1 and 3.16's nightly (`MultiHeadAttention._sliding_window` and `GroupedQueryAttention.sliding_window`
where this Keras has them). Pinned in tests/internals/test_attention_seams.py.

Example:
    >>> from tf_nvlink.internals import attention
    >>> attention.install_attention_seam(rules)   # rules.dot_product_attention(keras_attention, arguments)
    >>> attention.install_attention_mask_seam(rules)   # rules.attention_mask_made(mask, arguments)
"""

from __future__ import annotations

import functools
import inspect

from tf_nvlink.internals.registry import REGISTRY


def keras_attention_module():
    """The module of Keras' TensorFlow `dot_product_attention`: `keras.src.backend.tensorflow.nn` up to Keras 3.15,
    `keras.src.backend.tensorflow.ops.nn` from 3.16.

    Example:
        >>> attention.keras_attention_module().dot_product_attention   # Keras' own, or the seam once installed
    """
    try:
        from keras.src.backend.tensorflow import nn as module  # noqa: PLC0415
    except ImportError:
        from keras.src.backend.tensorflow.ops import nn as module  # noqa: PLC0415
    return module


def install_attention_seam(rules) -> None:
    """Patch Keras' TensorFlow `dot_product_attention` once -> `rules.dot_product_attention(keras_attention,
    arguments)`, where `arguments` is the call's arguments by name (query, key, value, bias, mask, scale, is_causal,
    flash_attention, and attn_logits_soft_cap where this Keras has it) and `keras_attention(**arguments)` is Keras'
    own. `keras.src.ops.nn.dot_product_attention` calls `backend.nn.dot_product_attention` (`backend.ops.nn.` from
    Keras 3.16) by attribute, so the patch reaches `MultiHeadAttention` and `keras.ops` alike."""
    tensorflow_nn = keras_attention_module()

    def patch(original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def dot_product_attention(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return rules.dot_product_attention(original, dict(bound.arguments))

        return dot_product_attention

    REGISTRY.patch(tensorflow_nn, "dot_product_attention", patch)


def _attention_layers():
    from keras.src.layers.attention import grouped_query_attention, multi_head_attention  # noqa: PLC0415

    return (multi_head_attention.MultiHeadAttention, grouped_query_attention.GroupedQueryAttention)


def install_attention_mask_seam(rules) -> None:
    """Patch `MultiHeadAttention._compute_attention_mask` and `GroupedQueryAttention`'s once -> after Keras' own,
    `rules.attention_mask_made(mask, arguments)`, where `mask` is what Keras returns (the [B, T, S] mask the layer
    passes on to `dot_product_attention`, expanded to [B, 1, T, S]; None without masks) and `arguments` the call's
    arguments by name (query_mask, value_mask, key_mask, attention_mask, use_causal_mask) plus the layer's
    `sliding_window` (None where this Keras has none)."""
    for layer_class in _attention_layers():
        def patch(original):
            signature = inspect.signature(original)

            @functools.wraps(original)
            def _compute_attention_mask(self, *args, **kwargs):
                mask = original(self, *args, **kwargs)
                bound = signature.bind(self, *args, **kwargs)
                bound.apply_defaults()
                arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
                arguments["sliding_window"] = getattr(self, "_sliding_window", getattr(self, "sliding_window", None))
                rules.attention_mask_made(mask, arguments)
                return mask

            return _compute_attention_mask

        REGISTRY.patch(layer_class, "_compute_attention_mask", patch)


def xla_custom_call(operands, target: str, backend_config: str, result_dtypes, result_shapes) -> list:
    """The results of an XLA custom call to `target` on `operands` (TensorFlow's XlaCustomCallV2 op; only inside
    an XLA program): operands and results in the default (row-major) layout, `result_shapes` fully known.

    Example:
        >>> out, stats, workspace = xla_custom_call([q, k, v], "__cudnn$fmhaSoftmax", config,
        ...                                         [tf.bfloat16, tf.float32, tf.uint8], [[8, 16, 512, 64], [8, 16, 512], [0]])
    """
    from tensorflow.compiler.tf2xla.ops import gen_xla_ops  # noqa: PLC0415

    return list(gen_xla_ops.xla_custom_call_v2(operands, call_target_name=target, backend_config=backend_config,
                                               has_side_effect=False, result_dtypes=list(result_dtypes),
                                               result_shapes=[list(shape) for shape in result_shapes]))
