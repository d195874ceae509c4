"""Training throughput, 1 GPU against N GPUs, per cross-device-ops candidate, side by side in one run.

Each candidate trains in its own process (TensorFlow tolerates one MirroredStrategy per process) on synthetic
data fed the way users feed it (`--input host`, the default): one global batch in host memory (uint8 images,
int32 tokens, float32 MLP features) served by `tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(AUTOTUNE)`;
the model casts images to floats on the device (its first layer, `Rescaling`). A candidate's figure is the wall
time of one whole `model.fit(ds, steps_per_epoch=steps)` call after a warm-up fit that compiles; `--rounds`
(default 3) runs the candidate list that many times, interleaved (even rounds in reverse order), and reports each
candidate's median round with the spread, warning when rounds disagree more than the medians differ.
`--long_steps L` adds a fit of L steps to each round: the difference from the short fit is the steady-state step
time, the rest the fixed cost of each fit call. `--profile DIR` runs the step doctor on a few steps of each
candidate (`tf_nvlink.StepDoctor`, its trace in DIR/<candidate>/) and records its verdict and breakdown. `--input device` (or
the modifier `@ondevice`) keeps the batch on each device instead: it lives in a non-trainable variable on every
replica's device (copied there once, when the model is built) and tf.data carries only int32 example indices and
the labels from the host, so the step is measured without the image copies.

Candidates (`candidates.Candidate`: a base and its `@` modifiers):

- `1gpu`: the best single-GPU setup (plain Keras, no strategy; XLA when `--jit`); `onedevice`: TensorFlow's
  OneDeviceStrategy on the first device (a strategy scope without replicas' machinery);
- `stock`: `tf.distribute.MirroredStrategy()` exactly as TensorFlow gives it (Keras turns XLA off under it);
- `auto`: `tf_nvlink.strategy()` with the policy's choice; `collective`, `nccl`, `reduce_to_one`,
  `hierarchical`: `tf_nvlink.strategy(cross_device_ops=...)`;
- modifiers for every base: `@nop2p` (`NCCL_P2P_DISABLE=1`: NCCL moves data through host memory, as on a
  PCIe-only machine), `@nocudagraphs` (`XLA_FLAGS=--xla_gpu_enable_command_buffer=`: no CUDA graphs),
  `@ondevice`, `@customloop` (TensorFlow's custom-training-guide loop instead of `model.fit`: a
  `tf.function(jit_compile=...)` step run by `strategy.run`, called per batch from Python, timed up to the
  last step's loss on the host);
- step-option modifiers for tf_nvlink strategies, each measured against the same name without it: `@nolhs`
  (xla_flags="none": no latency-hiding scheduler), `@bf16grad` (allreduce_dtype="bfloat16"), `@buffer1`
  (input_buffer=1, TensorFlow's default prefetch depth), `@split`/`@fused` (XLA all-reduce mode), `@nosync`
  (TF_NVLINK_SYNC_NON_TRAINABLE=0: replicas keep their own BatchNorm statistics, what the sync costs);
- `workers`: the multi-worker runtime on this host, one worker process per GPU (CUDA_VISIBLE_DEVICES) with a
  localhost TF_CONFIG, so `tf_nvlink.strategy()` gives a MultiWorkerMirroredStrategy (NCCL between the
  processes); with `--cpu_devices N`, N CPU-only workers (tests). The chief's figures are reported.

The models and their input are in `models`, the worker that trains one candidate (TensorFlow) in `worker`; this
module runs the workers and renders the table.

Example:
    $ tf-nvlink train-bench --model resnet50 --candidates 1gpu,stock,auto --jit
    $ python -m tf_nvlink.tools.training_bench --model transformer --candidates 1gpu,auto,auto@nop2p,auto@bf16grad@nop2p
    $ python -m tf_nvlink.tools.training_bench --model resnet50 --candidates 1gpu,onedevice,auto,auto@nocudagraphs \\
          --steps 60 --long_steps 240
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional, Sequence, Union

from tf_nvlink.tools import bench_stats
from tf_nvlink.tools import bench_models
from tf_nvlink.tools.training_bench.candidates import Candidate, parse_list
from tf_nvlink.util import atomic_files, json_workers
from tf_nvlink.util.cli_args import command_line, non_negative, positive, run_as_module, usage_error
from tf_nvlink.util.error_lines import one_line_error

MODELS = bench_models.BENCH_MODELS  # built by bench_models.build_bench_model
DEFAULT_BATCH = {"mlp": 1024, "resnet50": 128, "convnet": 64, "transformer": 8, "transformer_2048": 2,
                 "transformer_tiny": 4}  # per replica
IMAGE_MODELS, INPUTS = bench_models.IMAGE_MODELS, bench_models.INPUTS  # uint8-fed models; host- or device-held input
# Step-option modifier -> (what the table's ratio line calls it, True when the modifier turns the option ON).
KNOB_LINES = {"nolhs": ("latency-hiding scheduler on/off", False),
              "bf16grad": ("bfloat16/float32 gradient all-reduce", True),
              "buffer1": ("plan's input buffer/buffer 1", False),
              "nocudagraphs": ("CUDA graphs (XLA command buffers) on/off", False),
              "ondevice": ("data on the device/host-fed", True),
              "customloop": ("custom loop/model.fit", True)}
CPU_FALLBACK_DEVICES = 2


def cpu_candidates(candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]]:
    """(what makes sense on CPU devices, what was left out because it needs GPUs).

    Example:
        >>> kept, dropped = cpu_candidates(parse_list("1gpu,auto,nccl,auto@nop2p"))
        >>> [c.label for c in kept], [c.label for c in dropped]
        (['1gpu', 'auto'], ['nccl', 'auto@nop2p'])
    """
    return [c for c in candidates if not c.needs_gpu], [c for c in candidates if c.needs_gpu]


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


def run_candidates(model_name: str, candidates: Sequence[Union[Candidate, str]],
                   batch_per_replica: Optional[int] = None, steps: int = 30, jit: bool = True,
                   mixed_precision: Optional[bool] = None, cpu_devices: int = 0, timeout: int = 900, rounds: int = 3,
                   input_mode: str = "host", warmup_steps: int = 10, long_steps: int = 0, profile_dir: str = "",
                   profile_steps: int = 10, steps_per_execution: int = 1) -> list[dict]:
    """Run each candidate in its own process, one after another; failures become records with an `error`.

    With `rounds` > 1 the whole list runs that many times, interleaved: odd rounds in the given order, even rounds
    reversed (so slow drifts of a noisy machine, and the position in a round, hit every candidate alike), and each
    candidate's record is its median round, with every round's figure in `rounds_examples_per_s` and their spread.
    `long_steps` adds a fit of that many steps to each round (steady-state step time and the fixed cost of a fit
    call); `profile_dir` traces `profile_steps` steps of each candidate, in the first round, into a folder there.

    Example:
        >>> run_candidates("convnet", ["1gpu", "auto"], steps=2, jit=False, cpu_devices=2, rounds=2, warmup_steps=1)
    """
    chosen = [c if isinstance(c, Candidate) else Candidate.parse(c) for c in candidates]
    _check_run_arguments(model_name, rounds, input_mode, steps, long_steps)
    batch = batch_per_replica or DEFAULT_BATCH[model_name]
    # bfloat16 compute where it pays on GPUs: ResNet-50 and the Transformer (the tiny one mirrors the big one).
    mixed = (model_name == "resnet50" or model_name in bench_models.TRANSFORMER_CONFIGS) if mixed_precision is None \
        else mixed_precision
    settings = dict(model_name=model_name, batch=batch, steps=steps, jit=jit, mixed=mixed, cpu_devices=cpu_devices,
                    timeout=timeout, input_mode=input_mode, warmup_steps=warmup_steps, long_steps=long_steps,
                    profile_steps=profile_steps, steps_per_execution=steps_per_execution)
    runs: dict[Candidate, list[dict]] = {candidate: [] for candidate in chosen}
    for round_index in range(rounds):
        for candidate in (chosen if round_index % 2 == 0 else chosen[::-1]):
            record = _run_one(candidate, profile_dir=profile_dir if round_index == 0 else "", **settings)
            runs[candidate].append(record)
            where = f" (round {round_index + 1}/{rounds})" if rounds > 1 else ""
            print(f"  {candidate.label}{where}: " + (f"{record['examples_per_s']:.0f} examples/s"
                                                     if "error" not in record
                                                     else "FAILED: " + error_line(record["error"])),
                  file=sys.stderr, flush=True)
    return [combine_rounds(runs[candidate]) for candidate in chosen]


def _check_run_arguments(model_name: str, rounds: int, input_mode: str, steps: int, long_steps: int) -> None:
    if model_name not in MODELS:
        raise ValueError(f"model should be one of {list(MODELS)}. Received: {model_name!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds should be a positive integer. Received: rounds={rounds!r}")
    if input_mode not in INPUTS:
        raise ValueError(f"input should be one of {list(INPUTS)}. Received: input={input_mode!r}")
    if long_steps and long_steps <= steps:
        raise ValueError(f"long_steps should be 0 (no steady-state split) or more than steps={steps}. "
                         f"Received: long_steps={long_steps!r}")


def _run_one(candidate: Candidate, *, model_name, batch, steps, jit, mixed, cpu_devices, timeout, input_mode,
             warmup_steps, long_steps, profile_dir, profile_steps, steps_per_execution) -> dict:
    env = json_workers.package_env(candidate.worker_env(os.environ))

    def worker_args(devices):
        return [sys.executable, "-m", "tf_nvlink.tools.training_bench", "--worker", "--model", model_name,
                "--candidates", candidate.label, "--batch_per_replica", str(batch), "--steps", str(steps),
                "--jit" if jit else "--no-jit", "--mixed_precision" if mixed else "--no-mixed_precision",
                "--cpu_devices", str(devices), "--input", input_mode, "--warmup_steps", str(warmup_steps),
                "--long_steps", str(long_steps), "--profile", profile_dir, "--profile_steps", str(profile_steps),
                "--steps_per_execution", str(steps_per_execution)]

    started = time.perf_counter()
    if candidate.base == "workers":  # each worker process trains on one device: its GPU, or its one CPU
        record, error = _run_workers(worker_args(0), env, cpu_devices, timeout)
    else:
        record, error = json_workers.run_json_worker(worker_args(cpu_devices), env, timeout,
                                                     accept=lambda r: "examples_per_s" in r)
    if record is None:
        record = {"model": model_name, "candidate": candidate.label, "error": error}
    record["wall_s"] = round(time.perf_counter() - started, 1)
    return record


def combine_rounds(records: list[dict]) -> dict:
    """One candidate's rounds -> its median round (`bench_stats`: the lower middle for an even count), with every
    round's examples/s (None where it failed) and the spread (max - min) / median; with steady-state figures,
    their median and spread too; a failure only if every round failed.

    Example:
        >>> combine_rounds([{"examples_per_s": 90.0}, {"examples_per_s": 110.0}, {"examples_per_s": 100.0}])
        {'examples_per_s': 100.0, 'rounds_examples_per_s': [90.0, 110.0, 100.0], 'spread': 0.2}
    """
    if len(records) == 1:
        return records[0]
    figures = [r.get("examples_per_s") if "error" not in r else None for r in records]
    index = bench_stats.median_index(figures)
    if index is None:
        return dict(records[-1], rounds_examples_per_s=[None] * len(records))
    median = dict(records[index], rounds_examples_per_s=figures, spread=bench_stats.summarize(figures).spread)
    steady = [r.get("steady_examples_per_s") if "error" not in r else None for r in records]
    if any(value is not None for value in steady):
        steady_index = bench_stats.median_index(steady)
        for key in ("steady_examples_per_s", "steady_step_s", "fixed_s_per_fit", "steady_tokens_per_s"):
            if key in records[steady_index]:
                median[key] = records[steady_index][key]
        median.update(rounds_steady_examples_per_s=steady, steady_spread=bench_stats.summarize(steady).spread)
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
    outcomes = json_workers.run_json_workers([args] * len(layout), envs, timeout,
                                             accept=lambda r: "examples_per_s" in r)
    errors = [f"worker {i}: {error}" for i, (record, error) in enumerate(outcomes) if record is None]
    if errors:
        return None, "; ".join(errors)
    record = dict(outcomes[0][0], workers=len(layout),
                  worker_step_ms=[round(r["step_ms"], 2) for r, _ in outcomes])
    return record, ""


def _ratio(value: Optional[float]) -> str:
    return "N/A" if value is None else f"{value:.2f}"


def _nvlink_cell(record: dict) -> str:
    """NVLink bytes per step per GPU that NVLinkMonitor measured / the all-reduce's expected bytes, in MiB."""
    measured, expected = record.get("nvlink_bytes_per_step"), record.get("nvlink_expected_bytes_per_step")
    if measured is None:
        return "n/a"
    return f"{measured / 2**20:.1f}/{expected / 2**20:.1f}" if expected else f"{measured / 2**20:.1f}/-"


