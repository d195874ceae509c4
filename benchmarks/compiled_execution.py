r"""The compiled execution (N steps as one XLA program per replica) against today's per-step path, in ONE command.

Per model, interleaved rounds (the order rotates every round) of whole `model.fit` calls of --steps steps, each
after a warm-up fit that compiles:
  spe=1        `tf_nvlink.strategy()`, steps_per_execution=1 (what the step doctor looks at);
  per-step     steps_per_execution=N, compiled execution off (one XLA program per step, Keras' loop);
  compiled     steps_per_execution=N, compiled execution on (the default): N batches prefetched to the device,
               a full execution's loop count known to XLA;
  pageable     the compiled execution with its input copied from pageable host memory (pinning off);
  count-on-device  the compiled execution with its loop count passed as a tensor for full executions too (as a
               partial execution runs): XLA then reads the loop condition on the host after every step, the cost
               the known trip count removes;
  deep         the compiled execution with 2N batches prefetched to each device (`input_buffer=2N`): the next
               execution's batches are then fetched while the one before it runs (TensorFlow's prefetch to the
               GPU copies an element only after the kernels queued before the copy);
  restaged     the compiled execution with its input staged anew at every fit (`reuse_staged_input = False`): the
               default stages a tf.data dataset once per model, so later fits skip tracing its tf.data functions;
  host-input   the compiled execution with its batches kept in pinned host memory (not prefetched to the GPU):
               each full execution's function also copies the next execution's batches to the GPU, copies the
               program does not wait for, so they run beside it and no element waits for a device-to-host copy;
  resident     the compiled execution with the batches already on the GPU (the model gathers its examples from a
               copy held on the device: the same program without the host input, the ceiling for host-fed input);
  unfused      the compiled execution with Keras' own attention (`fused_attention="off"`): "compiled" runs Keras'
               attention as cuDNN's fused attention where it applies (`fused_attention="auto"`,
               tf_nvlink.training.fused_attention);
  sharded      the compiled execution with `optimizer_states="sharded"` (each replica holds and updates its share of
               the optimizer's slots; on one GPU the replicated path runs, which this row checks costs nothing);
  torch        resnet50 and the Transformers: the PyTorch peer (benchmarks/torch_peer.py), torch.compile with the
               same optimizer, in a child process that compiles while TensorFlow does; after the rounds
               torch.profiler traces 10 of its steps (with the doctor on), and its kernels' time by kind of work
               is set beside the step doctor's kinds and their bounds for the compiled execution;
  advised      the compiled execution at the N the step doctor advises for the spe=1 model (--doctor_n, when
               that N is not --steps_per_execution).
The host-fed setups read one synthetic batch from host memory through tf.data (uint8 images cast on the GPU,
int32 tokens), mixed_bfloat16, XLA, the optimizer of --optimizer (SGD momentum 0.9, or AdamW; both sides train with
bench_models.BENCH_OPTIMIZERS' hyper-parameters). For the Transformers every row also gives the model's TFLOP/s per
GPU and its MFU: bench_models.transformer_flops_per_step (6·N·T over the non-embedding parameters + 12·L·D·S·T) over
the GPU's bf16 dense peak (tf_nvlink.plan.gpu_peaks, "n/a" for a GPU not in its table; the GPU's name from NVML).
One process holds one strategy; the compiled execution is switched per model through the plan (what
`tf_nvlink.strategy(compiled_execution=False)` sets for a process).
The step doctor profiles the spe=1 model once (before the rounds): its step breakdown and its advice are kept, and
its predicted gain is set beside the measured one (spe=1 against the compiled execution at the advised N); the
compiled execution's step is set beside the doctor's compute time. After the rounds it profiles the compiled
execution too, with its batches prefetched to the GPU and kept on the host (their GPU idle shares, the input
copy's GB/s).

    python benchmarks/compiled_execution.py --models resnet50 --rounds 3 --json r50.json            # 1x H200
    python benchmarks/compiled_execution.py --models transformer --rounds 3 --steps 48 --json tfm.json
    python benchmarks/compiled_execution.py --models transformer,transformer_2048 --setups compiled,torch \
        --optimizer adamw --rounds 3 --steps 192 --warmup_steps 16 --json tfm_mfu.json     # + PyTorch, MFU
    python benchmarks/compiled_execution.py --models convnet --devices cpu --rounds 1 --notorch --steps 8
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/torch_peer.py

from tf_nvlink.plan import gpu_peaks  # noqa: E402
from tf_nvlink.tools import bench_models, bench_stats  # noqa: E402
from tf_nvlink.tools.doctor import outputs, trace  # noqa: E402
from tf_nvlink.tools.doctor.work_kinds import WORK_KINDS  # noqa: E402
from tf_nvlink.util import atomic_files  # noqa: E402
from torch_peer import PEER_MODELS, TorchPeer  # noqa: E402 - benchmarks/torch_peer.py

DEFAULT_BATCH = {"resnet50": 128, "transformer": 8, "transformer_2048": 2, "convnet": 8, "transformer_tiny": 4,
                 "mlp": 1024}
DEFAULT_STEPS_PER_EXECUTION = {"resnet50": 16, "transformer": 8, "transformer_2048": 8}
PEER_WARMUP_STEPS = 15
SETUPS = ("spe=1", "per-step", "compiled", "unfused", "restaged", "pageable", "count-on-device", "deep", "host-input", "resident",
          "sharded", "torch")
COMPILED_SETUPS = ("compiled", "unfused", "restaged", "pageable", "count-on-device", "deep", "host-input", "resident", "sharded",
                   "advised")
PROFILED_SETUPS = ("compiled", "unfused", "host-input", "deep")  # the doctor profiles those run, after the rounds

_MODELS = flags.DEFINE_list("models", ["resnet50"], f"Any of {list(bench_models.BENCH_MODELS)}.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds of every setup.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 96, "Steps per timed fit (a multiple of every N).", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup_steps", 32, "Steps of the warm-up fit before the timed ones.", lower_bound=1)
_SPE = flags.DEFINE_integer("steps_per_execution", None,
                            f"N; default per model {DEFAULT_STEPS_PER_EXECUTION}, else 8.", lower_bound=2)
_BATCH = flags.DEFINE_integer("batch_per_replica", None, f"Default per model: {DEFAULT_BATCH}.", lower_bound=1)
_SETUPS = flags.DEFINE_list("setups", list(SETUPS), f"Which of {list(SETUPS)} to run.")
_DEVICES = flags.DEFINE_enum("devices", "gpu", ["gpu", "cpu"], "gpu: tf_nvlink.strategy() over the GPUs; cpu: one "
                             "logical CPU device (a smoke run: fused mode needs GPUs, so nothing is compiled whole).")
_TORCH = flags.DEFINE_bool("torch", True, f"Run the PyTorch peer for {list(PEER_MODELS)} (needs torch, a GPU, and "
                           f"torchvision for resnet50).")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "sgd", list(bench_models.BENCH_OPTIMIZERS),
                               "What both sides train with (bench_models.BENCH_OPTIMIZERS): SGD momentum 0.9, or "
                               "AdamW (the PyTorch peer's fused).")
_DOCTOR = flags.DEFINE_bool("doctor", True, "Profile the spe=1 model with the step doctor first, and the compiled "
                             "model after the rounds.")
_DOCTOR_N = flags.DEFINE_bool("doctor_n", True, "Also time the compiled execution at the N of the doctor's "
                              "steps_per_execution advice for the spe=1 model (setup 'advised', when that N is not "
                              "--steps_per_execution), to check its predicted gain against the measured one.")
_JSON = flags.DEFINE_string("json", "", "Write every measurement to this JSON file.")
_OUTPUT = flags.DEFINE_string("output_dir", "compiled_execution_out", "Where the doctor's files go.")


def plan_for(strategy, setup: str, n: int):
    """The strategy's plan as `setup` runs it: compiled execution on or off, 2N batches prefetched for "deep"."""
    plan = dataclasses.replace(strategy.plan, compiled_execution=setup in COMPILED_SETUPS + ("spe=1",))
    return dataclasses.replace(plan, input_buffer=2 * n) if setup == "deep" else plan


