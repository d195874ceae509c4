"""tf_nvlink.training.fused_attention on CPU: the fused path's wiring (custom gradient, the batch the trace hides,
grouped-query heads, Keras' padding masks moved to cuDNN's key lengths) with reference kernels in place of cuDNN's
custom calls, and Keras' attention kept exactly where the fused one does not apply (CPU replicas), with one line
saying why. The custom calls themselves run on GPUs: tests/test_gpu.py."""

import numpy as np
import pytest

import scenarios

B, T, N, H = 4, 8, 2, 8


def reference_forward(query, key, value, scale, mask, lengths=None):
    """What cuDNN's forward returns: the output [B, T, N, H] and the softmax's log-sum-exp [B, N, T]; `mask` one of
    plan.attention.MASK_TYPES (causal: top-left), `lengths` the [B] query and key lengths of the padding masks
    (rows past the query length: 0), key and value with fewer heads than the query (grouped-query attention)."""
    import tensorflow as tf

    dtype = query.dtype
    query, key, value = (tf.cast(tensor, tf.float32) for tensor in (query, key, value))
    groups = query.shape[2] // key.shape[2]
    key, value = tf.repeat(key, groups, axis=2), tf.repeat(value, groups, axis=2)
    logits = tf.einsum("btnh,bsnh->bnts", query, key) * scale
    seq_q, seq_kv = logits.shape[-2], logits.shape[-1]
    allowed = tf.ones([1, 1, seq_q, seq_kv], tf.bool)
    if mask in ("causal", "padding_causal"):
        allowed = tf.logical_and(allowed, tf.cast(tf.linalg.band_part(tf.ones([seq_q, seq_kv]), -1, 0), tf.bool))
    rows = tf.ones([logits.shape[0], 1, seq_q, 1], tf.bool)
    if mask in ("padding", "padding_causal"):
        q_len, kv_len = lengths
        allowed = tf.logical_and(allowed, (tf.range(seq_kv) < kv_len[:, None])[:, None, None, :])
        rows = (tf.range(seq_q) < q_len[:, None])[:, None, :, None]
    logits = tf.where(allowed, logits, -1e9)
    stats = tf.reduce_logsumexp(logits, axis=-1)
    probs = tf.where(rows, tf.exp(logits - stats[..., None]), 0.0)
    return tf.cast(tf.einsum("bnts,bsnh->btnh", probs, value), dtype), stats


def reference_backward(query, key, value, stats, d_out, out, scale, mask, lengths=None):
    import tensorflow as tf

    with tf.GradientTape() as tape:
        tape.watch([query, key, value])
        again, _ = reference_forward(query, key, value, scale, mask, lengths)
    grads = tape.gradient(again, [query, key, value], output_gradients=d_out)
    return [tf.cast(grad, tensor.dtype) for grad, tensor in zip(grads, (query, key, value))]


REFERENCE = (reference_forward, reference_backward)


def keras_attention(query, key, value, causal, mask=None):
    import keras

    return keras.ops.dot_product_attention(query, key, value, mask=mask, scale=H ** -0.5, is_causal=causal)


def outputs_and_gradients(tf, attention, tensors, opened=False):
    """`attention(*tensors)` and its gradients with respect to each tensor, inside one XLA program; `opened`: the
    trace leaves the batch open (what a replica's step under tf_nvlink sees)."""
    weights = tf.constant(np.random.default_rng(9).normal(size=(tensors[0].shape[0], tensors[0].shape[1],
                                                                  N, H)).astype("float32"))

    @tf.function(jit_compile=True)
    def run(*tensors):
        tensors = list(tensors)
        if opened:
            tensors = [tf.compat.v1.placeholder_with_default(t, [None] + t.shape.as_list()[1:]) for t in tensors]
        with tf.GradientTape() as tape:
            tape.watch(tensors)
            out = attention(*tensors)
            loss = tf.reduce_sum(out * weights)
        return [out] + list(tape.gradient(loss, list(tensors)))

    return [t.numpy() for t in run(*tensors)]


def qkv(tf, seq_q=T, seq_kv=T, kv_heads=N, seed=0):
    rng = np.random.default_rng(seed)
    return [tf.constant(rng.normal(size=shape).astype("float32"))
            for shape in ((B, seq_q, N, H), (B, seq_kv, kv_heads, H), (B, seq_kv, kv_heads, H))]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("opened", [False, True])
