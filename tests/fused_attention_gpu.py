"""Fused against Keras' attention on one GPU, in one process: `python tests/fused_attention_gpu.py` prints one JSON line.

Under `tf_nvlink.strategy(gpus=[0])`, for each case of CASES a jit-compiled custom step (shapes known to the trace)
computes an attention layer's output and its gradients with respect to every input (query, key and value apart)
and every weight, with fused_attention "auto" and "off", from the same weights and inputs; each case keeps the
decisions the rule counted while it was traced (`fused_attention.decision_counts`). Then small models are fitted
for 200 steps with each setting (steps_per_execution=8: the compiled execution, whose trace leaves the batch open)
from the same initial weights: a causal Transformer LM, a Transformer encoder over padded sequences
(Embedding(mask_zero=True)) and a decoder with grouped-query attention; their per-epoch losses and decisions are
kept. `python tests/fused_attention_gpu.py CASE[,CASE]` runs those layer cases alone (and no fit), `... fits`
the fits alone.
"""

import json
import logging
import sys

import numpy as np
import tensorflow as tf

import tf_nvlink

tf.config.experimental.enable_tensor_float_32_execution(False)
strategy = tf_nvlink.strategy(gpus=[0])
import keras  # noqa: E402

from tf_nvlink.distribute import base  # noqa: E402
from tf_nvlink.training import fused_attention  # noqa: E402

logging.getLogger("tf_nvlink").setLevel(logging.WARNING)
CAPABILITY = fused_attention._compute_capability()  # noqa: SLF001

# name: layer ("mha", "gqa", "masked": MultiHeadAttention over Masking'd inputs, "attention_mask"), dtype, causal,
# B, T, S, query heads, key/value heads, head size, padding ("right", "holes"; for "masked"), self-attention.
CASES = {
    "bf16_causal": dict(dtype="bfloat16", causal=True),
    "bf16_no_mask": dict(dtype="bfloat16", causal=False),
    "fp16_causal": dict(dtype="float16", causal=True),
    "fp16_no_mask": dict(dtype="float16", causal=False),
    "cross_96x320_causal": dict(dtype="bfloat16", causal=True, T=96, S=320),
    "cross_96x320_no_mask": dict(dtype="bfloat16", causal=False, T=96, S=320),
    "cross_320x96_causal_fp16": dict(dtype="float16", causal=True, T=320, S=96),
    "head_32": dict(dtype="bfloat16", causal=True, H=32),
    "head_128": dict(dtype="bfloat16", causal=True, H=128),
    "head_256": dict(dtype="bfloat16", causal=True, H=256, N=2, needs=(9, 0)),
    "head_256_fp16_cross": dict(dtype="float16", causal=False, H=256, N=2, T=96, S=320, needs=(9, 0)),
    "t200_b3_n5": dict(dtype="bfloat16", causal=True, B=3, T=200, S=200, N=5),
    "t200_b3_n5_fp16_no_mask": dict(dtype="float16", causal=False, B=3, T=200, S=200, N=5),
    "gqa_8_on_2_causal": dict(layer="gqa", dtype="bfloat16", causal=True, N=8, K=2),
    "gqa_8_on_2_no_mask_fp16": dict(layer="gqa", dtype="float16", causal=False, N=8, K=2, T=96, S=320),
    "gqa_4_on_1_causal": dict(layer="gqa", dtype="bfloat16", causal=True, N=4, K=1),
    "padding_right_self_causal": dict(layer="masked", dtype="bfloat16", causal=True, padding="right", self=True),
    "padding_holes_self_causal": dict(layer="masked", dtype="bfloat16", causal=True, padding="holes", self=True),
    "padding_right_self": dict(layer="masked", dtype="float16", causal=False, padding="right", self=True),
    "padding_holes_cross": dict(layer="masked", dtype="bfloat16", causal=False, padding="holes", T=96, S=320),
    "padding_right_cross_fp16": dict(layer="masked", dtype="float16", causal=False, padding="right", T=96, S=320),
    "attention_mask_kept": dict(layer="attention_mask", dtype="bfloat16", causal=False, expect_fused=False),
    "empty_batch": dict(dtype="bfloat16", causal=True, B=0, expect_fused=False),
}
DEFAULTS = dict(layer="mha", B=4, T=256, S=None, N=4, K=None, H=64, padding=None, self=False, expect_fused=True,
                needs=(8, 0))


