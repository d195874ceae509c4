# NVLink traffic check (issue 17): ResNet-50 fit, NVLink bytes per step against the expected all-reduce bytes.
# Run on 2x H200 from the repo root (rehearsed on CPU with NVCHECK_MODEL=small, where it reports "unavailable"):
#   python benchmarks/nvlink_traffic_check.py                       # NVLink on: expect ratio ~1.0 (within 20%)
#   NCCL_P2P_DISABLE=1 python benchmarks/nvlink_traffic_check.py    # expect bytes/step near 0 and one "did not use NVLink" line
#   python benchmarks/nvlink_traffic_check.py overhead              # monitor overhead: epoch time with reads every batch vs none
import logging, os, sys, time
import numpy as np, tensorflow as tf, keras
import tf_nvlink
from tf_nvlink.training import nvlink_monitor
from tf_nvlink.machine import nvlink_traffic
from tf_nvlink.machine import nvml
logging.basicConfig(level=logging.WARNING)
small = os.environ.get("NVCHECK_MODEL") == "small"  # CPU rehearsal only
keras.mixed_precision.set_global_policy("float32" if small else "mixed_bfloat16")
strategy = tf_nvlink.strategy()
print(tf_nvlink.current_plan().summary(), "NCCL_P2P_DISABLE =", os.environ.get("NCCL_P2P_DISABLE"))
per_gpu, shape = (8, (32, 32, 3)) if small else (128, (224, 224, 3))
batch = per_gpu * strategy.num_replicas_in_sync
x = np.random.default_rng(0).uniform(size=(batch,) + shape).astype("float32")
y = np.random.default_rng(1).integers(0, 10, size=(batch,)).astype("int32")
data = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(8)
with strategy.scope():
    model = keras.applications.ResNet50(weights=None, input_shape=shape, classes=1000)
    model.compile(keras.optimizers.SGD(0.01, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(),
                  jit_compile=True)
steps = 5 if small else 100
overhead = sys.argv[1:] == ["overhead"]

class Timer(keras.callbacks.Callback):
    def on_train_begin(self, logs=None): self.s = []
    def on_epoch_begin(self, e, logs=None): self.t = time.perf_counter()
    def on_epoch_end(self, e, logs=None): self.s.append(time.perf_counter() - self.t)

if overhead:  # alternate epochs without / with a read every batch, same process, after a warm-up fit
    model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0)
    off, on = [], []
    for _ in range(3):
        t = Timer(); model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[t]); off += t.s
        t, m = Timer(), tf_nvlink.NVLinkMonitor(every_n_batches=1)
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[t, m]); on += t.s
    print(f"step ms without monitor {1000 * np.median(off) / steps:.2f}, reading every step "
          f"{1000 * np.median(on) / steps:.2f}; monitor's own read time / epoch time {m.read_overhead():.4%}; "
          f"median read {1e6 * np.median(m.read_seconds):.0f} us")
    gpus = tf_nvlink.current_plan().gpus
    with nvml.NvLinkCounterReader(gpus) as reader:
        print(f"one counter read of GPUs {list(gpus)}: {1e6 * nvlink_traffic.measure_read_seconds(reader, 1000):.0f} us")
else:
    mon = tf_nvlink.NVLinkMonitor()
    model.fit(data, steps_per_epoch=steps, epochs=4, verbose=2, callbacks=[mon])
    print("unavailable:", mon.unavailable)
    for e in mon.history:
        print(f"epoch {e.epoch}: {e.steps} steps, NVLink {e.bytes_per_step / 1e6:.1f} MB/step/GPU, expected "
              f"{e.expected_bytes_per_step / 1e6:.1f} MB, ratio {e.bytes_per_step / e.expected_bytes_per_step:.3f}, "
              f"{e.gbps:.1f} GB/s; per GPU: " + ", ".join(
                  f"{g}: tx {t.tx_bytes / e.steps / 1e6:.1f} rx {t.rx_bytes / e.steps / 1e6:.1f} MB/step"
                  for g, t in e.traffic.items()))
    print("bench record:", nvlink_traffic.bench_record(mon))
