"""Training throughput, 1 GPU against N GPUs, per cross-device-ops candidate, side by side in one run.

Each candidate trains in its own process (TensorFlow tolerates one MirroredStrategy per process) on synthetic
data already on the device, so the figures measure the step, not the input pipeline:

- `1gpu`: the best single-GPU setup (no strategy; XLA when `--jit`);
- `stock`: `tf.distribute.MirroredStrategy()` exactly as TensorFlow gives it (Keras turns XLA off under it);
- `auto`: `tf_nvlink.strategy()` with the policy's choice; `collective`, `nccl`, `reduce_to_one`,
  `hierarchical`: `tf_nvlink.strategy(cross_device_ops=...)`; `NAME@nop2p`: the same with `NCCL_P2P_DISABLE=1`
  (NCCL moves data through host memory, as on a PCIe-only machine); `NAME@nosync`: the same with
  TF_NVLINK_SYNC_NON_TRAINABLE=0 (replicas keep their own BatchNorm statistics: what the sync costs);
- `workers`: the multi-worker runtime on this host, one worker process per GPU (CUDA_VISIBLE_DEVICES) with a
  localhost TF_CONFIG, so `tf_nvlink.strategy()` gives a MultiWorkerMirroredStrategy (NCCL between the
  processes); with `--cpu_devices N`, N CPU-only workers (tests). The chief's figures are reported.

Example:
    $ python -m tf_nvlink.training_bench --model resnet50 --candidates 1gpu,stock,auto --jit
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from tf_nvlink import atomic, models, workers
from tf_nvlink.text import one_line_error

MODELS = ("mlp", "resnet50", "convnet")
DEFAULT_BATCH = {"mlp": 1024, "resnet50": 128, "convnet": 64}  # per replica
OPS_CANDIDATES = ("auto", "collective", "nccl", "reduce_to_one", "hierarchical")
CANDIDATES = ("1gpu", "stock") + OPS_CANDIDATES + ("workers",)


SUFFIXES = ("nop2p", "split", "fused", "nosync")
# Candidates that need GPUs: NCCL has no CPU kernels, HierarchicalCopyAllReduce falls back to reduce-to-one on CPU
# devices, fused XLA all-reduce is GPU-only, NCCL_P2P_DISABLE means nothing without GPUs.
GPU_ONLY = ("nccl", "hierarchical")
GPU_ONLY_SUFFIXES = ("nop2p", "fused")
CPU_FALLBACK_DEVICES = 2


def cpu_candidates(candidates: list[str]) -> tuple[list[str], list[str]]:
    """(what makes sense on CPU devices, what was left out because it needs GPUs).

    Example:
        >>> cpu_candidates(["1gpu", "stock", "auto", "nccl", "auto@nop2p"])
        (['1gpu', 'stock', 'auto'], ['nccl', 'auto@nop2p'])
    """
    kept, dropped = [], []
    for candidate in candidates:
        name, _, suffix = candidate.partition("@")
        (dropped if name in GPU_ONLY or suffix in GPU_ONLY_SUFFIXES else kept).append(candidate)
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
    from tf_nvlink import devices, nvml  # noqa: PLC0415

    topology = nvml.probe()
    if not topology.gpus:
        return topology.error or "NVML lists no GPU"
    if not devices.visible_nvml_indices(topology):
        return f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} hides every GPU"
    return None


def parse_candidates(text: str) -> list[str]:
    """"1gpu,auto,nccl@nop2p,auto@split" -> list, with a clear error for unknown names.

    Suffixes: "@nop2p" sets NCCL_P2P_DISABLE=1; "@split"/"@fused" force tf_nvlink's XLA all-reduce mode.
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
                             f"'@nop2p' (NCCL_P2P_DISABLE=1) and '@split' or '@fused' (XLA all-reduce mode). "
                             f"Received: {text!r}")
        if base in ("1gpu", "stock", "workers") and {"split", "fused"} & set(suffixes):
            raise ValueError(f"Candidate {name!r}: '@split' and '@fused' are tf_nvlink's XLA modes of a "
                             f"single-process strategy; {base!r} has none (only '@nop2p' applies). "
                             f"Received: {text!r}")
    return names


