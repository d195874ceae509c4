"""From a profiled window to the doctor's report: trace -> per-replica breakdown -> verdict, scaling, NVLink.

Example:
    >>> report, why = diagnose_trace("doctor/profile", step_ms=33.6, steps=10, calls=10, context=context)
    >>> why or report["verdict"]["kind"]
    'host-bound'
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from tf_nvlink.tools.costmodel import REPLICA_OVERHEAD_HOST_FED_MS
from tf_nvlink.tools.doctor.breakdown import mean_breakdown, replica_breakdown
from tf_nvlink.tools.doctor.predictions import nvlink_answer, scaling
from tf_nvlink.tools.doctor.trace import TraceError, find_trace, gpu_activity, host_plane_names, load_space
from tf_nvlink.tools.doctor.verdict import StepContext, diagnose


def context_dict(context: StepContext) -> dict:
    """The StepContext as JSON (the link by name)."""
    out = dataclasses.asdict(context)
    out["link"] = context.link.name if context.link else None
    return out


def diagnose_space(space, step_ms: float, steps: int, calls: int, context: StepContext,
                   nvlink_bytes_per_step: Optional[float] = None,
                   replica_overhead_ms: float = REPLICA_OVERHEAD_HOST_FED_MS) -> tuple[dict, Optional[str]]:
    """(report, None), or ({"unavailable": why}, why) when the XSpace has no GPU activity."""
    activity = gpu_activity(space)
    if not activity:
        why = (f"the trace has no GPU activity (planes: {', '.join(host_plane_names(space)) or 'none'}): the "
               f"replicas ran on no GPU, or CUPTI could not trace it")
        return {"unavailable": why, "context": context_dict(context)}, why
    replicas = [replica_breakdown(a, step_ms=step_ms, steps=steps, calls=calls) for a in activity.values()]
    mean = mean_breakdown(replicas)
    verdict = diagnose(mean, context)
    measured_bytes = nvlink_bytes_per_step if isinstance(nvlink_bytes_per_step, (int, float)) else None
    return {"replicas": [r.to_dict() for r in replicas], "mean": mean.to_dict(), "verdict": verdict.to_dict(),
            "scaling": scaling(mean, context, replica_overhead_ms=replica_overhead_ms),
            "nvlink": nvlink_answer(mean, context, measured_bytes), "context": context_dict(context)}, None


def diagnose_trace(profile_dir: str, step_ms: float, steps: int, calls: int, context: StepContext,
                   nvlink_bytes_per_step: Optional[float] = None,
                   replica_overhead_ms: float = REPLICA_OVERHEAD_HOST_FED_MS) -> tuple[dict, Optional[str]]:
    """`diagnose_space` of the newest trace under `profile_dir` (its path in report["trace"])."""
    try:
        path = find_trace(profile_dir)
        space = load_space(path)
    except TraceError as exc:
        return {"unavailable": str(exc), "context": context_dict(context)}, str(exc)
    report, why = diagnose_space(space, step_ms, steps, calls, context, nvlink_bytes_per_step, replica_overhead_ms)
    report["trace"] = path
    return report, why
