"""Fused attention: whether a call of Keras' attention can run as cuDNN's flash attention (one fused kernel forward,
one backward) inside XLA on an NVIDIA GPU, and the custom calls' configuration. Pure: facts in, a decision out.

Keras' TensorFlow backend computes `ops.dot_product_attention` (which `MultiHeadAttention` calls) as
softmax(Q K^T) V in separate XLA ops, writing the [T, S] scores of every head to memory and reading them back, in
the forward and again in the backward; it refuses `flash_attention=True`. XLA itself serves cuDNN's fused
attention as custom calls (`__cudnn$fmhaSoftmax` and `__cudnn$fmhaSoftmaxBackward`, configured by
`CudnnfMHABackendConfig` in XLA's `xla/service/gpu/backend_configs.proto`), which JAX's cuDNN attention emits;
`tf_nvlink.training.fused_attention` emits the same calls from TensorFlow where `decide` says they apply.

Example:
    >>> from tf_nvlink.plan import attention
    >>> attention.decide(attention.AttentionFacts(setting="auto", in_xla=True, on_gpu=True,
    ...     compute_capability=(9, 0), dtype="bfloat16", query_shape=(8, 512, 16, 64), key_shape=(8, 512, 4, 64),
    ...     value_shape=(8, 512, 4, 64), mask="causal", batch=8))
    (True, 'cuDNN flash attention (causal, bfloat16, 16 query heads on 4 of 64, 512 x 512 tokens)')
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

SETTINGS = ("auto", "off")
FORWARD_TARGET = "__cudnn$fmhaSoftmax"
BACKWARD_TARGET = "__cudnn$fmhaSoftmaxBackward"
DTYPES = {"bfloat16": "BF16", "float16": "F16"}
MIN_COMPUTE_CAPABILITY = (8, 0)  # flash attention in cuDNN: Ampere and newer
# cuDNN's flash attention takes head sizes that are multiples of 8, up to 128 before Hopper and up to 256 from
# compute capability 9.0 (JAX's check_is_flash_attention asks the same).
MAX_HEAD_DIM = 128
MAX_HEAD_DIM_HOPPER = 256
# The masks a call can carry: "none"; "causal" (is_causal=True: Keras' top-left causal mask, row t sees keys
# s <= t, which is also cuDNN's CAUSAL); "padding" and "padding_causal" (a mask made by Keras' MultiHeadAttention
# or GroupedQueryAttention from its inputs' Keras masks alone, e.g. Embedding(mask_zero=True): query rows and keys
# that are padding, with or without the causal mask); "tensor" (any other mask array, e.g. an attention_mask).
MASKS = ("none", "causal", "padding", "padding_causal", "tensor")
MASK_TYPES = {"none": "NO_MASK", "causal": "CAUSAL", "padding": "PADDING", "padding_causal": "PADDING_CAUSAL"}


def validate_fused_attention(fused_attention) -> str:
    """"auto" (fused where it applies, the default) or "off"; ValueError naming the valid choices for anything else.

    Example:
        >>> validate_fused_attention("off")
        'off'
    """
    if isinstance(fused_attention, str) and fused_attention.strip().lower() in SETTINGS:
        return fused_attention.strip().lower()
    raise ValueError(f"fused_attention should be one of {list(SETTINGS)}: 'auto' (the default) runs Keras' attention "
                     f"as cuDNN's fused flash attention where it applies (jit_compile=True on NVIDIA GPUs, bfloat16 "
                     f"or float16; see tf_nvlink.plan.attention.decide), 'off' keeps Keras' own everywhere. "
                     f"Received: fused_attention={fused_attention!r}")


def max_head_dim(compute_capability: Optional[tuple]) -> int:
    """The largest head size cuDNN's flash attention takes on a GPU of `compute_capability` (None: unknown).

    Example:
        >>> max_head_dim((9, 0)), max_head_dim((8, 0))
        (256, 128)
    """
    if compute_capability is not None and tuple(compute_capability) >= (9, 0):
        return MAX_HEAD_DIM_HOPPER
    return MAX_HEAD_DIM


def summary(setting: str) -> str:
    """The line the strategy logs after its plan: where Keras' attention runs fused, and where not.

    Example:
        >>> summary("off")
        "tf_nvlink attention: fused_attention='off': Keras' own attention everywhere"
    """
    if setting == "off":
        return "tf_nvlink attention: fused_attention='off': Keras' own attention everywhere"
    return ("tf_nvlink attention: fused_attention='auto': Keras' attention (MultiHeadAttention, "
            "GroupedQueryAttention, keras.ops.dot_product_attention) runs as cuDNN's flash attention inside a "
            "replica's XLA program (jit_compile=True) on NVIDIA GPUs of compute capability 8.0+, in bfloat16 or "
            "float16, head size a multiple of 8 up to 128 (256 from compute capability 9.0), with no mask, a causal "
            "one, grouped-query heads, or padding masks made from the inputs' Keras masks; elsewhere (an "
            "attention_mask tensor, a bias, dropout, returned scores, float32) Keras' attention runs, and one INFO "
            "line says why")


@dataclasses.dataclass(frozen=True)
class AttentionFacts:
    """One call of Keras' `dot_product_attention`, as the rule sees it while tracing: shapes are [B, T, N, H] for the
    query and [B, S, K, H] for key and value (K = N, or fewer heads that N is a multiple of: grouped-query
    attention, with key and value as they were before their heads were repeated), None where the trace does not
    know a dimension; `mask` one of `MASKS`; `same_padding`: for "padding_causal", the query's and the keys' padding
    is one mask (self-attention over one masked sequence); `scale_known`: the scale is a Python number or None
    (1/sqrt(H)); `batch`: the batch size, from the shapes or from the step traced (None: unknown)."""

    setting: str
    in_xla: bool
    on_gpu: bool
    compute_capability: Optional[tuple] = None
    dtype: str = "float32"
    query_shape: tuple = ()
    key_shape: tuple = ()
    value_shape: tuple = ()
    mask: str = "none"
    same_padding: bool = False
    has_bias: bool = False
    soft_cap: bool = False
    scale_known: bool = True
    batch: Optional[int] = 1


def decide(facts: AttentionFacts) -> tuple[bool, str]:
    """(fused, why): whether the call runs as cuDNN's fused attention, and the reason in a user's words (the reason
    it does not, when not).

    Example:
        >>> decide(AttentionFacts(setting="auto", in_xla=False, on_gpu=True))
        (False, 'not inside an XLA program (compile the model with jit_compile=True)')
    """
    if facts.setting == "off":
        return False, "fused_attention='off'"
    if not facts.on_gpu:
        return False, "not on an NVIDIA GPU"
    if not facts.in_xla:
        return False, "not inside an XLA program (compile the model with jit_compile=True)"
    if facts.compute_capability is not None and tuple(facts.compute_capability) < MIN_COMPUTE_CAPABILITY:
        return False, (f"GPU compute capability {'.'.join(map(str, facts.compute_capability))}: cuDNN's flash "
                       f"attention needs {'.'.join(map(str, MIN_COMPUTE_CAPABILITY))} or newer")
    if facts.dtype not in DTYPES:
        return False, f"{facts.dtype} attention: cuDNN's flash attention takes {' or '.join(DTYPES)}"
    shapes = (facts.query_shape, facts.key_shape, facts.value_shape)
    if any(len(shape) != 4 for shape in shapes):
        return False, "query, key and value are not 4-D [batch, tokens, heads, head size]"
    (_, seq_q, heads, head_dim), (_, seq_kv, kv_heads, key_dim), (_, seq_v, v_heads, value_dim) = shapes
    if None in (seq_q, heads, head_dim, seq_kv, kv_heads, key_dim, seq_v, v_heads, value_dim):
        return False, "the tokens, heads or head size are unknown to the trace"
    if facts.batch is None:
        return False, "the batch size is unknown to the trace"
    if facts.batch == 0 or 0 in (seq_q, seq_kv):
        return False, (f"an empty attention (batch {facts.batch}, {seq_q} query and {seq_kv} key tokens): cuDNN's "
                       f"kernels take no empty dimension")
    if not (head_dim == key_dim == value_dim):
        return False, f"head sizes differ (query {head_dim}, key {key_dim}, value {value_dim})"
    limit = max_head_dim(facts.compute_capability)
    if head_dim > limit or head_dim % 8:
        return False, (f"head size {head_dim}: cuDNN's flash attention takes multiples of 8 up to {limit} on this GPU "
                       f"(up to {MAX_HEAD_DIM} before compute capability 9.0, {MAX_HEAD_DIM_HOPPER} from it)")
    if seq_kv != seq_v:
        return False, f"key and value tokens differ ({seq_kv} and {seq_v})"
    if kv_heads != v_heads or heads % kv_heads:
        return False, (f"{heads} query heads on {kv_heads} key and {v_heads} value heads (fused when key and value "
                       f"have the same heads and the query's are a multiple of them)")
    if facts.has_bias:
        return False, "an attention bias"
    if facts.soft_cap:
        return False, "a logits soft cap"
    if not facts.scale_known:
        return False, "a scale that is a tensor"
    if facts.mask == "tensor":
        return False, ("a mask tensor other than one MultiHeadAttention or GroupedQueryAttention made from its inputs' "
                       "Keras masks (an attention_mask argument, a sliding window, or a mask passed to "
                       "keras.ops.dot_product_attention)")
    if facts.mask == "padding_causal" and not facts.same_padding:
        return False, ("a causal mask with padding that differs between the query and the keys (fused for "
                       "self-attention over one masked sequence)")
    mask = {"none": "no mask", "causal": "causal", "padding": "padding",
            "padding_causal": "padding, causal"}[facts.mask]
    grouped = f"{heads} query heads on {kv_heads}" if kv_heads != heads else f"{heads} heads"
    return True, (f"cuDNN flash attention ({mask}, {facts.dtype}, {grouped} of {head_dim}, {seq_q} x {seq_kv} "
                  f"tokens)")


# The contracting and batch dimensions of the fused kernel's matrix products for query, key and value laid out as
# [B, T, N, H] (JAX's "BTNH" layout of the same custom calls): ((lhs contracting, rhs contracting), (lhs batch,
# rhs batch)). BMM1: Q K^T -> P [B, N, T, S]; BMM2: P V -> O; the backward's four products give dK, dQ, dV, dP.
_FORWARD_DIMS = {"bmm1_dot_dimension_numbers": ((3, 3), ((0, 2), (0, 2))),
                 "bmm2_dot_dimension_numbers": ((3, 1), ((0, 1), (0, 2)))}
_BACKWARD_DIMS = {"bmm1_grad_gemm1_dot_dimension_numbers": ((2, 1), ((0, 1), (0, 2))),
                  "bmm1_grad_gemm2_dot_dimension_numbers": ((3, 1), ((0, 1), (0, 2))),
                  "bmm2_grad_gemm1_dot_dimension_numbers": ((2, 1), ((0, 1), (0, 2))),
                  "bmm2_grad_gemm2_dot_dimension_numbers": ((3, 3), ((0, 2), (0, 2)))}


def backend_config(batch: int, heads: int, seq_q: int, seq_kv: int, dtype: str, scale: float, mask: str,
                   backward: bool) -> str:
    """The custom call's `backend_config`: XLA's `GpuBackendConfig` as JSON, holding the `CudnnfMHABackendConfig`
    of the forward or the backward call for query, key and value as [B, T, N, H] (`heads`: the query's; key and
    value may have fewer) and `mask` one of `MASK_TYPES` (the padding masks add the int32 [B] query and key
    lengths as operands). XLA rejects fields it does not know; these are the fields of TensorFlow 2.21's XLA (the
    ones JAX's cuDNN attention sets).

    Example:
        >>> json.loads(backend_config(8, 16, 512, 512, "bfloat16", 0.125, "causal", False))[
        ...     "cudnn_fmha_backend_config"]["mask_type"]
        'CAUSAL'
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype should be one of {list(DTYPES)}. Received: dtype={dtype!r}")
    if mask not in MASK_TYPES:
        raise ValueError(f"mask should be one of {list(MASK_TYPES)}. Received: mask={mask!r}")
    config = {
        "algorithm": {"algo_id": "0", "math_type": "TENSOR_OP_MATH", "tuning_knobs": {"17": "1", "24": "0"},
                      "is_cudnn_frontend": True, "workspace_size": "0"},
        "fmha_scale": float(scale),
        "dropout_rate": 0.0,
        "intermediate_tensor_shape": {
            "element_type": DTYPES[dtype], "dimensions": [str(batch), str(heads), str(seq_q), str(seq_kv)],
            "tuple_shapes": [], "is_dynamic_dimension": [False] * 4,
            "layout": {"dim_level_types": [], "dim_unique": [], "dim_ordered": [], "minor_to_major": ["3", "2", "1", "0"],
                       "tiles": [], "element_size_in_bits": "0", "memory_space": "0",
                       "index_primitive_type": "PRIMITIVE_TYPE_INVALID",
                       "pointer_primitive_type": "PRIMITIVE_TYPE_INVALID",
                       "dynamic_shape_metadata_prefix_bytes": "0"}},
        "seed": "0",
        "is_flash_attention": True,
        "mask_type": MASK_TYPES[mask],
        "sliding_window_length": 0,
    }
    for name, ((lhs_contracting, rhs_contracting), (lhs_batch, rhs_batch)) in (
            _BACKWARD_DIMS if backward else _FORWARD_DIMS).items():
        config[name] = {"lhs_contracting_dimensions": [str(lhs_contracting)],
                        "rhs_contracting_dimensions": [str(rhs_contracting)],
                        "lhs_batch_dimensions": [str(d) for d in lhs_batch],
                        "rhs_batch_dimensions": [str(d) for d in rhs_batch]}
    return json.dumps({"operation_queue_id": "0", "wait_on_operation_queues": [], "cudnn_fmha_backend_config": config})