def _build_model(name: str, keras):
    if name == "mlp":
        return models.mnist_mlp()
    if name == "resnet50":
        return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
    if name == "convnet":  # small enough for CPU tests
        return keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                                 keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    raise ValueError(f"model should be one of {list(MODELS)}. Received: {name!r}")


def _input_shape(name: str) -> tuple[int, ...]:
    return {"mlp": (784,), "resnet50": (224, 224, 3), "convnet": (16, 16, 3)}[name]


def run_worker(model_name: str, candidate: str, batch_per_replica: int, steps: int, jit: bool,
               mixed_precision: bool, cpu_devices: int = 0) -> dict:
    """Train `steps` steps twice (the first pass compiles) and time the second; returns a JSON-ready record."""
    import numpy as np
    import tensorflow as tf

    import tf_nvlink

    ops = candidate.split("@")[0]
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
        suffixes = candidate.split("@")[1:]
        mode = "split" if "split" in suffixes else "fused" if "fused" in suffixes else "auto"
        strategy = tf_nvlink.strategy(cross_device_ops=ops, devices=devices if cpu_devices else None,
                                      xla_allreduce=mode)
        plan = tf_nvlink.current_plan()
    replicas = strategy.num_replicas_in_sync
    global_batch = batch_per_replica * replicas
    rng = np.random.default_rng(0)
    x = rng.uniform(size=(global_batch,) + _input_shape(model_name)).astype("float32")
    y = rng.integers(0, 10, size=(global_batch,)).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dataset = dataset.with_options(options)
    use_jit = jit and ops != "stock"  # stock = what TensorFlow gives: Keras turns XLA off under a strategy
    with strategy.scope():
        model = _build_model(model_name, keras)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=model_name != "resnet50"),
                      jit_compile=use_jit)
    timings = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            timings.append(time.perf_counter() - self.start)

    from tf_nvlink import monitor, nvlink_traffic  # NVLink bytes per step (unavailable: the record says why)

    nvlink = monitor.NVLinkMonitor()
    model.fit(dataset, steps_per_epoch=steps, epochs=3, verbose=0, callbacks=[Timer(), nvlink])
    seconds = min(timings[1:])  # epoch 0 compiles; the best of the rest is the least disturbed
    gradient_tensors = len(model.trainable_variables)
    return {
        "model": model_name, "candidate": candidate, "replicas": replicas, "jit_compile": bool(model.jit_compile),
        "batch_per_replica": batch_per_replica, "global_batch": global_batch, "steps": steps,
        "step_ms": 1000 * seconds / steps, "steps_per_s": steps / seconds,
        "examples_per_s": global_batch * steps / seconds, "gradient_tensors": gradient_tensors,
        "gradient_mib": sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables) / 2**20,
        "plan": plan.summary() if plan else None, "nccl_p2p_disable": os.environ.get("NCCL_P2P_DISABLE"),
        # "fused": the gradient all-reduce ran inside XLA, where TensorFlow uses its collective whatever the ops
        "xla_allreduce": getattr(plan, "xla_allreduce", None) if model.jit_compile and replicas > 1 else None,
        **nvlink_traffic.bench_record(nvlink),
    }


