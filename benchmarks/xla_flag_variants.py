r"""The compiled execution under several `XLA_FLAGS` values, in ONE command, with the step doctor's breakdown of each.

XLA reads `XLA_FLAGS` once per process, so each variant is its own worker process (all on the same GPU, memory
growth on). The workers build and compile side by side; then the driver runs interleaved rounds (the order rotates
every round) of whole `model.fit` calls, one worker at a time, and last asks each worker for a step-doctor window.
The doctor's traces are kept (`<output_dir>/<model>_<variant>.xplane.pb.gz`) for a look at where the GPU waits.

Variants are `name=flags` (flags space-separated, empty for none); `name@spe1` runs `steps_per_execution=1`
(what the doctor's advice starts from) instead of N.

    python benchmarks/xla_flag_variants.py --model transformer --steps 48 \
        --variants 'spe1@spe1=,default=,while=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE'
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tf_nvlink.tools import bench_stats  # noqa: E402
from tf_nvlink.tools.doctor import breakdown, trace  # noqa: E402

DEFAULT_BATCH = {"resnet50": 128, "transformer": 8, "convnet": 8, "mlp": 1024}
DEFAULT_STEPS_PER_EXECUTION = {"resnet50": 16, "transformer": 8}
MARK = "@@ "

_MODEL = flags.DEFINE_string("model", "transformer", "resnet50 or transformer (tf_nvlink.tools.bench_models).")
_VARIANTS = flags.DEFINE_string("variants", "default=", "';'-separated name[@spe1]=XLA flags.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 96, "Steps per timed fit.", lower_bound=1)
_SPE = flags.DEFINE_integer("steps_per_execution", None, f"N; default {DEFAULT_STEPS_PER_EXECUTION}.")
_OUTPUT = flags.DEFINE_string("output_dir", "xla_flag_variants_out", "Traces, logs and the JSON go here.")
_TIMEOUT = flags.DEFINE_integer("timeout", 400, "Seconds a worker may take to get ready.")


def parse_variants(text: str) -> list[tuple[str, bool, str]]:
    """'a=--x=1 --y=2;b@spe1=' -> [("a", False, "--x=1 --y=2"), ("b", True, "")]."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        if "=" not in item:
            raise app.UsageError(f"variant {item!r} is not name=flags")
        name, value = item.split("=", 1)
        out.append((name.replace("@spe1", ""), name.endswith("@spe1"), value.strip()))
    return out


def worker(model_name: str, steps_per_execution: int, output_dir: str) -> int:
    """One variant: build, compile, then obey 'fit STEPS' / 'doctor NAME' / 'quit' lines on stdin."""
    from tf_nvlink.tools.doctor import bench  # noqa: PLC0415
    from tf_nvlink.training import compiled_execution  # noqa: PLC0415

    strategy = bench.configure()
    model, dataset, global_batch = bench.build(model_name, strategy, DEFAULT_BATCH[model_name],
                                               steps_per_execution=steps_per_execution)
    started = time.perf_counter()
    model.fit(dataset, steps_per_epoch=max(32, 2 * steps_per_execution), epochs=1, verbose=0)
    print(MARK + json.dumps({"ready_s": time.perf_counter() - started,
                             "path": compiled_execution.execution_path(model),
                             "xla_flags": os.environ.get("XLA_FLAGS", "")}), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words or words[0] == "quit":
            break
        if words[0] == "fit":
            started = time.perf_counter()
            model.fit(dataset, steps_per_epoch=int(words[1]), epochs=1, verbose=0)
            print(MARK + json.dumps({"fit_s": time.perf_counter() - started}), flush=True)
        elif words[0] == "doctor":
            n = steps_per_execution
            folder = os.path.join(output_dir, words[1])
            doctor = bench.doctor_fit(model, dataset, global_batch, folder, verbose=False,
                                      **({} if n == 1 else {"warmup_steps": 2 * n, "window_steps": 2 * n}))
            kept = trace.keep_trace(doctor.profile_dir, folder + ".xplane.pb.gz")
            report = doctor.report or {"unavailable": doctor.unavailable}
            window = report.get("window") or {}
            where = where_the_gpu_waits(kept, window.get("steps", 1)) if kept else {}
            print(MARK + json.dumps({"mean": report.get("mean"), "verdict": report.get("verdict"),
                                     "window": window, "gaps": where}, default=str), flush=True)
    return 0


def where_the_gpu_waits(trace_path: str, steps: int, top: int = 12, smallest_ps: int = 5_000_000) -> dict:
    """From a trace: per step, the GPU's idle inside XLA module executions ('XLA Modules' line) and between them,
    and the idle stretches of at least `smallest_ps` grouped by the events before and after them."""
    space = trace.load_space(trace_path)
    out = {}
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        events, modules = [], []
        for line in plane.lines:
            base = line.timestamp_ns * 1000
            for e in line.events:
                iv = (base + e.offset_ps, base + e.offset_ps + e.duration_ps, names.get(e.metadata_id, ""))
                if line.name.startswith("Stream"):
                    events.append(iv)
                elif line.name == "XLA Modules":
                    modules.append(iv)
        if not events:
            continue
        events.sort()
        busy = breakdown.merge((a, b) for a, b, _ in events)
        mods = breakdown.merge((a, b) for a, b, _ in modules)
        first, last = busy[0][0], busy[-1][1]
        in_modules = breakdown.overlap(mods, [(first, last)])
        busy_in_modules = breakdown.overlap(mods, busy)
        pairs: dict = {}
        long_gaps = []
        prev_name = ""
        running_end = 0
        for a, b, name in events:
            if running_end and a - running_end >= smallest_ps:
                key = f"{prev_name[:50]} -> {name[:50]}"
                total, count = pairs.get(key, (0, 0))
                pairs[key] = (total + a - running_end, count + 1)
                long_gaps.append((a - running_end, running_end, a))
            if b > running_end:
                running_end, prev_name = b, name
        long_gaps = sorted(long_gaps, reverse=True)[:40]
        host_during: dict = {}
        for host in (p for p in space.planes if p.name == "/host:CPU"):
            host_names = {key: meta.name for key, meta in host.event_metadata.items()}
            for line in host.lines:
                base = line.timestamp_ns * 1000
                for e in line.events:
                    a = base + e.offset_ps
                    b = a + e.duration_ps
                    for _, g0, g1 in long_gaps:
                        if a < g1 and b > g0 and e.duration_ps < 50 * (g1 - g0):
                            key = f"{line.name[:24]}: {host_names.get(e.metadata_id, '')[:60]}"
                            host_during[key] = host_during.get(key, 0) + min(b, g1) - max(a, g0)
        per_step = 1.0 / (max(steps, 1) * 1e9)
        out[plane.name] = {
            "span_ms": (last - first) * per_step, "busy_ms": breakdown.length(busy) * per_step,
            "module_executions": len(modules), "in_modules_ms": in_modules * per_step,
            "idle_in_modules_ms": (in_modules - busy_in_modules) * per_step,
            "idle_between_modules_ms": ((last - first) - in_modules
                                        - (breakdown.length(busy) - busy_in_modules)) * per_step,
            "module_names": sorted({n for _, _, n in modules})[:4],
            "gaps": [[k, round(t * per_step, 4), c] for k, (t, c) in
                     sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]],
            "longest_gaps_us": [round(g / 1e6, 1) for g, _, _ in long_gaps[:10]],
            "host_during_longest_gaps": [[k, round(t / 1e6, 1)] for k, t in
                                         sorted(host_during.items(), key=lambda kv: -kv[1])[:top]]}
    return out


