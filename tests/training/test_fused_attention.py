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

    logits = tf.einsum("btnh,bsnh->bnts", query, key) * scale
    if causal:
        logits += (1.0 - tf.linalg.band_part(tf.ones(logits.shape[-2:]), -1, 0)) * -1e9
    stats = tf.reduce_logsumexp(logits, axis=-1)
    return tf.einsum("bnts,bsnh->btnh", tf.exp(logits - stats[..., None]), value), stats


def reference_backward(query, key, value, stats, d_out, out, scale, causal):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch([query, key, value])
        again, _ = reference_forward(query, key, value, scale, causal)
    return tape.gradient(again, [query, key, value], output_gradients=d_out)


def keras_attention(query, key, value, causal):
    import keras

    return keras.ops.dot_product_attention(query, key, value, scale=H ** -0.5, is_causal=causal)


@pytest.mark.parametrize("causal", [True, False])
def test_the_fused_path_gives_keras_attention_and_its_gradients(tf, causal):
    from tf_nvlink.training import fused_attention

    rng = np.random.default_rng(0)
    query, key, value = (tf.constant(rng.normal(size=(B, T, N, H)).astype("float32")) for _ in range(3))
    weights = tf.constant(rng.normal(size=(B, T, N, H)).astype("float32"))
    results = []
    for attend in (lambda q, k, v: fused_attention.attend(q, k, v, H ** -0.5, causal, B, None,
                                                          kernels=(reference_forward, reference_backward)),
                   lambda q, k, v: keras_attention(q, k, v, causal)):
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            out = attend(query, key, value)
            loss = tf.reduce_sum(out * weights)
        results.append([out.numpy()] + [g.numpy() for g in tape.gradient(loss, [query, key, value])])
    for fused, keras_own in zip(*results):
        np.testing.assert_allclose(fused, keras_own, rtol=1e-5, atol=1e-5)


def test_a_batch_the_trace_hides_runs_fused_and_another_size_runs_keras_attention(tf):
    """The step's trace leaves the batch open: the fused branch takes the batch the step was traced with (4); a
    batch of 3 at run time takes Keras' attention; both give Keras' numbers, gradients included."""
    from tf_nvlink.training import fused_attention

    calls = []

    def counted_forward(*args):
        with tf.control_dependencies([tf.py_function(lambda: calls.append(1) or 0, [], tf.int32)]):
            return [tf.identity(result) for result in reference_forward(*args)]

    spec = tf.TensorSpec([None, T, N, H], tf.float32)

    @tf.function(input_signature=[spec, spec, spec])
    def attend(query, key, value):
        return fused_attention.attend(query, key, value, H ** -0.5, True, B,
                                      lambda: keras_attention(query, key, value, True),
                                      kernels=(counted_forward, reference_backward))

    rng = np.random.default_rng(1)
    for batch, fused_calls in ((B, 1), (3, 0)):
        calls.clear()
        query, key, value = (tf.constant(rng.normal(size=(batch, T, N, H)).astype("float32")) for _ in range(3))
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            out = attend(query, key, value)
        grads = tape.gradient(out, [query, key, value])
        assert len(calls) == fused_calls and out.shape == (batch, T, N, H)
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            expected = keras_attention(query, key, value, True)
        for got, want in zip([out] + grads, [expected] + tape.gradient(expected, [query, key, value])):
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


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
""", {"auto, off and Keras' own": r"""
auto, off = fit("auto"), fit("off")
from keras.src.backend.tensorflow import nn as tensorflow_nn
from tf_nvlink.internals.registry import REGISTRY
REGISTRY.restore(tensorflow_nn, "dot_product_attention")
result = {"auto": auto, "off": off, "keras": fit("auto"), "lines": [l for l in lines if l.startswith("tf_nvlink: attention:")]}
""", "a bad setting": "tf_nvlink.strategy(devices=['/cpu:0', '/cpu:1'], fused_attention='on')"})


def test_cpu_replicas_keep_keras_attention_exactly_and_say_why():
    out = CPU.result("auto, off and Keras' own")
    assert out["auto"] == out["off"] == out["keras"]
    assert out["lines"] == ["tf_nvlink: attention: Keras' attention: not on an NVIDIA GPU",  # once, for 2 fits
                            "tf_nvlink: attention: Keras' attention: fused_attention='off'"]


def test_a_bad_setting_names_the_choices():
    error = CPU.error("a bad setting")
    assert "ValueError: fused_attention should be one of ['auto', 'off']" in error and "'on'" in error