def run_candidates(model_name: str, candidates: list[str], batch_per_replica: Optional[int] = None, steps: int = 30,
                   jit: bool = True, mixed_precision: Optional[bool] = None, cpu_devices: int = 0,
                   timeout: int = 900, rounds: int = 1) -> list[dict]:
    """Run each candidate in its own process, one after another; failures become records with an `error`.

    With `rounds` > 1 the whole list runs that many times, round-robin (so slow drifts of a noisy machine hit
    every candidate alike), and each candidate's record is its median round, with every round's figure in
    `rounds_examples_per_s` and their spread.
    """
    if model_name not in MODELS:
        raise ValueError(f"model should be one of {list(MODELS)}. Received: {model_name!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds should be a positive integer. Received: rounds={rounds!r}")
    batch = batch_per_replica or DEFAULT_BATCH[model_name]
    mixed = (model_name == "resnet50") if mixed_precision is None else mixed_precision
    runs: dict[str, list[dict]] = {candidate: [] for candidate in candidates}
    for round_index in range(rounds):
        for candidate in candidates:
            record = _run_one(model_name, candidate, batch, steps, jit, mixed, cpu_devices, timeout)
            runs[candidate].append(record)
            where = f" (round {round_index + 1}/{rounds})" if rounds > 1 else ""
            print(f"  {candidate}{where}: " + (f"{record['examples_per_s']:.0f} examples/s" if "error" not in record
                                               else "FAILED: " + error_line(record["error"])), file=sys.stderr,
                  flush=True)
    return [combine_rounds(runs[candidate]) for candidate in candidates]