def test_the_fused_path_gives_keras_attention_and_its_gradients_under_xla(tf, causal, opened):
    """`attend` with reference kernels in place of cuDNN's, inside an XLA program, against Keras' attention: the
    output and the gradients of query, key and value; `opened`: the batch the trace hides is given."""
    from tf_nvlink.training import fused_attention

    fused = outputs_and_gradients(tf, lambda q, k, v: fused_attention.attend(
        q, k, v, H ** -0.5, causal, B, kernels=REFERENCE), qkv(tf), opened)
    keras_own = outputs_and_gradients(tf, lambda q, k, v: keras_attention(q, k, v, causal), qkv(tf), opened)
    for got, want in zip(fused, keras_own):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seq_q, seq_kv", [(3, 11), (11, 3)])
def test_causal_cross_attention_is_keras_top_left_mask(tf, seq_q, seq_kv):
    """T != S: Keras' causal mask is top-left (row t sees keys s <= t), as cuDNN's CAUSAL; both ways round."""
    from tf_nvlink.training import fused_attention

    tensors = qkv(tf, seq_q, seq_kv)
    fused = outputs_and_gradients(tf, lambda q, k, v: fused_attention.attend(
        q, k, v, H ** -0.5, True, B, kernels=REFERENCE), tensors)
    keras_own = outputs_and_gradients(tf, lambda q, k, v: keras_attention(q, k, v, True), tensors)
    for got, want in zip(fused, keras_own):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_query_heads_go_to_the_kernels_with_their_own_heads(tf):
    """Key and value with 1 head for the query's 2 (grouped-query attention): the kernels take them as they are,
    and their gradients come back in their own heads, equal to Keras' attention on the repeated heads."""
    from tf_nvlink.training import fused_attention

    seen = []

    def forward(query, key, value, scale, mask, lengths=None):
        seen.append(key.shape.as_list())
        return reference_forward(query, key, value, scale, mask, lengths)

    tensors = qkv(tf, kv_heads=1)
    fused = outputs_and_gradients(tf, lambda q, k, v: fused_attention.attend(
        q, k, v, H ** -0.5, True, B, kernels=(forward, reference_backward)), tensors)
    keras_own = outputs_and_gradients(tf, lambda q, k, v: keras_attention(
        q, tf.repeat(k, 2, axis=2), tf.repeat(v, 2, axis=2), True), tensors)
    assert seen == [[B, T, 1, H]]
    assert fused[2].shape == (B, T, 1, H)
    for got, want in zip(fused, keras_own):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_repeated_heads_are_found_where_tf_repeat_made_them(tf):
    from tf_nvlink.training import attention_inputs as attention

    found = {}

    @tf.function
    def run(key):
        found["repeat"] = attention.repeated_heads(tf.repeat(key, 3, axis=2))
        found["tile"] = attention.repeated_heads(tf.tile(key, [1, 1, 3, 1]))  # heads in another order
        found["plain"] = attention.repeated_heads(key * 2.0)
        found["other axis"] = attention.repeated_heads(tf.repeat(key, 3, axis=1))
        return key

    run.get_concrete_function(tf.TensorSpec([None, T, 2, H], tf.float32))
    assert found["repeat"][1] == 3 and found["repeat"][0].shape.as_list() == [None, T, 2, H]
    assert found["tile"] is None and found["plain"] is None and found["other axis"] is None


# Padding patterns of [B=4, 8] masks: right padding, holes, a sequence with no valid key, and none padded.
MASKS = {
    "right": [[1] * 8, [1] * 5 + [0] * 3, [1] + [0] * 7, [1] * 8],
    "holes": [[1, 0, 1, 1, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 1], [1] * 8, [0, 1, 0, 1, 0, 1, 0, 1]],
    "empty": [[1] * 8, [0] * 8, [1] * 3 + [0] * 5, [0] * 7 + [1]],
}