class Worker:
    def __init__(self, name: str, spe1: bool, xla_flags: str, n: int):
        self.name, self.spe = name, 1 if spe1 else n
        env = dict(os.environ, TF_FORCE_GPU_ALLOW_GROWTH="true", PYTHONUNBUFFERED="1")
        env["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS", ""), xla_flags]))
        self.log_path = os.path.join(_OUTPUT.value, f"{_MODEL.value}_{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", _MODEL.value, str(self.spe), _OUTPUT.value],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True)

    def answer(self) -> dict:
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"worker {self.name} ended; see {self.log_path}")

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)
        except Exception:  # noqa: BLE001
            self.proc.kill()
        self.log.close()


def main(argv):
    del argv
    os.makedirs(_OUTPUT.value, exist_ok=True)
    print("# " + " ".join(sys.argv), flush=True)
    n = _SPE.value or DEFAULT_STEPS_PER_EXECUTION.get(_MODEL.value, 4)
    steps = _STEPS.value + (-_STEPS.value) % n
    workers = [Worker(name, spe1, value, n) for name, spe1, value in parse_variants(_VARIANTS.value)]
    record = {"model": _MODEL.value, "steps": steps, "steps_per_execution": n, "variants": {}}
    try:
        for w in workers:
            record["variants"][w.name] = {"spe": w.spe, **w.answer()}
            print(w.name, record["variants"][w.name], flush=True)
        seconds = {w.name: [] for w in workers}
        for r in range(_ROUNDS.value):
            for w in workers[r % len(workers):] + workers[:r % len(workers)]:
                seconds[w.name].append(w.ask(f"fit {steps}")["fit_s"])
        for w in workers:
            stats = bench_stats.summarize(seconds[w.name])
            record["variants"][w.name].update(fit_s=seconds[w.name], ms_per_step=stats.median * 1e3 / steps,
                                              spread=stats.spread)
            record["variants"][w.name]["doctor"] = w.ask(f"doctor {_MODEL.value}_{w.name}")
    finally:
        for w in workers:
            w.close()
        with open(os.path.join(_OUTPUT.value, f"{_MODEL.value}_variants.json"), "w") as f:
            json.dump(record, f, indent=1, default=str)
    print(f"{'variant':<12} {'spe':>4} {'ms/step':>8} {'spread':>7} {'doctor step':>11} {'compute':>8} "
          f"{'idle':>6} {'idle %':>6} {'call gap':>8}")
    for name, v in record["variants"].items():
        mean = (v.get("doctor") or {}).get("mean") or {}
        step = mean.get("step_ms", float("nan"))
        print(f"{name:<12} {v['spe']:>4} {v['ms_per_step']:>8.2f} {v['spread']:>7.1%} {step:>11.2f} "
              f"{mean.get('compute_ms', float('nan')):>8.2f} {mean.get('idle_ms', float('nan')):>6.2f} "
              f"{mean.get('idle_ms', float('nan')) / step:>6.1%} {mean.get('per_call_gap_ms', float('nan')):>8.2f}")
    for name, v in record["variants"].items():
        for plane, where in ((v.get("doctor") or {}).get("gaps") or {}).items():
            print(f"{name} {plane}: per step span {where['span_ms']:.2f} busy {where['busy_ms']:.2f} "
                  f"idle in modules {where['idle_in_modules_ms']:.2f} between {where['idle_between_modules_ms']:.2f} "
                  f"({where['module_executions']} module runs {where['module_names']})")
            for key, ms, count in where["gaps"]:
                print(f"    {ms:7.3f} ms/step  x{count:<5} {key}")
            print(f"    longest gaps (us): {where['longest_gaps_us']}")
            for key, us in where["host_during_longest_gaps"]:
                print(f"    host during them {us:9.1f} us  {key}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], int(sys.argv[3]), sys.argv[4]))
    app.run(main)
