"""`StepDoctor`: the Keras callback that profiles a short window of a real `fit` and says why the step is slow.

    import tf_nvlink
    doctor = tf_nvlink.StepDoctor(output_dir="doctor")
    model.fit(data, epochs=2, steps_per_epoch=500, callbacks=[doctor])
    # step doctor (ms/step)      GPU:0     GPU:1
    # step                       33.60     33.60
    # ...
    # verdict: host-bound
    #   try steps_per_execution=8: predicted 25.10 ms/step (+34%); ...
    history = model.fit(...); history.step_doctor["verdict"]["advice"][0]["gain"]

After `warmup_steps` training steps (counted over every fit the callback rides along) it waits for the device
(reading the optimizer's step counter), starts TensorFlow's profiler, and after `window_steps` more steps waits
again and stops it: only its own window is traced. The callback defines no `on_train_batch_end`, so Keras keeps
dispatching batch ends asynchronously; it acts in `on_train_batch_begin` at the window's two edges only.
At the end of the window's epoch it reads the trace, sets `model.history.step_doctor` (the History callback),
prints the table, writes step_doctor.json and step_doctor.png (with matplotlib) to `output_dir`. Without a
profiler, GPU trace or counters it says why in one line and training goes on.

With a keras.callbacks.TensorBoard in the callback list (or `log_dir` given), the window is traced into that run's
folder, where TensorBoard's profile plugin reads it (`<log_dir>/train/plugins/profile/<session>/<host>.xplane.pb`,
as Keras' own `profile_batch` writes), each traced call is marked as a step (`tf_runtime.step_trace`, as tf_keras
marks them: the overview page's steps), and `<log_dir>/step_doctor` gets the breakdown as scalars, the table and
verdict as text (or why there is none) and the chart as an image.
This module imports Keras; `tf_nvlink.StepDoctor` imports it on first use, so `import tf_nvlink` stays light.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Optional, Sequence

import keras

from tf_nvlink.distribute import base
from tf_nvlink.internals import tf_runtime
from tf_nvlink.machine import nvml as nvml_module
from tf_nvlink.machine.nvlink_traffic import gradient_bytes, per_gpu_bytes, traffic_delta, unreadable_reasons
from tf_nvlink.machine.nvml import NvLinkCounterReader
from tf_nvlink.tools.costmodel.links import link_for_topology
from tf_nvlink.tools.costmodel.model import REPLICA_OVERHEAD_HOST_FED_MS
from tf_nvlink.tools.doctor import outputs
from tf_nvlink.tools.doctor.diagnosis import diagnose_trace
from tf_nvlink.tools.doctor.verdict import StepContext
from tf_nvlink.training import compiled_execution, sharded_states

log = logging.getLogger("tf_nvlink")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} should be a positive integer. Received: {name}={value!r}")
    return value


def machine_context(model: Any, gpus: Optional[Sequence[int]], global_batch: int, nvml: Any = None) -> StepContext:
    """The StepContext of `model` under its distribution strategy: replicas, steps_per_execution, gradient bytes,
    the plan's all-reduce dtype and GPUs, and the cost model of those GPUs' links (probed through NVML)."""
    strategy = model.distribute_strategy
    replicas = int(strategy.num_replicas_in_sync)
    plan = getattr(strategy, "plan", None)
    chosen = tuple(gpus) if gpus is not None else tuple(getattr(plan, "gpus", ()) or ())
    link, kind = None, getattr(plan, "shape", "unknown") if plan is not None else "unknown"
    topology = nvml_module.probe(nvml) if chosen else None
    if topology is not None and not topology.error:
        kind = topology.shape(chosen)
        # one replica on a machine of several GPUs: its first two GPUs' links stand for "this machine's links"
        linked = chosen if len(chosen) >= 2 else tuple(topology.indices[:2])
        if len(linked) >= 2:
            try:
                link = link_for_topology(topology, linked)
            except ValueError:  # GPUs NVML does not list: the predictions use the reference machines only
                link = None
    float_input = any(str(getattr(t, "dtype", "")) in ("float32", "float64") for t in (model.inputs or ()))
    variables = model.trainable_variables
    per_replica_batch = global_batch // replicas if global_batch else 0
    compiled = compiled_execution.execution_path(
        model, max(2, int(getattr(model, "steps_per_execution", 1) or 1)))[0] == compiled_execution.COMPILED
    try:
        devices = tuple(strategy.extended.worker_devices) or ("",)
    except RuntimeError:  # the default strategy has no device list
        devices = ("",)
    return StepContext(replicas=replicas, steps_per_execution=int(getattr(model, "steps_per_execution", 1) or 1),
                       gradient_bytes=gradient_bytes(variables, "float32"), gradient_tensors=max(len(variables), 1),
                       per_replica_batch=per_replica_batch,
                       allreduce_dtype=getattr(plan, "allreduce_dtype", "float32"), float_input=float_input,
                       link=link, machine_kind=kind, xla_flags=os.environ.get("XLA_FLAGS", ""),
                       compiled_execution=compiled, batch_bytes=_input_bytes(model, per_replica_batch),
                       device_free_bytes=tf_runtime.device_bytes_free(devices[0]) or 0)


def optimizer_states_entry(model: Any) -> dict:
    """The report's "optimizer_states": the strategy's mode ("replicated" or "sharded", as asked of
    `tf_nvlink.strategy`) and, for a built optimizer under a tf_nvlink strategy, its memory rows over the strategy's
    replicas (`sharded_states.memory_table`; None otherwise).

    Example:
        >>> optimizer_states_entry(model)["memory"]["sharded"]["optimizer_states"]
        140
    """
    strategy = model.distribute_strategy
    ours = base.is_tf_nvlink_strategy(strategy)
    optimizer = getattr(model, "optimizer", None)
    built = ours and optimizer is not None and bool(getattr(optimizer, "built", False))
    return {"mode": strategy.optimizer_states if ours else "replicated",
            "memory": sharded_states.memory_table(optimizer) if built else None}


def _input_bytes(model, batch: int) -> int:
    """One replica's input bytes per step, from the model's input specs (0 when a shape is unknown)."""
    total = 0
    for tensor in model.inputs or ():
        dims = list(getattr(tensor, "shape", ())[1:])
        if any(d is None for d in dims):
            return 0
        size = 1
        for d in dims:
            size *= int(d)
        total += size * _dtype_bytes(tensor.dtype)
    return total * batch


def _dtype_bytes(dtype) -> int:
    import numpy as np  # noqa: PLC0415

    return int(np.dtype(keras.backend.standardize_dtype(dtype)).itemsize)


class StepDoctor(keras.callbacks.Callback):
    """Profiles `window_steps` training steps after `warmup_steps`, and reports per replica where the step
    time goes (compute, exposed and hidden all-reduce, input copies, GPU idle, each fit call's fixed cost; the
    kernels' time by kind of work: matmul, attention, normalisation, elementwise, optimizer, loss, ..., each against
    the time its bytes and FLOPs take at the GPU's memory bandwidth and peak), the NVLink bytes per step, a verdict
    (host-, input-, link- or compute-bound) with the one or two changes predicted to help most and the kinds of work
    furthest from their bound, scaling on 2/4/8 GPUs and what NVLink buys.

    Args:
        warmup_steps: training steps before the window (over all fits; compile and warm-up come first).
        window_steps: steps profiled.
        output_dir: where step_doctor.json, step_doctor.png and, without a TensorBoard log_dir, the trace
            (profile/) go; default: a new temporary folder (`self.output_dir`).
        global_batch: samples per step over all replicas, for the predicted samples/s (0: not shown).
        gpus: NVML indices of the replicas' GPUs (default: the tf_nvlink plan's).
        log_dir: TensorBoard log_dir (default: that of a keras.callbacks.TensorBoard in the same list): the trace
            goes to its `train` run, the report to its `step_doctor` run.
        replica_overhead_ms: per-step cost of each extra replica in the scaling predictions.
        verbose: print the table when the report is ready.
        chart: write step_doctor.png and its TensorBoard image (with matplotlib; False: neither).
        model_flops_per_step: the model's FLOPs in one training step over all replicas (e.g.
            `bench_models.transformer_flops_per_step`): the report then has the model's TFLOP/s and MFU ("mfu")
            against the bf16 dense peak of the GPU the trace names (`tf_nvlink.plan.gpu_peaks`).
        nvml: a pynvml stand-in (tests).

    After the window: `report` (the dict, also `model.history.step_doctor`), `unavailable`
    (why there is no breakdown, or None), `overhead_s` (seconds spent in the doctor's hooks).

    Example:
        >>> doctor = tf_nvlink.StepDoctor(warmup_steps=20, window_steps=10, global_batch=256)
        >>> model.fit(data, epochs=1, steps_per_epoch=2000, callbacks=[doctor])
        >>> doctor.report["verdict"]["kind"]
        'host-bound'
    """

    def __init__(self, warmup_steps: int = 20, window_steps: int = 10, output_dir: Optional[str] = None,
                 global_batch: int = 0, gpus: Optional[Sequence[int]] = None, log_dir: Optional[str] = None,
                 replica_overhead_ms: float = REPLICA_OVERHEAD_HOST_FED_MS, verbose: bool = True,
                 nvml: Any = None, chart: bool = True, model_flops_per_step: Optional[float] = None):
        super().__init__()
        self.warmup_steps = _positive_int("warmup_steps", warmup_steps)
        self.window_steps = _positive_int("window_steps", window_steps)
        if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 0:
            raise ValueError(f"global_batch should be a non-negative integer. Received: {global_batch!r}")
        if model_flops_per_step is not None and (isinstance(model_flops_per_step, bool)
                                                 or not isinstance(model_flops_per_step, (int, float))
                                                 or not model_flops_per_step > 0):
            raise ValueError(f"model_flops_per_step should be a positive number of FLOPs (or None: no MFU). "
                             f"Received: {model_flops_per_step!r}")
        self.model_flops_per_step = model_flops_per_step
        self.output_dir = output_dir or tempfile.mkdtemp(prefix="step_doctor_")
        self.global_batch, self.gpus, self.log_dir = global_batch, gpus, log_dir
        self.replica_overhead_ms, self.verbose, self.nvml, self.chart = replica_overhead_ms, verbose, nvml, chart
        self.report: Optional[dict] = None
        self.unavailable: Optional[str] = None
        self.overhead_s = 0.0
        self.files: dict[str, str] = {}
        self._host_steps = 0  # training steps launched so far, over every fit (counted on the host)
        self._window: Optional[dict] = None  # while profiling: start time, step, calls, counters
        self._finished: Optional[dict] = None  # the closed window, until its epoch ends
        self._done = False
        self._tensorboard_dir: Optional[str] = log_dir
        self._step_marker: Any = None  # the open step marker while the window traces

    @property
    def profile_dir(self) -> str:
        """Where the profiler writes: the TensorBoard run `<log_dir>/train`, else `<output_dir>/profile`."""
        if self._tensorboard_dir:
            return os.path.join(self._tensorboard_dir, "train")
        return os.path.join(self.output_dir, "profile")

    # -- the fit call --------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        from tf_nvlink.internals import callbacks as callback_seams  # noqa: PLC0415 - TensorFlow once it runs

        self._fit_began, self._first_batch_seen = time.perf_counter(), False
        if not self._done:  # the window's folder stays that of the fit it began in
            self._tensorboard_dir = self.log_dir or callback_seams.tensorboard_log_dir_beside(self)

    def on_train_batch_begin(self, batch, logs=None):
        entered = time.perf_counter()
        if not self._first_batch_seen:
            self._first_batch_seen = True
            self._before_first_batch_ms = (entered - self._fit_began) * 1e3
        steps = self._host_steps
        self._host_steps += int(getattr(self.model, "steps_per_execution", 1) or 1)
        if self._window is not None:
            if steps - self._window["first_host_step"] >= self.window_steps:
                self._close_window()
            else:
                self._window["calls"] += 1
                self._mark_step(steps)
        elif not self._done and steps >= self.warmup_steps:
            self._open_window(steps)
        self.overhead_s += time.perf_counter() - entered

    def _device_step(self) -> int:
        """Waits for the device to finish the steps already launched; returns the optimizer's step count."""
        return int(self.model.optimizer.iterations.numpy())

    def _open_window(self, host_step: int) -> None:
        import tensorflow as tf  # noqa: PLC0415

        self._done = True  # one window per callback
        first = self._device_step()
        reader, counters = self._open_counters()
        try:
            tf.profiler.experimental.start(self.profile_dir)
        except Exception as exc:  # noqa: BLE001 - any profiler failure: say why, train on
            self._say_unavailable(f"TensorFlow's profiler did not start: {exc}")
            if reader is not None:
                reader.close()
            return
        self._window = {"first_host_step": host_step, "first_step": first, "began": time.perf_counter(),
                        "calls": 1, "reader": reader, "counters": counters}
        self._mark_step(host_step)

    def _mark_step(self, host_step: Optional[int]) -> None:
        """Ends the open step marker and, with a step, opens the next: each traced call from its batch begin to
        the next call's (the doctor keeps off `on_train_batch_end`, so Keras' batch ends stay asynchronous)."""
        if self._step_marker is not None:
            self._step_marker.__exit__(None, None, None)
            self._step_marker = None
        if host_step is not None:
            marker = tf_runtime.step_trace(host_step)
            marker.__enter__()
            self._step_marker = marker

    def _open_counters(self):
        """(reader, first read) for the replicas' GPUs, or (None, why not)."""
        strategy = self.model.distribute_strategy
        plan = getattr(strategy, "plan", None)
        gpus = tuple(self.gpus) if self.gpus is not None else tuple(getattr(plan, "gpus", ()) or ())
        if int(strategy.num_replicas_in_sync) < 2:
            return None, "unavailable: one replica, nothing is all-reduced over NVLink"
        if len(gpus) < 2:
            return None, ("unavailable: the strategy names no 2+ NVML GPUs (no tf_nvlink plan; pass gpus=)")
        reader = NvLinkCounterReader(gpus, self.nvml, payload_only=True).open()
        if reader.error or len(reader.readable) < 2:
            reader.close()
            return None, f"unavailable: {reader.error or unreadable_reasons(reader)}"
        return reader, reader.read()

    def _close_window(self) -> None:
        import tensorflow as tf  # noqa: PLC0415

        window, self._window = self._window, None
        last = self._device_step()
        ended = time.perf_counter()
        self._mark_step(None)
        try:
            tf.profiler.experimental.stop()
        except Exception as exc:  # noqa: BLE001
            self._say_unavailable(f"TensorFlow's profiler did not stop cleanly: {exc}")
            return
        nvlink_bytes: Any = window["counters"]
        steps = max(last - window["first_step"], 1)
        if window["reader"] is not None:
            traffic = traffic_delta(window["counters"], window["reader"].read())
            window["reader"].close()
            nvlink_bytes = per_gpu_bytes(traffic) / steps if traffic else "unavailable: no counter moved"
        self._finished = {"steps": steps, "calls": max(window["calls"], 1),
                          "step_ms": (ended - window["began"]) * 1e3 / steps, "nvlink_bytes": nvlink_bytes}

    def _say_unavailable(self, why: str) -> None:
        self.unavailable = why
        log.warning("StepDoctor: no step breakdown: %s; training goes on", why)

    # -- the window's epoch end: the report ------------------------------------------------------------------
    def on_epoch_end(self, epoch, logs=None):
        entered = time.perf_counter()
        try:
            if self._window is not None:
                self._close_window()
            if self._finished is not None:
                finished, self._finished = self._finished, None
                self._write_report(finished, epoch)
        finally:
            self.overhead_s += time.perf_counter() - entered

    def _write_report(self, finished: dict, epoch: int) -> None:
        context = machine_context(self.model, self.gpus, self.global_batch, self.nvml)
        report, why = diagnose_trace(self.profile_dir, step_ms=finished["step_ms"], steps=finished["steps"],
                                     calls=finished["calls"], context=context,
                                     nvlink_bytes_per_step=finished["nvlink_bytes"],
                                     replica_overhead_ms=self.replica_overhead_ms,
                                     model_flops_per_step=self.model_flops_per_step)
        report["nvlink_bytes_per_step"] = finished["nvlink_bytes"]
        report["fit_call"] = {"fixed_ms": round(self._before_first_batch_ms, 3),
                              "measured": "from on_train_begin to the first batch of the window's fit"}
        report["window"] = {"epoch": epoch, "steps": finished["steps"], "calls": finished["calls"],
                            "step_ms": round(finished["step_ms"], 4)}
        report["doctor_hooks_s"] = round(self.overhead_s, 4)  # the doctor's own time up to the window's end
        report["optimizer_states"] = optimizer_states_entry(self.model)
        if why:
            self._say_unavailable(why)
        self.report = report
        self.files["json"] = outputs.write_json(report, os.path.join(self.output_dir, "step_doctor.json"))
        if not why:
            chart = outputs.write_chart(report, os.path.join(self.output_dir, "step_doctor.png")) if self.chart \
                else None
            if chart:
                self.files["png"] = chart
            if self.verbose:
                print(outputs.render_table(report), flush=True)
        if self._tensorboard_dir:
            self.files["tensorboard"] = outputs.write_tensorboard(report, self._tensorboard_dir, max(epoch, 0),
                                                                  chart=self.files.get("png"))
            self.files["profile"] = self.profile_dir
        history = getattr(self.model, "history", None)
        if history is not None:  # a dict in the epoch logs would break TensorBoard's and the progress bar's
            history.step_doctor = report

    def on_train_end(self, logs=None):
        entered = time.perf_counter()
        if self._window is not None:
            self._close_window()
        if self._finished is not None:  # fit ended without an epoch end after the window
            finished, self._finished = self._finished, None
            self._write_report(finished, -1)
        self.overhead_s += time.perf_counter() - entered

