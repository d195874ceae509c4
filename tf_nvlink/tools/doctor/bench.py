"""Training a benchmark model with the step doctor riding along: the shared part of `python -m
tf_nvlink.tools.doctor`, `examples/benchmark.py --step_doctor` and `benchmarks/step_doctor.py`.

The models and their host input are the training benchmark's (`tf_nvlink.tools.bench_models`): a uint8
host batch through tf.data, cast on the device, `mixed_bfloat16`, SGD with momentum (or AdamW), XLA,
`tf_nvlink.strategy()`.

Example:
    >>> strategy = configure(cpu_devices=0)
    >>> model, dataset, global_batch = build("resnet50", strategy, batch_per_replica=128)
    >>> doctor = doctor_fit(model, dataset, global_batch, output_dir="doctor")
    >>> doctor.report["verdict"]["kind"]
"""

from __future__ import annotations

import os
import sys
from typing import Any, Optional

from tf_nvlink.plan import compile_cache
from tf_nvlink.tools import bench_models


def configure(cpu_devices: int = 0, mixed_precision: bool = True):
    """`tf_nvlink.strategy()` over the GPUs (memory growth on, so a peer process can share them) or over
    `cpu_devices` logical CPU devices; sets `mixed_bfloat16` when asked. Call once per process, first."""
    cpu_names = [f"/device:CPU:{index}" for index in range(cpu_devices)]  # the names TensorFlow gives them
    if "tensorflow" not in sys.modules:
        # The compile cache's TF_XLA_FLAGS before TensorFlow lists its devices, for the strategy built below.
        compile_cache.prepare_process("auto", compile_cache.request_text(devices=cpu_names or None))
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from tf_nvlink.training import install  # noqa: PLC0415

    devices = None
    if cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    else:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
    if mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    return install.build_strategy(devices=devices)


def build(model_name: str, strategy: Any, batch_per_replica: int, steps_per_execution: int = 1,
          jit_compile: Optional[bool] = None, optimizer: str = "sgd"):
    """(compiled model, endless host dataset of one synthetic batch, global batch) under `strategy`.
    jit_compile: default XLA on GPUs, off on CPU devices (XLA on CPU cannot compile the collectives); optimizer: a
    key of `bench_models.BENCH_OPTIMIZERS` (default SGD with momentum)."""
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    global_batch = batch_per_replica * strategy.num_replicas_in_sync
    x, y = bench_models.synthetic_batch(model_name, global_batch)
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)
    if jit_compile is None:
        jit_compile = bool(tf.config.list_logical_devices("GPU"))
    with strategy.scope():
        model = bench_models.build_bench_model(model_name, x, keras, "host")
        model.compile(optimizer=bench_models.bench_optimizer(optimizer, keras),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=model_name != "resnet50"),
                      jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    return model, dataset, global_batch


def steps_covering_the_window(warmup_steps: int, window_steps: int, steps_per_execution: int = 1) -> int:
    """Steps of one fit that reach the doctor's window and close it: warm-up, window and two more calls, rounded up
    to whole calls of `steps_per_execution` steps.

    Example:
        >>> steps_covering_the_window(20, 10, steps_per_execution=8)
        48
    """
    spe = max(int(steps_per_execution or 1), 1)
    return -(-(warmup_steps + window_steps + 2 * spe) // spe) * spe


def doctor_fit(model: Any, dataset: Any, global_batch: int, output_dir: str, warmup_steps: int = 20,
               window_steps: int = 10, verbose: bool = True, log_dir: Optional[str] = None, chart: bool = True,
               model_flops_per_step: Optional[float] = None):
    """One `fit` of warmup + window + 2 steps with a StepDoctor (into the TensorBoard `log_dir` when given; with the
    model's FLOPs per step, its MFU); returns the doctor (its `report`)."""
    from tf_nvlink.tools.doctor.callback import StepDoctor  # noqa: PLC0415

    os.makedirs(output_dir, exist_ok=True)
    doctor = StepDoctor(warmup_steps=warmup_steps, window_steps=window_steps, output_dir=output_dir,
                        global_batch=global_batch, verbose=verbose, log_dir=log_dir, chart=chart,
                        model_flops_per_step=model_flops_per_step)
    steps = steps_covering_the_window(warmup_steps, window_steps, getattr(model, "steps_per_execution", 1))
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False, callbacks=[doctor])
    return doctor
