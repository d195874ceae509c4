"""The cost model itself: links, workloads, all-reduce time and predicted step time (see the package doc)."""

from __future__ import annotations

import dataclasses
from typing import Optional

__all__ = ["MIB", "NCCL_RING_BASE_US", "NCCL_HOP_NVLINK_US", "NCCL_HOP_PCIE_US", "TF_ALLREDUCE_OVERHEAD_US", "H200_NVLINK_GBPS", "H200_TF_BUSBW_GBPS", "NVLINK_EFFICIENCY", "TF_OVER_RAW_NCCL", "DEFAULT_FUSED_OVERLAP", "REPLICA_OVERHEAD_DATA_ON_GPU_MS", "REPLICA_OVERHEAD_HOST_FED_MS", "DEFAULT_REPLICA_OVERHEAD_MS", "ALLREDUCE_BYTES_PER_ELEMENT", "LinkModel", "LINKS", "Workload", "Prediction", "allreduce_ms", "OPTIMIZER_STATES", "SHARDED_NOTE", "predict", "fit_overhead"]


MIB = 2**20

# NCCL src/graph/tuning.cc: ring all-reduce with the Simple protocol (large messages) costs baseLat 8.4 us plus
# hwLat per ring step, and an all-reduce takes 2(N-1) steps. hwLat is 3.4 us over NVLink, 5.7 us over PCIe.
NCCL_RING_BASE_US = 8.4
NCCL_HOP_NVLINK_US = 3.4
NCCL_HOP_PCIE_US = 5.7

# TensorFlow adds about 230 us to every all-reduce over raw NCCL on 2x H200 (nccl:1 against PyTorch's NCCL at
# 1 MiB and 16 MiB, docs/results.md "All-reduce bandwidth through tf.distribute").
TF_ALLREDUCE_OVERHEAD_US = 230.0

# NVLink/NVSwitch busbw that TensorFlow's all-reduce reaches, as a fraction of the raw per-GPU NVLink rate:
# 2x H200, nccl:1 at 1 GiB 280 GB/s (and 331 raw NCCL) against 18 x 26.562 = 478.116 GB/s per direction.
# Used to turn other machines' link rates into busbw (assumption: the same efficiency on V100/A100 NVLink).
H200_NVLINK_GBPS = 18 * 26.562
H200_TF_BUSBW_GBPS = 280.0
NVLINK_EFFICIENCY = H200_TF_BUSBW_GBPS / H200_NVLINK_GBPS
# TensorFlow's busbw as a fraction of raw NCCL's on the same link (280 / 331 at 1 GiB on 2x H200); used to turn
# a PCIe link's usable rate into the busbw TensorFlow would see (assumption: the same fraction on PCIe).
TF_OVER_RAW_NCCL = 280.0 / 331.0

# Fraction of the all-reduce that XLA hides behind compute in the fused mode, as measured: 0. With XLA's default
# scheduler, 2x H200 ResNet-50 (data on the GPUs) cost 1.5 ms more per step with NVLink and 6.9 ms more with
# NCCL_P2P_DISABLE=1; the modelled all-reduce is 0.61 and 4.58 ms. Their difference (5.4 ms) is more than the
# all-reduces' difference (3.97 ms), so nothing was hidden; with overlap 0 and the overhead fitted on the NVLink
# run, the model predicts the P2P-off step within 3% (44.5 against 45.9 ms). The
# latency-hiding scheduler made the 2-GPU step 1.1 ms faster (issue 13), more than the whole modelled NVLink
# all-reduce: pass fused_overlap up to 1.0 to see what it can buy.
DEFAULT_FUSED_OVERLAP = 0.0

# Per-step cost of each extra replica beyond the all-reduce (launches, host threads, the input split), fitted
# with `fit_overhead` on 2x H200 ResNet-50 fused XLA:
# - data already on the GPUs (training_bench, second session): 39.0 -> 40.5 ms, minus 0.61 ms all-reduce;
REPLICA_OVERHEAD_DATA_ON_GPU_MS = 0.89
# - fed from host memory through tf.data, as users train (issue 13, five 1-vs-2-GPU pairs): the median pair
#   (3446 vs 6038 img/s: 37.14 -> 42.40 ms) minus the same all-reduce.
REPLICA_OVERHEAD_HOST_FED_MS = 4.64
DEFAULT_REPLICA_OVERHEAD_MS = REPLICA_OVERHEAD_DATA_ON_GPU_MS

ALLREDUCE_BYTES_PER_ELEMENT = {"float32": 4, "bfloat16": 2, "float16": 2}

