"""A custom loop's `jit_compile=True` step under `tf_nvlink.strategy()` on ONE GPU (tf_nvlink/xla/).

On 1x H200 the guide-shaped loop (a jit step calling `optimizer.apply_gradients`, passed to `strategy.run` inside
a plain tf.function) failed with TensorFlow's "merge_call called while defining a new graph" from the optimizer's
step counter: with every replica a GPU, TensorFlow takes its no-merge_call path under XLA even for one replica.
tf_nvlink now compiles the step per replica in fused mode there too. Checked here without XLA (XLA on CPU cannot
compile collectives): the no-merge_call path switched on for one CPU replica, as tests/test_xla_loops.py does.
"""

import json

import numpy as np

from conftest import FUSED_CPU_EMULATION, run_python

_SCRIPT = FUSED_CPU_EMULATION + r"""
import json, sys
import numpy as np, tensorflow as tf
mode = sys.argv[1]
import dataclasses, keras
if mode == "fused":
    strategy = fused_strategy_emulated_on_cpu(devices=("/cpu:0",))
    # the plan says "split" (as for fit on one GPU): one replica must still get the fused per-replica step
    strategy._tf_nvlink_plan = dataclasses.replace(strategy.plan, xla_allreduce="split")
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
                  "mode": getattr(strategy, "_custom_loop_mode", None),
                  "weights": [w.ravel().tolist() for w in model.get_weights()]}))
"""


def _run(mode):
    proc = run_python(["-c", _SCRIPT, mode], timeout=300)
    return proc, (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None)


def test_one_gpu_custom_loop_with_jit_step_runs_fused_and_equals_single_device():
    (_, single), (proc, fused) = _run("single"), _run("fused")
    assert fused is not None, proc.stderr[-3000:]
    assert fused["mode"] == "fused" and fused["iterations"] == single["iterations"] == 5
    np.testing.assert_allclose(fused["losses"], single["losses"], rtol=1e-5)
    for a, b in zip(single["weights"], fused["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)



def test_sparse_gradients_are_made_dense_inside_xla_only():
    """Embedding layers give tf.IndexedSlices gradients, whose all-reduce is an all-gather XLA cannot compile
    ("No registered 'CollectiveGatherV2' OpKernel for XLA_GPU_JIT": a Transformer LM's jit fit on 1x H200). The
    optimizer hook makes them dense inside XLA, and only there (split mode all-reduces them outside XLA)."""
    import tensorflow as tf

    from tf_nvlink.xla import private

    seen = {}

    @tf.function(jit_compile=True)
    def inside(values):
        grads = private.dense_gradients_in_xla([tf.IndexedSlices(values, tf.constant([0, 2]), tf.constant([4, 3]))])
        seen["type"] = type(grads[0]).__name__
        return grads[0]

    dense = inside(tf.ones((2, 3))).numpy()
    assert seen["type"] != "IndexedSlices"
    np.testing.assert_array_equal(dense, [[1, 1, 1], [0, 0, 0], [1, 1, 1], [0, 0, 0]])
    sparse = tf.IndexedSlices(tf.ones((2, 3)), tf.constant([0, 2]), tf.constant([4, 3]))
    assert private.dense_gradients_in_xla([sparse])[0] is sparse  # outside XLA: unchanged