def _throughput(record: dict, steady: bool = False) -> float:
    if steady:
        return record.get("steady_tokens_per_s", record["steady_examples_per_s"])
    return record.get("tokens_per_s", record["examples_per_s"])


def _one_device_baselines(ok: dict[Candidate, dict]) -> dict[str, dict]:
    """Input mode -> the plain-Keras one-GPU record (`1gpu`, or `1gpu@ondevice`) the ratios are against."""
    return {r.get("input", "host"): r for c, r in ok.items() if c.without("ondevice") == Candidate("1gpu")}


def render_table(results: list[dict]) -> str:
    """Examples/s (tokens/s for Transformers) per candidate, with speed-up over 1 GPU (fed the same way) and
    scaling efficiency = thr_N / (N x thr_1), spread of the rounds, NVLink speed-up for each `@nop2p` pair, the
    on/off ratio of each step-option pair (`@nolhs`, `@bf16grad`, `@buffer1`, `@nocudagraphs`, `@ondevice`), and, when
    the records have them, the steady-state table (long fit minus short fit) and the fixed cost of a fit call.

    Example:
        >>> print(render_table(run_candidates("convnet", ["1gpu", "auto"], steps=2, cpu_devices=2, rounds=1)))
    """
    ok = {Candidate.parse(r["candidate"]): r for r in results if "error" not in r}
    unit = "tokens/s" if any("tokens_per_s" in r for r in ok.values()) else "examples/s"
    lines = _main_rows(results, ok, unit)
    lines += _pair_lines(ok, unit)
    if any("steady_examples_per_s" in r for r in ok.values()):
        lines += _steady_state_lines(ok, unit)
    lines += _best_one_device_lines(ok)
    lines += _footer_lines(results, ok)
    return "\n".join(lines)


