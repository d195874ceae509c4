"""Reading a TensorFlow profiler trace (`.xplane.pb`): each GPU's activity, sorted into kinds.

`tf.profiler.experimental.stop()` writes an XSpace protobuf to `<logdir>/plugins/profile/<run>/<host>.xplane.pb`.
Each GPU is a plane named `/device:GPU:N`; its lines named `Stream #...` hold what ran on the GPU (kernels and
memory copies), each event with an offset and a duration in picoseconds from the line's timestamp (ns) and a
metadata id naming it. The host is the plane `/host:CPU`.

A copy is classified by what the trace says of it: CUPTI names each copy event by its kind (`MemcpyH2D`,
`MemcpyD2H`, `MemcpyD2D`, `MemcpyP2P`, `MemcpyOther`) and TensorFlow gives it a `memcpy_details` stat
(`kind_src:pageable kind_dst:device size:19267584 dest:0 async:1`): the memory on each side (`pageable`, `pinned`,
`device`, `managed`, ...) and the bytes. Peer-to-peer copies (`MemcpyP2P`, what `reduce_to_one` and `hierarchical`
all-reduces are made of) are communication, kind "p2p". Kernels and events without the stat keep the name rules.
Beside these kinds, each event gets its kind of work (matmul, attention, normalisation, ...: `work_kinds`, from
the kernel's name, its HLO instruction and its TensorFlow op's name scope), and each kind the bytes and FLOPs of its
kernels' instructions (`hlo_cost`), counted once per execution of an instruction: the kernels one instruction
launches one after the other on a stream (a cuDNN convolution's padding kernel and the convolution, a split gemm and
its reduction) are one execution, copies and memsets between them aside.

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

from tf_nvlink.tools.doctor import work_kinds

KINDS = ("compute", "collective", "p2p", "h2d", "d2h", "d2d")
# CUPTI's names of copy events (TensorFlow's cupti_collector) -> kind. MemcpyOther is read from memcpy_details.
_COPY_EVENT_KINDS = {"memcpyh2d": "h2d", "memcpyd2h": "d2h", "memcpyd2d": "d2d", "memcpyp2p": "p2p"}
# memcpy_details' memory kinds on the host side (CUPTI_ACTIVITY_MEMORY_KIND_*, as TensorFlow names them)
HOST_MEMORY_KINDS = ("pageable", "pinned")

# Substrings (lower case) of event names that make an event one kind. NCCL's kernels are ncclDevKernel_* /
# ncclKernel_*; XLA's own all-reduce thunks and TensorFlow's collective ops carry "allreduce"/"all-reduce".
_COLLECTIVE_MARKS = ("nccl", "allreduce", "all-reduce", "all_reduce", "reducescatter", "reduce-scatter",
                     "allgather", "all-gather")
_H2D_MARKS = ("memcpyh2d", "htod")
_D2H_MARKS = ("memcpyd2h", "dtoh")
_D2D_MARKS = ("memcpy", "memset")


class TraceError(RuntimeError):
    """The profiler's output is missing or unreadable; the message says which file and why."""


def parse_memcpy_details(text: str) -> dict:
    """The fields of a `memcpy_details` stat, as strings ({} for an empty one).

    Example:
        >>> parse_memcpy_details("kind_src:pageable kind_dst:device size:19267584 dest:0 async:1")
        {'kind_src': 'pageable', 'kind_dst': 'device', 'size': '19267584', 'dest': '0', 'async': '1'}
    """
    fields = {}
    for part in (text or "").split():
        key, sep, value = part.partition(":")
        if sep:
            fields[key] = value
    return fields


def _copy_kind_from_details(details: dict) -> Optional[str]:
    src, dst = details.get("kind_src", ""), details.get("kind_dst", "")
    host_src, host_dst = src in HOST_MEMORY_KINDS, dst in HOST_MEMORY_KINDS
    if host_src and not host_dst and dst:
        return "h2d"
    if host_dst and not host_src and src:
        return "d2h"
    if src and dst and not host_src and not host_dst:
        return "d2d"
    return None


