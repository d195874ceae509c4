"""Where a profiled step's time goes, read from a TensorFlow profiler trace (the `.xplane.pb` it writes).

The training benchmark's `--profile DIR` traces a few steps of each candidate into DIR/<candidate>/ and records
`summarize_trace` of it: per GPU, the window, busy, compute, NCCL (and the NCCL time not hidden under compute),
memory copies and idle time, in ms per step, with the busiest kernels; on the host, the busiest op names.

Example:
    >>> summarize_trace("/tmp/profile/auto", steps=10)["gpus"]["/device:GPU:0"]["nccl_exposed_ms_per_step"]
"""

import collections
import glob
import os


def _merge(intervals) -> list:
    """(start, end) intervals -> sorted, non-overlapping [start, end] lists."""
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _union(intervals) -> int:
    """Total length covered by (start, end) intervals, overlaps counted once."""
    return sum(end - start for start, end in _merge(intervals))


def _overlap(a, b):
    """Length of the intersection of two merged interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_trace(logdir: str, steps: int) -> dict:
    """Per GPU plane: window, busy, compute, NCCL (exposed = not overlapped by compute), copies, idle; in ms/step.
    Host: the busiest TensorFlow op names (ms/step, summed over threads). {"error": ...} without a trace."""
    from tf_nvlink import internals  # noqa: PLC0415 - TensorFlow, in the worker only

    paths = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    if not paths:
        return {"error": f"no .xplane.pb under {logdir}"}
    space = internals.read_profiler_trace(paths[-1])
    result = {"trace": paths[-1], "gpus": {}, "host_top": []}
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        if plane.name.startswith("/device:GPU:"):
            summary = _gpu_plane(plane, names, steps)
            if summary:
                result["gpus"][plane.name] = summary
        elif plane.name.startswith("/host:CPU"):
            result["host_top"] = _host_top(plane, names, steps)
    return result


def _event_kind(name: str) -> str:
    low = name.lower()  # the stream's own name lists every kind it carries ("MemcpyD2D,...")
    if "nccl" in low:
        return "nccl"
    if "memcpyh2d" in low or "htod" in low:
        return "h2d"
    if "memcpyd2h" in low or "dtoh" in low:
        return "d2h"
    if "memcpy" in low or "memset" in low:
        return "d2d"
    return "compute"


def _gpu_plane(plane, names: dict, steps: int) -> dict:
    """One GPU's stream events -> ms per step by kind, with the 15 busiest kernels; {} for a plane without any."""
    kinds = collections.defaultdict(list)
    kernel_names = collections.Counter()
    for line in plane.lines:
        if not line.name.startswith("Stream"):
            continue
        base = line.timestamp_ns * 1000
        for event in line.events:
            start = base + event.offset_ps
            name = names.get(event.metadata_id, "")
            kind = _event_kind(name)
            kinds[kind].append((start, start + event.duration_ps))
            kernel_names[(kind, name[:60])] += event.duration_ps
    everything = [interval for intervals in kinds.values() for interval in intervals]
    if not everything:
        return {}
    window = max(e for _, e in everything) - min(s for s, _ in everything)
    per_step = 1e9 * steps  # picoseconds per ms, times the steps
    busy = _union(everything)
    nccl = _union(kinds["nccl"])
    summary = {
        "window_ms_per_step": window / per_step,
        "busy_ms_per_step": busy / per_step,
        "idle_ms_per_step": (window - busy) / per_step,
        "compute_ms_per_step": _union(kinds["compute"]) / per_step,
        "nccl_ms_per_step": nccl / per_step,
        "nccl_exposed_ms_per_step": (nccl - _overlap(_merge(kinds["compute"]), _merge(kinds["nccl"]))) / per_step,
        "h2d_ms_per_step": _union(kinds["h2d"]) / per_step,
        "d2h_ms_per_step": _union(kinds["d2h"]) / per_step,
        "d2d_ms_per_step": _union(kinds["d2d"]) / per_step,
        "top_kernels": [(k, n, round(d / per_step, 3)) for (k, n), d in kernel_names.most_common(15)],
        "events_per_step": round(len(everything) / steps, 1),
    }
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items()}


def _host_top(plane, names: dict, steps: int) -> list:
    totals = collections.Counter()
    for line in plane.lines:
        for event in line.events:
            totals[names.get(event.metadata_id, "")[:80]] += event.duration_ps
    return [(n, round(d / 1e9 / steps, 3)) for n, d in totals.most_common(25)]
