"""tf_nvlink.training.fused_attention on CPU: the fused path's wiring (custom gradient, the batch the trace hides,
the fallback branch) with reference kernels in place of cuDNN's custom calls, and Keras' attention kept exactly
where the fused one does not apply (CPU replicas), with one line saying why. The custom calls themselves run on
GPUs: tests/test_gpu.py."""

import numpy as np
import pytest

import scenarios

B, T, N, H = 4, 8, 2, 8


def reference_forward(query, key, value, scale, causal):
    """What cuDNN's forward returns: the output [B, T, N, H] and the softmax's log-sum-exp [B, N, T]."""
    import tensorflow as tf

    dtype = query.dtype
    query, key, value = (tf.cast(tensor, tf.float32) for tensor in (query, key, value))
    logits = tf.einsum("btnh,bsnh->bnts", query, key) * scale
    if causal:
        logits += (1.0 - tf.linalg.band_part(tf.ones(logits.shape[-2:]), -1, 0)) * -1e9
    stats = tf.reduce_logsumexp(logits, axis=-1)
    return tf.cast(tf.einsum("bnts,bsnh->btnh", tf.exp(logits - stats[..., None]), value), dtype), stats


def reference_backward(query, key, value, stats, d_out, out, scale, causal):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch([query, key, value])
        again, _ = reference_forward(query, key, value, scale, causal)
    grads = tape.gradient(again, [query, key, value], output_gradients=d_out)
    return [tf.cast(grad, tensor.dtype) for grad, tensor in zip(grads, (query, key, value))]


