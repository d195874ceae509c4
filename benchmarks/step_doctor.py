r"""The step doctor's advice, applied and measured, in ONE command: per model, the doctor's verdict and predicted
gain, then interleaved rounds of
  (a) `tf_nvlink.strategy()`, `steps_per_execution=1` (what the doctor looked at),
  (b) the same with the doctor's `steps_per_execution=N` applied (when it advises one),
  (c) ResNet-50 only: a PyTorch peer in a child process (torchvision resnet50, bf16 autocast, channels_last,
      `torch.compile` with default options, SGD momentum, the same batch and a pinned uint8 host batch copied to the GPU
      and scaled each step).
Each measurement is the wall time of a whole `fit` of --steps steps (a --warmup_steps fit before compiles); the
table gives each setup's median over the rounds and the spread (max - min) / median, and the JSON keeps every round.

    python benchmarks/step_doctor.py --rounds 3 --json step_doctor.json                     # 1x H200
    python benchmarks/step_doctor.py --models resnet50 --doctor_window 3 --trace_out tests/tools/fixtures
                                                      # keep a small trace: the CPU tests' fixture
    python benchmarks/step_doctor.py --models convnet --devices cpu --rounds 1 --notorch    # CPU smoke run

Models and input are the training benchmark's (uint8 images cast on the GPU, mixed_bfloat16, SGD momentum 0.9):
resnet50 (batch 128 per replica) and the 368M-parameter transformer (batch 8). The predicted gain is the doctor's
saving per step applied to the measured (a) fit: a_fit / (a_fit - steps x saved) - 1; its per-step gain is shown too.
The doctor's cost: the time in its hooks plus the traced window's extra time over an untraced step, against a
2000-step epoch of (a).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/torch_peer.py

from tf_nvlink.tools import bench_stats  # noqa: E402
from tf_nvlink.tools import bench_models  # noqa: E402
from tf_nvlink.util import atomic_files  # noqa: E402
from torch_peer import TorchPeer  # noqa: E402 - benchmarks/torch_peer.py

DEFAULT_BATCH = {"resnet50": 128, "transformer": 8, "transformer_2048": 2, "convnet": 8, "transformer_tiny": 4,
                 "mlp": 1024}
EPOCH_STEPS = 2000  # the doctor's cost is judged against an epoch this long

_MODELS = flags.DEFINE_list("models", ["resnet50", "transformer"], f"Any of {list(bench_models.BENCH_MODELS)}.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds of every setup.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 96, "Steps per timed fit.", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup_steps", 15, "Steps of the warm-up fit before the timed ones.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_per_replica", None, f"Default per model: {DEFAULT_BATCH}.", lower_bound=1)
_DEVICES = flags.DEFINE_enum("devices", "gpu", ["gpu", "cpu"], "gpu: tf_nvlink.strategy() over the GPUs; cpu: "
                             "over --cpu_devices logical CPU devices (no trace of GPU work: the doctor says so).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 1, "Logical CPU devices for --devices cpu.", lower_bound=1)
_TORCH = flags.DEFINE_bool("torch", True, "Run the PyTorch peer for resnet50 (needs torch, torchvision and a GPU).")
_DOCTOR_WARMUP = flags.DEFINE_integer("doctor_warmup", 20, "The doctor's warmup_steps.", lower_bound=1)
_DOCTOR_WINDOW = flags.DEFINE_integer("doctor_window", 10, "The doctor's window_steps.", lower_bound=1)
_JSON = flags.DEFINE_string("json", "", "Write every measurement and the doctor's reports to this JSON file.")
_TRACE_OUT = flags.DEFINE_string("trace_out", "", "Copy each model's doctor trace and observation to "
                                 "DIR/step_doctor_<model>/ (profile/ and observation.json: a CPU test fixture).")
_OUTPUT = flags.DEFINE_string("output_dir", "step_doctor_out", "Where the doctor's files go (one folder a model).")


# ---- the TensorFlow side ---------------------------------------------------------------------------------------
def advised_steps_per_execution(report: dict):
    """N of the doctor's `steps_per_execution=N` advice and that advice, or (None, None)."""
    for advice in (report.get("verdict") or {}).get("advice", []):
        if advice["change"].startswith("steps_per_execution="):
            return int(advice["change"].split("=", 1)[1]), advice
    return None, None


def timed_fit(model, dataset, steps: int) -> float:
    started = time.perf_counter()
    model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0, shuffle=False)
    return time.perf_counter() - started


def summary(seconds: list, samples_per_fit: int) -> dict:
    stats = bench_stats.summarize(seconds)
    return {"fit_s": seconds, "median_s": stats.median, "spread": stats.spread,
            "samples_per_s": samples_per_fit / stats.median}


def save_fixture(doctor, model_name: str, out_dir: str) -> str:
    """The doctor's trace and what it observed, as tests/tools/test_doctor.py's fixture reads them."""
    target = os.path.join(out_dir, f"step_doctor_{model_name}")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(doctor.profile_dir, os.path.join(target, "profile"))
    report = doctor.report or {}
    context = dict(report.get("context") or {})
    window = report.get("window") or {}
    observation = {"model": model_name, "step_ms": window.get("step_ms"), "steps": window.get("steps"),
                   "calls": window.get("calls"), "verdict": (report.get("verdict") or {}).get("kind"),
                   "context": context}
    atomic_files.write_atomic(os.path.join(target, "observation.json"), json.dumps(observation, indent=1),
                              mode=None)
    return target


