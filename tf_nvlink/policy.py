"""Topology and requested GPUs in, a `Plan` (devices, cross-device ops, packs, reason) out. Pure: no TensorFlow.

The rules are grounded in measurements recorded in BUILD_NOTES.md ("Policy rules and the figures behind them").

Example:
    >>> from tf_nvlink import nvml, policy
    >>> p = policy.make_plan(nvml.probe(), gpus="all", cross_device_ops="auto")
    >>> p.summary()
    'tf_nvlink plan: GPUs [0, 1] (nvswitch, 478 GB/s per direction) -> nccl, num_packs=1: ...'
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence, Union

from tf_nvlink.topology import Topology

# The cross-device ops a user can name, mapped to what TensorFlow calls them.
OPS = {
    "nccl": "tf.distribute.NcclAllReduce",
    "hierarchical": "tf.distribute.HierarchicalCopyAllReduce",
    "reduce_to_one": "tf.distribute.ReductionToOneDevice",
    "collective": "CollectiveAllReduce (TensorFlow's MirroredStrategy default, NCCL inside)",
}
# "autotune": measure the candidates on the chosen GPUs once and reuse the stored winner (tf_nvlink/tune.py).
OPS_CHOICES = ("auto", "autotune") + tuple(OPS)
# Ops that pack gradients into `num_packs` buffers (tf.distribute.AllReduceCrossDeviceOps).
PACKED_OPS = ("nccl", "hierarchical")
# How a jit_compile=True model all-reduces its gradients (see tf_nvlink/xla.py).
XLA_ALLREDUCE_CHOICES = ("auto", "fused", "split")
GpuSpec = Union[str, Sequence[int], int]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `tf_nvlink.strategy()` builds, and why.

    `gpus` are NVML (nvidia-smi) indices; `devices` the TensorFlow device names the strategy mirrors over
    (filled in by the strategy, which maps GPUs to TensorFlow devices by PCI bus id).
    """

    gpus: tuple[int, ...]
    cross_device_ops: str  # a key of OPS
    num_packs: Optional[int]
    reason: str
    fingerprint: str
    shape: str  # Topology.kind(): none, single, nvswitch, nvlink-all, nvlink-partial, pcie
    nvlink_gbps: float  # slowest pair's NVLink GB/s per direction (0 without NVLink)
    devices: tuple[str, ...] = ()
    xla_allreduce: str = "split"  # for jit_compile=True models: "fused" into XLA (GPUs) or "split" (see xla.py)
    requested: tuple = ()  # (gpus, cross_device_ops, num_packs) as the user asked, for "same request?" checks
    # Knobs for the step (see `choose_knobs`): XLA flags tf_nvlink adds to XLA_FLAGS, the user's own XLA_FLAGS
    # entries that won over a planned flag of the same name, the dtype gradients are all-reduced in, and the
    # per-replica prefetch depth `experimental_distribute_dataset` uses (0: TensorFlow's default options).
    xla_flags: tuple[str, ...] = ()
    xla_flags_kept: tuple[str, ...] = ()
    allreduce_dtype: str = "float32"
    input_buffer: int = 0

    @property
    def on_cpu(self) -> bool:
        return not self.gpus

    def summary(self) -> str:
        """One line for the log and the report."""
        where = f"GPUs {list(self.gpus)} ({self.shape}" if self.gpus else "CPU (no GPU"
        if self.nvlink_gbps:
            where += f", {self.nvlink_gbps:.0f} GB/s per direction over NVLink"
        packs = f", num_packs={self.num_packs}" if self.num_packs is not None else ""
        xla = "; XLA models all-reduce inside XLA" if self.xla_allreduce == "fused" else ""
        return (f"tf_nvlink plan: {where}) -> {self.cross_device_ops}{packs}{xla}{self.knobs_summary()}: "
                f"{self.reason} [topology {self.fingerprint}]")

    def knobs_summary(self) -> str:
        """The step knobs that differ from TensorFlow's defaults, as "; ..." clauses (empty when none)."""
        parts = []
        if self.xla_flags:
            parts.append("XLA_FLAGS += " + " ".join(self.xla_flags))
        if self.xla_flags_kept:
            parts.append("user's XLA_FLAGS kept: " + " ".join(self.xla_flags_kept))
        if self.allreduce_dtype != "float32":
            parts.append(f"gradients all-reduced in {self.allreduce_dtype}")
        if self.input_buffer:
            parts.append(f"input prefetched to each replica's device, {self.input_buffer} batches deep")
        return "".join("; " + p for p in parts)

    def to_dict(self) -> dict:
        record = dataclasses.asdict(self)
        record["gpus"] = list(self.gpus)
        record["devices"] = list(self.devices)
        record["requested"] = [list(v) if isinstance(v, tuple) else v for v in self.requested]
        record["xla_flags"] = list(self.xla_flags)
        record["xla_flags_kept"] = list(self.xla_flags_kept)
        record["tensorflow_class"] = OPS.get(self.cross_device_ops)
        return record