def keras_attention(query, key, value, causal):
    import keras

    return keras.ops.dot_product_attention(query, key, value, scale=H ** -0.5, is_causal=causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("opened", [False, True])
def test_the_fused_path_gives_keras_attention_and_its_gradients_under_xla(tf, causal, opened):
    """`attend` with reference kernels in place of cuDNN's, inside an XLA program, against Keras' attention: the
    output and the gradients of query, key and value; `opened`: the step's trace leaves the batch open and the
    batch it hides is given (what a replica's step under tf_nvlink sees)."""
    from tf_nvlink.training import fused_attention

    rng = np.random.default_rng(0)
    query, key, value = (tf.constant(rng.normal(size=(B, T, N, H)).astype("float32")) for _ in range(3))
    weights = tf.constant(rng.normal(size=(B, T, N, H)).astype("float32"))

    def with_gradients(attention):
        @tf.function(jit_compile=True)
        def run(query, key, value):
            if opened:
                query, key, value = (tf.compat.v1.placeholder_with_default(t, [None, T, N, H])
                                     for t in (query, key, value))
            with tf.GradientTape() as tape:
                tape.watch([query, key, value])
                out = attention(query, key, value)
                loss = tf.reduce_sum(out * weights)
            return [out] + tape.gradient(loss, [query, key, value])

        return [t.numpy() for t in run(query, key, value)]

    fused = with_gradients(lambda q, k, v: fused_attention.attend(
        q, k, v, H ** -0.5, causal, B, kernels=(reference_forward, reference_backward)))
    keras_own = with_gradients(lambda q, k, v: keras_attention(q, k, v, causal))
    for got, want in zip(fused, keras_own):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_an_attention_batch_other_than_the_steps_fails_to_compile_naming_both(tf):
    """A model whose attention runs on another batch than the step's (a reshape into the batch): XLA refuses to
    compile, naming both shapes, where the fused kernel would otherwise run on the wrong rows."""
    from tf_nvlink.training import fused_attention

    @tf.function(jit_compile=True)
    def run(query):
        query = tf.compat.v1.placeholder_with_default(query, [None, T, N, H])
        return fused_attention.attend(query, query, query, H ** -0.5, True, B,
                                      kernels=(reference_forward, reference_backward))

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[3,8,2,8\].*\[4,8,2,8\]|\[4,8,2,8\].*\[3,8,2,8\]"):
        run(tf.zeros([3, T, N, H]))


# A tiny causal Transformer block trained under a tf_nvlink strategy on 2 CPU replicas: fused_attention "auto"
# (CPU: Keras' attention, one line says why), "off", and Keras' own function with the seam taken out all train
# to the same weights.
CPU = scenarios.Scenario("fused attention: 2 CPU replicas", r"""
import logging, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink
from tf_nvlink.distribute import base
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("tf_nvlink").addHandler(Keep()); logging.getLogger("tf_nvlink").setLevel(logging.INFO)
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
x = rng.integers(0, 16, size=(32, 8)).astype("int32"); y = np.roll(x, -1, axis=1)
def fit(setting):
    base.attach_fused_attention(strategy, setting)
    keras.utils.set_random_seed(2)
    with strategy.scope():
        tokens = keras.Input((8,), dtype="int32")
        h = keras.layers.Embedding(16, 16)(tokens)
        h = h + keras.layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=True)
        model = keras.Model(tokens, keras.layers.Dense(16)(h))
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    return [w.tolist() for w in model.get_weights()]
""", {"the default": "result = [base.fused_attention_of(strategy), strategy.fused_attention]",
      "auto, off and Keras' own": r"""
auto, off = fit("auto"), fit("off")
from tf_nvlink.internals.attention import keras_attention_module
tensorflow_nn = keras_attention_module()
from tf_nvlink.internals.registry import REGISTRY
REGISTRY.restore(tensorflow_nn, "dot_product_attention")
try:
    result = {"auto": auto, "off": off, "keras": fit("auto"),
              "lines": [l for l in lines if l.startswith("tf_nvlink: attention:")]}
finally:
    from tf_nvlink.internals import attention
    from tf_nvlink.training import install
    attention.install_attention_seam(install.KERAS_RULES)
""", "a bad setting": "tf_nvlink.strategy(devices=['/cpu:0', '/cpu:1'], fused_attention='on')",
    "the fused path inside XLA": r"""
# XLA on CPU replicas (split mode) with the GPU facts and the cuDNN kernels replaced by reference kernels: the rule's
# whole path in a fit (the step's batch open to the trace, the cond, the custom gradient) against Keras' attention.
import sys
sys.path.insert(0, "tests/training")
from test_fused_attention import reference_forward, reference_backward
from tf_nvlink.training import fused_attention
fused_attention._replicas_are_gpus = lambda strategy: True
fused_attention._compute_capability = lambda: (9, 0)
fused_attention.cudnn_forward, fused_attention.cudnn_backward = reference_forward, reference_backward
keras.mixed_precision.set_global_policy("mixed_bfloat16")
try:
    fused, plain = fit("auto"), fit("off")
finally:
    keras.mixed_precision.set_global_policy("float32")
result = {"fused": fused, "plain": plain, "lines": [l for l in lines if l.startswith("tf_nvlink: attention:")]}
"""}, expected_s=17)


def test_fused_attention_is_asked_for_not_the_default():
    assert CPU.result("the default") == ["off", "off"]


def test_cpu_replicas_keep_keras_attention_exactly_and_say_why():
    out = CPU.result("auto, off and Keras' own")
    assert out["auto"] == out["off"] == out["keras"]
    assert out["lines"] == ["tf_nvlink: attention: Keras' attention: not on an NVIDIA GPU",  # once, for 2 fits
                            "tf_nvlink: attention: Keras' attention: fused_attention='off'"]


def test_the_fused_path_trains_as_keras_attention_inside_xla():
    """The rule's path through a real fit: per-replica XLA programs (split mode on 2 CPU replicas, steps traced with
    their batch open), the fused branch taken, reference kernels in place of cuDNN's: the weights of Keras'
    attention to bfloat16's precision."""
    out = CPU.result("the fused path inside XLA")
    assert any(line.startswith("tf_nvlink: attention: fused: cuDNN flash attention (causal, bfloat16, 2 heads of 8, "
                               "8 x 8 tokens)") for line in out["lines"]), out["lines"]
    for fused, plain in zip(out["fused"], out["plain"]):
        np.testing.assert_allclose(np.array(fused), np.array(plain), rtol=2e-2, atol=2e-2)
    assert out["fused"] != out["plain"]  # the fused branch ran (bfloat16 rounds differently there)


def test_a_bad_setting_names_the_choices():
    error = CPU.error("a bad setting")
    assert "ValueError: fused_attention should be one of ['auto', 'off']" in error and "'on'" in error
