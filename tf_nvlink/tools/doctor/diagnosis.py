"""From a profiled window to the doctor's report: trace -> per-replica breakdown -> verdict, scaling, NVLink.

Example:
    >>> report, why = diagnose_trace("doctor/profile", step_ms=33.6, steps=10, calls=10, context=context)
    >>> why or report["verdict"]["kind"]
    'host-bound'
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_nvlink.plan import gpu_peaks
from tf_nvlink.tools.costmodel.model import REPLICA_OVERHEAD_HOST_FED_MS
from tf_nvlink.tools.doctor.bounds import kind_bounds
from tf_nvlink.tools.doctor.breakdown import mean_breakdown, replica_breakdown
from tf_nvlink.tools.doctor.predictions import nvlink_answer, scaling
from tf_nvlink.tools.doctor.trace import TraceError, find_trace, gpu_activity, host_plane_names, load_space
from tf_nvlink.tools.doctor.verdict import StepContext, diagnose


def context_dict(context: StepContext) -> dict:
    """The StepContext as JSON: the link by name, and its model's fields ("link_model", which `reread` restores)."""
    out = dataclasses.asdict(context)
    out["link"] = context.link.name if context.link else None
    out["link_model"] = dataclasses.asdict(context.link) if context.link else None
    return out


# Where the trace's copies carry no memcpy_details stat (which names the host memory), a host-to-device rate below
# this one is taken for a copy from pageable host memory (1x H200, PCIe gen5: pageable 5.6 GB/s, pinned 55.5 GB/s;
# docs/results.md).
PAGEABLE_COPY_GBPS = 15.0
# Below this many bytes per step the copies' fixed cost (microseconds each) sets their rate, whatever the memory
# (the 368M Transformer's 16 KiB of tokens per step copied at 2-5 GB/s from pinned memory, 1x H200).
SMALL_COPY_BYTES = 1 << 20
# The host memory that holds this share of the copy time names the input's copy (a few small copies from the other,
# such as a step counter's, do not make it "mixed").
MAIN_MEMORY_SHARE = 0.9


def input_copy(mean: dict, context: StepContext) -> Optional[dict]:
    """The input's host-to-device copy per step: bytes (one replica's batch), the GPU's copy time, its rate
    (GB/s, 1e9 bytes) and the host memory it came from: "pageable", "pinned" or "mixed" as the copies'
    memcpy_details stat says (`host_memory_from` "trace"), else guessed from the rate (`host_memory_from` "rate":
    below PAGEABLE_COPY_GBPS, "pageable"; None when the rate cannot tell). None when the batch's size or the
    copies are unknown.

    Example:
        >>> input_copy({"h2d_ms": 3.43, "exposed_h2d_ms": 3.10, "h2d_pageable_ms": 3.43}, context)   # 128 uint8 images
        {'bytes_per_step': 19267584, 'ms_per_step': 3.43, 'gb_per_s': 5.62, 'host_memory': 'pageable', ...}
    """
    if not context.batch_bytes or not mean.get("h2d_ms", 0) > 0:
        return None
    rate = context.batch_bytes / (mean["h2d_ms"] * 1e-3) / 1e9
    pageable_ms, pinned_ms = mean.get("h2d_pageable_ms", 0.0), mean.get("h2d_pinned_ms", 0.0)
    memory, source = None, None
    if pageable_ms > 0 or pinned_ms > 0:
        share = pageable_ms / (pageable_ms + pinned_ms)
        memory = "pageable" if share >= MAIN_MEMORY_SHARE else "pinned" if share <= 1 - MAIN_MEMORY_SHARE else "mixed"
        source = "trace"
    if context.batch_bytes < SMALL_COPY_BYTES:
        note = "a small copy: its fixed cost, not the host memory, sets the rate"
    elif source == "trace":
        note = {"pageable": "from pageable host memory (the trace's memcpy_details): pinned memory copies faster",
                "pinned": "from pinned host memory (the trace's memcpy_details)",
                "mixed": f"{pageable_ms:.2f} ms from pageable and {pinned_ms:.2f} ms from pinned host memory (the "
                         f"trace's memcpy_details)"}[memory]
    elif rate < PAGEABLE_COPY_GBPS:
        note = f"below {PAGEABLE_COPY_GBPS:.0f} GB/s: the rate of a copy from pageable host memory"
        memory, source = "pageable", "rate"
    else:
        note = ""
    return {"bytes_per_step": int(context.batch_bytes), "ms_per_step": round(mean["h2d_ms"], 4),
            "gb_per_s": round(rate, 2), "exposed_ms_per_step": round(mean.get("exposed_h2d_ms", 0.0), 4),
            "host_memory": memory, "host_memory_from": source, "note": note}


