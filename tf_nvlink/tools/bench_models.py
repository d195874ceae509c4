"""The seed program's model, shared by the examples and the training benchmark, and the benchmark's models
(`bench_body`, `build_bench_model`: ResNet-50, a small convnet, Transformer LMs) with their synthetic input.

Example:
    >>> from tf_nvlink.tools import bench_models
    >>> with tf_nvlink.strategy().scope():
    ...     model = bench_models.compiled_mnist_mlp(jit_compile=True)
"""

import functools


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

# ---- the training benchmark's models (tf_nvlink/training_bench.py) and their synthetic input --------------------

BENCH_MODELS = ("mlp", "resnet50", "convnet") + tuple(TRANSFORMER_CONFIGS)
IMAGE_MODELS = ("resnet50", "convnet")  # fed uint8 images, cast to floats on the device
INPUTS = ("host", "device")  # the batch from host memory through tf.data, or held on each device


def bench_body(name: str, keras):
    """The model proper, taking float images / float features / int32 tokens."""
    if name == "mlp":
        return mnist_mlp()
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    if name == "convnet":  # small enough for CPU tests
        return keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                                 keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    if name in TRANSFORMER_CONFIGS:
        return transformer_lm(**TRANSFORMER_CONFIGS[name])
    raise ValueError(f"model should be one of {list(BENCH_MODELS)}. Received: {name!r}")


def bench_input_shape(name: str) -> tuple[int, ...]:
    """One example's shape: (seq_len,) tokens for Transformers, else the features or the image."""
    if name in TRANSFORMER_CONFIGS:
        return (TRANSFORMER_CONFIGS[name]["seq_len"],)
    return {"mlp": (784,), "resnet50": (224, 224, 3), "convnet": (16, 16, 3)}[name]


def synthetic_batch(name: str, global_batch: int, seed: int = 0):
    """One global batch in host memory, in the dtype users feed: uint8 images, int32 tokens (labels: the next
    tokens), float32 MLP features; labels int32."""
    import numpy as np  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    shape = (global_batch,) + bench_input_shape(name)
    if name in TRANSFORMER_CONFIGS:
        vocab = TRANSFORMER_CONFIGS[name]["vocab_size"]
        tokens = rng.integers(0, vocab, size=(shape[0], shape[1] + 1)).astype("int32")
        return tokens[:, :-1], tokens[:, 1:]
    y = rng.integers(0, 10, size=(global_batch,)).astype("int32")
    if name in IMAGE_MODELS:
        return rng.integers(0, 256, size=shape).astype("uint8"), y
    return rng.uniform(size=shape).astype("float32"), y


def build_bench_model(name: str, x, keras, input_mode: str = "host"):
    """The benchmark model for `name` around `_build_body`: images enter as uint8 and are cast on the device
    (`Rescaling`, as decoded JPEGs arrive); with `input_mode="device"` the model's input is int32 example
    indices and its first layer gathers the examples from `x`, held in a non-trainable variable on each replica's
    device. Build inside the strategy's scope."""
    if input_mode not in INPUTS:
        raise ValueError(f"input should be one of {list(INPUTS)}. Received: input={input_mode!r}")
    body = bench_body(name, keras)
    if input_mode == "host":
        inputs = keras.Input(x.shape[1:], dtype=str(x.dtype), name="examples")
        features = inputs
    else:
        inputs = keras.Input((), dtype="int32", name="example_index")
        features = DeviceResidentBatch(x)(inputs)
    if name in IMAGE_MODELS:
        features = keras.layers.Rescaling(1 / 255.0, name="uint8_to_float")(features)
    return keras.Model(inputs, body(features), name=f"{name}_{input_mode}_fed")


@functools.lru_cache(maxsize=None)
def _device_resident_batch_class():
    import keras  # noqa: PLC0415

    class _DeviceResidentBatch(keras.layers.Layer):
        """Gathers examples by index from a non-trainable copy of the batch on each replica's device. int32 data
        (tokens) is held as int64: TensorFlow keeps int32 variables in host memory, where a GPU's XLA program
        cannot read them ("Trying to access resource ... located in device CPU:0 from device GPU:0")."""

        def __init__(self, data, **kwargs):
            super().__init__(**kwargs)
            self.output_dtype = str(data.dtype)
            held = data.astype("int64") if self.output_dtype == "int32" else data
            self.data = self.add_weight(shape=held.shape, dtype=str(held.dtype), trainable=False,
                                        initializer=lambda shape, dtype: held, name="device_batch")

        def call(self, indices):
            return keras.ops.cast(keras.ops.take(self.data, indices, axis=0), self.output_dtype)

    return _DeviceResidentBatch


def DeviceResidentBatch(data, **kwargs):  # noqa: N802 - a layer constructor
    """A Keras layer holding `data` (numpy) on the device; called on int32 indices, returns those examples."""
    return _device_resident_batch_class()(data, **kwargs)
