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