def _main_rows(results: list[dict], ok: dict[Candidate, dict], unit: str) -> list[str]:
    """The header, its units line and one row per candidate (FAILED with the error's line for a failure)."""
    ones = _one_device_baselines(ok)
    stock = ok.get(Candidate("stock"))
    spread = any("spread" in r for r in results)
    nvlink = any(r.get("nvlink_bytes_per_step") is not None for r in ok.values())
    lines = [f"{'candidate':<26}{'replicas':>9}{'XLA':>5}{'input':>7}{'step':>9}{unit:>12}{'vs 1 GPU':>10}"
             f"{'scaling':>9}{'vs stock':>10}" + (f"{'spread':>9}" if spread else "")
             + (f"{'NVLink/expected':>18}" if nvlink else ""),
             f"{'':<26}{'':>9}{'':>5}{'':>7}{'(ms)':>9}{'(median)' if spread else '':>12}{'(x)':>10}"
             f"{'(eff.)':>9}{'(x)':>10}" + (f"{'(%)':>9}" if spread else "")
             + (f"{'(MiB/step/GPU)':>18}" if nvlink else "")]
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
    return lines


def _pair_lines(ok: dict[Candidate, dict], unit: str) -> list[str]:
    """One line per measured pair: NVLink speed-up (`@nop2p`), BatchNorm sync cost (`@nosync`), step-option ratios."""
    lines = []
    for candidate, record in ok.items():
        base = candidate.without("nop2p")
        if base != candidate and base in ok:
            lines.append(f"# NVLink speed-up for {base}: {_throughput(ok[base]) / _throughput(record):.2f}x "
                         f"({_throughput(ok[base]):.0f} vs {_throughput(record):.0f} {unit} with "
                         f"NCCL_P2P_DISABLE=1)")
        base = candidate.without("nosync")
        if base != candidate and base in ok:
            cost = 1 - _throughput(ok[base]) / _throughput(record)
            lines.append(f"# replicas' BatchNorm-statistics sync costs {base} {100 * cost:.1f}% "
                         f"({_throughput(ok[base]):.0f} vs {_throughput(record):.0f} {unit} without it)")
    for candidate, record in ok.items():
        for modifier, (what, turns_on) in KNOB_LINES.items():
            base = candidate.without(modifier)
            if base != candidate and base in ok:
                on, off = (record, ok[base]) if turns_on else (ok[base], record)
                lines.append(f"# {what} for {base}: {_throughput(on) / _throughput(off):.3f}x "
                             f"({on['candidate']} {_throughput(on):.0f} vs {off['candidate']} "
                             f"{_throughput(off):.0f} {unit})")
    return lines


