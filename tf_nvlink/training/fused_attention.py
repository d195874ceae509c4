"""Keras' attention as cuDNN's flash attention under a tf_nvlink strategy: one fused kernel forward, one backward.

Keras' TensorFlow backend computes `ops.dot_product_attention` (`MultiHeadAttention` calls it when it has no dropout
and returns no scores) as separate XLA ops that write every head's [T, S] scores to memory and read them back, in
the forward and again in the backward. Inside a replica's XLA program on NVIDIA GPUs (compute capability 8.0+),
for bfloat16 or float16 attention with no mask or a causal one (`plan.attention.decide` has every condition), this
rule emits XLA's cuDNN custom calls instead, with a custom gradient that is cuDNN's fused backward. Elsewhere
Keras' own attention runs, and one INFO line per reason says why. It is asked for with
`tf_nvlink.strategy(fused_attention="auto")`; the default, "off", keeps Keras' attention everywhere until the fused
path's speed and its agreement with Keras' attention are measured on GPUs (tests/test_gpu.py,
benchmarks/fused_attention_micro.py).

The custom calls need fully known shapes, and tf_nvlink traces each replica's step with its batch dimension open
(`exact_batches.open_batch_dimension`). The rule takes the batch size the trace hides (`thread_state.static_batch`)
for the attention's batch: XLA checks it when it compiles (`tf.ensure_shape`), so a model whose attention runs on
another batch than its input's (a reshape into the batch) fails to compile, naming both shapes, where it would
otherwise compute on the wrong rows; such a model trains with `fused_attention="off"`.

Example:
    >>> with tf_nvlink.strategy(fused_attention="auto").scope():
    ...     model = transformer()                   # keras.layers.MultiHeadAttention(..., use_causal_mask=True)
    ...     model.compile(optimizer="adamw", loss=loss, jit_compile=True)
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import attention as attention_seams, tf_runtime
from tf_nvlink.plan import attention as attention_plan
from tf_nvlink.training import thread_state

log = logging.getLogger("tf_nvlink")
_SAID: set = set()  # each decision's line once per process


def dot_product_attention(keras_attention: Callable, arguments: dict):
    """The rule `internals.attention` calls for each `dot_product_attention`: cuDNN's fused attention where
    `plan.attention.decide` says it applies under a tf_nvlink strategy, else Keras' own (`keras_attention`)."""
    strategy = tf.distribute.get_strategy() if tf.distribute.has_strategy() else None
    if not base.is_tf_nvlink_strategy(strategy):
        return keras_attention(**arguments)
    query, key, value = (tf.convert_to_tensor(arguments[name]) for name in ("query", "key", "value"))
    facts = call_facts(strategy, query, key, value, arguments)
    fused, why = attention_plan.decide(facts)
    _say_once(("fused: " if fused else "Keras' attention: ") + why)
    if not fused:
        return keras_attention(**arguments)
    scale = arguments.get("scale")
    scale = float(scale) if scale is not None else float(query.shape[-1]) ** -0.5
    causal = facts.mask == "causal"
    batch = query.shape[0] if query.shape[0] is not None else thread_state.current().static_batch
    return attend(query, key, value, scale, causal, batch)


def call_facts(strategy, query, key, value, arguments: dict) -> attention_plan.AttentionFacts:
    """What `plan.attention.decide` needs of one call, read while it is traced."""
    mask = arguments.get("mask")
    scale = arguments.get("scale")
    dtypes = {query.dtype, key.dtype, value.dtype}
    batch_known = query.shape[0] is not None or bool(thread_state.current().static_batch)
    return attention_plan.AttentionFacts(
        setting=base.fused_attention_of(strategy), in_xla=tf_runtime.in_xla_context(),
        on_gpu=_replicas_are_gpus(strategy), compute_capability=_compute_capability(),
        dtype=query.dtype.name if len(dtypes) == 1 else "mixed",
        query_shape=tuple(query.shape.as_list()) if query.shape.rank is not None else (),
        key_shape=tuple(key.shape.as_list()) if key.shape.rank is not None else (),
        value_shape=tuple(value.shape.as_list()) if value.shape.rank is not None else (),
        mask="tensor" if mask is not None else "causal" if arguments.get("is_causal") else "none",
        has_bias=arguments.get("bias") is not None, soft_cap=arguments.get("attn_logits_soft_cap") is not None,
        scale_known=scale is None or isinstance(scale, (int, float)), batch_known=batch_known)


def attend(query, key, value, scale: float, causal: bool, batch: int, kernels: Optional[tuple] = None):
    """Fused attention of `query` [B, T, N, H] on `key` and `value` [B, S, N, H]. Where the trace leaves B open,
    `batch` (the batch size of the step traced) is B: the tensors are given that size for the custom calls
    (`tf.ensure_shape`, which XLA checks when it compiles) and the output's batch is open again after them.
    `kernels` (forward, backward) replaces the custom calls (tests on CPU pass reference kernels)."""
    forward, backward = kernels or (cudnn_forward, cudnn_backward)
    opened = query.shape[0] is None
    if opened:
        query, key, value = (tf.ensure_shape(tensor, [batch] + tensor.shape.as_list()[1:])
                             for tensor in (query, key, value))
    out = _fused(query, key, value, scale, causal, forward, backward)
    if opened:
        out = tf.compat.v1.placeholder_with_default(out, [None] + out.shape.as_list()[1:])
    return out


def _fused(query, key, value, scale, causal, forward, backward):
    @tf.custom_gradient
    def fused(query, key, value):
        out, stats = forward(query, key, value, scale, causal)

        def grad(d_out):
            return backward(query, key, value, stats, tf.cast(d_out, query.dtype), out, scale, causal)

        return out, grad

    return fused(query, key, value)


def cudnn_forward(query, key, value, scale: float, causal: bool):
    """(output [B, T, N, H], softmax statistics [B, N, T]) from cuDNN's fused forward (`__cudnn$fmhaSoftmax`)."""
    batch, seq_q, heads, head_dim = query.shape.as_list()
    seq_kv = key.shape[1]
    config = attention_plan.backend_config(batch, heads, seq_q, seq_kv, query.dtype.name, scale, causal,
                                           backward=False)
    out, stats, _ = attention_seams.xla_custom_call(
        [query, key, value], attention_plan.FORWARD_TARGET, config, [query.dtype, tf.float32, tf.uint8],
        [[batch, heads, seq_q, head_dim], [batch, heads, seq_q], [0]])
    return tf.transpose(out, [0, 2, 1, 3]), stats


def cudnn_backward(query, key, value, stats, d_out, out, scale: float, causal: bool):
    """(dQ, dK, dV) as [B, T|S, N, H] from cuDNN's fused backward (`__cudnn$fmhaSoftmaxBackward`)."""
    batch, seq_q, heads, head_dim = query.shape.as_list()
    seq_kv = key.shape[1]
    config = attention_plan.backend_config(batch, heads, seq_q, seq_kv, query.dtype.name, scale, causal,
                                           backward=True)
    d_query, d_key, d_value, _ = attention_seams.xla_custom_call(
        [query, key, value, stats, d_out, out], attention_plan.BACKWARD_TARGET, config,
        [query.dtype, key.dtype, value.dtype, tf.uint8],
        [[batch, heads, seq_q, head_dim], [batch, heads, seq_kv, head_dim], [batch, heads, seq_kv, head_dim], [0]])
    return [tf.transpose(grad, [0, 2, 1, 3]) for grad in (d_query, d_key, d_value)]


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


def _say_once(text: str) -> None:
    if text not in _SAID:
        _SAID.add(text)
        log.info("tf_nvlink: attention: %s", text)
