r"""Time to the first step: a fresh process's first `fit`, with a cold and a warm compile cache, in ONE command.

Per round, model and path (the order rotates every round), two fresh worker processes train the same model with
`tf_nvlink.strategy(compile_cache=FOLDER)`: the first with FOLDER empty (cold: XLA compiles every program and
stores it), the second with the same FOLDER (warm: the programs come back from disk). Each worker reports:
  first_s    from the start of `fit` to the end of its first execution (the first `on_train_batch_end`),
             what the user waits before training shows any progress;
  fit_s      the whole fit (--steps steps);
  steady     steps/s over the fit after its first execution;
  setup_s    from the worker's start to the start of `fit` (imports, the strategy, the model);
  entries    the cache entries before and after the fit (new ones: programs compiled and stored).
Paths: "compiled" (`steps_per_execution=N` as one XLA program per replica, the default) and "perstep"
(`compiled_execution=False`: one program per step). Medians and spreads over the rounds (`tools/bench_stats`),
and warm/cold of the medians. The host-fed setup of the step doctor's benchmark (`tools/doctor/bench.build`):
synthetic batches through tf.data, SGD momentum 0.9, XLA, mixed_bfloat16 on GPUs.

    python3 benchmarks/time_to_first_step.py --models resnet50 --paths compiled,perstep --rounds 3 --json x.json
    python3 benchmarks/time_to_first_step.py --models transformer --paths compiled,perstep --rounds 3 --json t.json
    python3 benchmarks/time_to_first_step.py --models convnet --cpu_devices 2 --rounds 1 --steps 4   # CPU smoke
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tf_nvlink.tools import bench_models, bench_stats  # noqa: E402
from tf_nvlink.util import atomic_files, text_table  # noqa: E402

PATHS = ("compiled", "perstep")
DEFAULT_BATCH = {"resnet50": 128, "transformer": 8, "transformer_2048": 2, "convnet": 8, "transformer_tiny": 4,
                 "mlp": 1024}
DEFAULT_STEPS_PER_EXECUTION = {"resnet50": 16, "transformer": 8, "transformer_2048": 8}
CACHES = ("cold", "warm")

_MODELS = flags.DEFINE_list("models", ["resnet50"], f"Any of {list(bench_models.BENCH_MODELS)}.")
_PATHS = flags.DEFINE_list("paths", list(PATHS), f"Any of {list(PATHS)}.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds (each: a cold and a warm process per model and path).",
                               lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", None, "Steps of each fit (default 4 executions of N).", lower_bound=1)
_SPE = flags.DEFINE_integer("steps_per_execution", None,
                            f"N; default per model {DEFAULT_STEPS_PER_EXECUTION}, else 8.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch_per_replica", None, f"Default per model: {DEFAULT_BATCH}.", lower_bound=1)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "0: the GPUs (tf_nvlink.strategy()); N: N logical CPU devices "
                                    "(a smoke run; CPU replicas take the per-step path in split mode).", lower_bound=0)
_TIMEOUT = flags.DEFINE_integer("timeout", 900, "Seconds a worker process may take.", lower_bound=1)
_JSON = flags.DEFINE_string("json", "", "Write every measurement to this JSON file.")
_CACHE_ROOT = flags.DEFINE_string("cache_root", "", "Where the rounds' cache folders go (default: a temporary "
                                  "folder, removed at the end).")
_WORKER = flags.DEFINE_string("worker", "", "Internal: run one fit as described by this JSON, print one JSON line "
                              "(outside absl's app.run: under it, importing TensorFlow lists its devices at once).")


# ---- the worker: one fresh process, one fit ----------------------------------------------------------------------

def worker(job: dict) -> dict:
    started = time.perf_counter()
    import logging  # noqa: PLC0415

    handler = logging.StreamHandler(sys.stderr)  # the first-execution lines, INFO ones included, for the parent
    # timestamps as TensorFlow's own log lines have them, to line both up when TF_CPP_VMODULE is set
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d: %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    logging.getLogger("tf_nvlink").addHandler(handler)
    logging.getLogger("tf_nvlink").setLevel(logging.INFO)
    from tf_nvlink.plan import compile_cache  # noqa: PLC0415

    cpu_devices = job["cpu_devices"]
    devices = [f"/cpu:{index}" for index in range(cpu_devices)] or None
    # before TensorFlow lists its devices (it reads TF_XLA_FLAGS then), as tf_nvlink.strategy() does
    compile_cache.prepare_process(job["cache"], compile_cache.request_text(devices=devices))
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415

    from tf_nvlink.distribute import single_host  # noqa: PLC0415
    from tf_nvlink.tools.doctor import bench  # noqa: PLC0415
    from tf_nvlink.training import compiled_execution, install  # noqa: PLC0415

    if cpu_devices:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * cpu_devices)
    else:
        for gpu in tf.config.list_physical_devices("GPU"):
            tf.config.experimental.set_memory_growth(gpu, True)
        keras.mixed_precision.set_global_policy("mixed_bfloat16")
    strategy = install.build_strategy(devices=devices, compile_cache=job["cache"],
                                      compiled_execution=job["path"] == "compiled")
    state = single_host.current_compile_cache()
    before = {os.path.basename(e.path) for e in compile_cache.entries(state.folder)} if state.folder else set()
    model, dataset, global_batch = bench.build(job["model"], strategy, job["batch"], steps_per_execution=job["n"],
                                               jit_compile=True)
    ends = []

    class FirstBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())

    fit_start = time.perf_counter()
    model.fit(dataset, steps_per_epoch=job["steps"], epochs=1, verbose=0, callbacks=[FirstBatch()])
    fit_end = time.perf_counter()
    after = {os.path.basename(e.path) for e in compile_cache.entries(state.folder)} if state.folder else set()
    later_steps = job["steps"] - job["n"]
    return {"first_s": ends[0] - fit_start, "fit_s": fit_end - fit_start, "setup_s": fit_start - started,
            "steady_steps_per_s": later_steps / (fit_end - ends[0]) if later_steps > 0 and fit_end > ends[0]
            else None, "entries_before": len(before), "entries_new": len(after - before),
            "path_taken": list(compiled_execution.execution_path(model)), "replicas": strategy.num_replicas_in_sync,
            "global_batch": global_batch, "cache_folder": state.folder}


# ---- the parent: rounds of fresh processes ------------------------------------------------------------------------

def run_worker(job: dict, timeout: int) -> dict:
    """One fresh process for `job`; its JSON answer, or {"error": ...}."""
    command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    wall = time.perf_counter() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
    answer = {**json.loads(lines[-1]), "process_s": wall,
              "log": [line for line in done.stderr.splitlines() if "first train execution" in line]}
    return {**answer, **first_execution_split(answer)}


def first_execution_split(answer: dict) -> dict:
    """`first_s` split at the first train execution's start, from its log line ("... took 12.3 s: ..."):
    `execution_s` (XLA compiling or reading its programs, then running them) and `before_execution_s` (Keras and
    tf_nvlink building the train function and staging the input). Empty when the line is missing.

    Example:
        >>> first_execution_split({"first_s": 20.0, "log": ["... first train execution of model 'm' took 15.0 s: x"]})
        {'execution_s': 15.0, 'before_execution_s': 5.0}
    """
    for line in answer.get("log", []):
        found = re.search(r"first train execution of model .* took ([0-9.]+) s", line)
        if found and answer.get("first_s") is not None:
            execution = float(found.group(1))
            return {"execution_s": execution, "before_execution_s": answer["first_s"] - execution}
    return {}


def jobs_for(models, paths, cpu_devices: int) -> list[dict]:
    jobs = []
    for model in models:
        n = _SPE.value or DEFAULT_STEPS_PER_EXECUTION.get(model, 8)
        for path in paths:
            jobs.append({"model": model, "path": path, "n": n, "steps": _STEPS.value or 4 * n,
                         "batch": _BATCH.value or DEFAULT_BATCH[model], "cpu_devices": cpu_devices})
    return jobs


def measure(jobs: list[dict], rounds: int, cache_root: str, timeout: int, echo=print) -> list[dict]:
    """Per round, for each job in a rotating order: a cold process in a new empty folder, then a warm one in it."""
    runs = {(job["model"], job["path"]): {cache: [] for cache in CACHES} for job in jobs}
    for round_index in range(rounds):
        order = jobs[round_index % len(jobs):] + jobs[:round_index % len(jobs)]
        for job in order:
            folder = os.path.join(cache_root, f"r{round_index}_{job['model']}_{job['path']}")
            os.makedirs(folder, exist_ok=True)
            for cache in CACHES:
                answer = run_worker({**job, "cache": folder}, timeout)
                runs[(job["model"], job["path"])][cache].append(answer)
                echo(f"round {round_index + 1} {job['model']} {job['path']} {cache}: "
                     + (answer["error"][-300:] if "error" in answer else
                        f"first {answer['first_s']:.1f} s (before the execution "
                        f"{answer.get('before_execution_s', float('nan')):.1f} s, the execution "
                        f"{answer.get('execution_s', float('nan')):.1f} s), fit {answer['fit_s']:.1f} s, "
                        f"{answer['entries_new']} new entries of {answer['entries_new'] + answer['entries_before']}"))
    return [summarize(job, runs[(job["model"], job["path"])]) for job in jobs]


def summarize(job: dict, runs: dict) -> dict:
    record = {**job, "runs": runs}
    for cache in CACHES:
        for key in ("first_s", "before_execution_s", "execution_s", "fit_s", "setup_s", "steady_steps_per_s",
                    "process_s"):
            values = [run.get(key) for run in runs[cache]]
            if any(value is not None for value in values):
                stats = bench_stats.summarize(values)
                record[f"{cache}_{key}"] = {"median": stats.median, "low": stats.low, "high": stats.high,
                                            "spread": stats.spread, "values": values}
    cold, warm = record.get("cold_first_s"), record.get("warm_first_s")
    record["warm_over_cold_first"] = warm["median"] / cold["median"] if cold and warm and cold["median"] else None
    return record


def render(records: list[dict]) -> str:
    def cell(record, key, digits=1):
        stats = record.get(key)
        if not stats:
            return "-"
        return f"{stats['median']:.{digits}f} ({100 * stats['spread']:.0f}%)"

    rows = [["model", "path", "first cold s", "first warm s", "warm/cold", "warm: before exec s", "warm: exec s",
             "fit cold s", "fit warm s", "steps/s cold", "steps/s warm", "entries"]]
    for record in records:
        ratio = record["warm_over_cold_first"]
        news = [run.get("entries_new") for run in record["runs"]["cold"]]
        rows.append([record["model"], record["path"], cell(record, "cold_first_s"), cell(record, "warm_first_s"),
                     f"{ratio:.2f}" if ratio is not None else "-", cell(record, "warm_before_execution_s"),
                     cell(record, "warm_execution_s"), cell(record, "cold_fit_s"),
                     cell(record, "warm_fit_s"), cell(record, "cold_steady_steps_per_s", 2),
                     cell(record, "warm_steady_steps_per_s", 2), ",".join(str(n) for n in news)])
    return "\n".join(text_table.table(rows, right=set(range(2, 12)), header_rows=1))


def main(argv):
    del argv
    unknown = [m for m in _MODELS.value if m not in bench_models.BENCH_MODELS]
    bad_paths = [p for p in _PATHS.value if p not in PATHS]
    if unknown or bad_paths:
        raise app.UsageError(f"--models {unknown} / --paths {bad_paths} unknown; valid: "
                             f"{list(bench_models.BENCH_MODELS)} / {list(PATHS)}")
    print("# " + " ".join(sys.argv), flush=True)
    cache_root = _CACHE_ROOT.value or tempfile.mkdtemp(prefix="tf_nvlink_ttfs_")
    try:
        records = measure(jobs_for(_MODELS.value, _PATHS.value, _CPU_DEVICES.value), _ROUNDS.value, cache_root,
                          _TIMEOUT.value, echo=lambda line: print(line, flush=True))
    finally:
        if not _CACHE_ROOT.value:
            shutil.rmtree(cache_root, ignore_errors=True)
    print(render(records), flush=True)
    if _JSON.value:
        atomic_files.write_atomic(_JSON.value, json.dumps(records, indent=1, default=str), mode=None)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        print(json.dumps(worker(json.loads(sys.argv[2]))), flush=True)
    else:
        app.run(main)
