"""Keras' attention as cuDNN's flash attention under a tf_nvlink strategy: one fused kernel forward, one backward.

Keras' TensorFlow backend computes `ops.dot_product_attention` (`MultiHeadAttention` and `GroupedQueryAttention`
call it when they have no dropout and return no scores) as separate XLA ops that write every head's [T, S] scores
to memory and read them back, in the forward and again in the backward. Inside a replica's XLA program on NVIDIA
GPUs (compute capability 8.0+), for bfloat16 or float16 attention (`plan.attention.decide` has every condition),
this rule emits XLA's cuDNN custom calls instead, with a custom gradient that is cuDNN's fused backward:
- no mask, or Keras' causal mask (top-left, row t sees keys s <= t, as cuDNN's CAUSAL), T = S or not;
- grouped-query attention: key and value whose heads `tf.repeat` made from fewer (`GroupedQueryAttention`), or
  fewer heads passed directly, go to cuDNN with their own heads, and their gradients come back in them;
- padding: the masks `MultiHeadAttention` and `GroupedQueryAttention` make from their inputs' Keras masks alone
  (`Embedding(mask_zero=True)`, `Masking`), through cuDNN's per-sequence key lengths (below).
Elsewhere Keras' own attention runs, and one INFO line per reason says why. `decision_counts()` counts each
decision (fused or not, and why) per traced call. `tf_nvlink.strategy(fused_attention="off")` keeps Keras'
attention everywhere.

Padding. Keras ANDs a query mask [B, T] and key masks [B, S] (and the causal mask) into one [B, T, S] mask and
computes softmax(where(mask, logits, -large)): a query row whose keys are all masked gets the same logit for every
key, a uniform softmax, and so the mean of all S values. cuDNN takes per-sequence lengths: the valid keys must come
first. The rule therefore moves each sequence's valid keys (and, for causal self-attention, its valid queries by
the same order) to the front, keeping their order (a stable sort of the mask, an exact permutation whose gradient
is the inverse permutation), gives cuDNN the number of valid keys (at least 1) and every query row, puts the rows
back in place, and sets every row whose keys are all masked to the mean of the values, as Keras does. Any pattern
of padding (not only right padding) then gives Keras' result, without a branch at run time. Causal attention with
padding is fused when the query and the keys share one mask (self-attention over one masked sequence): the causal
order of the valid tokens is then kept by the move.

The custom calls need fully known shapes, and tf_nvlink traces each replica's step with its batch dimension open
(`exact_batches.open_batch_dimension`). The rule takes the batch size the trace hides (`thread_state.static_batch`)
for the attention's batch: XLA checks it when it compiles (`tf.ensure_shape`), so a model whose attention runs on
another batch than its input's (a reshape into the batch) fails to compile, naming both shapes, where it would
otherwise compute on the wrong rows; such a model trains with `fused_attention="off"`.

Layout. TensorFlow's custom-call op gives every operand and result the default (row-major) layout, and cuDNN reads
a result's dimensions as [B, N, T, H]: the outputs are therefore [B, N, T, H] and transposed to Keras' [B, T, N, H]
(real copies; JAX declares a result layout that makes them free, which TensorFlow's op cannot express).

Example:
    >>> with tf_nvlink.strategy().scope():            # fused_attention="auto" is the default
    ...     model = transformer()                   # keras.layers.MultiHeadAttention(..., use_causal_mask=True)
    ...     model.compile(optimizer="adamw", loss=loss, jit_compile=True)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Callable, Optional

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import attention as attention_seams, tf_runtime
from tf_nvlink.plan import attention as attention_plan
from tf_nvlink.training import attention_inputs, thread_state

log = logging.getLogger("tf_nvlink")
_SAID: set = set()  # each decision's line once per process
_COUNTS: collections.Counter = collections.Counter()
_COUNTS_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class MaskOrigin:
    """What an attention mask was made of, kept on it by `attention_mask_made`: the query's Keras mask [B, T] (or
    None), the keys' Keras masks [B, S] (value's and key's, those given), whether Keras' causal mask is in it, and
    whether it holds nothing else (no attention_mask argument, no sliding window)."""

    query_mask: object
    key_masks: tuple
    causal: bool
    only_keras_masks: bool

    @property
    def same_padding(self) -> bool:
        """The query and the keys are padded by one mask (self-attention over one masked sequence)."""
        return self.query_mask is not None and bool(self.key_masks) and all(
            mask is self.query_mask for mask in self.key_masks)

    def padding(self, shared: bool) -> "Padding":
        """The masks as bool tensors, the keys' ANDed (made only for a call that runs fused)."""
        key_mask = None
        for mask in self.key_masks:
            mask = tf.cast(mask, tf.bool)
            key_mask = mask if key_mask is None else tf.logical_and(key_mask, mask)
        query_mask = None if self.query_mask is None else tf.cast(self.query_mask, tf.bool)
        return Padding(query_mask, key_mask, shared)


