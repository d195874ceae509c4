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
# communication-heavy benchmark model; "transformer_2048": the same model on 2048-token sequences (attention's share
# of the work 4x larger per token); "transformer_tiny": the same code in seconds on a CPU (tests).
TRANSFORMER_CONFIGS = {
    "transformer": dict(vocab_size=32000, seq_len=512, d_model=1024, num_layers=24, num_heads=16, ffn_dim=4096),
    "transformer_2048": dict(vocab_size=32000, seq_len=2048, d_model=1024, num_layers=24, num_heads=16,
                             ffn_dim=4096),
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
    x = PositionEmbedding(seq_len, d_model, name="position_embedding")(x)
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

def transformer_parameters(vocab_size, seq_len, d_model, num_layers, num_heads, ffn_dim) -> dict:
    """The trainable parameters of `transformer_lm` with this config: "embedding" (the token and position tables,
    read by gathers) and "non_embedding" (everything a matmul or an elementwise op reads: per block the attention's
    four d_model x d_model projections and biases, the feed-forward's two matrices and biases, two LayerNorms; the
    final LayerNorm; the untied logits' matrix and bias).

    Example:
        >>> transformer_parameters(**TRANSFORMER_CONFIGS["transformer"])
        {'embedding': 33292288, 'non_embedding': 335111424}
    """
    del num_heads  # the heads split d_model: no parameters of their own
    block = 4 * (d_model * d_model + d_model) + 2 * d_model * ffn_dim + ffn_dim + d_model + 2 * 2 * d_model
    return {"embedding": (vocab_size + seq_len) * d_model,
            "non_embedding": num_layers * block + 2 * d_model + d_model * vocab_size + vocab_size}


def transformer_flops_per_step(name: str, global_batch: int) -> float:
    """Model FLOPs of one training step (forward and backward) of benchmark Transformer `name` over `global_batch`
    sequences: 6·N·T + 12·L·D·S·T, with T = global_batch x S tokens, N the non-embedding parameters
    (`transformer_parameters`: the embedding tables are gathers, not matmuls; the untied logits' matrix is a matmul
    and counts), L layers, D = d_model, S = seq_len. 6·N·T is the weights' multiply-adds, twice in the backward pass;
    12·L·D·S·T is attention's scores (Q·K^T) and weighted sum (P·V) over the whole S x S matrix, as PaLM's MFU
    counts it (appendix B), not the causal half a fused causal kernel computes: the same count for every
    implementation, so TensorFlow's and PyTorch's figures compare. Work that is not a model FLOP (the
    optimizer, normalisation, softmax, recomputation) is not counted.

    Example:
        >>> round(transformer_flops_per_step("transformer", 8) / 1e12, 3)      # 8 x 512 tokens
        8.854
        >>> round(transformer_flops_per_step("transformer_2048", 2) / 1e12, 3)  # 2 x 2048 tokens
        10.71
    """
    if name not in TRANSFORMER_CONFIGS:
        raise ValueError(f"model should be one of {list(TRANSFORMER_CONFIGS)}. Received: {name!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch should be a positive integer. Received: {global_batch!r}")
    config = TRANSFORMER_CONFIGS[name]
    seq_len, tokens = config["seq_len"], global_batch * config["seq_len"]
    weights = 6 * transformer_parameters(**config)["non_embedding"] * tokens
    return float(weights + 12 * config["num_layers"] * config["d_model"] * seq_len * tokens)


def model_flops_per_step(name: str, global_batch: int):
    """`transformer_flops_per_step` for a Transformer benchmark model, None for the others (whose FLOPs the
    benchmarks do not count).

    Example:
        >>> model_flops_per_step("resnet50", 128) is None
        True
    """
    return transformer_flops_per_step(name, global_batch) if name in TRANSFORMER_CONFIGS else None


# The benchmarks' optimizers and their hyper-parameters, in Keras' names; the PyTorch peer (benchmarks/torch_peer.py)
# builds the same ones from this table. "sgd" is what every benchmark compiled with before "adamw" was added.
BENCH_OPTIMIZERS = {
    "sgd": dict(learning_rate=0.01, momentum=0.9),
    "adamw": dict(learning_rate=1e-3, weight_decay=0.01, beta_1=0.9, beta_2=0.999, epsilon=1e-8),
}


def bench_optimizer(name: str, keras):
    """The Keras optimizer `name` of BENCH_OPTIMIZERS with its hyper-parameters ("sgd": SGD with momentum).

    Example:
        >>> bench_optimizer("adamw", keras).weight_decay
        0.01
    """
    if name not in BENCH_OPTIMIZERS:
        raise ValueError(f"optimizer should be one of {list(BENCH_OPTIMIZERS)}. Received: {name!r}")
    return {"sgd": keras.optimizers.SGD, "adamw": keras.optimizers.AdamW}[name](**BENCH_OPTIMIZERS[name])


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
def _position_embedding_class():
    import keras  # noqa: PLC0415

    class _PositionEmbedding(keras.layers.Layer):
        """Adds a trained [seq_len, d_model] table of position vectors (initialised as Keras' `Embedding` is) to
        the token vectors."""

        def __init__(self, seq_len, d_model, **kwargs):
            super().__init__(**kwargs)
            self.seq_len, self.d_model = seq_len, d_model

        def build(self, input_shape):
            self.embeddings = self.add_weight(shape=(self.seq_len, self.d_model), initializer="uniform",
                                              name="embeddings")

        def call(self, tokens):
            return tokens + keras.ops.cast(self.embeddings, tokens.dtype)

    return _PositionEmbedding


def PositionEmbedding(seq_len, d_model, **kwargs):  # noqa: N802 - a layer constructor
    """A Keras layer adding a trained table of `seq_len` position vectors of `d_model` to its [batch, seq_len,
    d_model] input (GPT's learned positions; Keras' `Embedding` called on `arange(seq_len)` outside the model's
    graph would be a constant, not trained)."""
    return _position_embedding_class()(seq_len, d_model, **kwargs)


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
