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
import itertools
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

    @property
    def on_cpu(self) -> bool:
        return not self.gpus

    def summary(self) -> str:
        """One line for the log and the report."""
        if self.gpus:
            where = f"GPUs {list(self.gpus)} ({self.shape}"
        elif any("GPU" in d.upper() for d in self.devices):  # MIG instances, or GPUs NVML does not list
            where = f"TensorFlow devices {list(self.devices)} (no NVML GPU index names them"
        else:
            where = "CPU (no GPU"
        if self.nvlink_gbps:
            where += f", {self.nvlink_gbps:.0f} GB/s per direction over NVLink"
        packs = f", num_packs={self.num_packs}" if self.num_packs is not None else ""
        xla = "; XLA models all-reduce inside XLA" if self.xla_allreduce == "fused" else ""
        return (f"tf_nvlink plan: {where}) -> {self.cross_device_ops}{packs}{xla}: {self.reason} "
                f"[topology {self.fingerprint}]")

    def to_dict(self) -> dict:
        record = dataclasses.asdict(self)
        record["gpus"] = list(self.gpus)
        record["devices"] = list(self.devices)
        record["requested"] = [list(v) if isinstance(v, tuple) else v for v in self.requested]
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
        if index < 0:
            raise ValueError(f"gpus entries should be non-negative GPU indices (nvidia-smi numbering) among "
                             f"{list(valid)}, or 'all' / 'auto'. Received: {item!r} in gpus={spec!r}")
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
              xla_allreduce: str = "auto", no_gpu_reason: Optional[str] = None) -> Plan:
    """Choose GPUs and cross-device ops for `topology`.

    Raises ValueError for requests that cannot work (unknown GPUs or ops, NCCL without GPUs, hierarchical copy
    on an odd number of GPUs, which silently drops the last replica's gradient, GPU indices when no GPU is
    usable: only "all" and "auto" fall back to the CPU). `no_gpu_reason` says why no GPU is usable, for that
    message (the caller knows, e.g. "TensorFlow is built without CUDA").
    """
    validate_ops(cross_device_ops, num_packs)
    requested = (tuple(gpus) if isinstance(gpus, (list, tuple)) else gpus, cross_device_ops, num_packs)
    if not topology.gpus or (visible is not None and not visible):
        # No GPU to use: "all", "auto" and indices all mean the CPU (the strategy warns why), but a malformed
        # request is an error here too, not something that only fails on the GPU machine.
        if not (isinstance(gpus, str) and gpus.strip().lower() in ("all", "auto")):
            gpu_indices(gpus)
            why = no_gpu_reason or topology.error or (
                "CUDA_VISIBLE_DEVICES hides every GPU" if topology.gpus else "NVML lists no GPU")
            raise ValueError(f"gpus={gpus!r} names GPUs, but this process can use none ({why}). Make them "
                             f"visible, or pass gpus='all' or 'auto', which fall back to the CPU with a warning.")
        chosen: tuple[int, ...] = ()
    else:
        chosen = parse_gpus(gpus, topology, visible)
    shape = topology.kind(chosen)
    gbps = topology.min_pair_gbps(chosen) if len(chosen) > 1 else 0.0
    # "autotune" plans like "auto"; the strategy then swaps in the measured winner (it needs TensorFlow).
    rule_request = "auto" if cross_device_ops == "autotune" else cross_device_ops
    ops, packs, reason = _choose_ops(topology, chosen, shape, rule_request, num_packs)
    chosen = replica_order(topology, chosen, ops)
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
    """8 GPUs wired as the DGX-1 hybrid cube-mesh HierarchicalCopyAllReduce was written for (see `cube_mesh_order`).

    Example:
        >>> is_dgx1_like(topo_of("dgx1_v100_x8"), range(8))
        True
    """
    return cube_mesh_order(topology, chosen) is not None


def replica_order(topology: Topology, gpus: Sequence[int], cross_device_ops: str) -> tuple[int, ...]:
    """`gpus` in the order the strategy should mirror them for `cross_device_ops`: HierarchicalCopyAllReduce's
    halves are positions 0-3 and 4-7, so on a cube-mesh they are made the NVLink quads; other ops keep the order.

    Example:
        >>> replica_order(topo_of("dgx1_v100_x8"), (0, 4, 1, 5, 2, 6, 3, 7), "hierarchical")
        (0, 1, 2, 3, 4, 5, 6, 7)
    """
    gpus = tuple(gpus)
    if cross_device_ops != "hierarchical":
        return gpus
    return cube_mesh_order(topology, gpus) or gpus


def cube_mesh_order(topology: Topology, chosen: Sequence[int]) -> Optional[tuple[int, ...]]:
    """`chosen` ordered for HierarchicalCopyAllReduce, or None when the GPUs are not a DGX-1 hybrid cube-mesh.

    HierarchicalCopyAllReduce splits the replicas by position: the first half reduces among itself, the second
    half too, and position k copies to position k + 4. That is fast only when each half is an NVLink quad (4 GPUs
    all directly linked) and positions k and k + 4 are directly linked. So: 8 GPUs, two disjoint quads, every GPU
    with exactly one direct link across. A mesh where each GPU merely has 4 peers (no quads) is not one.

    Example:
        >>> cube_mesh_order(topo_of("dgx1_v100_x8"), [0, 4, 1, 5, 2, 6, 3, 7])
        (0, 1, 2, 3, 4, 5, 6, 7)
    """
    gpus = tuple(chosen)
    if len(gpus) != 8 or len(set(gpus)) != 8:
        return None

    def linked(a: int, b: int) -> bool:
        return topology.pair(a, b).direct_links > 0

    for quad in itertools.combinations(sorted(gpus), 4):
        if quad[0] != min(gpus):
            break  # the quad holding the lowest GPU decides; the other one is its complement
        other = tuple(g for g in sorted(gpus) if g not in quad)
        if not all(linked(a, b) for half in (quad, other) for a, b in itertools.combinations(half, 2)):
            continue
        partners = [[b for b in other if linked(a, b)] for a in quad]
        if all(len(p) == 1 for p in partners) and len({p[0] for p in partners}) == 4:
            return quad + tuple(p[0] for p in partners)
    return None


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
    quads_first = cube_mesh_order(topology, chosen) if shape == "nvlink-partial" else None
    if quads_first is not None:
        return ("hierarchical", packs, f"8 GPUs in a DGX-1 hybrid cube-mesh: HierarchicalCopyAllReduce was built "
                f"for exactly this shape (reduce within each NVLink quad, {list(quads_first[:4])} and "
                f"{list(quads_first[4:])}, then across their direct links; replicas ordered so)")
    if shape == "nvlink-partial":
        return ("nccl", packs, "some GPU pairs lack NVLink: NCCL routes rings over NVLink where it can and "
                "PCIe/host memory elsewhere; hierarchical copy assumes the DGX-1 wiring and is not used")
    return ("nccl", packs, "PCIe only (no NVLink between these GPUs): NCCL's ring all-reduce is bandwidth-"
            "optimal over PCIe; reduce-to-one would funnel every gradient through one GPU's PCIe link")