# optimizer_states="sharded" (tf_nvlink.training.sharded_states) as built: the gradients all-reduced as replicated,
# then the owners' updated float32 weights sent to every replica in one more (batched) all-reduce, since
# TensorFlow's replica context has no reduce-scatter. In a ring, all-reduce = reduce-scatter + all-gather, so a
# reduce-scatter of the gradients and an all-gather of the weights would move the bytes of one all-reduce: what
# the replicated rows already pay.
OPTIMIZER_STATES = ("replicated", "sharded")
SHARDED_NOTE = ("sharded rows: tf_nvlink as built, the gradients all-reduced, then the owners' float32 weights in one "
                "more all-reduce (fused mode; split and plain mode copy them from their owners), since TensorFlow "
                "has no reduce-scatter among replicas; in a ring, all-reduce = "
                "reduce-scatter + all-gather, so a reduce-scatter of the gradients plus an all-gather of the weights "
                "would move the same bytes as the replicated rows' all-reduce")


@dataclasses.dataclass(frozen=True)
class LinkModel:
    """What an all-reduce costs on one kind of interconnect.

    busbw_gbps: ring bus bandwidth in GB/s (1e9 B/s) for large messages, as TensorFlow's all-reduce reaches it.
    hop_latency_us: NCCL's per-ring-step latency on this link type (NVLink 3.4, PCIe 5.7 us).
    busbw_by_gpus: busbw for particular GPU counts where the ring's slowest hop changes with N (DGX-1: a pair,
        a quad and all 8 use different numbers of links); other counts than these raise.
    shared_gbps: aggregate GB/s per direction of a path that all N GPUs share (a PCIe root complex); then
        busbw(N) = min(busbw, shared_gbps / N). None where each GPU has its own path (NVLink, NVSwitch).
    max_gpus: the largest N this machine type has.
    source: where the numbers come from.

    Example:
        >>> LINKS["pcie-gen4"].busbw(8)
        6.25
    """

    name: str
    busbw_gbps: float
    hop_latency_us: float
    busbw_by_gpus: tuple[tuple[int, float], ...] = ()
    shared_gbps: Optional[float] = None
    max_gpus: int = 8
    source: str = ""

    def busbw(self, n_gpus: int) -> float:
        """Bus bandwidth in GB/s of a ring all-reduce over `n_gpus` GPUs of this link type."""
        _check_gpus(n_gpus, self)
        by_gpus = dict(self.busbw_by_gpus)
        if by_gpus and n_gpus > 1:
            if n_gpus not in by_gpus:
                raise ValueError(f"{self.name} has no busbw for {n_gpus} GPUs; valid GPU counts: "
                                 f"{sorted(by_gpus)}. Received: n_gpus={n_gpus}")
            bandwidth = by_gpus[n_gpus]
        else:
            bandwidth = self.busbw_gbps
        if self.shared_gbps is not None:
            bandwidth = min(bandwidth, self.shared_gbps / n_gpus)
        return bandwidth

    def latency_us(self, n_gpus: int) -> float:
        """NCCL ring latency of one all-reduce over `n_gpus` GPUs (0 for one GPU)."""
        _check_gpus(n_gpus, self)
        return 0.0 if n_gpus == 1 else NCCL_RING_BASE_US + 2 * (n_gpus - 1) * self.hop_latency_us


def _check_gpus(n_gpus: int, link: LinkModel) -> None:
    if not isinstance(n_gpus, int) or isinstance(n_gpus, bool) or not 1 <= n_gpus <= link.max_gpus:
        raise ValueError(f"n_gpus must be an integer from 1 to {link.max_gpus} for {link.name}. "
                         f"Received: n_gpus={n_gpus!r}")


_V100_LINK_GBPS = 25.781
_DGX1_BUSBW = {n: round(links * _V100_LINK_GBPS * NVLINK_EFFICIENCY, 1) for n, links in ((2, 2), (4, 4), (8, 6))}