def model_utilisation(model_flops_per_step: float, mean: dict, gpu_name: str, replicas: int) -> dict:
    """The report's "mfu": the model's TFLOP/s per GPU and its MFU over the window's step (`gpu_peaks.utilisation`),
    and `mfu_of_kernel_time`, the MFU were the step only its kernels' time (`compute_ms`: what the GPU idle costs).

    Example:
        >>> model_utilisation(8.854e12, {"step_ms": 42.3, "compute_ms": 35.0}, "NVIDIA H100 80GB HBM3", 1)["mfu"]
        0.2116
    """
    entry = gpu_peaks.utilisation(model_flops_per_step, mean["step_ms"] / 1e3, gpu_name, replicas)
    kernels = gpu_peaks.mfu(model_flops_per_step, mean["compute_ms"] / 1e3, gpu_name, replicas) \
        if mean.get("compute_ms", 0) > 0 else None
    entry["mfu_of_kernel_time"] = round(kernels, 4) if kernels is not None else None
    return entry


def diagnose_space(space, step_ms: float, steps: int, calls: int, context: StepContext,
                   nvlink_bytes_per_step: Optional[float] = None,
                   replica_overhead_ms: float = REPLICA_OVERHEAD_HOST_FED_MS,
                   model_flops_per_step: Optional[float] = None) -> tuple[dict, Optional[str]]:
    """(report, None), or ({"unavailable": why}, why) when the XSpace has no GPU activity. The report's
    "work_bounds": each kind of work against its bound on the GPU the trace names (`bounds.kind_bounds`). With the
    model's FLOPs per step (over all replicas), the report's "mfu" (`model_utilisation`) against that GPU's peak."""
    activity = gpu_activity(space)
    if not activity:
        why = (f"the trace has no GPU activity (planes: {', '.join(host_plane_names(space)) or 'none'}): the "
               f"replicas ran on no GPU, or CUPTI could not trace it")
        return {"unavailable": why, "context": context_dict(context)}, why
    replicas = [replica_breakdown(a, step_ms=step_ms, steps=steps, calls=calls) for a in activity.values()]
    mean = mean_breakdown(replicas)
    first = next(iter(activity.values()))
    bounds = kind_bounds(mean.work_ms, mean.work_cost, first.device_name, first.memory_bandwidth)
    verdict = diagnose(mean, context, bounds)
    measured_bytes = nvlink_bytes_per_step if isinstance(nvlink_bytes_per_step, (int, float)) else None
    report = {"replicas": [r.to_dict() for r in replicas], "mean": mean.to_dict(), "verdict": verdict.to_dict(),
              "scaling": scaling(mean, context, replica_overhead_ms=replica_overhead_ms),
              "nvlink": nvlink_answer(mean, context, measured_bytes), "context": context_dict(context),
              "input_copy": input_copy(mean.to_dict(), context), "work_bounds": rounded(bounds)}
    if model_flops_per_step:
        report["mfu"] = model_utilisation(model_flops_per_step, report["mean"], first.device_name, context.replicas)
    return report, None


def rounded(value):
    """`value` (dicts and lists of numbers) with every float rounded to 4 decimals, for the JSON.

    Example:
        >>> rounded({"ms": 6.141592, "kinds": [0.123456]})
        {'ms': 6.1416, 'kinds': [0.1235]}
    """
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(item) for item in value]
    return round(value, 4) if isinstance(value, float) else value


def diagnose_trace(profile_dir: str, step_ms: float, steps: int, calls: int, context: StepContext,
                   nvlink_bytes_per_step: Optional[float] = None,
                   replica_overhead_ms: float = REPLICA_OVERHEAD_HOST_FED_MS,
                   model_flops_per_step: Optional[float] = None) -> tuple[dict, Optional[str]]:
    """`diagnose_space` of the newest trace under `profile_dir` (its path in report["trace"])."""
    try:
        path = find_trace(profile_dir)
        space = load_space(path)
    except TraceError as exc:
        return {"unavailable": str(exc), "context": context_dict(context)}, str(exc)
    report, why = diagnose_space(space, step_ms, steps, calls, context, nvlink_bytes_per_step, replica_overhead_ms,
                                 model_flops_per_step)
    report["trace"] = path
    return report, why