def classify(event_name: str, memcpy_details: Optional[str] = None) -> str:
    """The kind of a GPU event: "collective" (NCCL and all-reduce kernels), "p2p" (peer-to-peer copies), "h2d",
    "d2h", "d2d" (other copies, memsets) or "compute" (every other kernel). A copy event's kind is CUPTI's name for
    it (`MemcpyP2P`, ...) or, for `MemcpyOther`, its `memcpy_details` stat's memory kinds; other events go by name.

    Example:
        >>> classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL")
        'collective'
        >>> classify("MemcpyP2P", "kind_src:device kind_dst:device size:1048576 dest:1 async:1")
        'p2p'
    """
    low = event_name.lower()
    if low in _COPY_EVENT_KINDS:
        return _COPY_EVENT_KINDS[low]
    if memcpy_details:
        kind = _copy_kind_from_details(parse_memcpy_details(memcpy_details))
        if kind:
            return kind
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
class CopyTotal:
    """Copies of one kind from one host memory (or "unknown" where the trace has no memcpy_details): how many,
    their bytes (from the stat; 0 where unknown) and their summed duration (ps)."""

    count: int = 0
    bytes: int = 0
    duration_ps: int = 0
    intervals: list = dataclasses.field(default_factory=list)  # (start_ps, end_ps)


@dataclasses.dataclass
class WorkCost:
    """What one kind of work's kernels cost over the window, from their HLO instructions (`hlo_cost`): bytes read
    and written, FLOPs and the part of them done by dots, convolutions and fused attention (`dot_flops`; on float32
    or float64 operands: `float32_dot_flops`), the instruction executions counted, and the summed time (ps) of its
    kernels with no instruction known (`unattributed_ps`), of its fused-attention kernels (`fused_attention_ps`) and
    of the transposes of their results (`attention_layout_ps`, in `attention_layout_executions`)."""

    bytes: int = 0
    flops: float = 0.0
    dot_flops: float = 0.0
    float32_dot_flops: float = 0.0
    executions: int = 0
    unattributed_ps: int = 0
    fused_attention_ps: int = 0
    attention_layout_ps: int = 0
    attention_layout_executions: int = 0


@dataclasses.dataclass
class GpuActivity:
    """What one GPU plane of a trace holds: per kind, the (start_ps, end_ps) of every event, and the summed
    duration of each event name (for the busiest kernels). `h2d_memory`: the host-to-device copies by the host
    memory their memcpy_details names ("pageable", "pinned", "managed", ..., "unknown" without the stat);
    `copy_bytes`: the bytes the stat gives per copy kind; `work`: per kind of work (`work_kinds.WORK_KINDS`) the
    (start_ps, end_ps) of its events, and `work_cost` its HLO cost (`WorkCost`); `device_name`: the GPU's name as
    the plane's `gpu_device_name` stat gives it ("NVIDIA H200"; "" without it); `memory_bandwidth`: the plane's
    `memory_bandwidth` stat, bytes/s (the device's memory clock x bus width as CUDA reports them; 0 without it)."""

    plane: str
    intervals: dict[str, list[tuple[int, int]]]
    time_by_name: dict[str, int]
    h2d_memory: dict[str, CopyTotal] = dataclasses.field(default_factory=dict)
    copy_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    work: dict[str, list[tuple[int, int]]] = dataclasses.field(default_factory=dict)
    device_name: str = ""
    work_cost: dict[str, WorkCost] = dataclasses.field(default_factory=dict)
    memory_bandwidth: float = 0.0

    @property
    def events(self) -> int:
        return sum(len(v) for v in self.intervals.values())


TRACE_PATTERNS = ("*.xplane.pb", "*.xplane.pb.gz")