@pytest.mark.parametrize("pattern", sorted(MASKS))
@pytest.mark.parametrize("kind", ["keys", "query and keys", "causal self"])
def test_padding_masks_give_keras_attention_through_key_lengths(tf, pattern, kind):
    """Keras' padding masks (a query mask [B, T] and a key mask [B, S], ANDed; with the causal mask for
    self-attention over one sequence) through the kernels' key lengths, the valid keys moved first: Keras' output
    and gradients for every pattern, rows whose keys are all masked included (Keras gives them the mean value)."""
    from tf_nvlink.training import fused_attention

    keys = tf.constant(np.array(MASKS[pattern], bool))
    queries = tf.constant(np.array(MASKS["right"] if kind != "causal self" else MASKS[pattern], bool))
    query_mask = None if kind == "keys" else queries
    causal = kind == "causal self"
    lengths_seen = []

    def forward(query, key, value, scale, mask, lengths=None):
        lengths_seen.append(mask)
        return reference_forward(query, key, value, scale, mask, lengths)

    def keras_mask():
        mask = keys[:, None, :]
        if query_mask is not None:
            mask = tf.logical_and(mask, query_mask[:, :, None])
        if causal:
            mask = tf.logical_and(mask, tf.cast(tf.linalg.band_part(tf.ones([T, T]), -1, 0), tf.bool)[None])
        return mask[:, None]

    padding = fused_attention.Padding(query_mask, keys, shared=causal)
    fused = outputs_and_gradients(tf, lambda q, k, v: fused_attention.attend(
        q, k, v, H ** -0.5, causal, B, padding, kernels=(forward, reference_backward)), qkv(tf))
    keras_own = outputs_and_gradients(tf, lambda q, k, v: keras_attention(q, k, v, False, keras_mask()), qkv(tf))
    assert lengths_seen == ["padding_causal" if causal else "padding"]
    for got, want in zip(fused, keras_own):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_an_attention_batch_other_than_the_steps_fails_to_compile_naming_both(tf):
    """A model whose attention runs on another batch than the step's (a reshape into the batch): XLA refuses to
    compile, naming both shapes, where the fused kernel would otherwise run on the wrong rows."""
    from tf_nvlink.training import fused_attention

    @tf.function(jit_compile=True)
    def run(query):
        query = tf.compat.v1.placeholder_with_default(query, [None, T, N, H])
        return fused_attention.attend(query, query, query, H ** -0.5, True, B, kernels=REFERENCE)

    with pytest.raises(tf.errors.InvalidArgumentError, match=r"\[3,8,2,8\].*\[4,8,2,8\]|\[4,8,2,8\].*\[3,8,2,8\]"):
        run(tf.zeros([3, T, N, H]))


# Small Transformer blocks trained under a tf_nvlink strategy on 2 CPU replicas: fused_attention "auto" (CPU:
# Keras' attention, one line says why; the default), "off", and Keras' own function with the seam taken out all
# train to the same weights; then, with the GPU facts and reference kernels in place of cuDNN's, the rule's whole
# path in fits (causal MultiHeadAttention, padding from Embedding(mask_zero=True), GroupedQueryAttention, an
# attention_mask argument).
PRELUDE = r"""
import logging, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink
from tf_nvlink.distribute import base
from tf_nvlink.training import fused_attention
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("tf_nvlink").addHandler(Keep()); logging.getLogger("tf_nvlink").setLevel(logging.INFO)
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
x = rng.integers(1, 16, size=(32, 8)).astype("int32"); y = np.roll(x, -1, axis=1)
x_padded = x.copy()
for row, length in enumerate(rng.integers(0, 9, size=32)):
    x_padded[row, length:] = 0
x_padded[3, 2] = 0  # a hole
def block(kind):
    tokens = keras.Input((8,), dtype="int32")
    h = keras.layers.Embedding(16, 16, mask_zero=kind.startswith("padding"))(tokens)
    if kind == "gqa":
        h = h + keras.layers.GroupQueryAttention(8, 4, 2)(h, h, use_causal_mask=True)
    elif kind == "attention_mask":
        mask = keras.ops.cast(keras.ops.not_equal(tokens, 3), "bool")[:, None, :] & keras.ops.ones((1, 8, 1), "bool")
        h = h + keras.layers.MultiHeadAttention(2, 8)(h, h, attention_mask=mask)
    else:
        h = h + keras.layers.MultiHeadAttention(2, 8)(h, h, use_causal_mask=kind in ("causal", "padding_causal"))
    return keras.Model(tokens, keras.layers.Dense(16)(h))
def fit(setting, kind="causal"):
    base.attach_fused_attention(strategy, setting)
    keras.utils.set_random_seed(2)
    with strategy.scope():
        model = block(kind)
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      jit_compile=True)
    model.fit(x_padded if kind.startswith("padding") or kind == "attention_mask" else x, y, batch_size=8, epochs=2,
              verbose=0, shuffle=False)
    return [w.tolist() for w in model.get_weights()]
"""
# XLA on CPU replicas (split mode) with the GPU facts and the cuDNN kernels replaced by reference kernels: the rule's
# whole path in a fit (the step's batch open to the trace, the custom gradient) against Keras' attention; KINDS is
# set before this body runs.
FUSED_PATH = r"""
import sys
sys.path.insert(0, "tests/training")
from test_fused_attention import reference_forward, reference_backward
fused_attention._replicas_are_gpus = lambda strategy: True
fused_attention._compute_capability = lambda: (9, 0)
fused_attention.cudnn_forward, fused_attention.cudnn_backward = reference_forward, reference_backward
keras.mixed_precision.set_global_policy("mixed_bfloat16")
result = {}
try:
    for kind in KINDS:
        before = fused_attention.decision_counts()
        fused = fit("auto", kind)
        counts = {k: v - before.get(k, 0) for k, v in fused_attention.decision_counts().items() if v - before.get(k, 0)}
        result[kind] = {"fused": fused, "plain": fit("off", kind), "counts": counts}
finally:
    keras.mixed_precision.set_global_policy("float32")
"""
DEFAULT_KINDS, SLOW_KINDS = ("causal", "padding_causal"), ("padding", "gqa", "attention_mask")
CPU = scenarios.Scenario("fused attention: 2 CPU replicas", PRELUDE, {
    "the default": "result = [base.fused_attention_of(strategy), strategy.fused_attention]",
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
    "the fused path inside XLA": f"KINDS = {DEFAULT_KINDS!r}\n" + FUSED_PATH}, expected_s=35)