def case_settings(name):
    case = dict(DEFAULTS, **CASES[name])
    case["S"] = case["S"] or case["T"]
    case["K"] = case["K"] or case["N"]
    return case


def lengths(batch, seq, pattern, seed):
    """A [batch, seq] bool padding mask: "right" (valid tokens first, one sequence full, one of 1 token) or
    "holes" (a random pattern with a fully masked sequence)."""
    rng = np.random.default_rng(seed)
    if pattern == "right":
        counts = [seq, max(1, seq - 37), 1] + list(rng.integers(1, seq + 1, size=max(0, batch - 3)))
        return np.arange(seq)[None, :] < np.array(counts[:batch])[:, None]
    mask = rng.random((batch, seq)) < 0.7
    mask[min(1, batch - 1)] = False
    return mask


def layer_and_inputs(case):
    dtype, batch, seq_q, seq_kv = case["dtype"], case["B"], case["T"], case["S"]
    width = case["N"] * case["H"]
    rng = np.random.default_rng(7)
    query, key, value = (rng.normal(size=(batch, seq, width)).astype("float32")
                         for seq in (seq_q, seq_kv, seq_kv))
    with strategy.scope():
        if case["layer"] == "gqa":
            layer = keras.layers.GroupQueryAttention(case["H"], case["N"], case["K"], dtype=dtype)
        else:
            layer = keras.layers.MultiHeadAttention(case["N"], case["H"], dtype=dtype)
        layer.build((batch, seq_q, width), (batch, seq_kv, width), (batch, seq_kv, width))
    extra = {}
    if case["layer"] == "masked":
        if case["self"]:
            key = value = query
            query = query * lengths(batch, seq_q, case["padding"], 1)[:, :, None]
        else:
            query = query * lengths(batch, seq_q, "right", 2)[:, :, None]
            key = value = value * lengths(batch, seq_kv, case["padding"], 3)[:, :, None]
    if case["layer"] == "attention_mask":
        extra["attention_mask"] = tf.constant(rng.random((batch, seq_q, seq_kv)) < 0.8)
    return layer, [tf.constant(t) for t in (query, key, value)], extra


def outputs_and_gradients(setting, case):
    """[output, d query, d key, d value, d weight...] as float32 arrays, and the decisions counted."""
    base.attach_fused_attention(strategy, setting)
    keras.utils.set_random_seed(3)
    layer, inputs, extra = layer_and_inputs(case)
    dtype = case["dtype"]
    weights = tf.constant(np.random.default_rng(8).normal(
        size=(case["B"], case["T"], case["N"] * case["H"])).astype("float32"))
    masking = keras.layers.Masking(0.0)

    @tf.function(jit_compile=True)
    def step(query, key, value):
        with tf.GradientTape() as tape:
            tape.watch([query, key, value])
            q, k, v = (tf.cast(t, dtype) for t in (query, key, value))
            if case["layer"] == "masked":
                if case["self"]:
                    q = k = v = masking(tf.cast(query, dtype))
                else:
                    q, v = masking(q), masking(v)
                    k = v
                out = layer(q, v, use_causal_mask=case["causal"])
            else:
                out = layer(q, v, key=k, use_causal_mask=case["causal"], **extra)
            loss = tf.reduce_sum(tf.cast(out, tf.float32) * weights)
        grads = tape.gradient(loss, [query, key, value] + layer.trainable_variables)
        return [tf.cast(out, tf.float32)] + [tf.zeros([0]) if g is None else tf.cast(g, tf.float32) for g in grads]

    before = fused_attention.decision_counts()
    results = strategy.run(step, args=tuple(inputs))
    counts = {why: n - before.get(why, 0) for why, n in fused_attention.decision_counts().items()
              if n - before.get(why, 0)}
    names = ["output", "d_query", "d_key", "d_value"] + [f"d_{w.path}" for w in layer.trainable_variables]
    return names, [strategy.experimental_local_results(r)[0].numpy() for r in results], counts