def newest_trace(folders: str) -> Optional[str]:
    """The newest `.xplane.pb` or `.xplane.pb.gz` in the folders the glob `folders` names ("**" for any depth), or
    None.

    Example:
        >>> newest_trace("/tmp/doctor/profile/plugins/profile/*")
        '/tmp/doctor/profile/plugins/profile/2026_12_07_15_29_01/vm.xplane.pb'
    """
    paths = [path for pattern in TRACE_PATTERNS
             for path in glob.glob(os.path.join(folders, pattern), recursive=True)]
    return max(paths, key=os.path.getmtime) if paths else None


def find_trace(logdir: str) -> str:
    """The newest `.xplane.pb` the profiler wrote under `logdir` (or a kept `.xplane.pb.gz`); TraceError naming
    `logdir` when there is none."""
    path = newest_trace(os.path.join(logdir, "plugins", "profile", "*"))
    if path is None:
        raise TraceError(f"the profiler wrote no .xplane.pb under {logdir}/plugins/profile")
    return path


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
    """The XSpace protobuf in the file at `path` (gzipped where `path` ends in .gz); TraceError when it is none."""
    from google.protobuf.message import DecodeError  # noqa: PLC0415

    from tf_nvlink.internals import tf_runtime  # noqa: PLC0415 - TensorFlow only when a trace is read

    space = tf_runtime.xplane_protobuf_module().XSpace()
    try:
        with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
            space.ParseFromString(f.read())
    except (OSError, ValueError, DecodeError) as exc:  # upb's DecodeError is no ValueError
        raise TraceError(f"cannot read the trace {path}: {exc}") from exc
    return space


# The stats of a kernel event that name its HLO instruction and its TensorFlow op (work_kinds.KernelEvent's fields)
_KERNEL_STATS = {"hlo_op": "hlo_op", "name": "tf_op_name", "program_id": "program_id", "hlo_module": "module_name",
                 "cuda_graph_id": "graph_id", "cuda_graph_node_id": "graph_node"}


def gpu_activity(space) -> dict[str, GpuActivity]:
    """{plane name: GpuActivity} for every `/device:GPU:N` plane with events on its `Stream` lines, by GPU number."""
    found = {}
    index = None
    for plane in space.planes:
        if not plane.name.startswith("/device:GPU:"):
            continue
        if index is None:
            index = work_kinds.HloIndex.from_space(space)
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        details_ids = {key for key, meta in plane.stat_metadata.items() if meta.name == "memcpy_details"}
        kernel_stat_ids = {key: _KERNEL_STATS[meta.name] for key, meta in plane.stat_metadata.items()
                           if meta.name in _KERNEL_STATS}
        intervals: dict[str, list[tuple[int, int]]] = {kind: [] for kind in KINDS}
        work: dict[str, list[tuple[int, int]]] = {kind: [] for kind in work_kinds.WORK_KINDS}
        time_by_name: dict[str, int] = {}
        h2d_memory: dict[str, CopyTotal] = {}
        copy_bytes: dict[str, int] = {}
        work_cost: dict[str, WorkCost] = {}
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # "XLA Ops", "XLA Modules", "Launch Stats": annotations over the same kernels
            base_ps = line.timestamp_ns * 1000
            events = sorted(line.events, key=lambda e: e.offset_ps)
            kernels = []
            for event in events:
                name = names.get(event.metadata_id, "")
                start = base_ps + event.offset_ps
                details = _stat_text(plane, event, details_ids) if details_ids else None
                kind = classify(name, details)
                kernels.append(work_kinds.KernelEvent(name, kind, **_kernel_stats(plane, event, kernel_stat_ids)))
                interval = (start, start + event.duration_ps)
                intervals[kind].append(interval)
                time_by_name[name] = time_by_name.get(name, 0) + event.duration_ps
                if details is not None or kind in ("h2d", "d2h", "p2p"):
                    fields = parse_memcpy_details(details or "")
                    size = int(fields["size"]) if fields.get("size", "").isdigit() else 0
                    copy_bytes[kind] = copy_bytes.get(kind, 0) + size
                    if kind == "h2d":
                        total = h2d_memory.setdefault(fields.get("kind_src") or "unknown", CopyTotal())
                        total.count += 1
                        total.bytes += size
                        total.duration_ps += event.duration_ps
                        total.intervals.append(interval)
            previous = None
            for event, kernel, (work_kind, op) in zip(events, kernels,
                                                      work_kinds.resolve_stream(index, kernels)):
                start = base_ps + event.offset_ps
                work[work_kind].append((start, start + event.duration_ps))
                if kernel.trace_kind == "compute":
                    _add_cost(work_cost.setdefault(work_kind, WorkCost()), kernel, op, previous, event.duration_ps)
                    previous = op
        activity = GpuActivity(plane.name, intervals, time_by_name, h2d_memory, copy_bytes, work,
                               str(_plane_stat(plane, "gpu_device_name") or ""), work_cost,
                               float(_plane_stat(plane, "memory_bandwidth") or 0))
        if activity.events:
            found[plane.name] = activity
    return dict(sorted(found.items(), key=lambda item: _plane_number(item[0])))


