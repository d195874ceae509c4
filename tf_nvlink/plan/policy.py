"""Topology and requested GPUs in, a `Plan` (devices, cross-device ops, packs, reason) out. Pure: no TensorFlow.

The rules are grounded in the measurements of docs/results.md ("What the policy chooses, and the evidence").
Two pure parts live beside it and are re-exported here: `gpu_request` (a `gpus` request resolved to NVML indices)
and `cube_mesh` (the DGX-1 wiring HierarchicalCopyAllReduce needs, and the replica order for it).

Example:
    >>> from tf_nvlink.machine import nvml; from tf_nvlink.plan import policy
    >>> p = policy.make_plan(nvml.probe(), gpus="all", cross_device_ops="auto")
    >>> p.summary()
    'tf_nvlink plan: GPUs [0, 1] (nvswitch, 478 GB/s per direction) -> nccl, num_packs=1: ...'
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from tf_nvlink.machine import tf_devices as devices_lib
from tf_nvlink.plan import step_options
from tf_nvlink.machine import nvml
from tf_nvlink.plan.cube_mesh import cube_mesh_order, replica_order
from tf_nvlink.plan.gpu_request import GpuSpec, gpu_indices, parse_gpus
from tf_nvlink.machine.topology import Topology

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
# How a jit_compile=True model all-reduces its gradients (see tf_nvlink.training.install).
XLA_ALLREDUCE_CHOICES = ("auto", "fused", "split")


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
    shape: str  # Topology.shape(): none, single, nvswitch, nvlink-all, nvlink-partial, pcie
    nvlink_gbps: float  # slowest pair's NVLink GB/s per direction (0 without NVLink)
    devices: tuple[str, ...] = ()
    xla_allreduce: str = "split"  # for jit_compile=True models: "fused" into XLA (GPUs) or "split" (see tf_nvlink.training.install)
    requested: tuple = ()  # (gpus, cross_device_ops, num_packs) as the user asked, for "same request?" checks
    xla_flags: tuple[str, ...] = ()  # step options (tf_nvlink/step_options.py): flags tf_nvlink adds to XLA_FLAGS,
    xla_flags_kept: tuple[str, ...] = ()  # the user's XLA_FLAGS entries that won over a planned flag,
    allreduce_dtype: str = "float32"  # the dtype gradients are all-reduced in,
    input_buffer: int = 0  # batches prefetched to each replica's device (0: TensorFlow's default options),
    compiled_execution: bool = True  # and whether steps_per_execution=N may run as one XLA program per replica

    @property
    def on_cpu(self) -> bool:
        return not self.gpus

    def summary(self) -> str:
        """One line for the log and the report."""
        if not self.gpus and any("GPU" in d.upper() for d in self.devices):  # MIG, or GPUs NVML does not list
            where = f"TensorFlow devices {list(self.devices)} (no NVML GPU index names them)"
        else:
            where = gpus_text(self.gpus, self.shape, self.nvlink_gbps)
        packs = f", num_packs={self.num_packs}" if self.num_packs is not None else ""
        xla = "; XLA models all-reduce inside XLA" if self.xla_allreduce == "fused" else ""
        return (f"tf_nvlink plan: {where} -> {self.cross_device_ops}{packs}{xla}{self.step_options_summary()}: "
                f"{self.reason} [topology {self.fingerprint}]")

    def step_options_summary(self) -> str:  # the step options that differ from TensorFlow's defaults, as "; ..." clauses
        return step_options.summary_clauses(self)

    def to_dict(self) -> dict:
        record = dataclasses.asdict(self)
        record.update({key: list(getattr(self, key)) for key in ("gpus", "devices", "xla_flags", "xla_flags_kept")})
        record["requested"] = [list(v) if isinstance(v, tuple) else v for v in self.requested]
        record["tensorflow_class"] = OPS.get(self.cross_device_ops)
        return record


def nvlink_text(gbps: float) -> str:
    """", 478 GB/s per direction over NVLink" ("" without NVLink): how every plan line states the link speed."""
    return f", {gbps:.0f} GB/s per direction over NVLink" if gbps else ""


def gpus_text(gpus: Sequence[int], shape: str, gbps: float, prefix: str = "GPUs ", on_gpu: Optional[bool] = None,
              cpu: str = "CPU (no GPU)") -> str:
    """"GPUs [0, 1] (nvswitch, 478 GB/s per direction over NVLink)", or `cpu` when there is no GPU (`on_gpu`:
    whether GPUs are used; default: whether `gpus` names any)."""
    if not (bool(gpus) if on_gpu is None else on_gpu):
        return cpu
    return f"{prefix}{list(gpus)} ({shape}{nvlink_text(gbps)})"


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
    shape = topology.shape(chosen)
    gbps = topology.min_pair_gbps(chosen) if len(chosen) > 1 else 0.0
    # "autotune" plans like "auto"; `decide` then swaps in the measured winner (`Facts.tune_choice`).
    rule_request = "auto" if cross_device_ops == "autotune" else cross_device_ops  # `decide` adds the winner
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
                f"buffer(s), one launch per step instead of one per tensor (2x H200: 197-204 vs 170 GB/s "
                f"for TensorFlow's default at 256 MiB, ResNet-50 5332 vs 5005 img/s in split mode; docs/results.md)")
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


# ---- the final plan, from every fact the edges gather ------------------------------------------------------------

TuneChoice = tuple  # (cross_device_ops, num_packs, reason), as `tune_cache.stored_choice` returns it


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the edges found out about this process, for `decide`. Plain data except `tune_choice`.

    `visible`: NVML indices TensorFlow can see (CUDA_VISIBLE_DEVICES; None: all). `tf_gpu_count`: GPUs TensorFlow
    lists (None: not asked, as in `tf-nvlink report --no-tf`). `no_gpu_cause`: why TensorFlow sees no GPU, when it
    sees none. `nccl_available`: whether TensorFlow has NCCL's GPU kernels (None: not asked). `tune_choice`: the
    tune winner for a set of GPUs, or None (reads the cache; for "autotune" it may measure). `mig`: the MIG
    instances CUDA_VISIBLE_DEVICES names (`devices.mig_entries`).
    """

    topology: Topology
    visible: Optional[tuple[int, ...]] = None
    tf_gpu_count: Optional[int] = None
    no_gpu_cause: str = ""
    nccl_available: Optional[bool] = True
    tune_choice: Optional[Callable[[tuple[int, ...]], Optional[TuneChoice]]] = None
    mig: tuple[str, ...] = ()
    user_xla_flags: str = ""  # the user's XLA_FLAGS, before tf_nvlink set any


