"""What the fused-attention rule reads of a call's inputs in the traced graph: key and value heads that
`tf.repeat` made from fewer (grouped-query attention), and what an attention mask was made of (kept on the mask
tensor when `MultiHeadAttention` or `GroupedQueryAttention` made it, and found again through the expand and cast the
layers apply before `dot_product_attention`).

TensorFlow 2.21's `tf.repeat` along an axis of a tensor of known rank builds Reshape(Tile(ExpandDims(x, axis + 1)))
(`array_ops.repeat_with_axis`); tests/training/test_fused_attention.py pins it.

Example:
    >>> attention_inputs.repeated_heads(tf.repeat(key, 4, axis=2))    # inside a traced function
    (key, 4)
"""

from __future__ import annotations

import tensorflow as tf

_TAG = "_tf_nvlink_attention_mask"
_SHAPE_OPS = ("ExpandDims", "Cast", "Identity")  # what the layers do to their mask before dot_product_attention


def tag_mask(mask, origin) -> None:
    """Keep `origin` on the mask tensor `mask` (as Keras keeps a tensor's Keras mask on it), for `mask_tag`."""
    try:
        setattr(mask, _TAG, origin)
    except AttributeError:  # a tensor type that takes no attributes: the mask is not recognised later
        pass


def mask_tag(mask):
    """The origin `tag_mask` kept on `mask` or on the tensor it was expanded or cast from (the layers expand the
    [B, T, S] mask to [B, 1, T, S] and cast it to bool before `dot_product_attention`); None when there is none.

    Example:
        >>> attention_inputs.mask_tag(arguments["mask"])     # what tag_mask kept in _compute_attention_mask, or None
    """
    tensor = mask
    for _ in range(4):
        origin = getattr(tensor, _TAG, None)
        if origin is not None:
            return origin
        op = getattr(tensor, "op", None)
        if op is None or getattr(op, "type", None) not in _SHAPE_OPS or not op.inputs:
            return None
        tensor = op.inputs[0]
    return None


def repeated_heads(tensor):
    """(source, repeats) where `tensor` [B, S, N, H] is `tf.repeat(source, repeats, axis=2)` of a traced source
    [B, S, N / repeats, H] (head n of `tensor` is head n // repeats of `source`: how `GroupedQueryAttention` and
    Keras' TensorFlow `dot_product_attention` give key and value the query's heads); None for any other tensor.

    Example:
        >>> attention_inputs.repeated_heads(tf.repeat(key, 4, axis=2))    # inside a traced function
        (key, 4)
    """
    op = getattr(tensor, "op", None)
    while op is not None and op.type == "Identity":
        tensor = op.inputs[0]
        op = tensor.op
    if op is None or op.type != "Reshape" or tensor.shape.rank != 4:
        return None
    tiled = op.inputs[0]
    if tiled.op.type != "Tile" or tiled.shape.rank != 5:
        return None
    expanded = tiled.op.inputs[0]
    if expanded.op.type != "ExpandDims" or tf.get_static_value(expanded.op.inputs[1]) not in (3, -2):
        return None
    source = expanded.op.inputs[0]
    if source.shape.rank != 4 or _batch_multiple(tiled.op.inputs[1]) != 1:
        return None
    batch, tokens, heads, head_dim = source.shape.as_list()
    repeats = tiled.shape[3]
    if (repeats is None or tiled.shape.as_list()[1:] != [tokens, heads, repeats, head_dim]
            or tensor.shape.as_list()[1:] != [tokens, heads * repeats, head_dim]
            or (batch is not None and tensor.shape[0] not in (None, batch))):
        return None
    return source, repeats


def _batch_multiple(multiples):
    """The first entry of a Tile's multiples where the trace knows it (tf.repeat packs constants, one of them
    reshaped), else None."""
    value = tf.get_static_value(multiples)
    if value is not None:
        return int(value[0])
    if multiples.op.type == "Pack" and multiples.op.inputs:
        first = tf.get_static_value(multiples.op.inputs[0])
        return None if first is None else int(first)
    return None