def _run_one(model_name, candidate, batch, steps, jit, mixed, cpu_devices, timeout) -> dict:
    env = workers.package_env(dict({"NCCL_P2P_DISABLE": "1"} if "@nop2p" in candidate else {},
                                   **({"TF_NVLINK_SYNC_NON_TRAINABLE": "0"} if "@nosync" in candidate else {})))
    multi = candidate.split("@")[0] == "workers"

    def worker_args(devices):
        return [sys.executable, "-m", "tf_nvlink.training_bench", "--worker", "--model", model_name,
                "--candidates", candidate, "--batch_per_replica", str(batch), "--steps", str(steps),
                "--jit" if jit else "--nojit", "--mixed_precision" if mixed else "--nomixed_precision",
                "--cpu_devices", str(devices)]

    started = time.perf_counter()
    if multi:  # each worker process trains on one device: its GPU, or its one CPU
        record, error = _run_workers(worker_args(0), env, cpu_devices, timeout)
    else:
        record, error = workers.run_json_worker(worker_args(cpu_devices), env, timeout,
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
    from tf_nvlink import devices, nvml  # noqa: PLC0415

    visible = devices.visible_nvml_indices(nvml.probe())
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
    ports = workers.free_ports(len(layout))
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    envs = [dict(env, CUDA_VISIBLE_DEVICES=visible, CUDA_DEVICE_ORDER="PCI_BUS_ID",  # NVML's order
                 TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
            for i, visible in enumerate(layout)]
    outcomes = workers.run_json_workers([args] * len(layout), envs, timeout, accept=lambda r: "examples_per_s" in r)
    errors = [f"worker {i}: {error}" for i, (record, error) in enumerate(outcomes) if record is None]
    if errors:
        return None, "; ".join(errors)
    record = dict(outcomes[0][0], workers=len(layout),
                  worker_step_ms=[round(r["step_ms"], 2) for r, _ in outcomes])
    return record, ""


def _ratio(value: Optional[float]) -> str:
    return "N/A" if value is None else f"{value:.2f}"


def render_table(results: list[dict]) -> str:
    """Examples/s per candidate, with speed-up over 1 GPU and scaling efficiency = thr_N / (N x thr_1)."""
    one = next((r for r in results if r["candidate"] == "1gpu" and "error" not in r), None)
    stock = next((r for r in results if r["candidate"] == "stock" and "error" not in r), None)
    spread = any("spread" in r for r in results)
    header = (f"{'candidate':<22}{'replicas':>9}{'XLA':>5}{'step':>9}{'examples/s':>12}{'vs 1 GPU':>10}"
              f"{'scaling':>9}{'vs stock':>10}" + (f"{'spread':>9}" if spread else ""))
    units = (f"{'':<22}{'':>9}{'':>5}{'(ms)':>9}{'':>12}{'(x)':>10}{'(eff.)':>9}{'(x)':>10}"
             + (f"{'(%)':>9}" if spread else ""))
    lines = [header, units]
    for r in results:
        if "error" in r:
            lines.append(f"{r['candidate']:<22}  FAILED: {error_line(r['error'])}")
            continue
        vs_one = r["examples_per_s"] / one["examples_per_s"] if one else None
        scaling = vs_one / r["replicas"] if one else None
        vs_stock = r["examples_per_s"] / stock["examples_per_s"] if stock else None
        lines.append(f"{r['candidate']:<22}{r['replicas']:>9}{'yes' if r['jit_compile'] else 'no':>5}"
                     f"{r['step_ms']:>9.1f}{r['examples_per_s']:>12.0f}{_ratio(vs_one):>10}{_ratio(scaling):>9}"
                     f"{_ratio(vs_stock):>10}" + (f"{100 * r['spread']:>9.1f}" if "spread" in r else ""))
    ok = {r["candidate"]: r for r in results if "error" not in r}
    for name, record in ok.items():
        base = name.replace("@nop2p", "")
        if name.endswith("@nop2p") and base in ok:
            lines.append(f"# NVLink speed-up for {base}: {ok[base]['examples_per_s'] / record['examples_per_s']:.2f}x "
                         f"({ok[base]['examples_per_s']:.0f} vs {record['examples_per_s']:.0f} examples/s with "
                         f"NCCL_P2P_DISABLE=1)")
        base = name.replace("@nosync", "")
        if name.endswith("@nosync") and base in ok:
            cost = 1 - ok[base]["examples_per_s"] / record["examples_per_s"]
            lines.append(f"# replicas' BatchNorm-statistics sync costs {base} {100 * cost:.1f}% "
                         f"({ok[base]['examples_per_s']:.0f} vs {record['examples_per_s']:.0f} examples/s without it)")
    fused = [r["candidate"] for r in results if "error" not in r and r.get("xla_allreduce") == "fused"]
    if len({name.split("@")[0] for name in fused}) > 1:
        lines.append(f"# {', '.join(fused)}: the all-reduce ran inside XLA (fused mode), where TensorFlow uses its "
                     f"collective whatever the candidate's ops, so these rows differ by run-to-run noise only; "
                     f"compare ops with NAME@split or --nojit")
    rounds = max((len(r.get("rounds_examples_per_s", ())) for r in results), default=0)
    if rounds > 1:
        lines.append(f"# {rounds} rounds, candidates interleaved; each row is its median round, spread = "
                     f"(max - min) / median of its rounds")
    plans = sorted({r["plan"] for r in results if r.get("plan")})
    lines += [f"# {p}" for p in plans]
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tf_nvlink.training_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--candidates", default="1gpu,stock,auto")
    parser.add_argument("--batch_per_replica", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--jit", dest="jit", action="store_true", default=True)
    parser.add_argument("--nojit", dest="jit", action="store_false")
    parser.add_argument("--mixed_precision", dest="mixed", action="store_true", default=None)
    parser.add_argument("--nomixed_precision", dest="mixed", action="store_false")
    parser.add_argument("--cpu_devices", type=int, default=0, help="run over N logical CPU devices (tests)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the candidate list this many times, interleaved, and report medians (noisy "
                             "machines; default 1)")
    parser.add_argument("--json", default="", help="also write the records to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or (args.batch_per_replica is not None and args.batch_per_replica < 1):
        parser.error(f"--steps, --rounds and --batch_per_replica should be >= 1. Received: steps={args.steps}, "
                     f"rounds={args.rounds}, batch_per_replica={args.batch_per_replica}")
    try:
        candidates = parse_candidates(args.candidates)
    except ValueError as exc:
        parser.error(str(exc))
    if args.worker:
        record = run_worker(args.model, candidates[0], args.batch_per_replica or DEFAULT_BATCH[args.model],
                            args.steps, args.jit, bool(args.mixed), args.cpu_devices)
        print(json.dumps(record), flush=True)
        return 0
    print("# " + " ".join([os.path.basename(sys.executable), "-m", "tf_nvlink.training_bench"]
                          + (argv if argv is not None else sys.argv[1:])))
    results = run_candidates(args.model, candidates, args.batch_per_replica, args.steps, args.jit, args.mixed,
                             args.cpu_devices, rounds=args.rounds)
    print(render_table(results))
    if args.json:
        atomic.write_atomic(args.json, json.dumps(results, indent=1), mode=None)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
