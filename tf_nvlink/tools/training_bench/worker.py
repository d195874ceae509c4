"""One candidate of the training benchmark, in its own process: TensorFlow here.

`python -m tf_nvlink.tools.training_bench --worker ...` calls `run_worker` and prints its record as one JSON line;
the runner and the table (`cli`) import no TensorFlow.

Example:
    >>> run_worker("convnet", Candidate.parse("auto"), batch_per_replica=4, steps=2, jit=False,
    ...            mixed_precision=False, cpu_devices=2, warmup_steps=1)["examples_per_s"]
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

from tf_nvlink.tools import bench_models
from tf_nvlink.tools.training_bench.candidates import Candidate


@dataclasses.dataclass(frozen=True)
class Timing:
    """How one worker measures: `steps` timed after `warmup_steps`; with `long_steps` also a fit of that many
    steps (steady state and fixed cost per fit); with `profile_dir` a profiled fit of `profile_steps` steps."""

    steps: int
    warmup_steps: int = 10
    long_steps: int = 0
    profile_dir: str = ""
    profile_steps: int = 10
    steps_per_execution: int = 1


def run_worker(model_name: str, candidate: Candidate, batch_per_replica: int, steps: int, jit: bool,
               mixed_precision: bool, cpu_devices: int = 0, input_mode: str = "host", warmup_steps: int = 10,
               long_steps: int = 0, profile_dir: str = "", profile_steps: int = 10,
               steps_per_execution: int = 1) -> dict:
    """Fit `warmup_steps` steps (compiles), then time one whole `model.fit` of `steps` steps; a JSON-ready record.
    `candidate.ondevice` overrides `input_mode` with "device"."""
    import tensorflow as tf

    timing = Timing(steps, warmup_steps, long_steps, profile_dir, profile_steps, steps_per_execution)
    input_mode = "device" if candidate.ondevice else input_mode
    strategy, plan = build_strategy(candidate, cpu_devices)
    import keras

    if mixed_precision:
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    global_batch = batch_per_replica * strategy.num_replicas_in_sync
    x, dataset = synthetic_dataset(tf, model_name, global_batch, input_mode)
    use_jit = jit and candidate.base != "stock"  # stock = what TensorFlow gives: Keras turns XLA off under it
    with strategy.scope():
        model = bench_models.build_bench_model(model_name, x, keras, input_mode)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=model_name != "resnet50"),
                      jit_compile=use_jit, steps_per_execution=steps_per_execution)
    if candidate.customloop:
        train = custom_loop_trainer(tf, keras, model, strategy, dataset, global_batch,
                                    from_logits=model_name != "resnet50", jit=use_jit)
    else:
        train = fit_trainer(model, dataset)
    measured = time_fits(train, plan, timing, candidate)
    return make_record(model_name, candidate, model, plan, strategy.num_replicas_in_sync, batch_per_replica,
                       input_mode, timing, measured)


def build_strategy(candidate: Candidate, cpu_devices: int):
    """(the candidate's strategy, tf_nvlink's plan or None), with `cpu_devices` logical CPU devices when > 0."""
    import tensorflow as tf

    from tf_nvlink.distribute import single_host
    from tf_nvlink.training import install

    if candidate.base == "workers":  # MultiWorkerMirroredStrategy (TF_CONFIG): first, before any TensorFlow op
        return install.build_strategy(), single_host.current_plan()
    if cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    devices = [d.name for d in tf.config.list_logical_devices("CPU" if cpu_devices else "GPU")]
    if candidate.base == "1gpu":
        return tf.distribute.get_strategy(), None  # no strategy at all: the plain single-device path
    if candidate.base == "onedevice":
        return tf.distribute.OneDeviceStrategy(devices[0] if devices else "/cpu:0"), None
    if candidate.base == "stock":
        return tf.distribute.MirroredStrategy(devices), None
    strategy = install.build_strategy(cross_device_ops=candidate.base, devices=devices if cpu_devices else None,
                                       xla_allreduce=candidate.xla_allreduce,
                                       xla_flags="none" if candidate.nolhs else "auto",
                                       allreduce_dtype="bfloat16" if candidate.bf16grad else "float32",
                                       input_buffer=1 if candidate.buffer1 else None)
    return strategy, single_host.current_plan()


def synthetic_dataset(tf, model_name: str, global_batch: int, input_mode: str):
    """(the host batch, a repeating tf.data pipeline of it): the batch itself, or its indices for "device"."""
    import numpy as np

    x, y = bench_models.synthetic_batch(model_name, global_batch)
    features = x if input_mode == "host" else np.arange(global_batch, dtype="int32")
    dataset = tf.data.Dataset.from_tensors((features, y)).repeat().prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return x, dataset.with_options(options)


def fit_trainer(model, dataset):
    """train(steps, callbacks) = one `model.fit` of `steps` steps."""
    def train(steps: int, callbacks=()) -> None:
        model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False, callbacks=list(callbacks))

    return train


def custom_loop_trainer(tf, keras, model, strategy, dataset, global_batch: int, from_logits: bool, jit: bool):
    """train(steps) = TensorFlow's custom-training-guide loop: a `tf.function(jit_compile=jit)` step that calls
    `optimizer.apply_gradients`, run by `strategy.run` inside a plain `tf.function`, called once per batch from
    Python, up to the last step's loss on the host (as fit's final logs wait). Keras callbacks do not apply."""
    with strategy.scope():
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits, reduction="none")

    @tf.function(jit_compile=jit)
    def train_step(features, labels):
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, model(features, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def distributed_step(batch):
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(train_step, args=batch), axis=None)

    iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def train(steps: int, callbacks=()) -> None:
        del callbacks
        loss = None
        for _ in range(steps):
            loss = distributed_step(next(iterator))
        float(loss)

    return train


def _seconds(train, steps: int, callbacks=()) -> float:
    started = time.perf_counter()
    train(steps, callbacks)
    return time.perf_counter() - started


def time_fits(train, plan, timing: Timing, candidate: Candidate) -> dict:
    """The warm-up run (compiles), the timed run (NVLinkMonitor on a fit), then the long run and the profiled run
    if asked. Returns {"fit_s", "long_fit_s", "nvlink": NVLinkMonitor or None, "profile": trace summary or None}."""
    _seconds(train, timing.warmup_steps)
    monitor = None
    if not candidate.customloop:
        from tf_nvlink.training import nvlink_monitor

        # bf16grad: the all-reduce moves bfloat16 gradients, half the bytes of the float32 variables
        monitor = nvlink_monitor.NVLinkMonitor(
            gradient_dtype="bfloat16" if getattr(plan, "allreduce_dtype", "") == "bfloat16" else None)
    measured = {"fit_s": _seconds(train, timing.steps, [monitor] if monitor else []), "nvlink": monitor,
                "long_fit_s": None, "profile": None}
    if timing.long_steps:
        measured["long_fit_s"] = _seconds(train, timing.long_steps)
    if timing.profile_dir:
        measured["profile"] = profile_fit(train, timing, candidate)
    return measured


def profile_fit(train, timing: Timing, candidate: Candidate) -> dict:
    """A fit with the step doctor tracing `timing.profile_steps` steps into profile_dir/<candidate>/: its verdict,
    advice and per-step breakdown go into the record (a custom loop is traced without the doctor's reading)."""
    import tensorflow as tf

    logdir = os.path.join(timing.profile_dir, candidate.label.replace("@", "_"))
    if candidate.customloop:
        tf.profiler.experimental.start(logdir)
        try:
            train(timing.profile_steps)
        finally:
            tf.profiler.experimental.stop()
        return {"logdir": logdir, "unavailable": "custom loop: the step doctor is a model.fit callback"}
    from tf_nvlink.tools.doctor.bench import steps_covering_the_window
    from tf_nvlink.tools.doctor.callback import StepDoctor

    warmup = max(timing.steps_per_execution, 1)  # one call before the window
    doctor = StepDoctor(warmup_steps=warmup, window_steps=timing.profile_steps, output_dir=logdir, verbose=False)
    train(steps_covering_the_window(warmup, timing.profile_steps, timing.steps_per_execution), [doctor])
    report = doctor.report or {}
    return {"logdir": logdir, "unavailable": doctor.unavailable, "verdict": report.get("verdict"),
            "mean": report.get("mean")}


def steady_state(fit_s: float, long_fit_s: Optional[float], steps: int, long_steps: int) -> dict:
    """The long fit minus the short one: seconds per step at steady state and the fixed cost of a fit call.

    Example:
        >>> steady_state(fit_s=1.5, long_fit_s=4.5, steps=10, long_steps=40)
        {'steady_step_s': 0.1, 'fixed_s_per_fit': 0.5}
    """
    if long_fit_s is None:
        return {}
    step_s = (long_fit_s - fit_s) / (long_steps - steps)
    return {"steady_step_s": round(step_s, 9), "fixed_s_per_fit": round(fit_s - steps * step_s, 9)}


def make_record(model_name: str, candidate: Candidate, model, plan, replicas: int, batch_per_replica: int,
                input_mode: str, timing: Timing, measured: dict) -> dict:
    """The JSON-ready record of one candidate's measurement."""
    import numpy as np

    from tf_nvlink.machine import nvlink_traffic

    global_batch = batch_per_replica * replicas
    seconds = measured["fit_s"]
    record = {
        "model": model_name, "candidate": candidate.label, "replicas": replicas,
        "jit_compile": bool(model.jit_compile), "input": input_mode, "batch_per_replica": batch_per_replica,
        "global_batch": global_batch, "steps": timing.steps, "warmup_steps": timing.warmup_steps,
        "steps_per_execution": timing.steps_per_execution, "fit_s": seconds, "step_ms": 1000 * seconds / timing.steps,
        "steps_per_s": timing.steps / seconds, "examples_per_s": global_batch * timing.steps / seconds,
        "gradient_tensors": len(model.trainable_variables),
        "parameters": int(sum(int(np.prod(v.shape)) for v in model.trainable_variables)),
        "gradient_mib": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables) / 2**20,
        "plan": plan.summary() if plan else None, "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE"),
        # "fused": the gradient all-reduce ran inside XLA, where TensorFlow uses its collective whatever the ops
        "xla_allreduce": getattr(plan, "xla_allreduce", None) if model.jit_compile and replicas > 1 else None,
        "xla_flags_env": os.environ.get("XLA_FLAGS"),
        "allreduce_dtype": getattr(plan, "allreduce_dtype", None), "input_buffer": getattr(plan, "input_buffer", None),
        "training_loop": "custom" if candidate.customloop else "fit",
        **(nvlink_traffic.bench_record(measured["nvlink"]) if measured["nvlink"] else {
            "nvlink_bytes_per_step": None, "nvlink_expected_bytes_per_step": None, "nvlink_gbps": None,
            "nvlink_unavailable": "custom loop: NVLinkMonitor is a model.fit callback"}),
    }
    steady = steady_state(seconds, measured["long_fit_s"], timing.steps, timing.long_steps)
    if steady:
        record.update(steady, long_steps=timing.long_steps)
        if steady["steady_step_s"] > 0:  # noise can make a short long-fit difference negative
            record["steady_examples_per_s"] = global_batch / steady["steady_step_s"]
    if measured["profile"] is not None:
        record["profile"] = measured["profile"]
    if model_name in bench_models.TRANSFORMER_CONFIGS:
        tokens = bench_models.bench_input_shape(model_name)[0]
        record["tokens_per_s"] = record["examples_per_s"] * tokens
        if "steady_examples_per_s" in record:
            record["steady_tokens_per_s"] = record["steady_examples_per_s"] * tokens
    return record
