"""Reading a TensorFlow profiler trace (`.xplane.pb`): each GPU's activity, sorted into kinds.

`tf.profiler.experimental.stop()` writes an XSpace protobuf to `<logdir>/plugins/profile/<run>/<host>.xplane.pb`.
Each GPU is a plane named `/device:GPU:N`; its lines named `Stream #...` hold what ran on the GPU (kernels and
memory copies), each event with an offset and a duration in picoseconds from the line's timestamp (ns) and a
metadata id naming it. The host is the plane `/host:CPU`.

Example:
    >>> activity = read_gpu_activity(find_trace("/tmp/doctor/profile"))
    >>> activity["/device:GPU:0"].intervals["collective"][:2]
    [(1796172984996354000, 1796172984996400000), ...]
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import os
import shutil
from typing import Optional

KINDS = ("compute", "collective", "h2d", "d2h", "d2d")

# Substrings (lower case) of event names that make an event one kind. NCCL's kernels are ncclDevKernel_* /
# ncclKernel_*; XLA's own all-reduce thunks and TensorFlow's collective ops carry "allreduce"/"all-reduce".
_COLLECTIVE_MARKS = ("nccl", "allreduce", "all-reduce", "all_reduce", "reducescatter", "reduce-scatter",
                     "allgather", "all-gather")
_H2D_MARKS = ("memcpyh2d", "htod")
_D2H_MARKS = ("memcpyd2h", "dtoh")
_D2D_MARKS = ("memcpy", "memset")


class TraceError(RuntimeError):
    """The profiler's output is missing or unreadable; the message says which file and why."""


def classify(event_name: str) -> str:
    """The kind of a GPU event from its name: "collective", "h2d", "d2h", "d2d" (other copies, memsets) or
    "compute" (every other kernel).

    Example:
        >>> classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
        'collective'
    """
    low = event_name.lower()
    if any(mark in low for mark in _COLLECTIVE_MARKS):
        return "collective"
    if any(mark in low for mark in _H2D_MARKS):
        return "h2d"
    if any(mark in low for mark in _D2H_MARKS):
        return "d2h"
    if any(mark in low for mark in _D2D_MARKS):
        return "d2d"
    return "compute"


@dataclasses.dataclass
class GpuActivity:
    """What one GPU plane of a trace holds: per kind, the (start_ps, end_ps) of every event, and the summed
    duration of each event name (for the busiest kernels)."""

    plane: str
    intervals: dict[str, list[tuple[int, int]]]
    time_by_name: dict[str, int]

    @property
    def events(self) -> int:
        return sum(len(v) for v in self.intervals.values())


def find_trace(logdir: str) -> str:
    """The newest `.xplane.pb` the profiler wrote under `logdir` (or a kept `.xplane.pb.gz`); TraceError naming
    `logdir` when there is none."""
    paths = [path for pattern in ("*.xplane.pb", "*.xplane.pb.gz")
             for path in glob.glob(os.path.join(logdir, "plugins", "profile", "*", pattern))]
    if not paths:
        raise TraceError(f"the profiler wrote no .xplane.pb under {logdir}/plugins/profile")
    return max(paths, key=os.path.getmtime)


def keep_trace(logdir: str, target: str) -> Optional[str]:
    """The newest trace under `logdir` (`find_trace`) gzipped to `target`, which `load_space` reads back; returns
    `target`, or None when the profiler wrote none there.

    Example:
        >>> keep_trace("/tmp/doctor/profile", "resnet50.xplane.pb.gz")
        'resnet50.xplane.pb.gz'
    """
    try:
        path = find_trace(logdir)
    except TraceError:
        return None
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as source, gzip.open(target, "wb") as kept:
        shutil.copyfileobj(source, kept)
    return target


def load_space(path: str):
    """The XSpace protobuf in the file at `path`."""
    from tf_nvlink.internals import tf_runtime  # noqa: PLC0415 - TensorFlow only when a trace is read

    space = tf_runtime.xplane_protobuf_module().XSpace()
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            space.ParseFromString(f.read())
    except (OSError, ValueError) as exc:  # protobuf's DecodeError is a ValueError
        raise TraceError(f"cannot read the trace {path}: {exc}") from exc
    return space


def gpu_activity(space) -> dict[str, GpuActivity]:
    """{plane name: GpuActivity} for every `/device:GPU:N` plane with events on its `Stream` lines, by GPU number."""
    found = {}
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        intervals: dict[str, list[tuple[int, int]]] = {kind: [] for kind in KINDS}
        time_by_name: dict[str, int] = {}
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # "XLA Ops", "XLA Modules", "Launch Stats": annotations over the same kernels
            base_ps = line.timestamp_ns * 1000
            for event in line.events:
                name = names.get(event.metadata_id, "")
                start = base_ps + event.offset_ps
                intervals[classify(name)].append((start, start + event.duration_ps))
                time_by_name[name] = time_by_name.get(name, 0) + event.duration_ps
        activity = GpuActivity(plane.name, intervals, time_by_name)
        if activity.events:
            found[plane.name] = activity
    return dict(sorted(found.items(), key=lambda item: _plane_number(item[0])))


def _plane_number(name: str) -> int:
    tail = name.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def host_plane_names(space) -> list[str]:
    """Names of the planes in the trace (for the one line saying why no GPU was found)."""
    return [plane.name for plane in space.planes]


def read_gpu_activity(path: str) -> dict[str, GpuActivity]:
    """`gpu_activity` of the trace file at `path`."""
    return gpu_activity(load_space(path))