def count_on_device(model) -> None:
    """Make `model`'s compiled execution pass its loop count as a tensor for full executions too (the program
    partial executions run): one more step than N is its capacity, so every execution of N steps is "partial"."""
    function = model.train_function
    function.steps = model.steps_per_execution + 1


def set_plan(strategy, plan, setup: str = "") -> None:
    """Plans switched inside one process: the train function reads it when built, the input at each fit; the
    optimizer states are sharded for the "sharded" setup (read when its optimizer is built and traced), and Keras'
    own attention kept for the "unfused" setup (read when its step is traced)."""
    from tf_nvlink.distribute import base  # noqa: PLC0415

    base.attach_plan(strategy, plan)
    base.attach_optimizer_states(strategy, "sharded" if setup == "sharded" else "replicated")
    base.attach_fused_attention(strategy, "off" if setup == "unfused" else "auto")


def build(name, strategy, batch, steps_per_execution, resident=False, optimizer="sgd"):
    """(model, endless dataset, global batch): host-fed as tf_nvlink.tools.doctor.bench.build, or resident."""
    import keras  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from tf_nvlink.tools.doctor import bench  # noqa: PLC0415

    if not resident:
        return bench.build(name, strategy, batch, steps_per_execution=steps_per_execution, optimizer=optimizer)
    global_batch = batch * strategy.num_replicas_in_sync
    x, y = bench_models.synthetic_batch(name, global_batch)
    dataset = tf.data.Dataset.from_tensors((np.arange(global_batch, dtype="int32"), y)).repeat()
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    with strategy.scope():
        model = bench_models.build_bench_model(name, x, keras, "device")
        model.compile(optimizer=bench_models.bench_optimizer(optimizer, keras),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=name != "resnet50"),
                      jit_compile=bool(tf.config.list_logical_devices("GPU")),
                      steps_per_execution=steps_per_execution)
    return model, dataset.with_options(options).prefetch(tf.data.AUTOTUNE), global_batch