def bench_model(name: str, strategy, batch: int, torch_peer: bool) -> dict:
    from tf_nvlink.tools.doctor import bench

    steps, rounds = _STEPS.value, _ROUNDS.value
    # first: the peer compiles while TensorFlow does
    peer = TorchPeer("resnet50", batch, steps, _WARMUP.value) if torch_peer else None
    model_a, dataset, global_batch = bench.build(name, strategy, batch, steps_per_execution=1)
    timed_fit(model_a, dataset, _WARMUP.value)  # compiles
    if peer:
        peer.wait_until_ready()  # idle from here on, until its rounds: the doctor's window has the GPU alone
    doctor = bench.doctor_fit(model_a, dataset, global_batch, os.path.join(_OUTPUT.value, name),
                              warmup_steps=_DOCTOR_WARMUP.value, window_steps=_DOCTOR_WINDOW.value)
    report = doctor.report or {}
    n, advice = advised_steps_per_execution(report)
    setups = {"a: tf_nvlink spe=1": model_a}
    if n:
        model_b, _, _ = bench.build(name, strategy, batch, steps_per_execution=n)
        timed_fit(model_b, dataset, max(_WARMUP.value, n))
        setups[f"b: tf_nvlink spe={n} (advised)"] = model_b
    seconds = {label: [] for label in setups}
    if peer:
        seconds["c: torch.compile peer"] = []
    try:
        labels = list(seconds)
        for round_index in range(rounds):
            order = labels[round_index % len(labels):] + labels[:round_index % len(labels)]
            for label in order:
                seconds[label].append(peer.run() if label.startswith("c:") else
                                      timed_fit(setups[label], dataset, steps))
    finally:
        if peer:
            peer.close()
    rows = {label: summary(values, global_batch * steps) for label, values in seconds.items()}
    record = {"model": name, "global_batch": global_batch, "steps": steps, "rounds": rounds, "rows": rows,
              "doctor": report, "doctor_unavailable": doctor.unavailable}
    a_fit = rows["a: tf_nvlink spe=1"]["median_s"]
    window_ms = (report.get("window") or {}).get("step_ms")
    untraced_step_ms = a_fit * 1e3 / steps
    traced_extra_s = max(((window_ms or untraced_step_ms) - untraced_step_ms) * _DOCTOR_WINDOW.value / 1e3, 0.0)
    record["doctor_cost"] = {"hooks_s": doctor.overhead_s, "traced_window_extra_s": traced_extra_s,
                             "fraction_of_2000_step_epoch": (doctor.overhead_s + traced_extra_s)
                             / (EPOCH_STEPS * untraced_step_ms / 1e3)}
    if advice:
        b_fit = rows[f"b: tf_nvlink spe={n} (advised)"]["median_s"]
        predicted_b = a_fit - steps * advice["saved_ms"] / 1e3
        record["advice"] = {"change": advice["change"], "predicted_gain_per_step": advice["gain"],
                            "predicted_gain": a_fit / predicted_b - 1 if predicted_b > 0 else None,
                            "measured_gain": a_fit / b_fit - 1}
    if _TRACE_OUT.value:
        record["fixture"] = save_fixture(doctor, name, _TRACE_OUT.value)
    del setups
    gc.collect()
    return record


def render(records: list) -> str:
    lines = []
    for record in records:
        rows = record["rows"]
        torch_rate = rows.get("c: torch.compile peer", {}).get("samples_per_s")
        lines.append(f"\n## {record['model']} (global batch {record['global_batch']}, {record['steps']}-step fits, "
                     f"{record['rounds']} interleaved rounds)")
        lines.append("| setup | samples/s (median) | spread | against torch.compile |")
        lines.append("| --- | --- | --- | --- |")
        for label, row in rows.items():
            ratio = f"{row['samples_per_s'] / torch_rate:.2f}" if torch_rate else "-"
            lines.append(f"| {label} | {row['samples_per_s']:.1f} | {row['spread']:.1%} | {ratio} |")
        verdict = (record["doctor"].get("verdict") or {}).get("kind") or record["doctor_unavailable"]
        lines.append(f"doctor: {verdict}")
        advice = record.get("advice")
        if advice:
            lines.append(f"advice {advice['change']}: predicted +{advice['predicted_gain']:.1%} per fit "
                         f"(+{advice['predicted_gain_per_step']:.1%} per step), measured "
                         f"{advice['measured_gain']:+.1%}")
        else:
            lines.append("advice: no steps_per_execution advice to apply")
        cost = record["doctor_cost"]
        lines.append(f"doctor cost: hooks {cost['hooks_s']:.3f} s + traced window {cost['traced_window_extra_s']:.3f} s"
                     f" = {cost['fraction_of_2000_step_epoch']:.2%} of a {EPOCH_STEPS}-step epoch")
    return "\n".join(lines)


def main(argv):
    del argv
    unknown = [m for m in _MODELS.value if m not in bench_models.BENCH_MODELS]
    if unknown:
        raise app.UsageError(f"--models: {unknown} unknown; valid: {list(bench_models.BENCH_MODELS)}")
    print("# " + " ".join(sys.argv), flush=True)
    # TensorFlow takes every GPU's memory at its first op unless told to grow: the PyTorch peer shares the GPU.
    os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    from tf_nvlink.tools.doctor import bench

    strategy = bench.configure(cpu_devices=_CPU_DEVICES.value if _DEVICES.value == "cpu" else 0)
    records = []
    for name in _MODELS.value:
        batch = _BATCH.value or DEFAULT_BATCH[name]
        use_torch = _TORCH.value and name == "resnet50" and _DEVICES.value == "gpu"
        records.append(bench_model(name, strategy, batch, use_torch))
        print(render(records[-1:]), flush=True)
    if _JSON.value:
        atomic_files.write_atomic(_JSON.value, json.dumps(records, indent=1, default=str), mode=None)
    return 0


if __name__ == "__main__":
    app.run(main)
