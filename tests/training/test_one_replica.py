"""A custom loop's `jit_compile=True` step under `tf_nvlink.strategy()` on ONE GPU (tf_nvlink.training.install).

On 1x H200 the guide-shaped loop (a jit step calling `optimizer.apply_gradients`, passed to `strategy.run` inside
a plain tf.function) failed with TensorFlow's "merge_call called while defining a new graph" from the optimizer's
step counter: with every replica a GPU, TensorFlow takes its no-merge_call path under XLA even for one replica.
tf_nvlink now compiles the step per replica in fused mode there too. Checked here without XLA (XLA on CPU cannot
compile collectives): the no-merge_call path switched on for one CPU replica, as tests/training/test_per_replica_steps.py does.
One process (tests/scenarios.py) trains every case, the plain-Keras references included (no strategy scope).
"""

import numpy as np
import pytest

import scenarios
from conftest import FUSED_CPU_EMULATION

_PRELUDE = FUSED_CPU_EMULATION + r"""
import collections, dataclasses, gc
import numpy as np, tensorflow as tf
import keras
from tf_nvlink.distribute import base
from tf_nvlink.training import gradient_allreduce
strategy = fused_strategy_emulated_on_cpu(devices=("/cpu:0",))  # TensorFlow's path on one GPU under XLA
DEFAULT = tf.distribute.get_strategy()  # outside any scope: plain Keras on one device
rng = np.random.default_rng(0)
x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")

def train_functions():
    return [obj for obj in gc.get_objects()
            if type(obj).__name__ == "Function" and getattr(obj, "_name", "") == "multi_step_on_iterator"]

def fit(strategy, steps_per_execution=1):
    earlier = train_functions()  # kept: the ops counted are those of this fit's functions only
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                      steps_per_execution=steps_per_execution)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    graph_ops, functions = collections.Counter(), 0
    for function in train_functions():
        if any(function is seen for seen in earlier):
            continue
        functions += 1
        for concrete in function._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
                graph_ops[node.op] += 1
    return {"loss": history.history["loss"], "weights": [w.ravel().tolist() for w in model.get_weights()],
            "collectives": graph_ops["CollectiveReduceV2"], "concats": graph_ops["ConcatV2"],
            "train_functions": functions}

def keras_allreduce_fit(steps_per_execution=1):
    gradient_allreduce.uninstall_gradient_allreduce_hook()  # what Keras does alone
    try:
        return fit(strategy, steps_per_execution)
    finally:
        gradient_allreduce.install_gradient_allreduce_hook()

def custom_loop(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
        optimizer = keras.optimizers.Adam(0.05)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def train(x, y):
        return strategy.run(step, args=(x, y))

    rng = np.random.default_rng(0)
    xs = tf.constant(rng.normal(size=(8, 4)), tf.float32)
    ys = tf.constant(rng.normal(size=(8, 1)), tf.float32)
    losses = [float(train(xs, ys)) for _ in range(5)]
    return {"losses": losses, "iterations": int(optimizer.iterations.numpy()),
            "mode": base.runner_of(strategy).custom_loop_mode if base.is_tf_nvlink_strategy(strategy) else None,
            "weights": [w.ravel().tolist() for w in model.get_weights()]}
"""
_SPLIT_PLAN = """
fused_plan = strategy.plan
# the plan says "split" (as for fit on one GPU): one replica must still get the fused per-replica step
base.attach_plan(strategy, dataclasses.replace(fused_plan, xla_allreduce="split"))
try:
    result = custom_loop(strategy)
finally:
    base.attach_plan(strategy, fused_plan)
"""
# Started in the background when the tests are collected (tests/scenarios.py). "keras_allreduce" comes last: it
# takes tf_nvlink's gradient all-reduce out (and puts it back).
ONE = scenarios.Scenario("one_replica: fused (emulated) on one CPU, and plain Keras", _PRELUDE, {
    "plain": "result = fit(DEFAULT)",
    "tf_nvlink": "result = fit(strategy)",
    "keras_allreduce": "result = keras_allreduce_fit()",
})
ONE_SLOW = scenarios.Scenario("one_replica: fused (emulated) on one CPU, and plain Keras (slow tier)", _PRELUDE, {
    "custom loop single": "result = custom_loop(DEFAULT)",
    "custom loop fused": _SPLIT_PLAN,
    "plain, steps_per_execution=3": "result = fit(DEFAULT, steps_per_execution=3)",
    "tf_nvlink, steps_per_execution=3": "result = fit(strategy, steps_per_execution=3)",
    "keras_allreduce, steps_per_execution=3": "result = keras_allreduce_fit(steps_per_execution=3)",
}, slow=True)


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_one_gpu_custom_loop_with_jit_step_runs_fused_and_equals_single_device():
    single, fused = ONE_SLOW.result("custom loop single"), ONE_SLOW.result("custom loop fused")
    assert fused["mode"] == "fused" and fused["iterations"] == single["iterations"] == 5
    np.testing.assert_allclose(fused["losses"], single["losses"], rtol=1e-5)
    for a, b in zip(single["weights"], fused["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_sparse_gradients_are_made_dense_inside_xla_only(tf):
    """Embedding layers give tf.IndexedSlices gradients, whose all-reduce is an all-gather XLA cannot compile
    ("No registered 'CollectiveGatherV2' OpKernel for XLA_GPU_JIT": a Transformer LM's jit fit on 1x H200). The
    optimizer hook makes them dense inside XLA, and only there (split mode all-reduces them outside XLA).
    The `tf` fixture: TensorFlow's devices are configured before this test runs a function (later tests in
    the same process, e.g. tests/distribute/test_single_host.py, count on the logical CPUs)."""
    from tf_nvlink.training import optimizer_rules as internals

    seen = {}

    @tf.function(jit_compile=True)
    def inside(values):
        grads = internals.dense_gradients_in_xla([tf.IndexedSlices(values, tf.constant([0, 2]), tf.constant([4, 3]))])
        seen["type"] = type(grads[0]).__name__
        return grads[0]

    dense = inside(tf.ones((2, 3))).numpy()
    assert seen["type"] != "IndexedSlices"
    np.testing.assert_array_equal(dense, [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]])
    sparse = tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 2]), tf.constant([4, 3]))
    assert internals.dense_gradients_in_xla([sparse])[0] is sparse  # outside XLA: unchanged