SLOW_CPU = scenarios.Scenario("fused attention: 2 CPU replicas, more masks", PRELUDE, {
    "the fused path inside XLA": f"KINDS = {SLOW_KINDS!r}\n" + FUSED_PATH}, slow=True, expected_s=30)


def test_fused_attention_is_the_default():
    assert CPU.result("the default") == ["auto", "auto"]


def test_cpu_replicas_keep_keras_attention_exactly_and_say_why():
    out = CPU.result("auto, off and Keras' own")
    assert out["auto"] == out["off"] == out["keras"]
    assert out["lines"] == ["tf_nvlink: attention: Keras' attention: not on an NVIDIA GPU",  # once, for 2 fits
                            "tf_nvlink: attention: Keras' attention: fused_attention='off'"]


@pytest.mark.parametrize("kind, decision", [
    ("causal", "fused: cuDNN flash attention (causal, bfloat16, 2 heads of 8, 8 x 8 tokens)"),
    ("padding_causal", "fused: cuDNN flash attention (padding, causal, bfloat16, 2 heads of 8, 8 x 8 tokens)"),
    pytest.param("padding", "fused: cuDNN flash attention (padding, bfloat16, 2 heads of 8, 8 x 8 tokens)",
                 marks=pytest.mark.slow),
    pytest.param("gqa", "fused: cuDNN flash attention (causal, bfloat16, 4 query heads on 2 of 8, 8 x 8 tokens)",
                 marks=pytest.mark.slow),
])
def test_the_fused_path_trains_as_keras_attention_inside_xla(kind, decision):
    """The rule's path through real fits: per-replica XLA programs (split mode on 2 CPU replicas, steps traced with
    their batch open), the fused branch taken (counted), reference kernels in place of cuDNN's: the weights of
    Keras' attention to bfloat16's precision, for causal MultiHeadAttention, padding from Embedding(mask_zero=True)
    (right padding, a hole, empty sequences), padding with the causal mask, and GroupedQueryAttention."""
    out = (CPU if kind in DEFAULT_KINDS else SLOW_CPU).result("the fused path inside XLA")[kind]
    # Keras' build of the model outside the step is the one call outside XLA
    assert set(out["counts"]) - {decision} <= {"Keras' attention: not inside an XLA program (compile the model with "
                                              "jit_compile=True)"}, out["counts"]
    assert out["counts"].get(decision, 0) >= 1, out["counts"]
    for fused, plain in zip(out["fused"], out["plain"]):
        np.testing.assert_allclose(np.array(fused), np.array(plain), rtol=2e-2, atol=2e-2)
    assert out["fused"] != out["plain"]  # the fused branch ran (bfloat16 rounds differently there)


@pytest.mark.slow
def test_an_attention_mask_argument_keeps_keras_attention_exactly():
    out = SLOW_CPU.result("the fused path inside XLA")["attention_mask"]
    assert out["fused"] == out["plain"]
    assert [why for why in out["counts"] if "not inside an XLA program" not in why] == ["Keras' attention: a mask tensor other than one MultiHeadAttention or "
                                   "GroupedQueryAttention made from its inputs' Keras masks (an attention_mask "
                                   "argument, a sliding window, or a mask passed to keras.ops.dot_product_attention)"]


def test_a_bad_setting_names_the_choices():
    error = CPU.error("a bad setting")
    assert "ValueError: fused_attention should be one of ['auto', 'off']" in error and "'on'" in error
