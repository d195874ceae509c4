"""The seed program's model, shared by the examples and the training benchmark.

Example:
    >>> from tf_nvlink import models
    >>> with tf_nvlink.strategy().scope():
    ...     model = models.compiled_mnist_mlp(jit_compile=True)
"""


def mnist_mlp():
    """The seed's 784-256-128-10 MLP with logits out (uncompiled). Build it inside `strategy.scope()`."""
    import keras  # noqa: PLC0415 - keep `import tf_nvlink` free of TensorFlow

    return keras.Sequential([
        keras.Input(shape=(784,)),
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dense(128, activation="relu"),
        keras.layers.Dense(10),
    ], name="mnist_mlp")


def compiled_mnist_mlp(learning_rate=1e-3, jit_compile=False):
    """`mnist_mlp()` compiled with Adam, sparse categorical cross-entropy on logits, and accuracy.

    Call inside `strategy.scope()`: Keras 3 binds the strategy when the variables are created.
    """
    import keras  # noqa: PLC0415

    model = mnist_mlp()
    model.compile(optimizer=keras.optimizers.Adam(learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
                  jit_compile=jit_compile)
    return model


# Decoder-only Transformer LM sizes. "transformer": ~368M parameters (1.37 GiB of float32 gradients), the
# communication-heavy benchmark model; "transformer_tiny": the same code in seconds on a CPU (tests).
TRANSFORMER_CONFIGS = {
    "transformer": dict(vocab_size=32000, seq_len=512, d_model=1024, num_layers=24, num_heads=16, ffn_dim=4096),
    "transformer_tiny": dict(vocab_size=64, seq_len=16, d_model=32, num_layers=2, num_heads=2, ffn_dim=64),
}


def transformer_lm(vocab_size=32000, seq_len=512, d_model=1024, num_layers=24, num_heads=16, ffn_dim=4096,
                   name="transformer_lm"):
    """A GPT-style decoder-only language model from Keras layers (uncompiled): token + learned position
    embeddings, `num_layers` pre-LayerNorm blocks (causal multi-head self-attention, GELU feed-forward, residuals),
    a final LayerNorm and logits over the vocabulary (float32, for the loss). Input: int32 tokens [batch, seq_len];
    output: logits [batch, seq_len, vocab_size]. Under `mixed_bfloat16` the blocks compute in bfloat16.

    Example:
        >>> model = transformer_lm(**TRANSFORMER_CONFIGS["transformer_tiny"])
        >>> model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """
    import keras  # noqa: PLC0415

    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(vocab_size, d_model, name="token_embedding")(tokens)
    positions = keras.layers.Embedding(seq_len, d_model, name="position_embedding")(
        keras.ops.arange(seq_len, dtype="int32"))
    x = x + positions
    for i in range(num_layers):
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln1")(x)
        h = keras.layers.MultiHeadAttention(num_heads, d_model // num_heads, name=f"block{i}_attention")(
            h, h, use_causal_mask=True)
        x = x + h
        h = keras.layers.LayerNormalization(epsilon=1e-5, name=f"block{i}_ln2")(x)
        h = keras.layers.Dense(ffn_dim, activation="gelu", name=f"block{i}_ffn_in")(h)
        x = x + keras.layers.Dense(d_model, name=f"block{i}_ffn_out")(h)
    x = keras.layers.LayerNormalization(epsilon=1e-5, name="final_ln")(x)
    logits = keras.layers.Dense(vocab_size, name="logits")(x)
    logits = keras.layers.Activation("linear", dtype="float32", name="logits_float32")(logits)
    return keras.Model(tokens, logits, name=name)
