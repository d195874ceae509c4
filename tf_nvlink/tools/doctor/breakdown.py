"""Where one replica's step time goes, from its GPU's activity in a profiled window.

Per step (ms): `compute` = the union of the compute kernels' intervals; `collective` = the union of the NCCL /
all-reduce kernels' and the peer-to-peer copies' (`peer_copy`, the trace's `MemcpyP2P`: what `reduce_to_one` and
`hierarchical` all-reduces are made of), split into `hidden` (overlapped by compute) and `exposed`; `h2d` =
host-to-device copies, `exposed_h2d` the part not overlapped by compute, `h2d_pageable` and `h2d_pinned` the
copies from each host memory as their `memcpy_details` stat says (both 0 where the trace does not say);
`other_copies` = device-to-host and device-to-device copies and memsets; `busy` = the union of everything on the GPU; `idle` = step -
busy (the GPU waits for the host). `per_call_gap` is the mean of the `calls - 1` longest gaps between busy
intervals, where `calls` is how many training-function calls the window made: the gap each call pays on the
host between its predecessor's last kernel and its own first, which `steps_per_execution` pays once per N steps.
`boundary_idle` (per call) is the idle part of the `calls - 1` longest gaps between compute (and collective)
kernels, the copies inside them left out: everything the GPU waits for between one call's program and the next
(the batch fetched, the program launched), where `per_call_gap` is only its longest idle stretch. `work_ms`: per kind
of work (`work_kinds.WORK_KINDS`: matmul, attention, normalisation, ...) the union of its events' intervals; the
compute kinds add up to `compute` where one stream runs the kernels, and copies and all-reduces overlap them.
`work_cost`: per kind of compute work, what its kernels' HLO instructions read and write and compute per step
(`cost_per_step`).

Example:
    >>> b = replica_breakdown(activity, step_ms=33.6, steps=10, calls=10)
    >>> round(b.idle_ms, 1), round(b.exposed_collective_ms, 2)
    (9.8, 0.21)
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from tf_nvlink.tools.doctor.trace import GpuActivity, WorkCost

PS_PER_MS = 1e9


def merge(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint intervals covering the same time as `intervals`.

    Example:
        >>> merge([(5, 8), (0, 2), (1, 3)])
        [(0, 3), (5, 8)]
    """
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def length(merged: Sequence[tuple[int, int]]) -> int:
    """Total time of disjoint intervals."""
    return sum(end - start for start, end in merged)


def overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    """Time covered by both of two merged interval lists.

    Example:
        >>> overlap([(0, 10)], [(5, 15), (20, 30)])
        5
    """
    i = j = total = 0
    while i < len(a) and j < len(b):
        low, high = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, high - low)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def gaps(merged: Sequence[tuple[int, int]]) -> list[int]:
    """The idle stretches between consecutive merged intervals, longest first."""
    return sorted((b[0] - a[1] for a, b in zip(merged, merged[1:])), reverse=True)


@dataclasses.dataclass(frozen=True)
class ReplicaBreakdown:
    """One replica's step in the profiled window, in ms per step (see the module doc for each term)."""

    plane: str
    step_ms: float
    compute_ms: float
    collective_ms: float
    exposed_collective_ms: float
    hidden_collective_ms: float
    h2d_ms: float
    exposed_h2d_ms: float
    other_copies_ms: float
    busy_ms: float
    idle_ms: float
    per_call_gap_ms: float
    calls_per_step: float
    top_kernels: tuple[tuple[str, float], ...]
    boundary_idle_ms: float = 0.0
    peer_copy_ms: float = 0.0
    h2d_pageable_ms: float = 0.0
    h2d_pinned_ms: float = 0.0
    work_ms: dict = dataclasses.field(default_factory=dict)
    work_cost: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["top_kernels"] = [list(k) for k in self.top_kernels]
        out["work_ms"] = {kind: round(ms, 4) for kind, ms in self.work_ms.items()}
        out["work_cost"] = {kind: {key: round(value, 4) for key, value in cost.items()}
                            for kind, cost in self.work_cost.items()}
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in out.items()}