def _steady_state_lines(ok: dict[Candidate, dict], unit: str) -> list[str]:
    """The steady-state table: throughput from the long fit minus the short one, and each fit call's fixed cost."""
    timed = next(r for r in ok.values() if "steady_examples_per_s" in r)
    ones = _one_device_baselines(ok)
    lines = ["", f"steady state ({timed['long_steps']}-step fit minus {timed['steps']}-step fit, same process)",
             f"{'candidate':<26}{unit:>12}{'spread':>9}{'step ms':>9}{'vs 1 GPU':>10}{'scaling':>9}"
             f"{'fixed ms/fit':>14}"]
    for record in ok.values():
        if "steady_examples_per_s" not in record:
            continue
        one = ones.get(record.get("input", "host"))
        vs_one = _throughput(record, True) / _throughput(one, True) if one and "steady_examples_per_s" in one \
            else None
        lines.append(f"{record['candidate']:<26}{_throughput(record, True):>12.0f}"
                     + (f"{100 * record['steady_spread']:>8.1f}%" if "steady_spread" in record else f"{'':>9}")
                     + f"{1000 * record['steady_step_s']:>9.1f}{_ratio(vs_one):>10}"
                     f"{_ratio(vs_one / record['replicas'] if vs_one else None):>9}"
                     f"{1000 * record['fixed_s_per_fit']:>14.0f}")
    return lines