def compare(name):
    case = case_settings(name)
    if CAPABILITY is not None and tuple(CAPABILITY) < case["needs"]:
        return {"skipped": f"compute capability {CAPABILITY} < {case['needs']}"}
    names, fused, fused_counts = outputs_and_gradients("auto", case)
    _, plain, plain_counts = outputs_and_gradients("off", case)
    rows = {}
    for label, got, want in zip(names, fused, plain):
        largest = float(np.max(np.abs(want))) if want.size else 0.0
        difference = float(np.max(np.abs(got - want))) if want.size else 0.0
        rows[label] = {"max_abs_difference": difference, "largest": largest,
                       "fused_largest": float(np.max(np.abs(got))) if got.size else 0.0,
                       "relative": difference / largest if largest else 0.0, "finite": bool(np.isfinite(got).all())}
    return {"case": case, "rows": rows, "fused_counts": fused_counts, "off_counts": plain_counts}


def fit_curves(kind):
    """Per-epoch losses of 200 AdamW steps (8 epochs of 25, steps_per_execution=8) with each setting, and the
    decisions counted in each fit."""
    from tf_nvlink.tools import bench_models  # noqa: PLC0415

    rng = np.random.default_rng(1)
    vocab, seq = 512, 256
    tokens = rng.integers(1, vocab, size=(8 * 25 + 1, seq + 1)).astype("int32")
    x, y = tokens[:200, :-1], tokens[:200, 1:]
    if kind == "encoder_padding":
        for row, length in enumerate(rng.integers(16, seq + 1, size=200)):
            x[row, length:] = 0
        x[::7, 5] = 0  # holes too
        y = (x % 7).astype("int32")  # a per-token label the attention helps with

    def build():
        if kind == "lm":
            return bench_models.transformer_lm(vocab_size=vocab, seq_len=seq, d_model=256, num_layers=2, num_heads=4,
                                               ffn_dim=512)
        inputs = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, 256, mask_zero=kind == "encoder_padding")(inputs)
        for _ in range(2):
            if kind == "encoder_padding":
                attended = keras.layers.MultiHeadAttention(4, 64)(h, h)
            else:
                attended = keras.layers.GroupQueryAttention(64, 8, 2)(h, h, use_causal_mask=True)
            h = keras.layers.LayerNormalization()(h + attended)
            h = keras.layers.LayerNormalization()(h + keras.layers.Dense(256)(keras.layers.Dense(512, "gelu")(h)))
        return keras.Model(inputs, keras.layers.Dense(vocab, dtype="float32")(h))

    curves, counts = {}, {}
    for setting in ("auto", "off"):
        base.attach_fused_attention(strategy, setting)
        keras.utils.set_random_seed(5)
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True,
                          steps_per_execution=8)
        before = fused_attention.decision_counts()
        history = model.fit(x, y, batch_size=8, epochs=8, verbose=0, shuffle=False)
        curves[setting] = history.history["loss"]
        counts[setting] = {why: n - before.get(why, 0) for why, n in fused_attention.decision_counts().items()
                           if n - before.get(why, 0)}
    return {"curves": curves, "counts": counts}


selected = sys.argv[1].split(",") if len(sys.argv) > 1 else list(CASES)
if selected == ["fits"]:
    selected = []
layers = {}
for name in selected:
    try:
        layers[name] = compare(name)
    except Exception as error:  # noqa: BLE001 - one case's failure is reported, the others still run
        layers[name] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
fits = {}
if len(sys.argv) == 1 or sys.argv[1] == "fits":
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    for kind in ("lm", "encoder_padding", "gqa_decoder"):
        try:
            fits[kind] = fit_curves(kind)
        except Exception as error:  # noqa: BLE001
            fits[kind] = {"error": f"{type(error).__name__}: {str(error)[:2000]}"}
print(json.dumps({"compute_capability": CAPABILITY, "layers": layers, "fits": fits}))
sys.exit(0)