def replica_breakdown(activity: GpuActivity, step_ms: float, steps: int, calls: int,
                      top: int = 5) -> ReplicaBreakdown:
    """The breakdown of one GPU's activity over a window of `steps` steps made in `calls` training-function
    calls, whose wall time per step was `step_ms`."""
    if steps < 1 or calls < 1 or not step_ms > 0:
        raise ValueError(f"steps and calls must be >= 1 and step_ms > 0. Received: steps={steps}, calls={calls}, "
                         f"step_ms={step_ms}")
    kinds = {kind: merge(ivs) for kind, ivs in activity.intervals.items()}
    compute, h2d = kinds["compute"], kinds["h2d"]
    collective = merge(kinds["collective"] + kinds.get("p2p", []))
    everything = merge(iv for ivs in kinds.values() for iv in ivs)
    per_step = 1.0 / (steps * PS_PER_MS)
    collective_ps, h2d_ps = length(collective), length(h2d)
    hidden_ps = overlap(collective, compute)
    busy_ms = length(everything) * per_step
    call_gaps = gaps(everything)[:max(calls - 1, 0)]
    per_call_gap_ms = sum(call_gaps) / len(call_gaps) / PS_PER_MS if call_gaps else 0.0
    kernels = merge(compute + collective)
    boundaries = sorted(((b[0] - a[1], a[1], b[0]) for a, b in zip(kernels, kernels[1:])),
                        reverse=True)[:max(calls - 1, 0)]
    spans = merge((start, end) for _, start, end in boundaries)
    boundary_idle_ms = ((length(spans) - overlap(spans, everything)) / len(boundaries) / PS_PER_MS
                        if boundaries else 0.0)
    top_kernels = sorted(activity.time_by_name.items(), key=lambda item: -item[1])[:top]
    return ReplicaBreakdown(
        plane=activity.plane, step_ms=step_ms, compute_ms=length(compute) * per_step,
        collective_ms=collective_ps * per_step, exposed_collective_ms=(collective_ps - hidden_ps) * per_step,
        hidden_collective_ms=hidden_ps * per_step, h2d_ms=h2d_ps * per_step,
        exposed_h2d_ms=(h2d_ps - overlap(h2d, compute)) * per_step,
        other_copies_ms=length(merge(kinds["d2h"] + kinds["d2d"])) * per_step,
        busy_ms=busy_ms, idle_ms=max(step_ms - busy_ms, 0.0), per_call_gap_ms=per_call_gap_ms,
        calls_per_step=calls / steps,
        top_kernels=tuple((name[:80], duration * per_step) for name, duration in top_kernels),
        boundary_idle_ms=boundary_idle_ms, peer_copy_ms=length(kinds.get("p2p", [])) * per_step,
        h2d_pageable_ms=_memory_ps(activity, "pageable") * per_step,
        h2d_pinned_ms=_memory_ps(activity, "pinned") * per_step,
        work_ms={kind: length(merge(ivs)) * per_step for kind, ivs in activity.work.items()},
        work_cost={kind: cost_per_step(cost, steps) for kind, cost in activity.work_cost.items()})


def cost_per_step(cost: WorkCost, steps: int) -> dict:
    """A kind's WorkCost over the window as the report gives it per step: "bytes", "flops", "dot_flops",
    "float32_dot_flops", "executions", the ms of its kernels with no instruction known ("ms_without_instruction")
    and of its fused-attention kernels ("fused_attention_ms"), and the ms and executions of the transposes of their
    results ("attention_layout_ms", "attention_layout_ops").

    Example:
        >>> per_step = cost_per_step(WorkCost(bytes=2_000_000, flops=1e9, unattributed_ps=10**9), steps=10)
        >>> per_step["bytes"], per_step["flops"], per_step["ms_without_instruction"]
        (200000.0, 100000000.0, 0.1)
    """
    return {"bytes": cost.bytes / steps, "flops": cost.flops / steps, "dot_flops": cost.dot_flops / steps,
            "float32_dot_flops": cost.float32_dot_flops / steps, "executions": cost.executions / steps,
            "ms_without_instruction": cost.unattributed_ps / steps / PS_PER_MS,
            "fused_attention_ms": cost.fused_attention_ps / steps / PS_PER_MS,
            "attention_layout_ms": cost.attention_layout_ps / steps / PS_PER_MS,
            "attention_layout_ops": cost.attention_layout_executions / steps}


def _memory_ps(activity: GpuActivity, memory: str) -> int:
    """The time (ps) covered by host-to-device copies from one host memory."""
    total = activity.h2d_memory.get(memory)
    return length(merge(total.intervals)) if total else 0


def mean_breakdown(replicas: Sequence[ReplicaBreakdown]) -> ReplicaBreakdown:
    """The replicas' mean breakdown (plane "mean"), the figure the verdict reads."""
    if not replicas:
        raise ValueError("mean_breakdown needs at least one replica")
    numeric = [f.name for f in dataclasses.fields(ReplicaBreakdown)
               if f.name not in ("plane", "top_kernels", "work_ms", "work_cost")]
    means = {name: sum(getattr(r, name) for r in replicas) / len(replicas) for name in numeric}
    kinds = dict.fromkeys(kind for r in replicas for kind in r.work_ms)
    work = {kind: sum(r.work_ms.get(kind, 0.0) for r in replicas) / len(replicas) for kind in kinds}
    costs = {}
    for kind in dict.fromkeys(kind for r in replicas for kind in r.work_cost):
        keys = dict.fromkeys(key for r in replicas for key in r.work_cost.get(kind, {}))
        costs[kind] = {key: sum(r.work_cost.get(kind, {}).get(key, 0.0) for r in replicas) / len(replicas)
                       for key in keys}
    return ReplicaBreakdown(plane="mean", top_kernels=replicas[0].top_kernels, work_ms=work, work_cost=costs, **means)
