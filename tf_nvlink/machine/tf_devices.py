"""TensorFlow's GPUs mapped to NVML's GPUs by PCI bus id.

TensorFlow numbers the GPUs CUDA shows it (`CUDA_VISIBLE_DEVICES` filters and reorders them), NVML numbers all
of them: with `CUDA_VISIBLE_DEVICES=1,0`, TensorFlow's GPU:0 is NVML's GPU 1. The PCI bus id in device_lib's
`physical_device_desc` is the one fact both sides share, so that is what we match on (as integers: NVML writes
`00000000:00:06.0`, TensorFlow `0000:00:06.0`). This module is pure: the descriptions come from
`tf_nvlink.internals.tf_runtime.tf_gpu_descs()`, which its callers (in distribute/ and tools/) pass in.

Example:
    >>> from tf_nvlink.internals import tf_runtime
    >>> from tf_nvlink.machine import tf_devices, nvml
    >>> topo = nvml.probe()
    >>> [(d.tf_name, d.nvml_index) for d in tf_devices.map_tf_gpus(topo, tf_runtime.tf_gpu_descs())]
    [('/device:GPU:0', 0), ('/device:GPU:1', 1)]
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Iterable, Mapping, Optional

from tf_nvlink.machine.topology import PciBusId, Topology

_DESC_FIELD = re.compile(r"(device|name|pci bus id|compute capability):\s*([^,]+)")


@dataclasses.dataclass(frozen=True)
class TfGpu:
    """One GPU as TensorFlow lists it, with the NVML GPU it is (None when no NVML GPU has its PCI id)."""

    tf_index: int
    tf_name: str  # "/device:GPU:0"
    name: str
    pci_bus_id: Optional[PciBusId]
    compute_capability: Optional[str]
    nvml_index: Optional[int]
    physical_device_desc: str


def parse_physical_device_desc(desc: str) -> dict:
    """Fields of device_lib's `physical_device_desc`.

    Example:
        >>> parse_physical_device_desc("device: 0, name: NVIDIA H200, pci bus id: 0000:00:06.0, "
        ...                            "compute capability: 9.0a")
        {'device': '0', 'name': 'NVIDIA H200', 'pci bus id': '0000:00:06.0', 'compute capability': '9.0a'}
    """
    return {key: value.strip() for key, value in _DESC_FIELD.findall(desc or "")}


def map_tf_gpus(topology: Topology, descs: Iterable[tuple[str, str]]) -> list[TfGpu]:
    """Match TensorFlow GPUs, given as (device name, physical_device_desc) pairs, to NVML GPUs by PCI bus id."""
    by_pci = {gpu.pci_bus_id: gpu.index for gpu in topology.gpus}
    mapped = []
    for tf_index, (tf_name, desc) in enumerate(descs):
        fields = parse_physical_device_desc(desc)
        pci = PciBusId.try_parse(fields.get("pci bus id"))
        ordinal = int(fields["device"]) if fields.get("device", "").isdigit() else tf_index
        mapped.append(TfGpu(tf_index=ordinal, tf_name=tf_name, name=fields.get("name", "N/A"), pci_bus_id=pci,
                            compute_capability=fields.get("compute capability"),
                            nvml_index=by_pci.get(pci) if pci else None, physical_device_desc=desc))
    return mapped


def visible_nvml_indices(topology: Topology, environ: Optional[Mapping[str, str]] = None) -> list[int]:
    """NVML indices of the GPUs CUDA (and so TensorFlow) will see, in TensorFlow's order.

    Reads `CUDA_VISIBLE_DEVICES` like CUDA does: indices or GPU-UUID prefixes, comma separated; the list ends at
    the first entry that names no GPU; unset means all GPUs, empty means none. This is the cheap answer that
    needs no TensorFlow; `map_tf_gpus` checks it against TensorFlow's own PCI ids.

    Example:
        >>> visible_nvml_indices(topo, {"CUDA_VISIBLE_DEVICES": "1,0"})
        [1, 0]
    """
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return list(topology.indices)
    chosen: list[int] = []
    for entry in (e.strip() for e in value.split(",")):
        index = _resolve_visible_entry(topology, entry)
        if index is None or index in chosen:
            break  # CUDA ignores everything from the first invalid or repeated entry on
        chosen.append(index)
    return chosen


def visible_needs_tensorflow(topology: Topology, environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when `CUDA_VISIBLE_DEVICES` numbers GPUs in an order NVML cannot predict, so only TensorFlow's PCI ids
    say which GPUs it sees (`visible_from_tensorflow`).

    CUDA numbers GPUs fastest first unless `CUDA_DEVICE_ORDER=PCI_BUS_ID`; NVML numbers them by PCI bus id. The two
    agree when every GPU is the same model, not on a machine that mixes models: there `CUDA_VISIBLE_DEVICES=0` may
    be NVML's GPU 1.

    Example:
        >>> visible_needs_tensorflow(t4_and_a100, {"CUDA_VISIBLE_DEVICES": "0"})
        True
    """
    environ = os.environ if environ is None else environ
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if not value or not any(re.fullmatch(r"\d+", e.strip()) for e in value.split(",")):
        return False
    if environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").strip().upper() == "PCI_BUS_ID":
        return False
    return len({(gpu.name, gpu.compute_capability) for gpu in topology.gpus}) > 1


def visible_from_tensorflow(mapped: Iterable[TfGpu]) -> list[int]:
    """NVML indices of the GPUs TensorFlow sees, in its order, from their PCI bus ids (`map_tf_gpus`)."""
    return [gpu.nvml_index for gpu in mapped if gpu.nvml_index is not None]


def mig_entries(environ: Optional[Mapping[str, str]] = None) -> list[str]:
    """The MIG instances `CUDA_VISIBLE_DEVICES` names ("MIG-<uuid>"): CUDA shows each as a GPU of its own, which
    no NVML GPU index names and which has no NVLink of its own."""
    environ = os.environ if environ is None else environ
    return [e.strip() for e in (environ.get("CUDA_VISIBLE_DEVICES") or "").split(",")
            if e.strip().upper().startswith("MIG-")]


def _resolve_visible_entry(topology: Topology, entry: str) -> Optional[int]:
    if re.fullmatch(r"\d+", entry):
        index = int(entry)
        return index if index in topology.indices else None
    if entry.upper().startswith("GPU-"):
        matches = [gpu.index for gpu in topology.gpus if gpu.uuid.upper().startswith(entry.upper())]
        return matches[0] if len(matches) == 1 else None
    return None  # MIG-... or garbage: not a whole GPU we can map


def tf_device_for(nvml_indices: Iterable[int], mapped: list[TfGpu]) -> list[str]:
    """TensorFlow device names ("/gpu:1") for NVML indices, given the mapping from `map_tf_gpus`.

    Raises ValueError naming the GPUs TensorFlow cannot see (hidden by CUDA_VISIBLE_DEVICES, say).
    """
    by_nvml = {gpu.nvml_index: gpu for gpu in mapped if gpu.nvml_index is not None}
    wanted = list(nvml_indices)
    missing = [i for i in wanted if i not in by_nvml]
    if missing:
        seen = sorted(by_nvml)
        raise ValueError(f"GPU(s) {missing} (NVML/nvidia-smi numbering) are not visible to TensorFlow, which sees "
                         f"NVML GPUs {seen} (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}). "
                         f"Choose among {seen}.")
    return [f"/gpu:{by_nvml[i].tf_index}" for i in wanted]