def decide(facts: Facts, gpus: GpuSpec = "all", cross_device_ops: str = "auto", num_packs: Optional[int] = None,
           xla_allreduce: str = "auto", ops_instance: str = "", asked_options=step_options.DEFAULT_REQUEST) -> tuple[Plan, list]:
    """The plan `tf_nvlink.strategy()` builds from `facts`, and the warning lines to log. The report calls it too.

    `ops_instance`: the class name of a `tf.distribute.CrossDeviceOps` instance the caller gave (then
    `cross_device_ops` is "auto" and only the GPUs are chosen). `asked_options`: see `step_options.validate_request`.

    Example:
        >>> plan, warnings = decide(Facts(nvml.probe(), tf_gpu_count=2))
        >>> plan.cross_device_ops
        'nccl'
    """
    topology, warnings = facts.topology, []
    if topology.warnings:  # one line, however many NVML calls failed (`tf-nvlink report` lists them all)
        warnings.append(nvml.warnings_line(topology.warnings))
    visible, no_gpu_reason, mig = facts.visible, None, list(facts.mig)
    if topology.gpus and facts.tf_gpu_count == 0:
        warnings.append(f"NVML sees {len(topology.gpus)} GPU(s) but TensorFlow sees none ({facts.no_gpu_cause}); "
                        f"falling back to the CPU.")
        no_gpu_reason = f"NVML sees {len(topology.gpus)} GPU(s) but TensorFlow sees none: {facts.no_gpu_cause}"
        visible = ()
    elif topology.error and not facts.tf_gpu_count:
        warnings.append(topology.error)  # no driver / NVML: the text ends with the CPU fallback
    elif mig and facts.tf_gpu_count and not visible:
        no_gpu_reason = f"CUDA_VISIBLE_DEVICES names MIG instance(s) {mig}, which no NVML GPU index names; " \
                        f"gpus='all' mirrors over them"
    # An explicit GPU request that cannot be honoured raises here (with the reason); "all"/"auto" fall back.
    plan = make_plan(topology, gpus, cross_device_ops, num_packs, visible=visible, xla_allreduce=xla_allreduce,
                     no_gpu_reason=no_gpu_reason)
    if len(plan.gpus) > 1 and cross_device_ops in ("auto", "autotune") and num_packs is None and facts.tune_choice:
        choice = facts.tune_choice(plan.gpus)
        if choice is not None:  # a stored hierarchical winner needs the cube-mesh order too
            plan = dataclasses.replace(plan, cross_device_ops=choice[0], num_packs=choice[1], reason=choice[2],
                                       gpus=replica_order(topology, plan.gpus, choice[0]))
    if plan.gpus and (plan.cross_device_ops == "nccl" or plan.xla_allreduce == "fused") \
            and facts.nccl_available is False:
        plan, warning = without_nccl(plan)
        warnings.append(warning)
    if not plan.gpus and facts.tf_gpu_count and not topology.gpus:
        warnings.append(f"TensorFlow sees {facts.tf_gpu_count} GPU(s) but NVML does not ("
                        f"{topology.error or nvml.warnings_line(topology.warnings) or 'NVML lists no GPU'}); "
                        f"mirroring over them with TensorFlow's default all-reduce.")
        plan = dataclasses.replace(plan, cross_device_ops="collective", num_packs=None,
                                   reason="GPUs without NVML: topology unknown, TensorFlow's default all-reduce")
    elif not plan.gpus and facts.tf_gpu_count and mig:
        ops = "reduce_to_one" if facts.tf_gpu_count == 1 else "collective"
        warnings.append(f"CUDA_VISIBLE_DEVICES names MIG instance(s) {mig}: mirroring over TensorFlow's "
                        f"{facts.tf_gpu_count} MIG device(s) with {ops} and no NVLink plan (a MIG instance has no "
                        f"NVLink of its own, and no NVML GPU index names it).")
        plan = dataclasses.replace(plan, cross_device_ops=ops, num_packs=None,
                                   reason=f"MIG instance(s) {mig}: TensorFlow's MIG device(s), no NVLink plan")
    if ops_instance:
        plan = dataclasses.replace(plan, cross_device_ops=ops_instance, num_packs=None,
                                   reason="a CrossDeviceOps instance given by the caller")
    return step_options.choose_step_options(plan, facts.user_xla_flags, *asked_options), warnings