def timed_fit(model, dataset, steps: int) -> float:
    started = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - started


def bench_model(name: str, strategy, setups: list) -> dict:
    from tf_nvlink.training import compiled_execution  # noqa: PLC0415

    from tf_nvlink.tools.doctor import bench  # noqa: PLC0415

    batch = _BATCH.value or DEFAULT_BATCH[name]
    n = _SPE.value or DEFAULT_STEPS_PER_EXECUTION.get(name, 8)
    steps = _STEPS.value
    optimizer = _OPTIMIZER.value
    flops = bench_models.model_flops_per_step(name, batch * strategy.num_replicas_in_sync)
    peer = TorchPeer(name, batch, steps, PEER_WARMUP_STEPS, optimizer=optimizer) if "torch" in setups else None
    # (first: the peer compiles while TensorFlow does)
    models, paths, compile_s, plans = {}, {}, {}, {}
    doctor_report = None

    def add(setup, n):
        plans[setup] = plan_for(strategy, setup, n)
        set_plan(strategy, plans[setup], setup)
        model, dataset, global_batch = build(name, strategy, batch, 1 if setup == "spe=1" else n,
                                             resident=setup == "resident", optimizer=optimizer)
        compile_s[setup] = timed_fit(model, dataset, max(_WARMUP.value, 2 * n))
        if setup == "restaged":
            model.train_function.reuse_staged_input = False  # the next fits stage their input anew, as each did
        if setup == "pageable":
            model.train_function.pinned_input = False  # the next fits' input is distributed from pageable memory
        if setup == "host-input":
            model.train_function.input_to_device = False  # the next fits' batches stay in host memory
            compile_s[setup] += timed_fit(model, dataset, 2 * n)  # the function retraces for host batches
        if setup == "count-on-device":
            count_on_device(model)
            compile_s[setup] += timed_fit(model, dataset, 2 * n)  # the program with the tensor count compiles
        paths[setup] = compiled_execution.execution_path(model)
        if setup == "sharded":  # one replica keeps the replicated path
            from tf_nvlink.distribute import base  # noqa: PLC0415

            paths[setup] = (*paths[setup], "states sharded" if base.shards_optimizer_states(strategy)
                            else "states replicated (one replica)")
        models[setup] = (model, dataset)
        return global_batch

    global_batch = batch * strategy.num_replicas_in_sync
    if "spe=1" in setups:  # first: the doctor's advice may set N
        add("spe=1", n)
        if _DOCTOR.value:
            model, dataset = models["spe=1"]
            doctor = bench.doctor_fit(model, dataset, global_batch, os.path.join(_OUTPUT.value, name), verbose=False,
                                      model_flops_per_step=flops)
            doctor_report = doctor.report or {"unavailable": doctor.unavailable}
    advised = advised_steps(doctor_report or {}) if _DOCTOR_N.value else None
    if advised and advised != n and "compiled" in setups:
        setups = setups + ["advised"]
    for every in {n, advised or n}:
        if steps % every:
            steps += every - steps % every  # whole executions in every setup
    for setup in setups:
        if setup not in ("torch", "spe=1"):
            add(setup, advised if setup == "advised" else n)
    if peer:
        peer.wait_until_ready()
    seconds = {setup: [] for setup in setups}
    torch_work = None
    try:
        for round_index in range(_ROUNDS.value):
            order = setups[round_index % len(setups):] + setups[:round_index % len(setups)]
            for setup in order:
                if setup != "torch":
                    set_plan(strategy, plans[setup], setup)
                seconds[setup].append(peer.run() if setup == "torch" else timed_fit(*models[setup], steps))
        if peer and _DOCTOR.value:
            torch_work = peer.profile()
    finally:
        if peer:
            peer.close()
    gpu = gpu_name(strategy)
    rows = {}
    for setup, values in seconds.items():
        stats = bench_stats.summarize(values)
        samples, gpus = (batch, 1) if setup == "torch" else (global_batch, strategy.num_replicas_in_sync)
        rows[setup] = {"fit_s": values, "median_s": stats.median, "spread": stats.spread,
                       "samples_per_s": samples * steps / stats.median,
                       "ms_per_step": stats.median * 1e3 / steps, "path": paths.get(setup),
                       "warmup_fit_s": compile_s.get(setup)}
        if flops:
            rows[setup]["utilisation"] = gpu_peaks.utilisation(flops * samples / global_batch, stats.median / steps,
                                                               gpu, gpus)
    record = {"model": name, "global_batch": global_batch, "steps": steps, "steps_per_execution": n,
              "optimizer": optimizer, "gpu": gpu, "model_flops_per_step": flops,
              "flop_count": FLOP_COUNT if flops else None,
              "rounds": _ROUNDS.value, "rows": rows, "doctor": doctor_report, "torch_work": torch_work,
              "prediction": prediction_check(doctor_report, rows, advised or n,
                                             "advised" if "advised" in rows else "compiled"),
              "against_compute": against_compute(doctor_report, rows)}
    for fed in (setup for setup in PROFILED_SETUPS if setup in models and _DOCTOR.value):
        # after the rounds: the compiled execution's own breakdown (its GPU idle), per input setup
        set_plan(strategy, plans[fed], fed)
        model, dataset = models[fed]
        doctor = bench.doctor_fit(model, dataset, global_batch, os.path.join(_OUTPUT.value, f"{name}_{fed}"),
                                  warmup_steps=2 * n, window_steps=2 * n, verbose=False, model_flops_per_step=flops)
        record[f"doctor_{fed}"] = {"setup": fed, **(doctor.report or {"unavailable": doctor.unavailable})}
        if fed != "compiled":
            record[f"against_compute_{fed}"] = against_compute(doctor_report, rows, fed)
    steady_check(record, n)
    for folder in (name, *(f"{name}_{fed}" for fed in PROFILED_SETUPS)):  # the doctor's traces, kept beside its JSON
        trace.keep_trace(os.path.join(_OUTPUT.value, folder, "profile"),
                         os.path.join(_OUTPUT.value, f"{folder}.xplane.pb.gz"))
    models.clear()
    gc.collect()
    return record