LINKS: dict[str, LinkModel] = {
    "nvswitch-h200": LinkModel(
        "nvswitch-h200", H200_TF_BUSBW_GBPS, NCCL_HOP_NVLINK_US,
        source="measured on 2x H200: TensorFlow nccl:1 busbw 280 GB/s at 1 GiB (198-204 at 256 MiB, where the fixed "
               "cost weighs more); raw NCCL 331. Every GPU has 18 x 26.562 GB/s into the switches, so a ring's hop "
               "has the same bandwidth for any N: busbw assumed constant up to 8 GPUs (NVLS off)"),
    "dgx1-v100": LinkModel(
        "dgx1-v100", _DGX1_BUSBW[8], NCCL_HOP_NVLINK_US, busbw_by_gpus=tuple(sorted(_DGX1_BUSBW.items())),
        source="DGX-1 hybrid cube-mesh, NVLink 2.0 at 25.781 GB/s per link: a ring runs at its slowest hop, and each "
               "directed ring uses one link out of every GPU, so busbw <= (links from the least-linked GPU into the "
               "chosen set) x 25.781. 2 GPUs: a doubled pair (2 links); 4: one quad (4 links each, two link-"
               "disjoint rings in both directions); 8: all 6 links (24 links = 3 disjoint 8-GPU rings). Times "
               "the H200-measured TensorFlow efficiency 0.586. Not measured"),
    "pcie-gen5": LinkModel(
        "pcie-gen5", round(50.0 * TF_OVER_RAW_NCCL, 1), NCCL_HOP_PCIE_US, shared_gbps=100.0,
        source="PCIe gen5 x16, ~50 GB/s usable per direction (pinned host-to-GPU measured 55.5), P2P through the "
               "root complex, times TensorFlow's measured fraction of raw NCCL (0.846). Assumed: all GPUs share "
               "one root complex of two x16 links' worth (100 GB/s per direction), so busbw = min(42.3, 100 / N). "
               "Not measured"),
    "pcie-gen4": LinkModel(
        "pcie-gen4", round(25.0 * TF_OVER_RAW_NCCL, 1), NCCL_HOP_PCIE_US, shared_gbps=50.0,
        source="PCIe gen4 x16, ~25 GB/s usable per direction, as pcie-gen5 at half the rate: busbw = min(21.1, "
               "50 / N). Not measured"),
    "pcie-host": LinkModel(
        "pcie-host", 23.6, NCCL_HOP_PCIE_US, shared_gbps=47.2,
        source="measured on 2x H200 with NCCL_P2P_DISABLE=1 (NCCL stages through host memory): TensorFlow "
               "all-reduce 23.6 GB/s busbw at 256 MiB. Assumed: those 2 GPUs already filled the host path "
               "(2 x 23.6 GB/s), so busbw = 47.2 / N"),
}