def _add_cost(total: WorkCost, kernel, op, previous, duration_ps: int) -> None:
    """Adds one compute kernel to its kind's WorkCost: its instruction's cost once per execution (the kernels an
    instruction launches one after the other, a cuDNN convolution's padding kernels and the convolution, count
    once), or its time to the unattributed time without an instruction."""
    if work_kinds.is_fused_attention(kernel.name, op):
        total.fused_attention_ps += duration_ps
    if op is not None and op.attention_layout:
        total.attention_layout_ps += duration_ps
        total.attention_layout_executions += op is not previous
    if op is None:
        total.unattributed_ps += duration_ps
    elif op is not previous:
        total.bytes += op.cost.bytes
        total.flops += op.cost.flops
        total.dot_flops += op.cost.dot_flops
        total.float32_dot_flops += op.cost.float32_dot_flops
        total.executions += 1


def _stat_text(plane, event, stat_ids) -> Optional[str]:
    """The text of the event's stat whose metadata id is in `stat_ids` (a string, or a reference to a stat
    metadata name, as XPlane stores repeated strings); None when the event has none."""
    for stat in event.stats:
        if stat.metadata_id in stat_ids:
            if stat.HasField("str_value"):
                return stat.str_value
            if stat.HasField("ref_value") and stat.ref_value in plane.stat_metadata:
                return plane.stat_metadata[stat.ref_value].name
    return None


def _kernel_stats(plane, event, stat_ids: dict) -> dict:
    """The KernelEvent fields an event's stats give (`_KERNEL_STATS`), strings and program ids as they are stored."""
    found = {}
    for stat in event.stats:
        field = stat_ids.get(stat.metadata_id)
        if field is None:
            continue
        which = stat.WhichOneof("value")
        if which == "ref_value":
            meta = plane.stat_metadata.get(stat.ref_value)
            found[field] = meta.name if meta is not None else None
        elif which is not None:
            found[field] = getattr(stat, which)
    for field in ("program_id", "graph_id", "graph_node"):
        if found.get(field) is not None:
            found[field] = int(found[field])
    return found


def _plane_stat(plane, name: str):
    """The value of the plane's own stat `name` (e.g. `gpu_device_name`), or None."""
    ids = {key for key, meta in plane.stat_metadata.items() if meta.name == name}
    for stat in plane.stats:
        if stat.metadata_id in ids:
            which = stat.WhichOneof("value")
            if which == "ref_value":
                return plane.stat_metadata[stat.ref_value].name if stat.ref_value in plane.stat_metadata else None
            return getattr(stat, which) if which else None
    return None


def _plane_number(name: str) -> int:
    tail = name.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def host_plane_names(space) -> list[str]:
    """Names of the planes in the trace (for the one line saying why no GPU was found)."""
    return [plane.name for plane in space.planes]


def read_gpu_activity(path: str) -> dict[str, GpuActivity]:
    """`gpu_activity` of the trace file at `path`."""
    return gpu_activity(load_space(path))