FLOP_COUNT = ("6·N·T + 12·L·D·S·T: N the non-embedding parameters, T the step's tokens, L layers, D d_model, S the "
              "sequence; attention over the whole S x S matrix (bench_models.transformer_flops_per_step)")


def gpu_name(strategy):
    """The name NVML gives the strategy's first GPU (the MFU's peak is looked up by it), else TensorFlow's name for
    its first GPU; None without a GPU."""
    import tensorflow as tf  # noqa: PLC0415

    from tf_nvlink.machine import nvml  # noqa: PLC0415

    indices = tuple(getattr(getattr(strategy, "plan", None), "gpus", ()) or ())
    if not indices:
        return None
    names = {gpu.index: gpu.name for gpu in nvml.probe().gpus}
    if indices[0] in names:
        return names[indices[0]]
    gpus = tf.config.list_physical_devices("GPU")
    return tf.config.experimental.get_device_details(gpus[0]).get("device_name") if gpus else None


def advised_steps(report: dict):
    """The N of the doctor's `steps_per_execution=N` advice, or None."""
    for advice in (report.get("verdict") or {}).get("advice", []):
        change = advice.get("change", "")
        if change.startswith("steps_per_execution="):
            return int(change.split("=", 1)[1])
    return None


def prediction_check(report, rows: dict, n: int, setup: str):
    """The doctor's predicted gain for steps_per_execution=n against the measured spe=1 -> `setup` gain (the
    compiled execution at that N)."""
    advice = [a for a in ((report or {}).get("verdict") or {}).get("advice", [])
              if a.get("change") == f"steps_per_execution={n}"]
    if not advice or "spe=1" not in rows or setup not in rows:
        return None
    measured = rows["spe=1"]["ms_per_step"] / rows[setup]["ms_per_step"] - 1
    predicted = advice[0]["gain"]
    return {"n": n, "setup": setup, "predicted_gain": predicted, "measured_gain": measured,
            "relative_error": (predicted - measured) / measured if measured else None}