def _best_one_device_lines(ok: dict[Candidate, dict]) -> list[str]:
    """With several one-device setups (1gpu, onedevice, their modifiers): scaling against the fastest of them,
    which is what scaling should be measured against, for whole fits and for the steady state."""
    lines = []
    for steady, what in ((False, "whole fits"), (True, "steady state")):
        key = "steady_examples_per_s" if steady else "examples_per_s"
        ones = [(c, r) for c, r in ok.items() if c.one_device and key in r]
        multi = [r for c, r in ok.items() if not c.one_device and key in r]
        if len(ones) > 1 and multi:
            best_candidate, best = max(ones, key=lambda item: _throughput(item[1], steady))
            lines.append(f"# scaling against the best one-device setup ({best_candidate}, {what}): " + ", ".join(
                f"{r['candidate']} {_throughput(r, steady) / (r['replicas'] * _throughput(best, steady)):.2f}"
                for r in multi))
    return lines


def _overlap_line(results: list[dict]) -> list[str]:
    stats = {r["candidate"]: bench_stats.summarize(r["rounds_examples_per_s"]) for r in results
             if "error" not in r and any(v is not None for v in r.get("rounds_examples_per_s", ()))}
    warning = bench_stats.overlap_warning(stats)
    return [f"# warning: {warning}"] if warning else []


