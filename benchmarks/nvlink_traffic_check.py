"""NVLink traffic check: a ResNet-50 fit's NVLink bytes per step (NVLinkMonitor) against the expected all-reduce bytes.

Run on 2+ GPUs from the repository root (`--small` rehearses it on a CPU, where the monitor reports "unavailable"):

    python benchmarks/nvlink_traffic_check.py                      # NVLink on: expect ratio ~1.0 (within 20%)
    NCCL_P2P_DISABLE=1 python benchmarks/nvlink_traffic_check.py   # expect bytes/step near 0, a "did not use NVLink"
    python benchmarks/nvlink_traffic_check.py --overhead           # epoch time with a read every batch against none
"""

import logging
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tf_nvlink.tools import bench_stats  # noqa: E402 - after the source checkout's path

_OVERHEAD = flags.DEFINE_bool("overhead", False, "measure the monitor's cost: 3 rounds of an epoch without reads "
                              "and one reading every batch, same process, after a warm-up fit")
_SMALL = flags.DEFINE_bool("small", False, "a 32x32 ResNet-50 in float32 for 5 steps: a CPU rehearsal")


def main(argv):
    del argv
    import keras
    import numpy as np
    import tensorflow as tf

    import tf_nvlink

    logging.basicConfig(level=logging.WARNING)
    keras.mixed_precision.set_global_policy("float32" if _SMALL.value else "mixed_bfloat16")
    strategy = tf_nvlink.strategy()
    print(tf_nvlink.current_plan().summary(), "NCCL_P2P_DISABLE =", os.environ.get("NCCL_P2P_DISABLE"))
    per_gpu, shape = (8, (32, 32, 3)) if _SMALL.value else (128, (224, 224, 3))
    batch = per_gpu * strategy.num_replicas_in_sync
    x = np.random.default_rng(0).uniform(size=(batch,) + shape).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, size=(batch,)).astype("int32")
    data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(8)
    with strategy.scope():
        model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=1000)
        model.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(),
                      jit_compile=True)
    steps = 5 if _SMALL.value else 100
    (monitor_overhead if _OVERHEAD.value else traffic)(tf_nvlink, model, data, steps)


def monitor_overhead(tf_nvlink, model, data, steps):
    """Alternate epochs without and with an NVLinkMonitor reading every batch (epoch begin to end, the fit
    call's own setup left out); median step times and read costs."""
    import keras

    from tf_nvlink.machine import nvlink_traffic, nvml

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self, seconds):
            super().__init__()
            self.seconds = seconds

        def on_epoch_begin(self, epoch, logs=None):
            self.started = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.started)

    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    off, on = [], []
    for _ in range(3):
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[EpochTimer(off)])
        monitor = tf_nvlink.NVLinkMonitor(every_n_batches=1)
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[EpochTimer(on), monitor])
    off_ms, on_ms = (bench_stats.summarize([1000 * s / steps for s in fits]) for fits in (off, on))
    print(f"step ms without monitor {off_ms.describe(2)}, reading every step {on_ms.describe(2)}; monitor's own "
          f"read time / epoch time {monitor.read_overhead():.4%}; median read "
          f"{1e6 * bench_stats.summarize(monitor.read_seconds).median:.0f} us")
    gpus = tf_nvlink.current_plan().gpus
    with nvml.NvLinkCounterReader(gpus) as reader:
        read_s = nvlink_traffic.measure_read_seconds(reader, 1000)
        print(f"one counter read of GPUs {list(gpus)}: {1e6 * read_s:.0f} us")


def traffic(tf_nvlink, model, data, steps):
    """Four epochs under an NVLinkMonitor: each epoch's NVLink bytes per step per GPU against the expected."""
    from tf_nvlink.machine import nvlink_traffic

    monitor = tf_nvlink.NVLinkMonitor()
    model.fit(data, steps_per_epoch=steps, epochs=4, verbose=2, callbacks=[monitor])
    print("unavailable:", monitor.unavailable)
    for e in monitor.history:
        print(f"epoch {e.epoch}: {e.steps} steps, NVLink {e.bytes_per_step / 1e6:.1f} MB/step/GPU, expected "
              f"{e.expected_bytes_per_step / 1e6:.1f} MB, ratio {e.bytes_per_step / e.expected_bytes_per_step:.3f}, "
              f"{e.gbps:.1f} GB/s; per GPU: " + ", ".join(
                  f"{g}: tx {t.tx_bytes / e.steps / 1e6:.1f} rx {t.rx_bytes / e.steps / 1e6:.1f} MB/step"
                  for g, t in e.traffic.items()))
    print("bench record:", nvlink_traffic.bench_record(monitor))


if __name__ == "__main__":
    app.run(main)