def steady_check(record: dict, n: int) -> None:
    """Beside the whole-fit check: the predicted gain against the doctor's own steady-state steps (spe=1's window
    against the compiled execution's at N), when the prediction is for that N."""
    prediction, spe1 = record.get("prediction"), ((record.get("doctor") or {}).get("mean") or {}).get("step_ms")
    compiled = ((record.get("doctor_compiled") or {}).get("mean") or {}).get("step_ms")
    if prediction and prediction["n"] == n and spe1 and compiled:
        measured = spe1 / compiled - 1
        prediction.update(measured_gain_steady=measured,
                          relative_error_steady=(prediction["predicted_gain"] - measured) / measured)


def against_compute(report, rows: dict, setup: str = "compiled"):
    """A compiled execution setup's ms per step over the doctor's compute time per step (spe=1's kernels)."""
    compute = ((report or {}).get("mean") or {}).get("compute_ms")
    if not compute or setup not in rows:
        return None
    return {"setup": setup, "compute_ms": compute, "compiled_ms": rows[setup]["ms_per_step"],
            "ratio": rows[setup]["ms_per_step"] / compute}


def setups_for(name: str, setups: list, torch: bool) -> list:
    """The setups model `name` runs: "torch" only where the PyTorch peer runs (`torch`) and has the model."""
    return [setup for setup in setups if setup != "torch" or (torch and name in PEER_MODELS)]