def test_one_replica_fit_skips_the_all_reduce_and_equals_plain_keras():
    """One GPU under XLA: TensorFlow packed every gradient (ConcatV2) and all-reduced it over a group of one
    (CollectiveReduceV2), 4 ms of every 47 ms Transformer step on 1x H200. tf_nvlink's optimizer hook skips it."""
    plain, keras_allreduce, one_replica = ONE.result("plain"), ONE.result("keras_allreduce"), ONE.result("tf_nvlink")
    assert keras_allreduce["collectives"] >= 1 and keras_allreduce["concats"] >= 1  # what Keras does alone
    assert one_replica["train_functions"] >= 1  # its ops were counted
    assert one_replica["collectives"] == 0 and one_replica["concats"] == 0
    np.testing.assert_allclose(one_replica["loss"], plain["loss"], rtol=1e-6)
    for a, b in zip(plain["weights"], one_replica["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_one_replica_fit_with_steps_per_execution_works_and_equals_plain_keras():
    """Keras' multi-step loop (steps_per_execution > 1) around TensorFlow's one-replica all-reduce failed on the
    GPU path ("You must feed a value for placeholder tensor ... while/cond/Placeholder", as fused mode did on 2
    GPUs). Without the all-reduce, a one-GPU tf_nvlink strategy runs Keras' own loop and trains like plain Keras."""
    keras_allreduce = ONE_SLOW.error("keras_allreduce, steps_per_execution=3")
    assert "Placeholder" in keras_allreduce  # what Keras does alone
    plain = ONE_SLOW.result("plain, steps_per_execution=3")
    one_replica = ONE_SLOW.result("tf_nvlink, steps_per_execution=3")
    assert one_replica["collectives"] == 0
    np.testing.assert_allclose(one_replica["loss"], plain["loss"], rtol=1e-6)
    for a, b in zip(plain["weights"], one_replica["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