def decision_counts() -> dict:
    """How many traced calls of Keras' attention each decision took in this process, by its log line's text
    ("fused: cuDNN flash attention (...)" or "Keras' attention: <why>").

    Example:
        >>> before = decision_counts(); model.fit(...)
        >>> {k: v - before.get(k, 0) for k, v in decision_counts().items()}
        {'fused: cuDNN flash attention (causal, bfloat16, 16 heads of 64, 512 x 512 tokens)': 2}
    """
    with _COUNTS_LOCK:
        return dict(_COUNTS)


def attention_mask_made(mask, arguments: dict) -> None:
    """The rule `internals.attention` calls after `MultiHeadAttention` or `GroupedQueryAttention` made its attention
    mask: what the mask was made of is kept on it (`MaskOrigin`), for `dot_product_attention` to recognise."""
    if mask is None:
        return
    attention_inputs.tag_mask(mask, MaskOrigin(
        query_mask=arguments.get("query_mask"),
        key_masks=tuple(m for m in (arguments.get("value_mask"), arguments.get("key_mask")) if m is not None),
        causal=bool(arguments.get("use_causal_mask")),
        only_keras_masks=arguments.get("attention_mask") is None and arguments.get("sliding_window") is None))


def dot_product_attention(keras_attention: Callable, arguments: dict):
    """The rule `internals.attention` calls for each `dot_product_attention`: cuDNN's fused attention where
    `plan.attention.decide` says it applies under a tf_nvlink strategy, else Keras' own (`keras_attention`)."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if not base.is_tf_nvlink_strategy(strategy):
        return keras_attention(**arguments)
    query, key, value = (tf.convert_to_tensor(arguments[name]) for name in ("query", "key", "value"))
    key, value = _own_heads(key, value)
    origin = _padding_origin(arguments)
    facts = call_facts(strategy, query, key, value, arguments, origin)
    fused, why = attention_plan.decide(facts)
    _count_and_say(("fused: " if fused else "Keras' attention: ") + why)
    if not fused:
        return keras_attention(**arguments)
    scale = arguments.get("scale")
    scale = float(scale) if scale is not None else float(query.shape[-1]) ** -0.5
    padding = None
    if facts.mask.startswith("padding"):
        padding = origin.padding(shared=facts.mask == "padding_causal")
    return attend(query, key, value, scale, facts.mask in ("causal", "padding_causal"), facts.batch, padding)


def call_facts(strategy, query, key, value, arguments: dict, origin: Optional[MaskOrigin] = None
               ) -> attention_plan.AttentionFacts:
    """What `plan.attention.decide` needs of one call, read while it is traced (`key` and `value` with their own
    heads, `origin` what a mask tensor was made of, where known)."""
    scale = arguments.get("scale")
    dtypes = {query.dtype, key.dtype, value.dtype}
    batch = query.shape[0] if query.shape.rank and query.shape[0] is not None else thread_state.current().static_batch
    return attention_plan.AttentionFacts(
        setting=base.fused_attention_of(strategy), in_xla=tf_runtime.in_xla_context(),
        on_gpu=_replicas_are_gpus(strategy), compute_capability=_compute_capability(),
        dtype=query.dtype.name if len(dtypes) == 1 else "mixed",
        query_shape=tuple(query.shape.as_list()) if query.shape.rank is not None else (),
        key_shape=tuple(key.shape.as_list()) if key.shape.rank is not None else (),
        value_shape=tuple(value.shape.as_list()) if value.shape.rank is not None else (),
        mask=_mask_kind(arguments, origin), same_padding=bool(origin and origin.same_padding),
        has_bias=arguments.get("bias") is not None, soft_cap=arguments.get("attn_logits_soft_cap") is not None,
        scale_known=scale is None or isinstance(scale, (int, float)), batch=batch)


def _mask_kind(arguments: dict, origin: Optional[MaskOrigin]) -> str:
    causal = bool(arguments.get("is_causal"))
    if arguments.get("mask") is None:
        return "causal" if causal else "none"
    if origin is None or not origin.only_keras_masks:
        return "tensor"
    if origin.query_mask is None and not origin.key_masks:  # Keras' causal mask alone, as a tensor (Keras < 3.15)
        return "causal" if causal or origin.causal else "tensor"
    return "padding_causal" if causal or origin.causal else "padding"


def _padding_origin(arguments: dict) -> Optional[MaskOrigin]:
    mask = arguments.get("mask")
    if mask is None or not tf.is_tensor(mask):
        return None
    origin = attention_inputs.mask_tag(mask)
    return origin if isinstance(origin, MaskOrigin) else None


def _own_heads(key, value):
    """Key and value with the heads they had before `tf.repeat` gave them the query's (grouped-query attention),
    where both were repeated alike; else as they are."""
    repeated_key, repeated_value = attention_inputs.repeated_heads(key), attention_inputs.repeated_heads(value)
    if repeated_key and repeated_value and repeated_key[1] == repeated_value[1]:
        return repeated_key[0], repeated_value[0]
    return key, value


@dataclasses.dataclass(frozen=True)
class Padding:
    """Keras masks of one attention: `query_mask` [B, T] bool (None: every query row is valid), `key_mask` [B, S]
    bool (None: every key), `shared`: causal self-attention over one masked sequence (the queries move with the
    keys)."""

    query_mask: object
    key_mask: object
    shared: bool = False


def attend(query, key, value, scale: float, causal: bool, batch: int, padding: Optional[Padding] = None,
           kernels: Optional[tuple] = None):
    """Fused attention of `query` [B, T, N, H] on `key` and `value` [B, S, K, H] (K divides N: grouped-query
    attention), causal (top-left) or not, with Keras' masks `padding` (or None). Where the trace leaves B open,
    `batch` (the batch size of the step traced) is B: the tensors are given that size for the custom calls
    (`tf.ensure_shape`, which XLA checks when it compiles) and the output's batch is open again after them.
    `kernels` (forward, backward) replaces the custom calls (tests on CPU pass reference kernels).

    Example:
        >>> out = attend(query, key, value, 0.125, causal=True, batch=8)     # inside a replica's XLA program
    """
    forward, backward = kernels or (cudnn_forward, cudnn_backward)
    opened = query.shape[0] is None
    if opened:
        query, key, value = (tf.ensure_shape(tensor, [batch] + tensor.shape.as_list()[1:])
                             for tensor in (query, key, value))
        if padding is not None:
            padding = Padding(*(None if mask is None else tf.ensure_shape(mask, [batch] + mask.shape.as_list()[1:])
                                for mask in (padding.query_mask, padding.key_mask)), padding.shared)
    if padding is None:
        out = _fused(query, key, value, scale, "causal" if causal else "none", None, forward, backward)
    else:
        out = _padded(query, key, value, scale, causal, padding, forward, backward)
    if opened:
        out = tf.compat.v1.placeholder_with_default(out, [None] + out.shape.as_list()[1:])
    return out


def _padded(query, key, value, scale, causal, padding: Padding, forward, backward):
    """Attention with Keras' padding masks through cuDNN's key lengths (see the module doc)."""
    batch, seq_q = query.shape[0], query.shape[1]
    seq_kv = key.shape[1]
    key_mask = padding.key_mask if padding.key_mask is not None else tf.ones([batch, seq_kv], tf.bool)
    key_mask = tf.broadcast_to(key_mask, [batch, seq_kv])
    order = tf.argsort(tf.cast(tf.logical_not(key_mask), tf.int32), axis=1, stable=True)
    inverse = tf.argsort(order, axis=1, stable=True)
    key_count = tf.reduce_sum(tf.cast(key_mask, tf.int32), axis=1)
    lengths = (tf.fill([batch], seq_q), tf.maximum(key_count, 1))  # cuDNN computes every query row
    moved_key, moved_value = _permute(key, order, inverse), _permute(value, order, inverse)
    if causal:  # one mask for queries and keys (decide asks it): the valid tokens keep their causal order
        out = _permute(_fused(_permute(query, order, inverse), moved_key, moved_value, scale, "padding_causal",
                              lengths, forward, backward), inverse, order)
    else:
        out = _fused(query, moved_key, moved_value, scale, "padding", lengths, forward, backward)
    row_valid = tf.broadcast_to((key_count > 0)[:, None], [batch, seq_q])
    if padding.query_mask is not None:
        row_valid = tf.logical_and(row_valid, tf.broadcast_to(padding.query_mask, [batch, seq_q]))
    # Keras' value for a row whose keys are all masked: a uniform softmax over all S keys, the mean of the values.
    heads, kv_heads = query.shape[2], value.shape[2]
    mean_value = tf.cast(tf.reduce_mean(tf.cast(value, tf.float32), axis=1, keepdims=True), value.dtype)
    if kv_heads != heads:
        mean_value = tf.repeat(mean_value, heads // kv_heads, axis=2)
    return tf.where(row_valid[:, :, None, None], out, mean_value)


def _permute(tensor, order, inverse):
    """`tensor` [B, S, ...] with its tokens in `order` (per sequence); the gradient goes back through `inverse`."""
    @tf.custom_gradient
    def permute(tensor):
        def grad(d_moved):
            return tf.gather(d_moved, inverse, axis=1, batch_dims=1)

        return tf.gather(tensor, order, axis=1, batch_dims=1), grad

    return permute(tensor)


def _fused(query, key, value, scale, mask, lengths, forward, backward):
    @tf.custom_gradient
    def fused(query, key, value):
        out, stats = forward(query, key, value, scale, mask, lengths)

        def grad(d_out):
            return backward(query, key, value, stats, tf.cast(d_out, query.dtype), out, scale, mask, lengths)

        return out, grad

    return fused(query, key, value)


def cudnn_forward(query, key, value, scale: float, mask: str, lengths=None):
    """(output [B, T, N, H], softmax statistics [B, N, T]) from cuDNN's fused forward (`__cudnn$fmhaSoftmax`);
    `mask` one of `plan.attention.MASK_TYPES`, `lengths` the int32 [B] query and key lengths of the padding masks."""
    batch, seq_q, heads, head_dim = query.shape.as_list()
    seq_kv = key.shape[1]
    config = attention_plan.backend_config(batch, heads, seq_q, seq_kv, query.dtype.name, scale, mask,
                                           backward=False)
    out, stats, _ = attention_seams.xla_custom_call(
        [query, key, value] + _length_operands(lengths), attention_plan.FORWARD_TARGET, config,
        [query.dtype, tf.float32, tf.uint8], [[batch, heads, seq_q, head_dim], [batch, heads, seq_q], [0]])
    return tf.transpose(out, [0, 2, 1, 3]), stats


def cudnn_backward(query, key, value, stats, d_out, out, scale: float, mask: str, lengths=None):
    """(dQ, dK, dV) as [B, T|S, N|K, H] from cuDNN's fused backward (`__cudnn$fmhaSoftmaxBackward`): dK and dV
    with key's and value's own heads. cuDNN reads `out` with the layout of `d_out` ([B, T, N, H] both)."""
    batch, seq_q, heads, head_dim = query.shape.as_list()
    seq_kv, kv_heads = key.shape[1], key.shape[2]
    config = attention_plan.backend_config(batch, heads, seq_q, seq_kv, query.dtype.name, scale, mask,
                                           backward=True)
    d_query, d_key, d_value, _ = attention_seams.xla_custom_call(
        [query, key, value, stats, d_out, out] + _length_operands(lengths), attention_plan.BACKWARD_TARGET, config,
        [query.dtype, key.dtype, value.dtype, tf.uint8],
        [[batch, heads, seq_q, head_dim], [batch, kv_heads, seq_kv, head_dim], [batch, kv_heads, seq_kv, head_dim],
         [0]])
    return [tf.transpose(grad, [0, 2, 1, 3]) for grad in (d_query, d_key, d_value)]


def _length_operands(lengths) -> list:
    return [] if lengths is None else [tf.cast(length, tf.int32) for length in lengths]


def _replicas_are_gpus(strategy) -> bool:
    devices = getattr(strategy.extended, "worker_devices", ()) or ()
    return bool(devices) and all("GPU" in device.upper() for device in devices)


@functools.lru_cache(maxsize=1)
def _compute_capability() -> Optional[tuple]:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    capability = tf.config.experimental.get_device_details(gpus[0]).get("compute_capability")
    return tuple(capability) if capability else None


def _count_and_say(text: str) -> None:
    with _COUNTS_LOCK:
        _COUNTS[text] += 1
        first = text not in _SAID
        _SAID.add(text)
    if first:
        log.info("tf_nvlink: attention: %s", text)
