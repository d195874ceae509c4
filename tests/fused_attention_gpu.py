"""Fused against Keras' attention on one GPU, in one process: `python tests/fused_attention_gpu.py` prints one JSON line.

Under `tf_nvlink.strategy()` on GPU 0: (1) a jit-compiled custom step (shapes known to the trace) computes a
causal and an unmasked multi-head attention layer's output and its gradients in bfloat16 and float16, with
fused_attention "auto" and "off", from the same weights and inputs; (2) a small causal Transformer LM
(mixed_bfloat16, AdamW) is fitted for 200 steps with each setting (steps_per_execution=8: the compiled execution,
whose trace leaves the batch open) from the same initial weights, and its per-epoch losses are kept; (3) the
attention lines tf_nvlink logged.
"""

import json
import logging
import sys

import numpy as np
import tensorflow as tf

import tf_nvlink

lines = []


class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())


logging.getLogger("tf_nvlink").addHandler(Keep())
logging.getLogger("tf_nvlink").setLevel(logging.INFO)
tf.config.experimental.enable_tensor_float_32_execution(False)
strategy = tf_nvlink.strategy(gpus=[0])
import keras  # noqa: E402

from tf_nvlink.distribute import base  # noqa: E402

B, T, HEADS, HEAD_DIM = 4, 256, 4, 64


def layer_outputs_and_gradients(setting, dtype, causal):
    base.attach_fused_attention(strategy, setting)
    keras.utils.set_random_seed(3)
    with strategy.scope():
        layer = keras.layers.MultiHeadAttention(HEADS, HEAD_DIM, dtype=dtype)
        layer.build((B, T, HEADS * HEAD_DIM), (B, T, HEADS * HEAD_DIM))
    x = tf.constant(np.random.default_rng(7).normal(size=(B, T, HEADS * HEAD_DIM)).astype("float32"))
    weights = tf.constant(np.random.default_rng(8).normal(size=(B, T, HEADS * HEAD_DIM)).astype("float32"))

    @tf.function(jit_compile=True)
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            out = layer(tf.cast(x, dtype), tf.cast(x, dtype), use_causal_mask=causal)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * weights)
        grads = tape.gradient(loss, [x] + layer.trainable_variables)
        return [tf.cast(out, tf.float32)] + [tf.cast(g, tf.float32) for g in grads]

    results = strategy.run(step, args=(x,))
    return [strategy.experimental_local_results(r)[0].numpy() for r in results]


def relative_difference(a, b):
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))


layer_checks = {}
for dtype in ("bfloat16", "float16"):
    for causal in (True, False):
        fused = layer_outputs_and_gradients("auto", dtype, causal)
        plain = layer_outputs_and_gradients("off", dtype, causal)
        layer_checks[f"{dtype}_{'causal' if causal else 'no_mask'}"] = [relative_difference(a, b)
                                                                          for a, b in zip(fused, plain)]

keras.mixed_precision.set_global_policy("mixed_bfloat16")
from tf_nvlink.tools import bench_models  # noqa: E402

config = dict(vocab_size=512, seq_len=256, d_model=256, num_layers=2, num_heads=4, ffn_dim=512)
tokens = np.random.default_rng(1).integers(0, 512, size=(8 * 25 + 1, config["seq_len"] + 1)).astype("int32")
x, y = tokens[:200, :-1], tokens[:200, 1:]


def fit(setting):
    base.attach_fused_attention(strategy, setting)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        model = bench_models.transformer_lm(**config)
        model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True,
                      steps_per_execution=8)
    history = model.fit(x, y, batch_size=8, epochs=8, verbose=0, shuffle=False)  # 25 steps an epoch, 200 steps
    return history.history["loss"]


curves = {"auto": fit("auto"), "off": fit("off")}
print(json.dumps({"layer": layer_checks, "curves": curves,
                  "lines": [line for line in lines if line.startswith("tf_nvlink: attention:")]}))
sys.exit(0)
