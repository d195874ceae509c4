"""Every batch trains as on one device, on real GPUs: the exact-batch scenarios of
`tf_nvlink.tools.exact_batches_check` (uneven last batches 1 + 0, 2 + 1, 17 + 16; global batches 5 and 7;
gradient_accumulation_steps 2 and 4; sample_weight, validation_split, steps_per_execution=3, a learning-rate
schedule; a custom loop with `tf_nvlink.average_loss`) under `tf_nvlink.strategy()`, each compared with the same
training on one device in the same process. Prints one JSON object: max |w - w_single| (and the logged loss and
metric differences) per case; the target is 1e-5 everywhere (float32, SGD).

    python benchmarks/exact_batches_gpu.py                          # all GPUs, fused XLA mode
    python benchmarks/exact_batches_gpu.py --mode split --scenarios last_batch_1,batch_size_5
    python benchmarks/exact_batches_gpu.py --devices cpu:2 --mode plain   # CPU replicas (no fused mode there)
    TF_CONFIG=... python benchmarks/exact_batches_gpu.py --devices tf_config --mode plain   # one per worker
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tf_nvlink  # noqa: E402 - before app.run: it sets up the compile cache before TensorFlow lists its devices

FLAGS = flags.FLAGS
flags.DEFINE_string("devices", "gpu", '"gpu" (every GPU), "gpu:N" (the first N), "cpu:N" (N logical CPUs), or '
                    '"tf_config" (the workers named by TF_CONFIG, one process each)')
flags.DEFINE_enum("mode", "fused", ["fused", "split", "plain"], "fused/split: jit_compile=True with that "
                  "xla_allreduce; plain: jit_compile=False")
flags.DEFINE_string("scenarios", "", "comma-separated scenario names (default: all of them)")
flags.DEFINE_bool("custom_loop", True, "also run the custom loop with tf_nvlink.average_loss")
flags.DEFINE_string("json", "", "also write the result to this file")


def _strategy(devices: str, mode: str):
    kind, _, count = devices.partition(":")
    if devices != "tf_config" and (kind not in ("gpu", "cpu") or (count and not count.isdigit())):
        raise app.UsageError(f'--devices should be "gpu", "gpu:N", "cpu:N" or "tf_config". Received: {devices!r}')
    if kind == "cpu" and mode == "fused":
        raise app.UsageError("--mode fused needs GPU replicas (TensorFlow all-reduces inside XLA only there); "
                             "use --mode split or plain with --devices cpu:N")
    import tensorflow as tf  # noqa: PLC0415

    xla_allreduce = "split" if mode == "plain" else mode
    if devices == "tf_config":
        return tf_nvlink.strategy(xla_allreduce=xla_allreduce)
    if kind == "cpu":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * int(count or 2))
        return tf_nvlink.strategy(devices=[f"/cpu:{i}" for i in range(int(count or 2))], xla_allreduce="split")
    gpus = "all" if not count else list(range(int(count)))
    return tf_nvlink.strategy(gpus=gpus, xla_allreduce=xla_allreduce)


def main(argv):
    del argv
    strategy = _strategy(FLAGS.devices, FLAGS.mode)
    from tf_nvlink.tools import exact_batches_check  # noqa: PLC0415

    jit = FLAGS.mode != "plain"
    names = [n for n in FLAGS.scenarios.split(",") if n] or None
    cases = exact_batches_check.run_scenarios(strategy, jit_compile=jit, names=names)
    if FLAGS.custom_loop:
        cases["custom_loop"] = exact_batches_check.run_custom_loop(
            strategy, jit, global_batch_size_known=FLAGS.mode == "split")  # split: no all-reduce inside XLA
    result = {"devices": FLAGS.devices, "mode": FLAGS.mode, "replicas": strategy.num_replicas_in_sync,
              "cases": cases,
              "max_weight_difference": max((c.get("weights", float("inf")) for c in cases.values()), default=0.0)}
    text = json.dumps(result, sort_keys=True)
    print(text)
    if FLAGS.json:
        with open(FLAGS.json, "w") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    app.run(main)
