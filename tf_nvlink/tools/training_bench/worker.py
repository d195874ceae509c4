"""One candidate of the training benchmark (tf_nvlink/training_bench.py), in its own process: TensorFlow here.

`python -m tf_nvlink.tools.training_bench --worker ...` calls `run_worker` and prints its record as one JSON line; the
runner and the table stay in tf_nvlink/training_bench.py, which imports no TensorFlow.

Example:
    >>> run_worker("convnet", "auto", batch_per_replica=4, steps=2, jit=False, mixed_precision=False,
    ...            cpu_devices=2, warmup_steps=1)["examples_per_s"]
"""

from __future__ import annotations

import os
import time

from tf_nvlink.tools.training_bench import models


def run_worker(model_name: str, candidate: str, batch_per_replica: int, steps: int, jit: bool,
               mixed_precision: bool, cpu_devices: int = 0, input_mode: str = "host", warmup_steps: int = 10) -> dict:
    """Fit `warmup_steps` steps (compiles), then time one whole `model.fit` of `steps` steps; a JSON-ready record.
    The candidate's "@ondevice" suffix overrides `input_mode` with "device"."""
    import numpy as np
    import tensorflow as tf

    import tf_nvlink

    ops, *suffixes = candidate.split("@")
    if "ondevice" in suffixes:
        input_mode = "device"
    if ops == "workers":  # MultiWorkerMirroredStrategy (TF_CONFIG): first, before any TensorFlow op runs
        strategy = tf_nvlink.strategy()
    if cpu_devices and ops != "workers":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    import keras

    if mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    device_kind = "CPU" if cpu_devices else "GPU"
    devices = [d.name for d in tf.config.list_logical_devices(device_kind)]
    plan = None
    if ops == "workers":
        plan = strategy.plan
    elif ops == "1gpu":
        strategy = tf.distribute.get_strategy()  # no strategy at all: the plain single-device path
    elif ops == "stock":
        strategy = tf.distribute.MirroredStrategy(devices)
    else:
        mode = "split" if "split" in suffixes else "fused" if "fused" in suffixes else "auto"
        strategy = tf_nvlink.strategy(cross_device_ops=ops, devices=devices if cpu_devices else None,
                                      xla_allreduce=mode, xla_flags="none" if "nolhs" in suffixes else "auto",
                                      allreduce_dtype="bfloat16" if "bf16grad" in suffixes else "float32",
                                      input_buffer=1 if "buffer1" in suffixes else None)
        plan = tf_nvlink.current_plan()
    replicas = strategy.num_replicas_in_sync
    global_batch = batch_per_replica * replicas
    x, y = models.synthetic_batch(model_name, global_batch)
    features = x if input_mode == "host" else np.arange(global_batch, dtype="int32")
    dataset = tf.data.Dataset.from_tensors((features, y)).repeat().prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)
    use_jit = jit and ops != "stock"  # stock = what TensorFlow gives: Keras turns XLA off under a strategy
    with strategy.scope():
        model = models.build_bench_model(model_name, x, keras, input_mode)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=model_name != "resnet50"),
                      jit_compile=use_jit)
    model.fit(dataset, steps_per_epoch=warmup_steps, epochs=1, verbose=0, shuffle=False)  # compiles
    from tf_nvlink.training import nvlink_monitor  # NVLink bytes per step (unavailable: the record says why)
    from tf_nvlink.machine import nvlink_traffic

    # bf16grad: the all-reduce moves bfloat16 gradients, half the bytes of the float32 variables
    nvlink = nvlink_monitor.NVLinkMonitor(gradient_dtype="bfloat16" if getattr(plan, "allreduce_dtype", "") == "bfloat16"
                                   else None)
    started = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False, callbacks=[nvlink])
    seconds = time.perf_counter() - started
    record = {
        "model": model_name, "candidate": candidate, "replicas": replicas, "jit_compile": bool(model.jit_compile),
        "input": input_mode, "batch_per_replica": batch_per_replica, "global_batch": global_batch, "steps": steps,
        "warmup_steps": warmup_steps, "fit_s": seconds, "step_ms": 1000 * seconds / steps,
        "steps_per_s": steps / seconds, "examples_per_s": global_batch * steps / seconds,
        "gradient_tensors": len(model.trainable_variables),
        "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "gradient_mib": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables) / 2**20,
        "plan": plan.summary() if plan else None, "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE"),
        # "fused": the gradient all-reduce ran inside XLA, where TensorFlow uses its collective whatever the ops
        "xla_allreduce": getattr(plan, "xla_allreduce", None) if model.jit_compile and replicas > 1 else None,
        "xla_flags_env": os.environ.get("XLA_FLAGS"),
        "allreduce_dtype": getattr(plan, "allreduce_dtype", None), "input_buffer": getattr(plan, "input_buffer", None),
        **nvlink_traffic.bench_record(nvlink),
    }
    if model_name in models.TRANSFORMER_CONFIGS:
        record["tokens_per_s"] = record["examples_per_s"] * models.bench_input_shape(model_name)[0]
    return record
