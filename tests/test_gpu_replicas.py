"""On real GPUs (`pytest -m gpu`): replicas agree on BatchNorm statistics after a ResNet-style fit in fused XLA
mode, where the averaging runs inside each replica's XLA program (tf_nvlink/replica_sync.py).

The shards differ on purpose (each global batch's second half has another mean and spread), so replicas that
kept their own statistics would end far apart: the `nosync` run (TF_NVLINK_SYNC_NON_TRAINABLE=0) shows by how
much, which is what makes the agreement meaningful. `check_replicas_agree(..., cpus=2)` rehearses the script on
CPU replicas (split mode there).
"""

import json

import numpy as np
import pytest

from conftest import run_python
from test_gpu import GPU_COUNT, needs_2_gpus

pytestmark = pytest.mark.gpu

_SCRIPT = r"""
import json, os, sys, tempfile
import numpy as np, tensorflow as tf, keras
import tf_nvlink
from tf_nvlink.training import replica_sync
mode, cpus, synchronized = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "synchronized"
if cpus:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * cpus)
strategy = tf_nvlink.strategy(gpus="all", xla_allreduce=mode)
replica_count = strategy.num_replicas_in_sync
per_replica, n = 32, 32 * replica_count * 8
rng = np.random.default_rng(0)
x = rng.normal(size=(n, 16, 16, 3)).astype("float32")
y = rng.integers(0, 10, n).astype("int32")
batch = per_replica * replica_count
for start in range(0, n, batch):  # every replica's shard of a global batch: its own mean and spread
    for r in range(replica_count):
        rows = slice(start + r * per_replica, start + (r + 1) * per_replica)
        x[rows] = 2.0 * r + (1.0 + r) * x[rows]

def block(inputs, filters, stride):
    h = keras.layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization(synchronized=synchronized)(h)
    h = keras.layers.ReLU()(h)
    h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization(synchronized=synchronized)(h)
    shortcut = inputs if stride == 1 and inputs.shape[-1] == filters else keras.layers.BatchNormalization(
        synchronized=synchronized)(keras.layers.Conv2D(filters, 1, strides=stride, use_bias=False)(inputs))
    return keras.layers.ReLU()(keras.layers.Add()([h, shortcut]))

keras.utils.set_random_seed(3)
with strategy.scope():
    inputs = keras.Input((16, 16, 3))
    h = keras.layers.BatchNormalization(synchronized=synchronized)(inputs)
    h = block(block(h, 16, 1), 32, 2)
    model = keras.Model(inputs, keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h)))
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=batch, epochs=3, shuffle=False, verbose=0)
in_strategy = model.evaluate(x, y, batch_size=batch, verbose=0)
predictions = model.predict(x, batch_size=batch, verbose=0)
path = os.path.join(tempfile.mkdtemp(), "model.keras")
model.save(path)
with tf.device("/cpu:0" if cpus else "/gpu:0"):
    reloaded = keras.models.load_model(path)
    on_one_device = reloaded.evaluate(x, y, batch_size=batch, verbose=0)
    reloaded_predictions = reloaded.predict(x, batch_size=batch, verbose=0)
print(json.dumps({"replicas": replica_count, "mode": strategy.xla_allreduce, "jit": bool(model.jit_compile),
                  "diff": replica_sync.replicas_max_difference(model), "evaluate": in_strategy,
                  "reloaded_evaluate": on_one_device,
                  "predict_diff": float(np.max(np.abs(predictions - reloaded_predictions)))}))
"""


def run_replicas_script(mode, cpus=0, synchronized=False, sync=True):
    env = {"TF_NVLINK_SYNC_NON_TRAINABLE": "1" if sync else "0"}
    if cpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = run_python(["-c", _SCRIPT, mode, str(cpus), "synchronized" if synchronized else "local"], env=env,
                      timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_replicas_agree(mode, replicas, cpus=0, synchronized=False):
    """Fit with the sync on and off: on, every non-trainable variable agrees across replicas (< 1e-6) and the
    saved model evaluates as in the strategy (1e-5); off, the BatchNorm statistics differ."""
    out = run_replicas_script(mode, cpus, synchronized)
    assert out["replicas"] == replicas and out["jit"]
    assert max(out["diff"].values()) < 1e-6, out["diff"]
    assert out["predict_diff"] < 1e-4  # two devices' kernels; the model is the same
    np.testing.assert_allclose(out["reloaded_evaluate"], out["evaluate"], rtol=1e-5, atol=1e-6)
    if not synchronized:
        drift = run_replicas_script(mode, cpus, sync=False)
        assert max(drift["diff"].values()) > 1e-3, drift["diff"]
    return out


@needs_2_gpus
def test_fused_xla_fit_keeps_batch_norm_statistics_identical_on_every_gpu():
    out = check_replicas_agree("fused", GPU_COUNT)
    assert out["mode"] == "fused"


@needs_2_gpus
@pytest.mark.parametrize("mode", ["fused", "split"])
def test_synchronized_batch_norm_under_xla_on_gpus(mode):
    """On GPUs the cross-replica moments compile into XLA without merge_call, so synchronized=True works."""
    check_replicas_agree(mode, GPU_COUNT, synchronized=True)
