"""An Embedding trained with Adam on ids that repeat within a batch (every language model's batches): what Keras
computes on one device, and what tf_nvlink computes.

Keras' TensorFlow backend gives an Embedding's table a sparse gradient (tf.IndexedSlices: one row per lookup, an
id's rows repeated) and applies its elementwise ops to each row (`elementwise_unary` in
keras/src/backend/tensorflow/sparse.py), so `ops.square` squares every lookup's row before the rows of an id are
summed: Adam's second moment gets the sum of the squares where Adam's definition, and Keras' JAX backend, have the
square of the sum. tf_nvlink makes the gradient dense where the optimizer's update runs inside XLA
(`optimizer_rules.dense_gradients_in_xla`), which gives plain Adam; where the update runs outside XLA it computes
Keras' update. The feature matrix's `embedding_repeated_ids` row compares every layout with the update it computes.

The tests that pin Keras' update fail once Keras squares the summed rows; then the sentences in docs/architecture.md
and the README, and the matrix row's two references, go.
"""

import numpy as np
import pytest

import scenarios

# Keras' optimizers whose update from a sparse gradient with repeated rows is not the update from its dense form
# (Keras 3.12 to 3.15 and keras-nightly 3.16): each squares the gradient (Adamax: takes its absolute value) row by
# row. In Keras 3.15 so do Muon's AdamW update of embedding tables and ScheduleFreeAdamW. SGD, with or without
# momentum, and Lion only scale the gradient before an id's rows are summed (a scatter, or a sum with a dense tensor).
SPARSE_UPDATE_DIFFERS = {"Adam", "AdamW", "Adamax", "Nadam", "RMSprop", "Adagrad", "Adadelta", "Ftrl", "Adafactor",
                         "Lamb"}
SPARSE_UPDATE_SAME = {"SGD", "Lion"}


def test_keras_squares_each_row_of_a_sparse_gradient(tf):
    """`keras.ops.square` of rows [1, 2] and [3, 4], both of id 0: Keras gives [10, 20] (1 + 9, 4 + 16) where the
    square of the gradient is [16, 36]."""
    import keras

    gradient = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 0]), tf.constant([3, 2]))
    squared = keras.ops.square(gradient)
    assert isinstance(squared, tf.IndexedSlices)
    np.testing.assert_array_equal(tf.convert_to_tensor(squared).numpy(), [[10, 20], [0, 0], [0, 0]])
    np.testing.assert_array_equal(tf.square(tf.convert_to_tensor(gradient)).numpy(), [[16, 36], [0, 0], [0, 0]])


def _sparse_to_dense_difference(tf, keras, name: str) -> float:
    """Three updates of a 5x3 table by optimizer `name` from a gradient whose ids repeat, given as tf.IndexedSlices
    and as its dense form: the largest difference between the two tables, relative to the largest change the dense
    updates made (Adadelta's steps are a thousandth of Adam's)."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(5, 3)).astype("float32")
    ids = tf.constant([0, 0, 2, 0, 2, 4])
    rows = rng.normal(size=(3, 6, 3)).astype("float32")
    tables = []
    for sparse in (True, False):
        variable = keras.Variable(table)
        optimizer = getattr(keras.optimizers, name)(learning_rate=1.0)
        for step_rows in rows:
            gradient = tf.IndexedSlices(tf.constant(step_rows), ids, tf.constant([5, 3]))
            optimizer.apply([gradient if sparse else tf.convert_to_tensor(gradient)], [variable])
        tables.append(variable.numpy())
    return float(np.abs(tables[0] - tables[1]).max() / np.abs(tables[1] - table).max())


def test_keras_optimizers_update_from_a_sparse_gradient_with_repeated_ids(tf):
    """Which Keras optimizers update a table differently from the sparse gradient than from its dense form
    (SPARSE_UPDATE_DIFFERS), and which the same (SPARSE_UPDATE_SAME): on one device, without XLA or a strategy."""
    import keras

    differences = {name: _sparse_to_dense_difference(tf, keras, name)
                   for name in sorted(SPARSE_UPDATE_DIFFERS | SPARSE_UPDATE_SAME)}
    assert {name for name, difference in differences.items() if difference > 1e-2} == SPARSE_UPDATE_DIFFERS, differences
    assert all(differences[name] < 1e-5 for name in SPARSE_UPDATE_SAME), differences


_PRELUDE = r"""
import contextlib, dataclasses
import numpy as np, tensorflow as tf
import tf_nvlink
from tf_nvlink.distribute import base
strategy = tf_nvlink.strategy(devices=["/cpu:0"])  # one CPU replica
import keras

class OneHotEmbedding(keras.layers.Embedding):
    def call(self, inputs):  # a dense gradient: the rows of repeated ids summed
        return keras.ops.matmul(keras.ops.one_hot(inputs, self.input_dim, dtype=self.embeddings.dtype),
                                self.embeddings)

tokens = np.random.default_rng(12).integers(0, 12, (33, 7)).astype("int32")

def fit(embedding, scope, jit_compile, compiled_execution=True):
    base.attach_plan(strategy, dataclasses.replace(strategy.plan, compiled_execution=compiled_execution))
    with scope:
        keras.utils.set_random_seed(3)
        model = keras.Sequential([keras.Input((6,), dtype="int32"), embedding(12, 4), keras.layers.Dense(12)])
        model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=jit_compile, steps_per_execution=2,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tokens[:, :-1], tokens[:, 1:], batch_size=8, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w).ravel().tolist() for w in model.get_weights()]
"""
ONE_CPU = scenarios.Scenario("embedding numerics: one CPU replica under XLA, and Keras on one device", _PRELUDE, {
    "keras embedding": "result = fit(keras.layers.Embedding, contextlib.nullcontext(), jit_compile=False)",
    "keras embedding, jit": "result = fit(keras.layers.Embedding, contextlib.nullcontext(), jit_compile=True)",
    "one-hot": "result = fit(OneHotEmbedding, contextlib.nullcontext(), jit_compile=False)",
    "tf_nvlink": "result = fit(keras.layers.Embedding, strategy.scope(), jit_compile=True)",
    "tf_nvlink, compiled execution off": ("result = fit(keras.layers.Embedding, strategy.scope(), jit_compile=True, "
                                          "compiled_execution=False)"),
}, slow=True)


def _max_difference(weights, other) -> float:
    return max(float(np.abs(np.subtract(a, b)).max()) for a, b in zip(weights, other))


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_one_cpu_replica_under_xla_trains_plain_adam_where_keras_does_not():
    """One CPU replica, `jit_compile=True`: the update runs inside XLA, where tf_nvlink makes the Embedding's
    gradient dense, so tf_nvlink trains as the one-hot lookup does (plain Adam); Keras' own Embedding, with or
    without XLA, trains differently (its rows squared before they are summed)."""
    one_hot = ONE_CPU.result("one-hot")
    for case in ("tf_nvlink", "tf_nvlink, compiled execution off"):
        for expected, got in zip(one_hot, ONE_CPU.result(case)):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=case)
    for case in ("keras embedding", "keras embedding, jit"):
        assert _max_difference(ONE_CPU.result(case), one_hot) > 1e-3, case
    assert _max_difference(ONE_CPU.result("keras embedding, jit"), ONE_CPU.result("keras embedding")) < 1e-5
