"""tf_nvlink.plan.attention: where cuDNN's fused attention applies, and the custom calls' configuration (checked
field by field against the JSON names of XLA's CudnnfMHABackendConfig)."""

import json

import pytest

from error_messages import raises_naming
from tf_nvlink.plan import attention

SHAPE = (8, 512, 16, 64)


def facts(**changes):
    base = dict(setting="auto", in_xla=True, on_gpu=True, compute_capability=(9, 0), dtype="bfloat16",
                query_shape=SHAPE, key_shape=SHAPE, value_shape=SHAPE, mask="causal", batch=8)
    base.update(changes)
    return attention.AttentionFacts(**base)


def shapes(query, key=None):
    key = key or query
    return dict(query_shape=query, key_shape=key, value_shape=key)


def test_the_usual_causal_bfloat16_attention_runs_fused():
    assert attention.decide(facts()) == (
        True, "cuDNN flash attention (causal, bfloat16, 16 heads of 64, 512 x 512 tokens)")
    assert attention.decide(facts(mask="none", dtype="float16", key_shape=(8, 128, 16, 64),
                                  value_shape=(8, 128, 16, 64)))[0]
    assert attention.decide(facts(query_shape=(None, 512, 16, 64)))[0]  # the batch, from the step traced


@pytest.mark.parametrize("changes, why", [
    (dict(mask="causal", **shapes((8, 96, 16, 64), (8, 320, 16, 64))),
     "cuDNN flash attention (causal, bfloat16, 16 heads of 64, 96 x 320 tokens)"),
    (dict(mask="causal", **shapes((8, 320, 16, 64), (8, 96, 16, 64))),
     "cuDNN flash attention (causal, bfloat16, 16 heads of 64, 320 x 96 tokens)"),
    (dict(**shapes((8, 512, 16, 64), (8, 512, 4, 64))),
     "cuDNN flash attention (causal, bfloat16, 16 query heads on 4 of 64, 512 x 512 tokens)"),
    (dict(**shapes((8, 512, 16, 64), (8, 512, 1, 64))),
     "cuDNN flash attention (causal, bfloat16, 16 query heads on 1 of 64, 512 x 512 tokens)"),
    (dict(**shapes((2, 200, 4, 256))), "cuDNN flash attention (causal, bfloat16, 4 heads of 256, 200 x 200 tokens)"),
    (dict(mask="padding", **shapes((8, 96, 16, 64), (8, 320, 16, 64))),
     "cuDNN flash attention (padding, bfloat16, 16 heads of 64, 96 x 320 tokens)"),
    (dict(mask="padding_causal", same_padding=True),
     "cuDNN flash attention (padding, causal, bfloat16, 16 heads of 64, 512 x 512 tokens)"),
])
def test_what_cudnn_computes_runs_fused(changes, why):
    """Causal with T != S (Keras' and cuDNN's causal masks are both top-left), grouped-query heads, head size 256
    from compute capability 9.0, and Keras' padding masks."""
    assert attention.decide(facts(**changes)) == (True, why)


@pytest.mark.parametrize("changes, reason", [
    (dict(setting="off"), "fused_attention='off'"),
    (dict(on_gpu=False), "not on an NVIDIA GPU"),
    (dict(in_xla=False), "jit_compile=True"),
    (dict(compute_capability=(7, 0)), "compute capability 7.0"),
    (dict(dtype="float32"), "float32 attention"),
    (dict(dtype="mixed"), "mixed attention"),
    (dict(query_shape=(8, 512, 1024)), "not 4-D"),
    (dict(query_shape=(8, None, 16, 64)), "unknown to the trace"),
    (dict(batch=None), "batch size is unknown"),
    (dict(batch=0), "an empty attention (batch 0"),
    (dict(**shapes((8, 0, 16, 64), (8, 512, 16, 64))), "0 query and 512 key tokens"),
    (dict(compute_capability=(8, 0), **shapes((8, 512, 16, 256))), "head size 256: cuDNN's flash attention takes "
                                                                   "multiples of 8 up to 128 on this GPU"),
    (dict(**shapes((8, 512, 16, 264))), "head size 264"),
    (dict(**shapes((8, 512, 16, 60))), "head size 60"),
    (dict(value_shape=(8, 512, 16, 32)), "head sizes differ"),
    (dict(**shapes((8, 512, 16, 64), (8, 512, 3, 64))), "16 query heads on 3 key and 3 value heads"),
    (dict(key_shape=(8, 512, 4, 64)), "16 query heads on 4 key and 16 value heads"),
    (dict(value_shape=(8, 256, 16, 64)), "key and value tokens differ"),
    (dict(has_bias=True), "bias"),
    (dict(soft_cap=True), "soft cap"),
    (dict(scale_known=False), "scale that is a tensor"),
    (dict(mask="tensor"), "an attention_mask argument"),
    (dict(mask="padding_causal", same_padding=False), "a causal mask with padding that differs"),
])
def test_what_keeps_keras_attention_is_named(changes, reason):
    fused, why = attention.decide(facts(**changes))
    assert not fused and reason in why, why