@dataclasses.dataclass(frozen=True)
class Workload:
    """One model's training step on one GPU.

    compute_ms: measured step time on one GPU at `per_gpu_batch` (no all-reduce).
    gradient_bytes: bytes of all gradients in float32 (4 x parameters).
    gradient_tensors: how many gradient tensors (variables) there are.
    per_gpu_batch: samples per GPU per step (images, sequences, examples).
    packs: all-reduce calls per step: the gradients are packed into this many buffers; 0 = one call per tensor.
    name: a label for tables.

    Example:
        >>> Workload(compute_ms=39.7, gradient_bytes=int(97.5 * MIB), gradient_tensors=161, per_gpu_batch=128)
    """

    compute_ms: float
    gradient_bytes: int
    gradient_tensors: int = 1
    per_gpu_batch: int = 1
    packs: int = 1
    name: str = "workload"

    def __post_init__(self):
        if not self.compute_ms > 0:
            raise ValueError(f"compute_ms must be > 0. Received: compute_ms={self.compute_ms!r}")
        if self.gradient_bytes < 0 or self.gradient_tensors < 1 or self.per_gpu_batch < 1 or self.packs < 0:
            raise ValueError("gradient_bytes must be >= 0, gradient_tensors and per_gpu_batch >= 1, packs >= 0. "
                             f"Received: gradient_bytes={self.gradient_bytes}, gradient_tensors="
                             f"{self.gradient_tensors}, per_gpu_batch={self.per_gpu_batch}, packs={self.packs}")

    @property
    def allreduce_calls(self) -> int:
        return self.gradient_tensors if self.packs == 0 else min(self.packs, self.gradient_tensors)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted step of `workload` on `n_gpus` GPUs over `link`. Times in ms; scaling 1.0 = N x one GPU."""

    workload: str
    link: str
    n_gpus: int
    allreduce_dtype: str
    busbw_gbps: float
    comm_ms: float
    exposed_comm_ms: float
    overhead_ms: float
    step_ms: float
    scaling: float
    samples_per_s: float
    optimizer_states: str = "replicated"

    @property
    def images_per_s(self) -> float:
        return self.samples_per_s


def allreduce_ms(nbytes: float, link: LinkModel, n_gpus: int, *, calls: int = 1,
                 framework_overhead_us: float = TF_ALLREDUCE_OVERHEAD_US) -> float:
    """Time of all-reducing `nbytes` over `n_gpus` GPUs in `calls` all-reduces (0 for one GPU).

    Example:
        >>> round(allreduce_ms(256 * MIB, LINKS["nvswitch-h200"], 2), 3)   # 0.230 + 0.015 + 0.959 ms
        1.204
    """
    if n_gpus == 1:
        _check_gpus(n_gpus, link)
        return 0.0
    fixed_us = calls * (framework_overhead_us + link.latency_us(n_gpus))
    transfer_s = nbytes * 2 * (n_gpus - 1) / n_gpus / (link.busbw(n_gpus) * 1e9)
    return fixed_us / 1e3 + transfer_s * 1e3


def predict(workload: Workload, link: LinkModel, n_gpus: int, *, allreduce_dtype: str = "float32",
            fused_overlap: float = DEFAULT_FUSED_OVERLAP,
            replica_overhead_ms: float = DEFAULT_REPLICA_OVERHEAD_MS,
            framework_overhead_us: float = TF_ALLREDUCE_OVERHEAD_US,
            optimizer_states: str = "replicated") -> Prediction:
    """Step time, all-reduce time and scaling of `workload` on `n_gpus` GPUs joined by `link`.

    allreduce_dtype: "float32" or "bfloat16"/"float16" (half the bytes on the wire).
    fused_overlap: fraction of the all-reduce hidden behind compute (0 = XLA's default schedule, measured).
    replica_overhead_ms: per-step cost of each extra replica (REPLICA_OVERHEAD_HOST_FED_MS for host-fed input).
    optimizer_states: "replicated", or "sharded": one more all-reduce, of the float32 weights (the gradients'
        float32 bytes, in one call), after the gradients' (SHARDED_NOTE says why).

    Example:
        >>> predict(resnet, LINKS["pcie-host"], 2).scaling   # 0.85 measured
    """
    if allreduce_dtype not in ALLREDUCE_BYTES_PER_ELEMENT:
        raise ValueError(f"allreduce_dtype must be one of {sorted(ALLREDUCE_BYTES_PER_ELEMENT)}. "
                         f"Received: allreduce_dtype={allreduce_dtype!r}")
    if not 0.0 <= fused_overlap <= 1.0:
        raise ValueError(f"fused_overlap must be between 0 and 1. Received: fused_overlap={fused_overlap!r}")
    if optimizer_states not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_states must be one of {list(OPTIMIZER_STATES)}. "
                         f"Received: optimizer_states={optimizer_states!r}")
    nbytes = workload.gradient_bytes * ALLREDUCE_BYTES_PER_ELEMENT[allreduce_dtype] / 4
    comm = allreduce_ms(nbytes, link, n_gpus, calls=workload.allreduce_calls,
                        framework_overhead_us=framework_overhead_us)
    if optimizer_states == "sharded" and n_gpus > 1:
        comm += allreduce_ms(workload.gradient_bytes, link, n_gpus, framework_overhead_us=framework_overhead_us)
    exposed = (1.0 - fused_overlap) * comm
    overhead = (n_gpus - 1) * replica_overhead_ms
    step = workload.compute_ms + exposed + overhead
    return Prediction(workload=workload.name, link=link.name, n_gpus=n_gpus, allreduce_dtype=allreduce_dtype,
                      busbw_gbps=link.busbw(n_gpus) if n_gpus > 1 else 0.0, comm_ms=comm, exposed_comm_ms=exposed,
                      overhead_ms=overhead, step_ms=step, scaling=workload.compute_ms / step,
                      samples_per_s=n_gpus * workload.per_gpu_batch * 1e3 / step,
                      optimizer_states=optimizer_states)


def fit_overhead(measured_1gpu_ms: float, measured_ngpu_ms: float, *, workload: Workload, link: LinkModel,
                 n_gpus: int = 2, allreduce_dtype: str = "float32", fused_overlap: float = DEFAULT_FUSED_OVERLAP,
                 framework_overhead_us: float = TF_ALLREDUCE_OVERHEAD_US) -> float:
    """The per-extra-replica overhead (ms) that makes `predict` reproduce a measured N-GPU step.

    Negative when the measured step is shorter than compute plus the modelled exposed all-reduce (the model
    overestimates the all-reduce, or the two runs' compute differs: compare runs from one command only).

    Example:
        >>> fit_overhead(39.0, 40.5, workload=resnet, link=LINKS["nvswitch-h200"])   # 2x H200, data on GPU
        0.89...
    """
    if n_gpus < 2:
        raise ValueError(f"fit_overhead needs a measurement on 2 or more GPUs. Received: n_gpus={n_gpus}")
    calibrated = dataclasses.replace(workload, compute_ms=measured_1gpu_ms)
    without_overhead = predict(calibrated, link, n_gpus, allreduce_dtype=allreduce_dtype,
                               fused_overlap=fused_overlap, replica_overhead_ms=0.0,
                               framework_overhead_us=framework_overhead_us)
    return (measured_ngpu_ms - without_overhead.step_ms) / (n_gpus - 1)