def _footer_lines(results: list[dict], ok: dict[Candidate, dict]) -> list[str]:
    """What the rows mean: fused-mode note, rounds and their agreement, the timing method, NVLink, the plans."""
    lines = []
    fused = [r["candidate"] for r in ok.values() if r.get("xla_allreduce") == "fused"]
    if len({Candidate.parse(name).base for name in fused}) > 1:
        lines.append(f"# {', '.join(fused)}: the all-reduce ran inside XLA (fused mode), where TensorFlow uses its "
                     f"collective whatever the candidate's ops, so these rows differ by run-to-run noise only; "
                     f"compare ops with NAME@split or --no-jit")
    rounds = max((len(r.get("rounds_examples_per_s", ())) for r in results), default=0)
    if rounds > 1:
        lines.append(f"# {rounds} rounds, candidates interleaved (even rounds in reverse order); each row is its "
                     f"median round, spread = (max - min) / median of its rounds")
        lines += _overlap_line(results)
    timed = next(iter(ok.values()), None)
    if timed and "warmup_steps" in timed:
        lines.append(f"# each round: wall time of one model.fit of {timed['steps']} steps after a "
                     f"{timed['warmup_steps']}-step warm-up fit"
                     + (f", steps_per_execution={timed['steps_per_execution']}"
                        if timed.get("steps_per_execution", 1) > 1 else "")
                     + "; input host = tf.data from host memory"
                     + (" (uint8 images cast on the device)" if timed["model"] in IMAGE_MODELS else "")
                     + ", device = the batch held on each device, indices from the host"
                     + ("; @customloop rows time the custom loop's steps instead, up to the last loss on the host"
                        if any(c.customloop for c in ok) else ""))
    if any(r.get("nvlink_bytes_per_step") is not None for r in ok.values()):
        reasons = sorted({f"{r['candidate']}: {r['nvlink_unavailable']}" for r in ok.values()
                          if r.get("nvlink_unavailable") and r["replicas"] > 1})
        lines.append("# NVLink/expected: bytes per step per GPU over NVLink (NVLinkMonitor, NVML counters) / the "
                     "all-reduce of the gradients (2(n-1)/n x gradient bytes)"
                     + (f"; n/a: {'; '.join(reasons)}" if reasons else ""))
    lines += [f"# step doctor {r['candidate']}: {_doctor_line(r['profile'])}" for r in ok.values() if "profile" in r]
    lines += [f"# {p}" for p in sorted({r["plan"] for r in results if r.get("plan")})]
    return lines


def _doctor_line(profile: dict) -> str:
    """The step doctor's verdict and first advice for a profiled candidate, or why it has none, and its folder."""
    verdict = profile.get("verdict") or {}
    advice = (verdict.get("advice") or [{}])[0].get("change")
    said = (f"{verdict['kind']}" + (f", try {advice}" if advice else "")) if verdict else profile.get("unavailable")
    return f"{said} ({profile.get('logdir', '')})"


