"""The benchmark's runner: each candidate in its own worker process, its JSON line turned into records."""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, Sequence, TextIO

from tf_nvlink.util import json_workers
from tf_nvlink.tools.allreduce_bench.specs import Candidate, Target, algbw_gbps, busbw_gbps, plan_runs
from tf_nvlink.util.error_lines import one_line_error

def worker_command(candidate: Candidate, target: Target, sizes: Sequence[int], iters: int, warmup: int,
                   repeats: int) -> list[str]:
    """The argument list of one worker process (never a shell string)."""
    return [sys.executable, "-m", "tf_nvlink.tools.allreduce_bench.worker", "--candidate", candidate.label,
            "--target", target.spec, "--sizes", ",".join(map(str, sizes)), "--iters", str(iters),
            "--warmup", str(warmup), "--repeats", str(repeats)]


def worker_env(target: Target, extra: Optional[dict] = None) -> dict[str, str]:
    """The worker's environment: ours, tf_nvlink importable, TensorFlow's C++ chatter down, plus `extra`."""
    env = json_workers.package_env()
    if target.device_type == "CPU":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run must not initialise (or hold memory on) any GPU
    env.update(extra or {})
    return env


def spawn_worker(candidate: Candidate, target: Target, sizes: Sequence[int], iters: int, warmup: int,
                 repeats: int, env: Optional[dict] = None, timeout: float = 1800) -> dict:
    """Run one worker process and return its JSON record ({"ok": False, "error": ...} when it failed)."""
    command = worker_command(candidate, target, sizes, iters, warmup, repeats)
    record, error = json_workers.run_json_worker(command, worker_env(target, env), timeout,
                                            accept=lambda output: "ok" in output)
    return record if record is not None else {"ok": False, "candidate": candidate.label, "error": error[:1000]}


_RECORD_KEYS = ("candidate", "label", "variant", "ops", "num_packs", "n_gpus", "n_replicas", "device_type",
                "size_bytes", "count", "dtype", "time_us", "algbw", "busbw", "wrong", "status", "error", "env",
                "iters", "repeats", "tf_version", "plan", "raw_time_us", "local_us", "local_capped",
                "nvlink_bytes", "nvlink_expected_bytes", "nvlink_unavailable")


def _record(**fields) -> dict:
    record = dict.fromkeys(_RECORD_KEYS)
    record.update(dtype="float32", **fields)
    return record


def to_records(output: dict, candidate: Candidate, target: Target, env: Optional[dict] = None,
               variant: str = "") -> list[dict]:
    """A worker's output -> one record per size (or one "failed" record), with algbw and busbw."""
    env = dict(env or {})
    base = {"candidate": candidate.label, "variant": variant, "env": env, "device_type": target.device_type,
            "n_gpus": len(target.gpus), "n_replicas": target.n}
    if not output.get("ok"):
        label = candidate.label + (f"@{variant}" if variant else "")
        return [_record(**base, label=label, status="failed", error=one_line_error(output.get("error")))]
    resolved = output["ops"] + (f":{output['num_packs']}" if output.get("num_packs") is not None else "")
    label = f"auto({resolved})" if candidate.name == "auto" else candidate.label
    label += f"@{variant}" if variant else ""
    n = output["n_replicas"]
    common = dict(base, label=label, ops=output["ops"], num_packs=output.get("num_packs"), n_replicas=n,
                  n_gpus=output.get("n_gpus", len(target.gpus)), iters=output.get("iters"),
                  repeats=output.get("repeats"), tf_version=output.get("tf_version"), plan=output.get("plan"),
                  nvlink_unavailable=output.get("nvlink_unavailable"))
    records = []
    for result in output["results"]:
        if "error" in result:
            records.append(_record(**common, size_bytes=result["size_bytes"], count=result.get("count"),
                                   status="failed", error=one_line_error(result["error"])))
            continue
        time_us = float(result["time_us"])
        wrong = int(result["wrong"])
        records.append(_record(**common, size_bytes=result["size_bytes"], count=result["count"], time_us=time_us,
                               algbw=algbw_gbps(result["size_bytes"], time_us),
                               busbw=busbw_gbps(result["size_bytes"], time_us, n), wrong=wrong,
                               status="ok" if wrong == 0 else "wrong", raw_time_us=result.get("raw_time_us"),
                               local_us=result.get("local_us"), local_capped=result.get("local_capped"),
                               nvlink_bytes=result.get("nvlink_bytes"),
                               nvlink_expected_bytes=result.get("nvlink_expected_bytes")))
    return records


def measure(candidates: Sequence[Candidate], target: Target, sizes: Sequence[int], *, iters: int = 10,
            warmup: int = 2, repeats: int = 3, env: Optional[dict] = None, variant: str = "",
            timeout: float = 1800, progress: Optional[TextIO] = sys.stderr,
            spawn: Callable[..., dict] = None) -> tuple[list[dict], list[tuple[str, str]]]:
    """Measure each runnable candidate in its own process, one after another.

    Returns (records, skipped): records as `to_records` makes them, skipped as (label, reason).
    """
    spawn = spawn or spawn_worker
    runs, skipped = plan_runs(candidates, target)
    records: list[dict] = []
    for i, candidate in enumerate(runs, 1):
        label = candidate.label + (f"@{variant}" if variant else "")
        if progress:
            print(f"# [{i}/{len(runs)}] {label}: measuring in a worker process ...", file=progress, flush=True)
        started = time.perf_counter()
        output = spawn(candidate, target, sizes, iters, warmup, repeats, env=env, timeout=timeout)
        new = to_records(output, candidate, target, env, variant)
        records.extend(new)
        if progress:
            failed = [r for r in new if r["status"] == "failed"]
            state = f"FAILED: {failed[0]['error']}" if failed else "done"
            print(f"# [{i}/{len(runs)}] {label}: {state} ({time.perf_counter() - started:.1f} s)", file=progress,
                  flush=True)
    return records, skipped


def skipped_records(skipped: Sequence[tuple[str, str]], target: Target) -> list[dict]:
    """One "skipped" record per (label, reason), for the JSON output."""
    return [_record(candidate=label, label=label, variant="", env={}, device_type=target.device_type,
                    n_gpus=len(target.gpus), n_replicas=target.n, status="skipped", error=reason)
            for label, reason in skipped]

