import pytest
"""A custom loop's `jit_compile=True` step under `tf_nvlink.strategy()` on ONE GPU (tf_nvlink.training.install).

On 1x H200 the guide-shaped loop (a jit step calling `optimizer.apply_gradients`, passed to `strategy.run` inside
a plain tf.function) failed with TensorFlow's "merge_call called while defining a new graph" from the optimizer's
step counter: with every replica a GPU, TensorFlow takes its no-merge_call path under XLA even for one replica.
tf_nvlink now compiles the step per replica in fused mode there too. Checked here without XLA (XLA on CPU cannot
compile collectives): the no-merge_call path switched on for one CPU replica, as tests/training/test_per_replica_steps.py does.
"""

import json

import numpy as np

from conftest import FUSED_CPU_EMULATION, run_python

_SCRIPT = FUSED_CPU_EMULATION + r"""
import json, sys
import numpy as np, tensorflow as tf
mode = sys.argv[1]
import dataclasses, keras
from tf_nvlink.distribute import base
if mode == "fused":
    strategy = fused_strategy_emulated_on_cpu(devices=("/cpu:0",))
    # the plan says "split" (as for fit on one GPU): one replica must still get the fused per-replica step
    base.attach_plan(strategy, dataclasses.replace(strategy.plan, xla_allreduce="split"))
else:
    strategy = tf.distribute.get_strategy()
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
x = tf.constant(rng.normal(size=(8, 4)), tf.float32)
y = tf.constant(rng.normal(size=(8, 1)), tf.float32)
losses = [float(train(x, y)) for _ in range(5)]
print(json.dumps({"losses": losses, "iterations": int(optimizer.iterations.numpy()),
                  "mode": base.runner_of(strategy).custom_loop_mode if base.is_tf_nvlink_strategy(strategy) else None,
                  "weights": [w.ravel().tolist() for w in model.get_weights()]}))
"""


def _run(mode):
    proc = run_python(["-c", _SCRIPT, mode], timeout=300)
    return proc, (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None)


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_one_gpu_custom_loop_with_jit_step_runs_fused_and_equals_single_device():
    (_, single), (proc, fused) = _run("single"), _run("fused")
    assert fused is not None, proc.stderr[-3000:]
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
    from tf_nvlink import internals

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


_FIT_SCRIPT = FUSED_CPU_EMULATION + r"""
import collections, json, sys
import numpy as np, tensorflow as tf
mode, steps_per_execution = sys.argv[1], int(sys.argv[2])
import keras
from tf_nvlink.training import gradient_allreduce
if mode == "plain":
    strategy = tf.distribute.get_strategy()
else:
    strategy = fused_strategy_emulated_on_cpu(devices=("/cpu:0",))  # TensorFlow's path on one GPU under XLA
    if mode == "keras_allreduce":
        gradient_allreduce.uninstall_gradient_allreduce_hook()
with strategy.scope():
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse",
                  steps_per_execution=steps_per_execution)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(32, 4)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
graph_ops = collections.Counter()
import gc
for obj in gc.get_objects():
    if type(obj).__name__ == "Function" and getattr(obj, "_name", "") == "multi_step_on_iterator":
        for concrete in obj._list_all_concrete_functions():
            graph = concrete.graph.as_graph_def()
            for node in list(graph.node) + [n for f in graph.library.function for n in f.node_def]:
                graph_ops[node.op] += 1
print(json.dumps({"loss": history.history["loss"], "weights": [w.ravel().tolist() for w in model.get_weights()],
                  "collectives": graph_ops["CollectiveReduceV2"], "concats": graph_ops["ConcatV2"]}))
"""


def _fit(mode, steps_per_execution=1, must_pass=True):
    proc = run_python(["-c", _FIT_SCRIPT, mode, str(steps_per_execution)], timeout=300)
    if not must_pass:
        return proc
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_one_replica_fit_skips_the_all_reduce_and_equals_plain_keras():
    """One GPU under XLA: TensorFlow packed every gradient (ConcatV2) and all-reduced it over a group of one
    (CollectiveReduceV2), 4 ms of every 47 ms Transformer step on 1x H200. tf_nvlink's optimizer hook skips it."""
    plain, keras_allreduce, one_replica = _fit("plain"), _fit("keras_allreduce"), _fit("tf_nvlink")
    assert keras_allreduce["collectives"] >= 1 and keras_allreduce["concats"] >= 1  # what Keras does alone
    assert one_replica["collectives"] == 0 and one_replica["concats"] == 0
    np.testing.assert_allclose(one_replica["loss"], plain["loss"], rtol=1e-6)
    for a, b in zip(plain["weights"], one_replica["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_one_replica_fit_with_steps_per_execution_works_and_equals_plain_keras():
    """Keras' multi-step loop (steps_per_execution > 1) around TensorFlow's one-replica all-reduce failed on the
    GPU path ("You must feed a value for placeholder tensor ... while/cond/Placeholder", as fused mode did on 2
    GPUs). Without the all-reduce, a one-GPU tf_nvlink strategy runs Keras' own loop and trains like plain Keras."""
    keras_allreduce = _fit("keras_allreduce", steps_per_execution=3, must_pass=False)
    assert keras_allreduce.returncode != 0 and "Placeholder" in keras_allreduce.stderr  # what Keras does alone
    plain, one_replica = _fit("plain", steps_per_execution=3), _fit("tf_nvlink", steps_per_execution=3)
    assert one_replica["collectives"] == 0
    np.testing.assert_allclose(one_replica["loss"], plain["loss"], rtol=1e-6)
    for a, b in zip(plain["weights"], one_replica["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