def test_the_largest_head_size_follows_the_compute_capability():
    assert [attention.max_head_dim(cc) for cc in ((8, 0), (8, 9), (9, 0), (10, 0), None)] == [128, 128, 256, 256, 128]


def test_the_summary_says_where_it_applies():
    assert "Keras' own attention everywhere" in attention.summary("off")
    text = attention.summary("auto")
    for part in ("jit_compile=True", "compute capability 8.0+", "bfloat16 or float16", "256 from compute capability "
                 "9.0", "grouped-query", "padding masks made from the inputs' Keras masks", "attention_mask tensor",
                 "one INFO line says why"):
        assert part in text, part


def test_settings():
    assert attention.validate_fused_attention(" OFF ") == "off" and attention.validate_fused_attention("auto") == "auto"
    for bad in ("on", True, None, 1):
        raises_naming(lambda bad=bad: attention.validate_fused_attention(bad), repr(bad), "'auto'", "'off'")


def dimension_numbers(config, name):
    numbers = config[name]
    return ((int(numbers["lhs_contracting_dimensions"][0]), int(numbers["rhs_contracting_dimensions"][0])),
            (tuple(map(int, numbers["lhs_batch_dimensions"])), tuple(map(int, numbers["rhs_batch_dimensions"]))))


def test_the_backend_config_holds_the_forward_or_the_backward_products():
    forward = json.loads(attention.backend_config(8, 16, 96, 320, "bfloat16", 0.125, "causal", backward=False))
    config = forward["cudnn_fmha_backend_config"]
    assert set(forward) == {"operation_queue_id", "wait_on_operation_queues", "cudnn_fmha_backend_config"}
    assert config["mask_type"] == "CAUSAL" and config["fmha_scale"] == 0.125 and config["is_flash_attention"]
    # [B, N, T, S]: the query's tokens before the keys' (the backward reads the shape of P from it)
    assert config["intermediate_tensor_shape"]["dimensions"] == ["8", "16", "96", "320"]
    assert config["intermediate_tensor_shape"]["element_type"] == "BF16"
    # The six products of JAX's BTNH layout, ((lhs contracting, rhs contracting), (lhs batch, rhs batch)):
    assert dimension_numbers(config, "bmm1_dot_dimension_numbers") == ((3, 3), ((0, 2), (0, 2)))  # Q K^T -> P
    assert dimension_numbers(config, "bmm2_dot_dimension_numbers") == ((3, 1), ((0, 1), (0, 2)))  # P V -> O
    assert not any("grad" in key for key in config)
    backward = json.loads(attention.backend_config(2, 16, 2048, 1024, "float16", 0.125, "none", backward=True))
    config = backward["cudnn_fmha_backend_config"]
    assert config["mask_type"] == "NO_MASK" and config["intermediate_tensor_shape"]["element_type"] == "F16"
    assert config["intermediate_tensor_shape"]["dimensions"] == ["2", "16", "2048", "1024"]
    assert dimension_numbers(config, "bmm1_grad_gemm1_dot_dimension_numbers") == ((2, 1), ((0, 1), (0, 2)))  # dK
    assert dimension_numbers(config, "bmm1_grad_gemm2_dot_dimension_numbers") == ((3, 1), ((0, 1), (0, 2)))  # dQ
    assert dimension_numbers(config, "bmm2_grad_gemm1_dot_dimension_numbers") == ((2, 1), ((0, 1), (0, 2)))  # dV
    assert dimension_numbers(config, "bmm2_grad_gemm2_dot_dimension_numbers") == ((3, 3), ((0, 2), (0, 2)))  # dP
    assert sorted(key for key in config if key.endswith("dot_dimension_numbers")) == [
        "bmm1_grad_gemm1_dot_dimension_numbers", "bmm1_grad_gemm2_dot_dimension_numbers",
        "bmm2_grad_gemm1_dot_dimension_numbers", "bmm2_grad_gemm2_dot_dimension_numbers"]
    raises_naming(lambda: attention.backend_config(1, 1, 8, 8, "float32", 1.0, "none", False), "'float32'",
                  "'bfloat16'")


@pytest.mark.parametrize("mask, mask_type", [("none", "NO_MASK"), ("causal", "CAUSAL"), ("padding", "PADDING"),
                                             ("padding_causal", "PADDING_CAUSAL")])
def test_each_mask_has_its_cudnn_mask_type(mask, mask_type):
    config = json.loads(attention.backend_config(1, 2, 8, 8, "bfloat16", 1.0, mask, False))
    assert config["cudnn_fmha_backend_config"]["mask_type"] == mask_type


def test_a_mask_cudnn_has_no_type_for_is_refused_naming_the_choices():
    raises_naming(lambda: attention.backend_config(1, 1, 8, 8, "bfloat16", 1.0, "tensor", False), "'tensor'",
                  "'padding'")