def without_nccl(plan: Plan) -> tuple[Plan, str]:
    """The plan for a TensorFlow without NCCL kernels, and the one warning line that says so.

    NcclAllReduce becomes ReductionToOneDevice (copies over NVLink/PCIe); the XLA all-reduce stays split,
    since XLA's GPU all-reduce is NCCL too. Other ops are kept (CollectiveAllReduce falls back to its ring).
    """
    ops = "reduce_to_one" if plan.cross_device_ops == "nccl" else plan.cross_device_ops
    change = f"using {ops} instead of {plan.cross_device_ops}" if ops != plan.cross_device_ops else f"keeping {ops}"
    warning = (f"this TensorFlow has no NCCL GPU kernels: {change}, and jit_compile=True models all-reduce "
               f"outside XLA (split mode)")
    return dataclasses.replace(
        plan, cross_device_ops=ops, num_packs=None if ops == "reduce_to_one" else plan.num_packs,
        xla_allreduce="split", reason=f"NCCL kernels missing from this TensorFlow build: {ops} (planned "
                                      f"{plan.cross_device_ops}: {plan.reason})"), warning


# ---- across workers --------------------------------------------------------------------------------------------

def choose_implementation(topology: Topology, local_gpu_count: int,
                          visible: Optional[Sequence[int]] = None) -> tuple[str, str]:
    """("NCCL" | "RING", reason) for a worker with `local_gpu_count` GPUs; pure, no TensorFlow.

    `visible` are the NVML indices of the worker's GPUs (default: the first `local_gpu_count` of those
    `CUDA_VISIBLE_DEVICES` leaves).

    Any GPU means NCCL, whatever the links; only the reason differs. TensorFlow's AUTO is no neutral default on
    GPUs: TensorFlow 2.21 runs NCCL only when the hint says "nccl" (or ConfigProto's collective_nccl is set, which
    MultiWorkerMirroredStrategy does in graph mode only: `CollectiveParamResolverLocal::AssignCollectiveType`), so
    AUTO means its own gRPC ring, which copies every gradient through host memory. NCCL uses NVLink inside the
    worker and InfiniBand/RoCE (or TCP sockets) between workers; a TensorFlow built without NCCL falls back to its
    ring by itself. CPU-only workers get RING (NCCL needs GPUs).
    """
    if isinstance(local_gpu_count, bool) or not isinstance(local_gpu_count, int) or local_gpu_count < 0:
        raise ValueError(f"local_gpu_count should be a non-negative integer. Received: "
                         f"local_gpu_count={local_gpu_count!r}")
    if local_gpu_count == 0:
        if topology.gpus:
            return ("RING", f"NVML sees {len(topology.gpus)} GPU(s) but this worker trains on none (TensorFlow "
                    "without CUDA, or CUDA_VISIBLE_DEVICES hides them): TensorFlow's ring all-reduce over gRPC "
                    "(NCCL needs GPUs)")
        return "RING", "CPU-only worker: TensorFlow's ring all-reduce over gRPC (NCCL needs GPUs)"
    if not topology.gpus:
        return ("NCCL", f"{local_gpu_count} GPU(s) without NVML (interconnect unknown): NCCL all the same, since "
                "TensorFlow's AUTO would mean its gRPC ring through host memory on GPUs")
    if visible is None:
        visible = devices_lib.visible_nvml_indices(topology)[:local_gpu_count]
    visible = tuple(visible)
    if len(visible) != local_gpu_count:
        return ("NCCL", f"this worker trains on {local_gpu_count} GPU(s) but NVML maps {len(visible)} of them "
                f"({list(visible)}), so their links are uncertain: NCCL all the same, since TensorFlow's AUTO would "
                "mean its gRPC ring through host memory on GPUs")
    shape = topology.shape(visible)
    if shape == "single":
        return ("NCCL", "one GPU per worker: NCCL all-reduces across workers (InfiniBand/RoCE when present, TCP "
                "sockets otherwise); TensorFlow's AUTO would mean its gRPC ring through host memory")
    if shape in ("nvswitch", "nvlink-all"):
        link = "through NVSwitch" if shape == "nvswitch" else "by direct NVLink"
        gbps = topology.min_pair_gbps(visible)
        return ("NCCL", f"this worker's {len(visible)} GPUs reach each other {link} ({gbps:.0f} GB/s per "
                "direction): NCCL all-reduces over NVLink inside the worker and over the network between workers")
    what = "only some GPU pairs have NVLink" if shape == "nvlink-partial" else "PCIe only, no NVLink"
    return ("NCCL", f"this worker's {len(visible)} GPUs: {what}; NCCL still (it routes over NVLink where it can "
            "and PCIe elsewhere), since TensorFlow's AUTO would mean its gRPC ring through host memory")