def doctor_work_lines(report: dict, label: str) -> list:
    """The doctor's kernel time by kind of work (ms per step, kinds with time) and its MFU line, for the log."""
    work = (report.get("mean") or {}).get("work_ms") or {}
    lines = []
    if any(work.values()):
        lines.append(f"doctor ({label}) by kind of work, ms per step: "
                     + ", ".join(f"{kind} {ms:.2f}" for kind, ms in work.items() if ms))
    if report.get("mfu"):
        lines.append(f"doctor ({label}): {outputs.mfu_line(report['mfu'])}")
    return lines


def _cell(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def kind_table(record: dict) -> list:
    """The two steps kind by kind, ms per step: the step doctor's window of the compiled execution (else of spe=1)
    with each kind's bound and measured / bound (`tf_nvlink.tools.doctor.bounds`), and the PyTorch peer's kernels
    by the same kinds (torch.profiler, `torch_peer.work_by_kind`); the GPU's busy time last."""
    theirs = record.get("torch_work") or {}
    label, doctor = next(((label, report) for label, report in (
        (f"compiled, N={record['steps_per_execution']}", record.get("doctor_compiled")),
        ("spe=1", record.get("doctor"))) if (report or {}).get("mean")), ("no window", {}))
    mean = doctor.get("mean") or {}
    ours, bounds = mean.get("work_ms") or {}, (doctor.get("work_bounds") or {}).get("kinds") or {}
    torch_ms = theirs.get("work_ms") or {}
    kinds = [kind for kind in WORK_KINDS if ours.get(kind) or torch_ms.get(kind)]
    if not kinds:
        return []
    torch_label = f"torch.profiler, {theirs.get('steps')} steps" if theirs else "not run"
    lines = [f"by kind of work, ms per step: tf_nvlink (the step doctor, {label}) and torch ({torch_label})",
             "| kind | tf_nvlink | its bound | x bound | torch |", "| --- | --- | --- | --- | --- |"]
    for kind in kinds:
        row = bounds.get(kind) or {}
        lines.append(f"| {kind} | {_cell(ours.get(kind))} | {_cell(row.get('bound_ms'))} | "
                     f"{_cell(row.get('x_bound'))} | {_cell(torch_ms.get(kind))} |")
    lines.append(f"| GPU busy | {_cell(mean.get('busy_ms'))} | - | - | {_cell(theirs.get('busy_ms'))} |")
    return lines


def render(record: dict) -> str:
    rows = record["rows"]
    flops = record.get("model_flops_per_step")
    mfu_head, mfu_rule = (" model TFLOP/s per GPU | MFU |", " --- | --- |") if flops else ("", "")
    lines = [f"\n## {record['model']} (global batch {record['global_batch']}, N={record['steps_per_execution']}, "
             f"{record['steps']}-step fits, {record['rounds']} interleaved rounds, {record.get('optimizer', 'sgd')})",
             f"| setup | samples/s (median) | ms/step | spread | vs per-step | vs torch |{mfu_head} path |",
             f"| --- | --- | --- | --- | --- | --- |{mfu_rule} --- |"]
    base = rows.get("per-step", {}).get("samples_per_s")
    peer = rows.get("torch", {}).get("samples_per_s")
    for setup, row in rows.items():
        rate = row["samples_per_s"]
        against = [f"{rate / other:.3f}" if other else "-" for other in (base, peer)]
        use = row.get("utilisation")
        mfu_cells = f" {use['tflops_per_gpu']:.4g} | {gpu_peaks.mfu_text(use['mfu'])} |" if use else ""
        lines.append(f"| {setup} | {rate:.1f} | {row['ms_per_step']:.2f} | {row['spread']:.1%} | {against[0]} | "
                     f"{against[1]} |{mfu_cells} {row['path'][0] if row['path'] else '-'} |")
    if flops:
        gpu = record.get("gpu")
        peak = gpu_peaks.bf16_dense_peak(gpu)
        lines.append(f"model FLOPs per step {flops / 1e12:.4g} TFLOP ({record['flop_count']}); MFU against "
                     + (f"the {peak.label}'s {peak.tflops:g} TFLOP/s ({peak.source})" if peak else
                        "no peak: no GPU" if gpu is None else
                        f"no peak: the GPU {gpu!r} is not in tf_nvlink.plan.gpu_peaks"))
    doctor = record.get("doctor") or {}
    window = doctor.get("window") or {}
    if window:
        lines.append(f"doctor (spe=1): {(doctor.get('verdict') or {}).get('kind')}; step {window.get('step_ms')} ms; "
                     f"breakdown {json.dumps(doctor.get('breakdown'), default=str)[:400]}")
        lines += doctor_work_lines(doctor, "spe=1")
    for advice in (doctor.get("verdict") or {}).get("advice", []):
        lines.append(f"doctor advice: {advice.get('change')} predicted +{advice.get('gain', 0):.1%} per step")
    if doctor.get("input_copy"):
        lines.append(f"doctor input copy (spe=1): {json.dumps(doctor['input_copy'])}")
    check = record.get("prediction")
    if check:
        error = check["relative_error"]
        lines.append(f"prediction check N={check['n']} ({check['setup']}): predicted +{check['predicted_gain']:.1%}, "
                     f"measured +{check['measured_gain']:.1%}"
                     + (f" (relative error {error:+.0%})" if error is not None else "")
                     + (f"; steady state (the doctor's windows) +{check['measured_gain_steady']:.1%} (relative error "
                        f"{check['relative_error_steady']:+.0%})" if "measured_gain_steady" in check else ""))
    for fed in PROFILED_SETUPS:
        ratio = record.get("against_compute" if fed == "compiled" else f"against_compute_{fed}")
        if ratio:
            lines.append(f"{fed} step {ratio['compiled_ms']:.2f} ms against the doctor's compute "
                         f"{ratio['compute_ms']:.2f} ms per step: {ratio['ratio']:.3f}x")
        compiled = record.get(f"doctor_{fed}") or {}
        mean = compiled.get("mean")
        if mean:
            lines.append(f"doctor ({fed}, N={record['steps_per_execution']}): step {mean['step_ms']:.2f} ms, "
                         f"compute {mean['compute_ms']:.2f} ms, GPU idle {mean['idle_ms']:.2f} ms "
                         f"({mean['idle_ms'] / mean['step_ms']:.1%}), input copy exposed {mean['exposed_h2d_ms']:.2f} "
                         f"ms; input copy {json.dumps(compiled.get('input_copy'))}")
            lines += doctor_work_lines(compiled, f"{fed}, N={record['steps_per_execution']}")
        elif compiled:
            lines.append(f"doctor ({fed}): {compiled.get('unavailable')}")
    lines += kind_table(record)
    return "\n".join(lines)


def main(argv):
    del argv
    unknown = [m for m in _MODELS.value if m not in bench_models.BENCH_MODELS]
    bad_setups = [s for s in _SETUPS.value if s not in SETUPS]
    if unknown or bad_setups:
        raise app.UsageError(f"--models {unknown} / --setups {bad_setups} unknown; valid: "
                             f"{list(bench_models.BENCH_MODELS)} / {list(SETUPS)}")
    print("# " + " ".join(sys.argv), flush=True)
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")  # the PyTorch peer shares the GPU
    from tf_nvlink.tools.doctor import bench  # noqa: PLC0415

    strategy = bench.configure(cpu_devices=1 if _DEVICES.value == "cpu" else 0)
    records = []
    for name in _MODELS.value:
        setups = setups_for(name, _SETUPS.value, _TORCH.value and _DEVICES.value == "gpu")
        records.append(bench_model(name, strategy, setups))
        print(render(records[-1]), flush=True)
        if _JSON.value:
            atomic_files.write_atomic(_JSON.value, json.dumps(records, indent=1, default=str), mode=None)
    return 0


if __name__ == "__main__":
    app.run(main)
