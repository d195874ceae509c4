r"""Synthetic training throughput: tf_nvlink's plan against every cross-device-ops candidate, 1 GPU against all.

    python examples/benchmark.py                                 # the seed MLP, every candidate
    python examples/benchmark.py --model resnet50 --candidates 1gpu,stock,auto
    python examples/benchmark.py --model resnet50 --nvlink_off   # adds each candidate with NCCL_P2P_DISABLE=1
    python examples/benchmark.py --model resnet50 --step_doctor  # + the step doctor's breakdown and advice

Each candidate trains in its own process (TensorFlow tolerates one MirroredStrategy per process) on synthetic
data, side by side in one run, and the table gives examples/s, the speed-up over one GPU, the scaling efficiency
(throughput_N / (N x throughput_1)) and the ratio to TensorFlow's stock MirroredStrategy.
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

try:
    from tf_nvlink.tools.training_bench import cli as training_bench
except ImportError:  # run from a source checkout without `pip install .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tf_nvlink.tools.training_bench import cli as training_bench
from tf_nvlink.tools.training_bench.candidates import BASES, Candidate, parse_list
from tf_nvlink.util import atomic_files

_MODEL = flags.DEFINE_enum("model", "mlp", training_bench.MODELS,
                           "mlp: the seed 784-256-128-10 MLP (overhead-bound); resnet50: ResNet-50 on 224x224 "
                           "synthetic images with mixed_bfloat16 (compute-heavy); convnet: a tiny CPU-friendly net.")
_CANDIDATES = flags.DEFINE_string(
    "candidates", ",".join(c for c in BASES if c != "workers"),
    "Comma list: 1gpu (no strategy), stock (tf.distribute.MirroredStrategy as TensorFlow gives it), auto "
    "(tf_nvlink's plan), collective, nccl, reduce_to_one, hierarchical, onedevice (OneDeviceStrategy); each may "
    "end in @nop2p, @ondevice, @nocudagraphs or @customloop (not workers), and tf_nvlink's in @split, @fused, "
    "@nolhs, @bf16grad, @buffer1 or @nosync. Also workers (one MultiWorkerMirroredStrategy process per GPU on this "
    "host; @nop2p, @ondevice, @nocudagraphs only).")
_BATCH = flags.DEFINE_integer("batch_per_replica", None, "Batch per replica (default: mlp 1024, resnet50 128).",
                              lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 30, "Timed steps per epoch (3 epochs; the first compiles).", lower_bound=1)
_JIT = flags.DEFINE_bool("jit", True, "XLA for 1gpu and tf_nvlink candidates (stock keeps Keras' choice: off).")
_NVLINK_OFF = flags.DEFINE_bool("nvlink_off", False, "Also run tf_nvlink's plan with NCCL_P2P_DISABLE=1, to show "
                                "what NVLink buys on this machine.")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Run over N logical CPU devices instead of GPUs (machines "
                                    "without GPUs, tests). 0: GPUs.", lower_bound=0)
_ROUNDS = flags.DEFINE_integer("rounds", 1, "Run the candidate list this many times, interleaved, and report each "
                               "candidate's median (these machines are noisy: 3 is a good start).", lower_bound=1)
_JSON = flags.DEFINE_string("json", "", "Write the records to this JSON file.")
_STEP_DOCTOR = flags.DEFINE_bool(
    "step_doctor", False, "Also fit the model once under tf_nvlink.strategy() with tf_nvlink.StepDoctor (its own "
    "process) and print where the step time goes, the verdict and the advice with its predicted gain.")
_STEP_DOCTOR_DIR = flags.DEFINE_string("step_doctor_dir", "step_doctor", "Where --step_doctor writes "
                                       "step_doctor.json, step_doctor.png and the trace.")


def run_step_doctor(model: str, batch_per_replica: int, cpu_devices: int, output_dir: str) -> int:
    """`python -m tf_nvlink.tools.doctor` in a child process (one strategy per process); its exit status."""
    command = [sys.executable, "-m", "tf_nvlink.tools.doctor", "--model", model, "--batch_per_replica",
               str(batch_per_replica), "--output_dir", output_dir]
    if cpu_devices:
        command += ["--cpu_devices", str(cpu_devices)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print(f"\n# step doctor: {' '.join(command[1:])}", flush=True)
    return subprocess.run(command, env=env).returncode


def main(argv):
    del argv
    try:
        candidates = parse_list(_CANDIDATES.value)
    except ValueError as exc:
        raise app.UsageError(str(exc)) from exc
    if _NVLINK_OFF.value and Candidate("auto", nop2p=True) not in candidates:
        candidates.append(Candidate("auto", nop2p=True))
    print("# " + " ".join(sys.argv), flush=True)
    cpu_devices = _CPU_DEVICES.value
    no_gpu = None if cpu_devices else training_bench.gpu_absence()
    if no_gpu:  # say so now, and run what means something on CPU devices, instead of failing rows a minute later
        cpu_devices = training_bench.CPU_FALLBACK_DEVICES
        candidates, dropped = training_bench.cpu_candidates(candidates)
        print(f"# no GPU here ({no_gpu}): running on {cpu_devices} logical CPU devices, as --cpu_devices "
              f"{cpu_devices} does; CPU figures say nothing about NVLink"
              + (f"; left out {', '.join(c.label for c in dropped)} (they need GPUs)" if dropped else ""), flush=True)
        if not candidates:
            raise app.UsageError(f"no candidate of --candidates={_CANDIDATES.value!r} runs without GPUs; try "
                                 f"--candidates 1gpu,stock,auto,collective,reduce_to_one --cpu_devices 2")
    results = training_bench.run_candidates(_MODEL.value, candidates, _BATCH.value, _STEPS.value, _JIT.value,
                                            cpu_devices=cpu_devices, rounds=_ROUNDS.value)
    print(training_bench.render_table(results))
    if _JSON.value:
        atomic_files.write_atomic(_JSON.value, json.dumps(results, indent=1), mode=None)
    doctor_status = 0
    if _STEP_DOCTOR.value:
        doctor_status = run_step_doctor(_MODEL.value, _BATCH.value or training_bench.DEFAULT_BATCH[_MODEL.value],
                                        cpu_devices, _STEP_DOCTOR_DIR.value)
    return 1 if doctor_status or any("error" in r for r in results) else 0


if __name__ == "__main__":
    app.run(main)
