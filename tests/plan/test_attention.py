"""tf_nvlink.plan.attention: where cuDNN's fused attention applies, and the custom calls' configuration (checked
field by field against the JSON names of XLA's CudnnfMHABackendConfig)."""

import json

import pytest

from error_messages import raises_naming
from tf_nvlink.plan import attention

SHAPE = (8, 512, 16, 64)


def facts(**changes):
    base = dict(setting="auto", in_xla=True, on_gpu=True, compute_capability=(9, 0), dtype="bfloat16",
                query_shape=SHAPE, key_shape=SHAPE, value_shape=SHAPE, mask="causal")
    base.update(changes)
    return attention.AttentionFacts(**base)


def test_the_usual_causal_bfloat16_attention_runs_fused():
    assert attention.decide(facts()) == (
        True, "cuDNN flash attention (causal, bfloat16, 16 heads of 64, 512 x 512 tokens)")
    assert attention.decide(facts(mask="none", dtype="float16", key_shape=(8, 128, 16, 64),
                                  value_shape=(8, 128, 16, 64)))[0]
    assert attention.decide(facts(query_shape=(None, 512, 16, 64)))[0]  # the batch, from the step traced


@pytest.mark.parametrize("changes, reason", [
    (dict(setting="off"), "fused_attention='off'"),
    (dict(on_gpu=False), "not on an NVIDIA GPU"),
    (dict(in_xla=False), "jit_compile=True"),
    (dict(compute_capability=(7, 0)), "compute capability 7.0"),
    (dict(dtype="float32"), "float32 attention"),
    (dict(dtype="mixed"), "mixed attention"),
    (dict(query_shape=(8, 512, 1024)), "not 4-D"),
    (dict(query_shape=(8, None, 16, 64)), "unknown to the trace"),
    (dict(batch_known=False), "batch size is unknown"),
    (dict(query_shape=(8, 512, 16, 256), key_shape=(8, 512, 16, 256), value_shape=(8, 512, 16, 256)),
     "head size 256"),
    (dict(query_shape=(8, 512, 16, 60), key_shape=(8, 512, 16, 60), value_shape=(8, 512, 16, 60)), "head size 60"),
    (dict(value_shape=(8, 512, 16, 32)), "head sizes differ"),
    (dict(key_shape=(8, 512, 4, 64), value_shape=(8, 512, 4, 64)), "heads"),
    (dict(has_bias=True), "bias"),
    (dict(soft_cap=True), "soft cap"),
    (dict(scale_known=False), "scale that is a tensor"),
    (dict(mask="tensor"), "a mask tensor"),
    (dict(key_shape=(8, 256, 16, 64), value_shape=(8, 256, 16, 64)), "causal mask over 512 query and 256 key"),
])
def test_what_keeps_keras_attention_is_named(changes, reason):
    fused, why = attention.decide(facts(**changes))
    assert not fused and reason in why, why


def test_settings():
    assert attention.validate_fused_attention(" OFF ") == "off" and attention.validate_fused_attention("auto") == "auto"
    for bad in ("on", True, None, 1):
        raises_naming(lambda bad=bad: attention.validate_fused_attention(bad), repr(bad), "'auto'", "'off'")


def test_the_backend_config_holds_the_forward_or_the_backward_products():
    forward = json.loads(attention.backend_config(8, 16, 512, 512, "bfloat16", 0.125, True, backward=False))
    config = forward["cudnn_fmha_backend_config"]
    assert set(forward) == {"operation_queue_id", "wait_on_operation_queues", "cudnn_fmha_backend_config"}
    assert config["mask_type"] == "CAUSAL" and config["fmha_scale"] == 0.125 and config["is_flash_attention"]
    assert config["intermediate_tensor_shape"]["dimensions"] == ["8", "16", "512", "512"]
    assert config["intermediate_tensor_shape"]["element_type"] == "BF16"
    assert config["bmm1_dot_dimension_numbers"] == {  # Q [B, T, N, H] x K [B, S, N, H] -> [B, N, T, S]
        "lhs_contracting_dimensions": ["3"], "rhs_contracting_dimensions": ["3"],
        "lhs_batch_dimensions": ["0", "2"], "rhs_batch_dimensions": ["0", "2"]}
    assert "bmm2_dot_dimension_numbers" in config and not any("grad" in key for key in config)
    backward = json.loads(attention.backend_config(2, 16, 2048, 2048, "float16", 0.125, False, backward=True))
    config = backward["cudnn_fmha_backend_config"]
    assert config["mask_type"] == "NO_MASK" and config["intermediate_tensor_shape"]["element_type"] == "F16"
    assert sorted(key for key in config if key.endswith("dot_dimension_numbers")) == [
        "bmm1_grad_gemm1_dot_dimension_numbers", "bmm1_grad_gemm2_dot_dimension_numbers",
        "bmm2_grad_gemm1_dot_dimension_numbers", "bmm2_grad_gemm2_dot_dimension_numbers"]
    raises_naming(lambda: attention.backend_config(1, 1, 8, 8, "float32", 1.0, False, False), "'float32'",
                  "'bfloat16'")