HELP = "training throughput per strategy candidate (1 GPU, stock MirroredStrategy, tf_nvlink), each in its own process"


def add_arguments(parser) -> None:
    """The `tf-nvlink train-bench` options (also `python -m tf_nvlink.tools.training_bench`)."""
    import argparse  # noqa: PLC0415

    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--candidates", default="1gpu,stock,auto")
    parser.add_argument("--batch_per_replica", type=positive, default=None)
    parser.add_argument("--steps", type=positive, default=30)
    parser.add_argument("--jit", action=argparse.BooleanOptionalAction, default=True,
                        help="XLA (default); --no-jit: Keras without XLA")
    parser.add_argument("--mixed_precision", dest="mixed", action=argparse.BooleanOptionalAction, default=None,
                        help="mixed_bfloat16 (default: the model's own choice)")
    parser.add_argument("--cpu_devices", type=non_negative, default=0, help="run over N logical CPU devices (tests)")
    parser.add_argument("--rounds", type=positive, default=3,
                        help="run the candidate list this many times, interleaved (even rounds reversed), and "
                             "report medians with their spread (default 3)")
    parser.add_argument("--input", default="host", choices=INPUTS,
                        help="host: tf.data from host memory, as users train (default); device: the batch held on "
                             "each device (NAME@ondevice does this for one candidate)")
    parser.add_argument("--warmup_steps", type=positive, default=10,
                        help="steps of the untimed warm-up fit that compiles (default 10)")
    parser.add_argument("--long_steps", type=non_negative, default=0,
                        help="also time a fit of this many steps (more than --steps) in each round: the difference "
                             "gives the steady-state step time and the fixed cost of each fit call")
    parser.add_argument("--steps_per_execution", type=positive, default=1, help="Keras compile() option (default 1)")
    parser.add_argument("--profile", default="",
                        help="the step doctor on --profile_steps steps of each candidate (first round; its trace and report "
                             "into this folder, one subfolder per candidate, and record where the step time goes")
    parser.add_argument("--profile_steps", type=positive, default=10)
    parser.add_argument("--json", default="", help="also write the records to this JSON file")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run(args) -> int:
    """`tf-nvlink train-bench`: run the candidates, print the table (and --json); 1 when a candidate failed."""
    if args.long_steps and args.long_steps <= args.steps:
        return usage_error(args, f"--long_steps should be 0 or more than --steps={args.steps}. "
                                 f"Received: {args.long_steps}")
    try:
        candidates = parse_list(args.candidates)
    except ValueError as exc:
        return usage_error(args, f"--candidates: {exc}")
    if args.worker:
        from tf_nvlink.tools.training_bench.worker import run_worker  # noqa: PLC0415 - TensorFlow, in the worker only

        record = run_worker(args.model, candidates[0], args.batch_per_replica or DEFAULT_BATCH[args.model],
                            args.steps, args.jit, bool(args.mixed), args.cpu_devices, args.input, args.warmup_steps,
                            args.long_steps, args.profile, args.profile_steps, args.steps_per_execution)
        print(json.dumps(record), flush=True)
        return 0
    print("# " + command_line(args))
    results = run_candidates(args.model, candidates, args.batch_per_replica, args.steps, args.jit, args.mixed,
                             args.cpu_devices, rounds=args.rounds, input_mode=args.input,
                             warmup_steps=args.warmup_steps, long_steps=args.long_steps, profile_dir=args.profile,
                             profile_steps=args.profile_steps, steps_per_execution=args.steps_per_execution)
    print(render_table(results))
    if args.json:
        atomic_files.write_atomic(args.json, json.dumps(results, indent=1), mode=None)
    return 1 if any("error" in r for r in results) else 0


def main(argv=None) -> int:
    """`python -m tf_nvlink.tools.training_bench ...`: the same as `tf-nvlink train-bench ...`."""
    return run_as_module("tf_nvlink.tools.training_bench", HELP, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