def parse_gpus(spec: GpuSpec, topology: Topology, visible: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Resolve a `gpus` request to NVML indices.

    `spec` is "all" (every GPU TensorFlow can see), "auto" (the largest NVLink-connected group), a list of
    indices, or a string such as "0,1" (absl-flag friendly). `visible` are the NVML indices TensorFlow can see
    (default: all of them).

    Example:
        >>> parse_gpus("1,0", topo)
        (1, 0)
    """
    visible = tuple(topology.indices if visible is None else visible)
    if isinstance(spec, str) and spec.strip().lower() in ("all", "auto"):
        return visible if spec.strip().lower() == "all" else auto_gpus(topology, visible)
    indices = gpu_indices(spec, visible)
    for index in indices:
        if index not in visible:
            hidden = " (hidden from TensorFlow by CUDA_VISIBLE_DEVICES)" if index in topology.indices else ""
            raise ValueError(f"GPU {index} does not exist on this machine{hidden}; valid GPU indices are "
                             f"{list(visible)}. Received: gpus={spec!r}")
    return indices


def gpu_indices(spec: GpuSpec, valid: Sequence[int] = ()) -> tuple[int, ...]:
    """The indices a `gpus` request names, checked for form only (not whether the GPUs exist): non-negative
    integers, each once, at least one. ValueError names the bad value and `valid` (the machine's indices).
    "all" and "auto" name no index: they are the caller's to resolve.
    """
    if isinstance(spec, str):
        text = spec.strip().lower()
        if not text:
            raise ValueError(f"gpus should be 'all', 'auto', or GPU indices such as '0,1'. Received: gpus={spec!r}")
        items: list = [item.strip() for item in text.split(",")]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        items = [spec]
    elif isinstance(spec, (list, tuple)):
        items = list(spec)
    else:
        raise ValueError(f"gpus should be 'all', 'auto', a list of GPU indices or a string such as '0,1'. "
                         f"Received: gpus={spec!r}")
    if not items:
        raise ValueError(f"gpus should name at least one GPU; this machine has {list(valid)}. "
                         f"Received: gpus={spec!r}")
    indices: list[int] = []
    for item in items:
        if isinstance(item, bool) or not (isinstance(item, int) or (isinstance(item, str)
                                                                   and re.fullmatch(r"\d+", item))):
            raise ValueError(f"gpus entries should be non-negative GPU indices (nvidia-smi numbering) among "
                             f"{list(valid)}, or 'all' / 'auto'. Received: {item!r} in gpus={spec!r}")
        index = int(item)
        if index in indices:
            raise ValueError(f"gpus names GPU {index} twice; each GPU can hold one replica. Name each of "
                             f"{list(valid)} at most once. Received: gpus={spec!r}")
        indices.append(index)
    return tuple(indices)


def auto_gpus(topology: Topology, visible: Sequence[int]) -> tuple[int, ...]:
    """The largest NVLink-connected group of visible GPUs; ties go to the faster links, then more free memory."""
    visible_set = set(visible)
    groups = [tuple(i for i in group if i in visible_set) for group in topology.nvlink_groups()]
    groups = [g for g in groups if g]
    if not groups:
        return ()

    def rank(group):
        free = sum(topology.gpu(i).memory_free_mib or 0 for i in group)
        return (-len(group), -topology.min_pair_gbps(group), -free, group)

    return min(groups, key=rank)


def validate_ops(cross_device_ops: str, num_packs) -> None:
    """Check the user's ops name and num_packs, with a message naming the bad value and the valid choices."""
    if cross_device_ops not in OPS_CHOICES:
        raise ValueError(f"cross_device_ops should be one of {list(OPS_CHOICES)} or a "
                         f"tf.distribute.CrossDeviceOps instance. Received: cross_device_ops={cross_device_ops!r}")
    if num_packs is not None:
        if isinstance(num_packs, bool) or not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(f"num_packs should be a non-negative integer (0 = no packing) or None for the "
                             f"policy's choice. Received: num_packs={num_packs!r}")
        if cross_device_ops not in PACKED_OPS + ("auto", "autotune"):
            raise ValueError(f"num_packs applies to cross_device_ops in {list(PACKED_OPS)}, not "
                             f"{cross_device_ops!r}. Received: num_packs={num_packs!r}")


def make_plan(topology: Topology, gpus: GpuSpec = "all", cross_device_ops: str = "auto",
              num_packs: Optional[int] = None, visible: Optional[Sequence[int]] = None,
              xla_allreduce: str = "auto") -> Plan:
    """Choose GPUs and cross-device ops for `topology`.

    Raises ValueError for requests that cannot work (unknown GPUs or ops, NCCL without GPUs, hierarchical copy
    on an odd number of GPUs, which silently drops the last replica's gradient).
    """
    validate_ops(cross_device_ops, num_packs)
    requested = (tuple(gpus) if isinstance(gpus, (list, tuple)) else gpus, cross_device_ops, num_packs)
    if not topology.gpus or (visible is not None and not visible):
        # No GPU to use: "all", "auto" and indices all mean the CPU (the strategy warns why), but a malformed
        # request is an error here too, not something that only fails on the GPU machine.
        if not (isinstance(gpus, str) and gpus.strip().lower() in ("all", "auto")):
            gpu_indices(gpus)
        chosen: tuple[int, ...] = ()
    else:
        chosen = parse_gpus(gpus, topology, visible)
    shape = topology.kind(chosen)
    gbps = topology.min_pair_gbps(chosen) if len(chosen) > 1 else 0.0
    # "autotune" plans like "auto"; the strategy then swaps in the measured winner (it needs TensorFlow).
    rule_request = "auto" if cross_device_ops == "autotune" else cross_device_ops
    ops, packs, reason = _choose_ops(topology, chosen, shape, rule_request, num_packs)
    available = topology.indices if visible is None else tuple(visible)
    if isinstance(gpus, str) and gpus.strip().lower() == "auto" and 0 < len(chosen) < len(available):
        reason += (f"; gpus='auto' took the largest NVLink-connected group {list(chosen)} of {list(available)} "
                   f"(gpus='all' mirrors over every GPU, over PCIe where NVLink is missing)")
    if xla_allreduce not in XLA_ALLREDUCE_CHOICES:
        raise ValueError(f"xla_allreduce should be one of {list(XLA_ALLREDUCE_CHOICES)}. "
                         f"Received: xla_allreduce={xla_allreduce!r}")
    if xla_allreduce == "fused" and not chosen:
        raise ValueError("xla_allreduce='fused' needs GPUs (TensorFlow all-reduces inside XLA only when every "
                         "replica is a GPU); this process sees none. Use 'auto' or 'split'.")
    if xla_allreduce == "auto":
        xla_allreduce = "fused" if len(chosen) > 1 else "split"
    return Plan(gpus=chosen, cross_device_ops=ops, num_packs=packs, reason=reason,
                fingerprint=topology.fingerprint(), shape=shape, nvlink_gbps=round(gbps, 1), requested=requested,
                xla_allreduce=xla_allreduce)


def is_dgx1_like(topology: Topology, chosen: Sequence[int]) -> bool:
    """8 GPUs with direct NVLink where each reaches exactly 4 others: the hybrid cube-mesh
    HierarchicalCopyAllReduce was written for."""
    if len(chosen) != 8:
        return False
    for a in chosen:
        peers = [b for b in chosen if b != a and topology.pair(a, b).direct_links > 0]
        if len(peers) != 4:
            return False
    return True


def _choose_ops(topology: Topology, chosen: tuple[int, ...], shape: str, requested: str,
                num_packs: Optional[int]) -> tuple[str, Optional[int], str]:
    n = len(chosen)
    if requested != "auto":
        if requested == "nccl" and n == 0:
            raise ValueError("cross_device_ops='nccl' needs GPUs, and this process sees none; NCCL does not run "
                             "on CPU devices. Use 'auto', 'reduce_to_one' or 'collective'.")
        if requested == "hierarchical" and n % 2 == 1 and n > 1:
            raise ValueError(f"cross_device_ops='hierarchical' with {n} GPUs would silently drop the last "
                             f"replica's gradient (HierarchicalCopyAllReduce needs an even number of GPUs). Use "
                             f"'auto', 'nccl', 'collective' or 'reduce_to_one', or an even number of GPUs.")
        packs = num_packs if num_packs is not None else (1 if requested in PACKED_OPS else None)
        return requested, packs, "requested by the caller"
    if n == 0:
        return ("reduce_to_one", None, "no GPU visible: mirrored over the CPU, gradients reduced on one device "
                "(NCCL does not run on CPU devices)")
    if n == 1:
        return "reduce_to_one", None, "one GPU: no all-reduce happens, nothing to choose"
    packs = 1 if num_packs is None else num_packs
    if shape in ("nvswitch", "nvlink-all"):
        link = "through NVSwitch" if shape == "nvswitch" else "by direct NVLink"
        return ("nccl", packs,
                f"all {n} GPUs reach each other {link}: NCCL all-reduce of the gradients packed into {packs} "
                f"buffer(s), one launch per step instead of one per tensor (2x H200: 176 vs 142 GB/s for "
                f"TensorFlow's default at 256 MiB, ResNet-50 5332 vs 5005 img/s; BUILD_NOTES.md)")
    if shape == "nvlink-partial" and is_dgx1_like(topology, chosen):
        return ("hierarchical", packs, "8 GPUs in a DGX-1 hybrid cube-mesh: HierarchicalCopyAllReduce was built "
                "for exactly this shape (reduce within each NVLink quad, then across)")
    if shape == "nvlink-partial":
        return ("nccl", packs, "some GPU pairs lack NVLink: NCCL routes rings over NVLink where it can and "
                "PCIe/host memory elsewhere; hierarchical copy assumes the DGX-1 wiring and is not used")
    return ("nccl", packs, "PCIe only (no NVLink between these GPUs): NCCL's ring all-reduce is bandwidth-"
            "optimal over PCIe; reduce-to-one would funnel every gradient through one GPU's PCIe link")


# --- Step knobs: XLA flags, gradient all-reduce dtype, input prefetch depth -------------------------------------

# XLA flags tf_nvlink may set. XLA aborts the process on a flag name it does not know, so only names checked in
# TensorFlow 2.21's XLA (its .so) are accepted.
KNOWN_XLA_FLAGS = ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_all_reduce_combine_threshold_bytes",
                   "xla_gpu_enable_pipelined_all_reduce", "xla_gpu_enable_highest_priority_async_stream")
# Fused multi-GPU XLA: the scheduler overlaps the in-XLA NCCL all-reduce with the backward pass (ResNet-50,
# 2x H200, host-fed fit: 5518/5453 vs 5181/5182 img/s, +3-6%; training_bench auto 6535 vs 6360).
FUSED_MULTI_GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
XLA_FLAGS_CHOICES = ("auto", "none")
ALLREDUCE_DTYPES = ("float32", "bfloat16")
# Batches prefetched to each GPU by `experimental_distribute_dataset` (TensorFlow's default is 1): 2 lets the
# host split and the host-to-device copy of the next batch overlap the step.
GPU_INPUT_BUFFER = 2


def xla_flag_name(flag: str) -> str:
    """"--xla_gpu_x=true" -> "xla_gpu_x"."""
    return flag.strip().lstrip("-").split("=", 1)[0]


def validate_xla_flags(xla_flags) -> tuple[str, ...]:
    """"auto", "none", or a sequence of "--name=value" flags whose names are in KNOWN_XLA_FLAGS. Returns the
    explicit flags (empty for "auto"/"none"). ValueError names the bad value and the valid choices."""
    if isinstance(xla_flags, str):
        if xla_flags in XLA_FLAGS_CHOICES:
            return ()
        raise ValueError(f"xla_flags should be one of {list(XLA_FLAGS_CHOICES)} or a list of '--name=value' flags "
                         f"named in {list(KNOWN_XLA_FLAGS)}. Received: xla_flags={xla_flags!r}")
    if not isinstance(xla_flags, (list, tuple)):
        raise ValueError(f"xla_flags should be one of {list(XLA_FLAGS_CHOICES)} or a list of '--name=value' flags. "
                         f"Received: xla_flags={xla_flags!r}")
    for flag in xla_flags:
        if not isinstance(flag, str) or not re.fullmatch(r"--\w+=\S+", flag.strip()) \
                or xla_flag_name(flag) not in KNOWN_XLA_FLAGS:
            raise ValueError(f"xla_flags entries should be '--name=value' with a name in {list(KNOWN_XLA_FLAGS)} "
                             f"(XLA aborts on names it does not know). Received: {flag!r} in xla_flags={xla_flags!r}")
    return tuple(flag.strip() for flag in xla_flags)


def choose_xla_flags(n_gpus: int, xla_allreduce: str, request="auto") -> tuple[str, ...]:
    """The XLA flags a plan wants: the latency-hiding scheduler when 2+ GPUs all-reduce inside XLA ("fused");
    nothing for 1 GPU, CPUs or split mode (no collective inside XLA to overlap); the caller's own list as given.

    Example:
        >>> choose_xla_flags(2, "fused")
        ('--xla_gpu_enable_latency_hiding_scheduler=true',)
    """
    explicit = validate_xla_flags(request)
    if not isinstance(request, str):
        return explicit
    if request == "none" or n_gpus < 2 or xla_allreduce != "fused":
        return ()
    return FUSED_MULTI_GPU_XLA_FLAGS


def merge_xla_flags(user_xla_flags: str, planned: Sequence[str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Merge planned flags into the user's XLA_FLAGS value: the user's setting of a flag wins.

    Returns (new XLA_FLAGS value, the planned flags added, the user's entries kept instead of a planned flag).

    Example:
        >>> lhs = "--xla_gpu_enable_latency_hiding_scheduler"
        >>> merge_xla_flags("--xla_dump_to=/tmp/x " + lhs + "=false", (lhs + "=true",))
        ('--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=false', (), ('--xla_gpu_...=false',))
    """
    user_entries = (user_xla_flags or "").split()
    user_by_name = {xla_flag_name(entry): entry for entry in user_entries if entry.startswith("-")}
    added = tuple(flag for flag in planned if xla_flag_name(flag) not in user_by_name)
    kept = tuple(user_by_name[xla_flag_name(flag)] for flag in planned if xla_flag_name(flag) in user_by_name)
    return " ".join(user_entries + list(added)), added, kept


def choose_input_buffer(n_gpus: int, request: Optional[int] = None) -> int:
    """Batches `experimental_distribute_dataset` prefetches to each replica's device: GPU_INPUT_BUFFER on GPUs,
    0 (TensorFlow's own options) on CPUs, or the caller's positive integer."""
    if request is not None:
        if isinstance(request, bool) or not isinstance(request, int) or request < 1:
            raise ValueError(f"input_buffer should be a positive integer (batches prefetched to each replica's "
                             f"device) or None for the policy's choice. Received: input_buffer={request!r}")
        return request
    return GPU_INPUT_BUFFER if n_gpus else 0


def validate_allreduce_dtype(allreduce_dtype: str) -> str:
    if allreduce_dtype not in ALLREDUCE_DTYPES:
        raise ValueError(f"allreduce_dtype should be one of {list(ALLREDUCE_DTYPES)}. "
                         f"Received: allreduce_dtype={allreduce_dtype!r}")
    return allreduce_dtype


def choose_knobs(plan: Plan, user_xla_flags: str = "", xla_flags="auto", allreduce_dtype: str = "float32",
                 input_buffer: Optional[int] = None) -> Plan:
    """`plan` with its step knobs chosen: XLA flags (merged under the user's `XLA_FLAGS` value, which wins),
    the gradient all-reduce dtype (float32 unless asked: bfloat16 halves the bytes but sums in 8 bits of
    mantissa), and the input prefetch depth per replica.

    Example:
        >>> choose_knobs(plan, user_xla_flags="").xla_flags     # a 2-GPU fused plan
        ('--xla_gpu_enable_latency_hiding_scheduler=true',)
    """
    validate_allreduce_dtype(allreduce_dtype)  # with one replica nothing is all-reduced: recorded, harmless
    planned = choose_xla_flags(len(plan.gpus), plan.xla_allreduce, xla_flags)
    _, added, kept = merge_xla_flags(user_xla_flags, planned)
    return dataclasses.replace(plan, xla_flags=added, xla_flags_kept=kept, allreduce_dtype=allreduce_dtype,
                               input_buffer=choose_input_buffer(len(plan.gpus), input_buffer))
