"""The bf16 dense tensor-core peak and the memory bandwidth of NVIDIA GPUs by name, and the model FLOPs utilisation
(MFU) the peak gives.

MFU = model FLOPs per step / (step time x the GPUs' bf16 dense peak). The peaks are NVIDIA's datasheet figures for
BF16 tensor cores, dense, without sparsity: the datasheets print twice these figures, "with sparsity" (2:4
structured sparsity, which dense training does not use). A name is matched by its model token as NVML and
TensorFlow print it ("NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB"); a GPU not in the
table has no peak, and its MFU is "n/a". The memory bandwidths (`HBM_BANDWIDTHS`, HBM or GDDR as the board has) are
the datasheets' "GPU memory bandwidth" figures, in TB/s of 10^12 bytes.

Example:
    >>> peak = bf16_dense_peak("NVIDIA H100 80GB HBM3")
    >>> peak.label, peak.tflops
    ('H100 SXM', 989.4)
    >>> round(mfu(8.854e12, 0.0423, "NVIDIA H100 80GB HBM3"), 3)
    0.212
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional


@dataclasses.dataclass(frozen=True)
class GpuPeak:
    """One row of the table: the GPU (`label`), the regular expression its NVML/CUDA name matches (upper case), its
    bf16 dense tensor-core peak in TFLOP/s (`tflops`), the datasheet's BF16 Tensor Core figure with sparsity
    (`sparse_tflops`, twice the dense one) and the datasheet it is printed in."""

    label: str
    pattern: str
    tflops: float
    sparse_tflops: float
    datasheet: str

    @property
    def source(self) -> str:
        return (f"{self.datasheet}: BF16 Tensor Core {self.sparse_tflops:,g} TFLOPS with sparsity; dense, without "
                f"sparsity, {self.tflops:,g}")


# First match wins: the NVL and PCIe boards before the SXM part of the same chip; \b keeps "GH200" and "GB200"
# from matching H200 and B200. Hopper's 1,979 is printed rounded: 1978.9 = 2 x 132 SMs x 4 tensor cores x 512 bf16
# FMA a clock x 2 FLOP x 1.83 GHz.
PEAKS = (
    GpuPeak("GH200", r"\bGH200\b", 989.4, 1978.9, "NVIDIA GH200 Grace Hopper Superchip datasheet"),
    GpuPeak("H200 NVL", r"\bH200\b.*\bNVL\b", 835.5, 1671, "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL"),
    GpuPeak("H200 SXM", r"\bH200\b", 989.4, 1978.9, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM"),
    GpuPeak("H100 PCIe", r"\bH100\b.*\bPCIE\b", 756.5, 1513, "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe"),
    GpuPeak("H100 NVL", r"\bH100\b.*\bNVL\b", 835.5, 1671, "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL"),
    GpuPeak("H100 SXM", r"\bH100\b", 989.4, 1978.9, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM"),
    GpuPeak("B200", r"\bB200\b", 2250, 4500, "NVIDIA HGX B200 datasheet, per GPU"),
    GpuPeak("A100", r"\bA100\b", 312, 624, "NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe, 40 and 80 GB)"),
    GpuPeak("L40S", r"\bL40S\b", 362.05, 733, "NVIDIA L40S datasheet"),
    GpuPeak("L40", r"\bL40\b", 181.05, 362.1, "NVIDIA L40 datasheet"),
    GpuPeak("L4", r"\bL4\b", 121, 242, "NVIDIA L4 datasheet"),
)


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """One row of the memory-bandwidth table: the GPU (`label`), the regular expression its NVML/CUDA name matches
    (upper case), its memory bandwidth in TB/s (10^12 bytes a second), the figure as its datasheet prints it and
    the datasheet."""

    label: str
    pattern: str
    tb_per_s: float
    printed: str
    datasheet: str

    @property
    def source(self) -> str:
        return f"{self.datasheet}: GPU memory bandwidth {self.printed}"


# First match wins, as in PEAKS: the boards of one chip with another memory before the rest of its name. V100 and the
# RTX 3090 have a bandwidth and no bf16 dense peak in PEAKS (V100 has no bf16 tensor cores).
HBM_BANDWIDTHS = (
    GpuMemory("GH200 HBM3e", r"\bGH200\b.*(144G|HBM3E)", 4.9, "4.9TB/s",
              "NVIDIA GH200 Grace Hopper Superchip datasheet, 144GB HBM3e"),
    GpuMemory("GH200", r"\bGH200\b", 4.0, "4TB/s", "NVIDIA GH200 Grace Hopper Superchip datasheet, 96GB HBM3"),
    GpuMemory("H200 NVL", r"\bH200\b.*\bNVL\b", 4.8, "4.8TB/s", "NVIDIA H200 Tensor Core GPU datasheet, H200 NVL"),
    GpuMemory("H200 SXM", r"\bH200\b", 4.8, "4.8TB/s", "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM"),
    GpuMemory("H100 PCIe", r"\bH100\b.*\bPCIE\b", 2.0, "2TB/s", "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe"),
    GpuMemory("H100 NVL", r"\bH100\b.*\bNVL\b", 3.9, "3.9TB/s", "NVIDIA H100 Tensor Core GPU datasheet, H100 NVL"),
    GpuMemory("H100 SXM", r"\bH100\b", 3.35, "3.35TB/s", "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM"),
    GpuMemory("B200", r"\bB200\b", 8.0, "8TB/s", "NVIDIA HGX B200 datasheet, per GPU"),
    GpuMemory("A100 80GB PCIe", r"\bA100\b(?=.*80GB)(?=.*\bPCIE\b)", 1.935, "1,935GB/s",
              "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB PCIe"),
    GpuMemory("A100 80GB SXM", r"\bA100\b.*80GB", 2.039, "2,039GB/s",
              "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM"),
    GpuMemory("A100 40GB", r"\bA100\b", 1.555, "1,555GB/s",
              "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB (PCIe and SXM)"),
    GpuMemory("L40S", r"\bL40S\b", 0.864, "864GB/s", "NVIDIA L40S datasheet"),
    GpuMemory("L40", r"\bL40\b", 0.864, "864GB/s", "NVIDIA L40 datasheet"),
    GpuMemory("L4", r"\bL4\b", 0.3, "300GB/s", "NVIDIA L4 datasheet"),
    GpuMemory("V100S", r"\bV100S\b", 1.134, "1,134GB/s", "NVIDIA V100 Tensor Core GPU datasheet, V100S PCIe"),
    GpuMemory("V100", r"\bV100\b", 0.9, "900GB/s", "NVIDIA V100 Tensor Core GPU datasheet (SXM2 and PCIe)"),
    GpuMemory("RTX 3090", r"\bRTX 3090\b(?!\s*TI)", 0.936, "936GB/s", "NVIDIA GeForce RTX 3090 specifications"),
)


def memory_bandwidth(gpu_name: Optional[str]) -> Optional[GpuMemory]:
    """The memory-bandwidth table's row for a GPU name as NVML or TensorFlow give it, or None for a GPU not in it.

    Example:
        >>> memory_bandwidth("NVIDIA H100 80GB HBM3").tb_per_s
        3.35
        >>> memory_bandwidth("NVIDIA A100-SXM4-80GB").label
        'A100 80GB SXM'
    """
    return _first_match(HBM_BANDWIDTHS, gpu_name)


def bf16_dense_peak(gpu_name: Optional[str]) -> Optional[GpuPeak]:
    """The table's row for a GPU name as NVML or TensorFlow give it, or None for a GPU not in the table (or no name).

    Example:
        >>> bf16_dense_peak("NVIDIA H100 PCIe").tflops
        756.5
        >>> bf16_dense_peak("Tesla V100-SXM2-32GB") is None   # no bf16 tensor cores: not in the table
        True
    """
    return _first_match(PEAKS, gpu_name)


def _first_match(table, gpu_name: Optional[str]):
    """The first row of `table` whose pattern the upper-cased `gpu_name` matches; None for no name or no row."""
    if not gpu_name:
        return None
    upper = gpu_name.upper()
    return next((row for row in table if re.search(row.pattern, upper)), None)


def mfu(model_flops_per_step: float, step_seconds: float, gpu_name: Optional[str], gpus: int = 1) -> Optional[float]:
    """Model FLOPs utilisation of a step of `model_flops_per_step` (over all `gpus`) taking `step_seconds` on GPUs
    named `gpu_name`: the achieved FLOP/s over the GPUs' summed bf16 dense peak; None when the GPU is not in the
    table.

    Example:
        >>> round(mfu(10.71e12, 0.0330, "NVIDIA H200"), 3)      # 2 x 2048 tokens of the 368M Transformer
        0.328
    """
    if not model_flops_per_step > 0 or not step_seconds > 0 or isinstance(gpus, bool) or int(gpus) != gpus \
            or gpus < 1:
        raise ValueError(f"model_flops_per_step and step_seconds should be positive and gpus a positive integer. "
                         f"Received: model_flops_per_step={model_flops_per_step!r}, step_seconds={step_seconds!r}, "
                         f"gpus={gpus!r}")
    peak = bf16_dense_peak(gpu_name)
    if peak is None:
        return None
    return model_flops_per_step / step_seconds / (peak.tflops * 1e12 * gpus)


def utilisation(model_flops_per_step: float, step_seconds: float, gpu_name: Optional[str], gpus: int = 1) -> dict:
    """The JSON entry every MFU figure is reported with: the model's TFLOP/s per GPU, the GPU, its peak and the
    peak's source, and the MFU (None where the GPU is not in the table).

    Example:
        >>> utilisation(8.854e12, 0.0423, "NVIDIA H100 80GB HBM3")["tflops_per_gpu"]
        209.31
    """
    value = mfu(model_flops_per_step, step_seconds, gpu_name, gpus)
    peak = bf16_dense_peak(gpu_name)
    return {"model_flops_per_step": model_flops_per_step,
            "tflops_per_gpu": round(model_flops_per_step / step_seconds / gpus / 1e12, 2),
            "gpu": gpu_name, "peak_label": peak.label if peak else None,
            "peak_tflops": peak.tflops if peak else None, "peak_source": peak.source if peak else None,
            "mfu": round(value, 4) if value is not None else None}


def mfu_text(value: Optional[float]) -> str:
    """An MFU as a table shows it: "21.2%", or "n/a" for a GPU not in the table.

    Example:
        >>> mfu_text(0.2117), mfu_text(None)
        ('21.2%', 'n/a')
    """
    return "n/a" if value is None else f"{value:.1%}"
