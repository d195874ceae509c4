"""Training throughput, 1 GPU against N GPUs, per cross-device-ops candidate, side by side in one run.

Each candidate trains in its own process (TensorFlow tolerates one MirroredStrategy per process) on synthetic
data fed the way users feed it (`--input host`, the default): one global batch in host memory (uint8 images,
int32 tokens, float32 MLP features) served by `tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(AUTOTUNE)`;
the model casts images to floats on the device (its first layer, `Rescaling`). A candidate's figure is the wall
time of one whole `model.fit(ds, steps_per_epoch=steps)` call after a warm-up fit that compiles; `--rounds`
(default 3) runs the candidate list that many times, interleaved, and reports each candidate's median round with
the spread. `--input device` (or the suffix `@ondevice`) keeps the batch on each device instead: it lives in a
non-trainable variable on every replica's device (copied there once, when the model is built) and tf.data
carries only int32 example indices and the labels from the host, so the step is measured without the image
copies. Candidates:

- `1gpu`: the best single-GPU setup (no strategy; XLA when `--jit`);
- `stock`: `tf.distribute.MirroredStrategy()` exactly as TensorFlow gives it (Keras turns XLA off under it);
- `auto`: `tf_nvlink.strategy()` with the policy's choice; `collective`, `nccl`, `reduce_to_one`,
  `hierarchical`: `tf_nvlink.strategy(cross_device_ops=...)`; `NAME@nop2p`: the same with `NCCL_P2P_DISABLE=1`
  (NCCL moves data through host memory, as on a PCIe-only machine);
- knob suffixes for tf_nvlink strategies, each measured against the same name without it: `@nolhs`
  (xla_flags="none": no latency-hiding scheduler), `@bf16grad` (allreduce_dtype="bfloat16"), `@buffer1`
  (input_buffer=1, TensorFlow's default prefetch depth), `@split`/`@fused` (XLA all-reduce mode), `@nosync`
  (TF_NVLINK_SYNC_NON_TRAINABLE=0: replicas keep their own BatchNorm statistics, what the sync costs);
- `workers`: the multi-worker runtime on this host, one worker process per GPU (CUDA_VISIBLE_DEVICES) with a
  localhost TF_CONFIG, so `tf_nvlink.strategy()` gives a MultiWorkerMirroredStrategy (NCCL between the
  processes); with `--cpu_devices N`, N CPU-only workers (tests). The chief's figures are reported.

The models and their input are in tf_nvlink/models.py, the worker that trains one candidate (TensorFlow) in
tf_nvlink/bench/training_worker.py; this module runs the workers and renders the table.

Example:
    $ python -m tf_nvlink.tools.training_bench --model resnet50 --candidates 1gpu,stock,auto --jit
    $ python -m tf_nvlink.tools.training_bench --model transformer --candidates 1gpu,auto,auto@nop2p,auto@bf16grad@nop2p
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from tf_nvlink.util import atomic_files

from tf_nvlink.tools.training_bench import models

from tf_nvlink.util import json_workers
from tf_nvlink.util.text import one_line_error

MODELS = models.BENCH_MODELS  # built by models.build_bench_model
DEFAULT_BATCH = {"mlp": 1024, "resnet50": 128, "convnet": 64, "transformer": 8, "transformer_tiny": 4}  # per replica
IMAGE_MODELS, INPUTS = models.IMAGE_MODELS, models.INPUTS  # uint8-fed models; host- or device-held input
OPS_CANDIDATES = ("auto", "collective", "nccl", "reduce_to_one", "hierarchical")
CANDIDATES = ("1gpu", "stock") + OPS_CANDIDATES + ("workers",)


# Suffixes for tf_nvlink single-process strategies only (their arguments), and for every candidate.
STRATEGY_SUFFIXES = ("split", "fused", "nolhs", "bf16grad", "buffer1", "nosync")
SUFFIXES = ("nop2p", "ondevice") + STRATEGY_SUFFIXES
# Knob suffix -> (what the table's ratio line calls it, True when the suffix turns the knob ON).
KNOB_LINES = {"nolhs": ("latency-hiding scheduler on/off", False),
              "bf16grad": ("bfloat16/float32 gradient all-reduce", True),
              "buffer1": ("plan's input buffer/buffer 1", False),
              "ondevice": ("data on the device/host-fed", True)}
# Candidates that need GPUs: NCCL has no CPU kernels, HierarchicalCopyAllReduce falls back to reduce-to-one on CPU
# devices, fused XLA all-reduce is GPU-only, NCCL_P2P_DISABLE means nothing without GPUs.
GPU_ONLY = ("nccl", "hierarchical")
GPU_ONLY_SUFFIXES = ("nop2p", "fused")
CPU_FALLBACK_DEVICES = 2


def cpu_candidates(candidates: list[str]) -> tuple[list[str], list[str]]:
    """(what makes sense on CPU devices, what was left out because it needs GPUs).

    Example:
        >>> cpu_candidates(["1gpu", "stock", "auto", "nccl", "auto@nop2p", "auto@bf16grad@fused"])
        (['1gpu', 'stock', 'auto'], ['nccl', 'auto@nop2p', 'auto@bf16grad@fused'])
    """
    kept, dropped = [], []
    for candidate in candidates:
        name, *suffixes = candidate.split("@")
        (dropped if name in GPU_ONLY or set(suffixes) & set(GPU_ONLY_SUFFIXES) else kept).append(candidate)
    return kept, dropped


def error_line(error: str, limit: int = 150) -> str:
    """One line of a worker's error for a table: the exception line, never the traceback's frames
    (`text.one_line_error`).

    Example:
        >>> error_line('Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad')
        'ValueError: bad'
    """
    return one_line_error(error, limit=limit, empty="(no message)")


def gpu_absence() -> Optional[str]:
    """Why this machine has no GPU to benchmark (NVML, no TensorFlow), or None when NVML lists a visible one."""
    from tf_nvlink.machine import tf_devices  # noqa: PLC0415
    from tf_nvlink.machine import nvml

    topology = nvml.probe()
    if not topology.gpus:
        return topology.error or "NVML lists no GPU"
    if not tf_devices.visible_nvml_indices(topology):
        return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides every GPU"
    return None


def parse_candidates(text: str) -> list[str]:
    """"1gpu,auto,nccl@nop2p,auto@split" -> list, with a clear error for unknown names.

    Suffixes: "@nop2p" sets NCCL_P2P_DISABLE=1; "@ondevice" keeps the batch on the devices; for tf_nvlink
    strategies "@split"/"@fused" force the XLA all-reduce mode, "@nolhs" adds no XLA flags, "@bf16grad"
    all-reduces gradients in bfloat16, "@buffer1" prefetches one batch per replica.
    """
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError(f"candidates should be a comma list of {list(CANDIDATES)} (optionally NAME@nop2p). "
                         f"Received: {text!r}")
    for name in names:
        base, *suffixes = name.split("@")
        if base not in CANDIDATES or any(x not in SUFFIXES for x in suffixes) or len(set(suffixes)) < len(
                suffixes) or {"split", "fused"} <= set(suffixes):
            raise ValueError(f"Unknown candidate {name!r}; valid: {list(CANDIDATES)}, each optionally with "
                             f"'@nop2p' (NCCL_P2P_DISABLE=1), '@ondevice' (data on the devices), '@split' or "
                             f"'@fused' (XLA all-reduce mode), '@nolhs', '@bf16grad', '@buffer1'. "
                             f"Received: {text!r}")
        if base in ("1gpu", "stock", "workers") and set(STRATEGY_SUFFIXES) & set(suffixes):
            raise ValueError(f"Candidate {name!r}: {['@' + x for x in STRATEGY_SUFFIXES]} are arguments of a "
                             f"single-process tf_nvlink strategy; {base!r} has none (only '@nop2p' and "
                             f"'@ondevice' apply). Received: {text!r}")
    return names


def run_candidates(model_name: str, candidates: list[str], batch_per_replica: Optional[int] = None, steps: int = 30,
                   jit: bool = True, mixed_precision: Optional[bool] = None, cpu_devices: int = 0,
                   timeout: int = 900, rounds: int = 3, input_mode: str = "host",
                   warmup_steps: int = 10) -> list[dict]:
    """Run each candidate in its own process, one after another; failures become records with an `error`.

    With `rounds` > 1 the whole list runs that many times, round-robin (so slow drifts of a noisy machine hit
    every candidate alike), and each candidate's record is its median round, with every round's figure in
    `rounds_examples_per_s` and their spread.
    """
    if model_name not in MODELS:
        raise ValueError(f"model should be one of {list(MODELS)}. Received: {model_name!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds should be a positive integer. Received: rounds={rounds!r}")
    if input_mode not in INPUTS:
        raise ValueError(f"input should be one of {list(INPUTS)}. Received: input={input_mode!r}")
    batch = batch_per_replica or DEFAULT_BATCH[model_name]
    # bfloat16 compute where it pays on GPUs: ResNet-50 and the Transformer (the tiny one mirrors the big one).
    mixed = (model_name == "resnet50" or model_name in models.TRANSFORMER_CONFIGS) if mixed_precision is None \
        else mixed_precision
    runs: dict[str, list[dict]] = {candidate: [] for candidate in candidates}
    for round_index in range(rounds):
        for candidate in candidates:
            record = _run_one(model_name, candidate, batch, steps, jit, mixed, cpu_devices, timeout, input_mode,
                              warmup_steps)
            runs[candidate].append(record)
            where = f" (round {round_index + 1}/{rounds})" if rounds > 1 else ""
            print(f"  {candidate}{where}: " + (f"{record['examples_per_s']:.0f} examples/s" if "error" not in record
                                               else "FAILED: " + error_line(record["error"])), file=sys.stderr,
                  flush=True)
    return [combine_rounds(runs[candidate]) for candidate in candidates]


def _run_one(model_name, candidate, batch, steps, jit, mixed, cpu_devices, timeout, input_mode="host",
             warmup_steps=10) -> dict:
    env = json_workers.package_env(dict({"NCCL_P2P_DISABLE": "1"} if "@nop2p" in candidate else {},
                                   **({"TF_NVLINK_SYNC_NON_TRAINABLE": "0"} if "@nosync" in candidate else {})))
    multi = candidate.split("@")[0] == "workers"

    def worker_args(devices):
        return [sys.executable, "-m", "tf_nvlink.tools.training_bench", "--worker", "--model", model_name,
                "--candidates", candidate, "--batch_per_replica", str(batch), "--steps", str(steps),
                "--jit" if jit else "--nojit", "--mixed_precision" if mixed else "--nomixed_precision",
                "--cpu_devices", str(devices), "--input", input_mode, "--warmup_steps", str(warmup_steps)]

    started = time.perf_counter()
    if multi:  # each worker process trains on one device: its GPU, or its one CPU
        record, error = _run_workers(worker_args(0), env, cpu_devices, timeout)
    else:
        record, error = json_workers.run_json_worker(worker_args(cpu_devices), env, timeout,
                                                accept=lambda r: "examples_per_s" in r)
    if record is None:
        record = {"model": model_name, "candidate": candidate, "error": error}
    record["wall_s"] = round(time.perf_counter() - started, 1)
    return record


def combine_rounds(records: list[dict]) -> dict:
    """One candidate's rounds -> its median round (the lower middle for an even count), with every round's
    examples/s (None where it failed) and the spread (max - min) / median; a failure only if every round failed.

    Example:
        >>> combine_rounds([{"examples_per_s": 90.0}, {"examples_per_s": 110.0}, {"examples_per_s": 100.0}])
        {'examples_per_s': 100.0, 'rounds_examples_per_s': [90.0, 110.0, 100.0], 'spread': 0.2}
    """
    if len(records) == 1:
        return records[0]
    ok = sorted((r for r in records if "error" not in r), key=lambda r: r["examples_per_s"])
    if not ok:
        return dict(records[-1], rounds_examples_per_s=[None] * len(records))
    median = dict(ok[(len(ok) - 1) // 2])
    figures = [r.get("examples_per_s") if "error" not in r else None for r in records]
    median["rounds_examples_per_s"] = figures
    median["spread"] = round((ok[-1]["examples_per_s"] - ok[0]["examples_per_s"]) / median["examples_per_s"], 4)
    failed = [r["error"] for r in records if "error" in r]
    if failed:
        median["failed_rounds"] = failed
    return median


def worker_layout(cpu_devices: int = 0) -> list[str]:
    """CUDA_VISIBLE_DEVICES of each worker of the `workers` candidate: one GPU each, or "" (CPU) per CPU worker."""
    if cpu_devices:
        return [""] * cpu_devices
    from tf_nvlink.machine import tf_devices  # noqa: PLC0415
    from tf_nvlink.machine import nvml

    visible = tf_devices.visible_nvml_indices(nvml.probe())
    if len(visible) < 2:
        raise ValueError(f"the 'workers' candidate needs 2 or more GPUs (one worker each); NVML shows "
                         f"{len(visible)} here. Use --cpu_devices N for N CPU-only workers.")
    return [str(i) for i in visible]


def _run_workers(args: list[str], env: dict, cpu_devices: int, timeout: int) -> tuple[Optional[dict], str]:
    """The `workers` candidate: one process per GPU (or CPU worker) on localhost, started together; the chief's
    record, with every worker's step time. `args` run one worker on one device (--cpu_devices 0)."""
    try:
        layout = worker_layout(cpu_devices)
    except ValueError as exc:
        return None, str(exc)
    ports = json_workers.free_ports(len(layout))
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    envs = [dict(env, CUDA_VISIBLE_DEVICES=visible, CUDA_DEVICE_ORDER="PCI_BUS_ID",  # NVML's order
                 TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
            for i, visible in enumerate(layout)]
    outcomes = json_workers.run_json_workers([args] * len(layout), envs, timeout, accept=lambda r: "examples_per_s" in r)
    errors = [f"worker {i}: {error}" for i, (record, error) in enumerate(outcomes) if record is None]
    if errors:
        return None, "; ".join(errors)
    record = dict(outcomes[0][0], workers=len(layout),
                  worker_step_ms=[round(r["step_ms"], 2) for r, _ in outcomes])
    return record, ""


def _ratio(value: Optional[float]) -> str:
    return "N/A" if value is None else f"{value:.2f}"


def _without(name: str, suffix: str) -> str:
    base, *suffixes = name.split("@")
    return "@".join([base] + [x for x in suffixes if x != suffix])


def _nvlink_cell(record: dict) -> str:
    """NVLink bytes per step per GPU that NVLinkMonitor measured / the all-reduce's expected bytes, in MiB."""
    measured, expected = record.get("nvlink_bytes_per_step"), record.get("nvlink_expected_bytes_per_step")
    if measured is None:
        return "n/a"
    return f"{measured / 2**20:.1f}/{expected / 2**20:.1f}" if expected else f"{measured / 2**20:.1f}/-"


def _throughput(record: dict) -> float:
    return record.get("tokens_per_s", record["examples_per_s"])


def render_table(results: list[dict]) -> str:
    """Examples/s (tokens/s for Transformers) per candidate, with speed-up over 1 GPU (fed the same way) and
    scaling efficiency = thr_N / (N x thr_1), spread of the rounds, NVLink speed-up for each `@nop2p` pair and the
    on/off ratio of each knob pair (`@nolhs`, `@bf16grad`, `@buffer1`, `@ondevice`)."""
    ok = {r["candidate"]: r for r in results if "error" not in r}
    ones = {r.get("input", "host"): r for name, r in ok.items() if name.split("@")[0] == "1gpu"
            and "nop2p" not in name.split("@")}
    stock = ok.get("stock")
    spread = any("spread" in r for r in results)
    unit = "tokens/s" if any("tokens_per_s" in r for r in ok.values()) else "examples/s"
    nvlink = any(r.get("nvlink_bytes_per_step") is not None for r in ok.values())
    header = (f"{'candidate':<26}{'replicas':>9}{'XLA':>5}{'input':>7}{'step':>9}{unit:>12}{'vs 1 GPU':>10}"
              f"{'scaling':>9}{'vs stock':>10}" + (f"{'spread':>9}" if spread else "")
              + (f"{'NVLink/expected':>18}" if nvlink else ""))
    units = (f"{'':<26}{'':>9}{'':>5}{'':>7}{'(ms)':>9}{'(median)' if spread else '':>12}{'(x)':>10}"
             f"{'(eff.)':>9}{'(x)':>10}" + (f"{'(%)':>9}" if spread else "")
             + (f"{'(MiB/step/GPU)':>18}" if nvlink else ""))
    lines = [header, units]
    for r in results:
        if "error" in r:
            lines.append(f"{r['candidate']:<26}  FAILED: {error_line(r['error'])}")
            continue
        one = ones.get(r.get("input", "host"))
        vs_one = _throughput(r) / _throughput(one) if one else None
        scaling = vs_one / r["replicas"] if one else None
        vs_stock = _throughput(r) / _throughput(stock) if stock and stock.get("input") == r.get("input") else None
        lines.append(f"{r['candidate']:<26}{r['replicas']:>9}{'yes' if r['jit_compile'] else 'no':>5}"
                     f"{r.get('input', 'host'):>7}{r['step_ms']:>9.1f}{_throughput(r):>12.0f}{_ratio(vs_one):>10}"
                     f"{_ratio(scaling):>9}{_ratio(vs_stock):>10}"
                     + (f"{100 * r['spread']:>9.1f}" if "spread" in r else "")
                     + (f"{_nvlink_cell(r):>18}" if nvlink else ""))
    for name, record in ok.items():
        base = _without(name, "nop2p")
        if base != name and base in ok:
            lines.append(f"# NVLink speed-up for {base}: {_throughput(ok[base]) / _throughput(record):.2f}x "
                         f"({_throughput(ok[base]):.0f} vs {_throughput(record):.0f} {unit} with "
                         f"NCCL_P2P_DISABLE=1)")
        base = _without(name, "nosync")
        if base != name and base in ok:
            cost = 1 - _throughput(ok[base]) / _throughput(record)
            lines.append(f"# replicas' BatchNorm-statistics sync costs {base} {100 * cost:.1f}% "
                         f"({_throughput(ok[base]):.0f} vs {_throughput(record):.0f} {unit} without it)")
    for name, record in ok.items():
        for suffix, (what, turns_on) in KNOB_LINES.items():
            base = _without(name, suffix)
            if base != name and base in ok:
                on, off = (record, ok[base]) if turns_on else (ok[base], record)
                lines.append(f"# {what} for {base}: {_throughput(on) / _throughput(off):.3f}x "
                             f"({on['candidate']} {_throughput(on):.0f} vs {off['candidate']} "
                             f"{_throughput(off):.0f} {unit})")
    fused = [r["candidate"] for r in results if "error" not in r and r.get("xla_allreduce") == "fused"]
    if len({name.split("@")[0] for name in fused}) > 1:
        lines.append(f"# {', '.join(fused)}: the all-reduce ran inside XLA (fused mode), where TensorFlow uses its "
                     f"collective whatever the candidate's ops, so these rows differ by run-to-run noise only; "
                     f"compare ops with NAME@split or --nojit")
    rounds = max((len(r.get("rounds_examples_per_s", ())) for r in results), default=0)
    if rounds > 1:
        lines.append(f"# {rounds} rounds, candidates interleaved; each row is its median round, spread = "
                     f"(max - min) / median of its rounds")
    timed = next(iter(ok.values()), None)
    if timed and "warmup_steps" in timed:
        lines.append(f"# each round: wall time of one model.fit of {timed['steps']} steps after a "
                     f"{timed['warmup_steps']}-step warm-up fit; input host = tf.data from host memory"
                     + (" (uint8 images cast on the device)" if timed["model"] in IMAGE_MODELS else "")
                     + ", device = the batch held on each device, indices from the host")
    if nvlink:
        reasons = sorted({f"{r['candidate']}: {r['nvlink_unavailable']}" for r in ok.values()
                          if r.get("nvlink_unavailable") and r["replicas"] > 1})
        lines.append("# NVLink/expected: bytes per step per GPU over NVLink (NVLinkMonitor, NVML counters) / the "
                     "all-reduce of the gradients (2(n-1)/n x gradient bytes)"
                     + (f"; n/a: {'; '.join(reasons)}" if reasons else ""))
    plans = sorted({r["plan"] for r in results if r.get("plan")})
    lines += [f"# {p}" for p in plans]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tf_nvlink.tools.training_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--candidates", default="1gpu,stock,auto")
    parser.add_argument("--batch_per_replica", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--jit", dest="jit", action="store_true", default=True)
    parser.add_argument("--nojit", dest="jit", action="store_false")
    parser.add_argument("--mixed_precision", dest="mixed", action="store_true", default=None)
    parser.add_argument("--nomixed_precision", dest="mixed", action="store_false")
    parser.add_argument("--cpu_devices", type=int, default=0, help="run over N logical CPU devices (tests)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="run the candidate list this many times, interleaved, and report medians with their "
                             "spread (default 3)")
    parser.add_argument("--input", default="host", choices=INPUTS,
                        help="host: tf.data from host memory, as users train (default); device: the batch held on "
                             "each device (NAME@ondevice does this for one candidate)")
    parser.add_argument("--warmup_steps", type=int, default=10,
                        help="steps of the untimed warm-up fit that compiles (default 10)")
    parser.add_argument("--json", default="", help="also write the records to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup_steps < 1 or (args.batch_per_replica is not None
                                                                      and args.batch_per_replica < 1):
        parser.error(f"--steps, --rounds, --warmup_steps and --batch_per_replica should be >= 1. Received: "
                     f"steps={args.steps}, rounds={args.rounds}, warmup_steps={args.warmup_steps}, "
                     f"batch_per_replica={args.batch_per_replica}")
    try:
        candidates = parse_candidates(args.candidates)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        from tf_nvlink.tools.training_bench.worker import run_worker  # noqa: PLC0415 - TensorFlow, in the worker only

        record = run_worker(args.model, candidates[0], args.batch_per_replica or DEFAULT_BATCH[args.model],
                            args.steps, args.jit, bool(args.mixed), args.cpu_devices, args.input, args.warmup_steps)
        print(json.dumps(record), flush=True)
        return 0
    print("# " + " ".join([os.path.basename(sys.executable), "-m", "tf_nvlink.tools.training_bench"]
                          + (argv if argv is not None else sys.argv[1:])))
    results = run_candidates(args.model, candidates, args.batch_per_replica, args.steps, args.jit, args.mixed,
                             args.cpu_devices, rounds=args.rounds, input_mode=args.input,
                             warmup_steps=args.warmup_steps)
    print(render_table(results))
    if args.json:
        atomic_files.write_atomic(args.json, json.dumps(results, indent=1), mode=None)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
