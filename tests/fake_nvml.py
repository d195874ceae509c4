"""A stand-in for the `pynvml` module that answers the calls `tf_nvlink.machine.nvml.probe` makes, as real NVML does.

Errors are real pynvml exceptions (`pynvml.NVMLError(code)` maps to `NVMLError_InvalidArgument` and friends),
so the probe's error handling is exercised exactly as on hardware. The machines below are built from real systems;
the 2x H200 values were read off the lent GPU machine (../shared/hardware-facts.md).

Example:
    >>> from tf_nvlink.machine import nvml
    >>> topo = nvml.probe(FakeNvml(h200_x2()))
"""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Optional

import pynvml

GIB = 2**30
NVML_VERSION_OF = {"2.0": 2, "2.2": 3, "3.0": 4, "3.1": 5, "4.0": 6, "5.0": 7}
SWITCH = 2
GPU = 0


@dataclasses.dataclass
class FakeLink:
    remote_type: int  # NVML enum: 0 GPU, 1 IBM NPU, 2 switch
    remote_pci: str  # what nvmlDeviceGetNvLinkRemotePciInfo().busId says
    active: int = 1


@dataclasses.dataclass
class FakeGpu:
    name: str
    pci: str  # NVML spelling, 8-hex-digit domain
    uuid: str
    capability: tuple[int, int]
    memory_gib: int
    links: list[FakeLink] = dataclasses.field(default_factory=list)
    nvlink_version: int = 6  # NVML enum
    nvlink_supported: bool = True  # False: every NVLink call raises NotSupported (PCIe-only / consumer GPUs)
    lost: bool = False  # nvmlDeviceGetHandleByIndex raises GPU_IS_LOST
    traffic_fields: tuple = (138, 139, 140, 141)  # fields answered; the others NOT_SUPPORTED (older GPUs: none)
    mig: Optional[int] = None  # nvmlDeviceGetMigMode's current mode (0 off, 1 on); None: NotSupported (no MIG)
    counters_kib: dict = dataclasses.field(default_factory=dict)  # {(field id, link): cumulative KiB}
    link_count_field: bool = True  # NVML_FI_DEV_NVLINK_LINK_COUNT answers len(links); False: NOT_SUPPORTED
    stamps: bool = True  # field values carry NVML's timestamp (microseconds); False: 0, as some drivers leave it


@dataclasses.dataclass
class FakeMachine:
    gpus: list[FakeGpu]
    p2p_nvlink: dict  # {(a, b): status}; missing pairs are NOT_SUPPORTED (5)
    pcie_level: dict  # {(a, b): level}; missing pairs are SYSTEM (50)
    driver: str = "580.159.04"
    init_error: Optional[int] = None  # an NVML error code nvmlInit raises
    failing_calls: dict = dataclasses.field(default_factory=dict)  # {"nvmlDeviceGetUUID": code}


class FakeNvml(types.SimpleNamespace):
    """Module-like object with pynvml's names; counts nvmlInit/nvmlShutdown so tests can check pairing."""

    def __init__(self, machine: FakeMachine):
        super().__init__()
        self.machine = machine
        self.init_calls = 0
        self.shutdown_calls = 0
        self.calls: list[str] = []
        self.NVMLError = pynvml.NVMLError
        for name in dir(pynvml):
            if name.startswith(("NVML_", "NVMLError_")):
                setattr(self, name, getattr(pynvml, name))

    # -- helpers ---------------------------------------------------------------------------------------------
    def _check(self, call: str) -> None:
        self.calls.append(call)
        if self.init_calls <= self.shutdown_calls and call not in ("nvmlInit", "nvmlShutdown"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if call in self.machine.failing_calls:
            raise pynvml.NVMLError(self.machine.failing_calls[call])

    def _gpu(self, handle) -> FakeGpu:
        return self.machine.gpus[handle]

    def _link(self, handle, link: int) -> FakeLink:
        gpu = self._gpu(handle)
        if not gpu.nvlink_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not isinstance(link, int) or not 0 <= link < len(gpu.links):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu.links[link]

    @staticmethod
    def _pci_struct(bus_id: str):
        return types.SimpleNamespace(busId=bus_id, busIdLegacy=bus_id[4:] if bus_id else "")

    # -- the pynvml calls ------------------------------------------------------------------------------------
    def nvmlInit(self):
        self._check("nvmlInit")
        if self.machine.init_error is not None:
            raise pynvml.NVMLError(self.machine.init_error)
        self.init_calls += 1

    def nvmlShutdown(self):
        self._check("nvmlShutdown")
        if self.init_calls <= self.shutdown_calls:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.shutdown_calls += 1

    def nvmlSystemGetDriverVersion(self):
        self._check("nvmlSystemGetDriverVersion")
        return self.machine.driver

    def nvmlSystemGetNVMLVersion(self):
        self._check("nvmlSystemGetNVMLVersion")
        return "13." + self.machine.driver

    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount")
        return len(self.machine.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._check("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.machine.gpus):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if self.machine.gpus[index].lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return index

    def nvmlDeviceGetName(self, handle):
        self._check("nvmlDeviceGetName")
        return self._gpu(handle).name

    def nvmlDeviceGetUUID(self, handle):
        self._check("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetPciInfo(self, handle):
        self._check("nvmlDeviceGetPciInfo")
        return self._pci_struct(self._gpu(handle).pci)

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        self._check("nvmlDeviceGetCudaComputeCapability")
        return self._gpu(handle).capability

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._check("nvmlDeviceGetMemoryInfo")
        total = self._gpu(handle).memory_gib * GIB
        return types.SimpleNamespace(total=total, free=total - 600 * 2**20, used=600 * 2**20)

    def nvmlDeviceGetNvLinkState(self, handle, link):
        self._check("nvmlDeviceGetNvLinkState")
        return self._link(handle, link).active

    def nvmlDeviceGetNvLinkVersion(self, handle, link):
        self._check("nvmlDeviceGetNvLinkVersion")
        self._link(handle, link)
        return self._gpu(handle).nvlink_version

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, handle, link):
        self._check("nvmlDeviceGetNvLinkRemoteDeviceType")
        return self._link(handle, link).remote_type

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle, link):
        self._check("nvmlDeviceGetNvLinkRemotePciInfo")
        return self._pci_struct(self._link(handle, link).remote_pci)

    def nvmlDeviceGetNvLinkCapability(self, handle, link, capability):
        self._check("nvmlDeviceGetNvLinkCapability")
        self._link(handle, link)
        return 1

    def nvmlDeviceGetP2PStatus(self, handle1, handle2, index):
        self._check("nvmlDeviceGetP2PStatus")
        if not isinstance(index, int):  # what ctypes does with pynvml's NVML_P2P_CAPS_INDEX_READ == (0,)
            raise TypeError("wrong type")
        key = tuple(sorted((handle1, handle2)))
        if index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            return self.machine.p2p_nvlink.get(key, pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)
        if index == pynvml.NVML_P2P_CAPS_INDEX_PCI:
            return pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        return pynvml.NVML_P2P_STATUS_OK

    def nvmlDeviceGetTopologyCommonAncestor(self, handle1, handle2):
        self._check("nvmlDeviceGetTopologyCommonAncestor")
        return self.machine.pcie_level.get(tuple(sorted((handle1, handle2))), pynvml.NVML_TOPOLOGY_SYSTEM)


# ---- machines built from real systems ----------------------------------------------------------------------

def _pci(bus: int, device: int = 0) -> str:
    return f"00000000:{bus:02X}:{device:02X}.0"


def _all_pairs(n: int, value) -> dict:
    return {(a, b): value for a in range(n) for b in range(a + 1, n)}


def h200_x2() -> FakeMachine:
    """The lent machine: 2x H200 SXM, 18 NVLink 4.0 links each into NVSwitches (a VM: the switch links' remote
    PCI info reads ffffffff:ff:ff.0, 143771 MiB per GPU)."""
    gpus = [FakeGpu("NVIDIA H200", _pci(0, 6 + i), f"GPU-5c2f0e1a-0000-4000-8000-00000000000{i}", (9, 0), 141,
                    links=[FakeLink(SWITCH, "ffffffff:ff:ff.0") for _ in range(18)], nvlink_version=6, mig=0)
            for i in range(2)]
    return FakeMachine(gpus, p2p_nvlink=_all_pairs(2, 0), pcie_level=_all_pairs(2, 30))


def h100_hgx_x8() -> FakeMachine:
    """HGX H100 8-GPU: 18 NVLink 4.0 links per GPU into 4 NVSwitches; two PCIe switches per CPU socket."""
    buses = [0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB]
    switches = [_pci(0x05 + s) for s in range(4)]
    gpus = [FakeGpu("NVIDIA H100 80GB HBM3", _pci(bus), f"GPU-h100-{i}", (9, 0), 80,
                    links=[FakeLink(SWITCH, switches[link % 4]) for link in range(18)], nvlink_version=6)
            for i, bus in enumerate(buses)]
    level = {}
    for a in range(8):
        for b in range(a + 1, 8):
            level[(a, b)] = 20 if a // 2 == b // 2 else 40 if a // 4 == b // 4 else 50
    return FakeMachine(gpus, p2p_nvlink=_all_pairs(8, 0), pcie_level=level)


# DGX-1 (8x V100) hybrid cube-mesh: two fully connected quads (0-3, 4-7) plus i <-> i+4; each GPU has 6 links,
# doubled on some edges (nvidia-smi shows NV1 and NV2). Each GPU reaches 4 of the other 7, with 6 links in all.
DGX1_EDGES = {(0, 1): 1, (0, 2): 1, (0, 3): 2, (0, 4): 2, (1, 2): 2, (1, 3): 1, (1, 5): 2, (2, 3): 2, (2, 6): 1,
              (3, 7): 1, (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2}


# What `nvidia-smi topo -m` prints for a DGX-1V: the NVLink cells the probe and the report must reproduce.
DGX1_TOPO_MATRIX = ("X   NV1 NV1 NV2 NV2 SYS SYS SYS",
                    "NV1 X   NV2 NV1 SYS NV2 SYS SYS",
                    "NV1 NV2 X   NV2 SYS SYS NV1 SYS",
                    "NV2 NV1 NV2 X   SYS SYS SYS NV1",
                    "NV2 SYS SYS SYS X   NV1 NV1 NV2",
                    "SYS NV2 SYS SYS NV1 X   NV2 NV1",
                    "SYS SYS NV1 SYS NV1 NV2 X   NV2",
                    "SYS SYS SYS NV1 NV2 NV1 NV2 X")


def dgx1_v100_x8() -> FakeMachine:
    buses = [0x06, 0x07, 0x0A, 0x0B, 0x85, 0x86, 0x89, 0x8A]
    links: dict[int, list[FakeLink]] = {i: [] for i in range(8)}
    for (a, b), count in DGX1_EDGES.items():
        for _ in range(count):
            links[a].append(FakeLink(GPU, _pci(buses[b])))
            links[b].append(FakeLink(GPU, _pci(buses[a])))
    gpus = [FakeGpu("Tesla V100-SXM2-16GB", _pci(bus), f"GPU-v100-{i}", (7, 0), 16, links=links[i],
                    nvlink_version=2) for i, bus in enumerate(buses)]
    level = {}
    for a in range(8):
        for b in range(a + 1, 8):
            level[(a, b)] = 10 if a // 2 == b // 2 else 40 if a // 4 == b // 4 else 50
    return FakeMachine(gpus, p2p_nvlink={edge: 0 for edge in DGX1_EDGES}, pcie_level=level)


def rtx3090_x2_bridge() -> FakeMachine:
    """2x GeForce RTX 3090 joined by an NVLink bridge: 4 links, version enum 5 (reported as 3.1)."""
    pcis = [_pci(0x01), _pci(0x21)]
    gpus = [FakeGpu("NVIDIA GeForce RTX 3090", pcis[i], f"GPU-3090-{i}", (8, 6), 24,
                    links=[FakeLink(GPU, pcis[1 - i]) for _ in range(4)], nvlink_version=5) for i in range(2)]
    return FakeMachine(gpus, p2p_nvlink={(0, 1): 0}, pcie_level={(0, 1): 40})


def pcie_x4() -> FakeMachine:
    """4 PCIe-only GPUs (L40S): every NVLink call raises NotSupported; pairs on one switch are PIX."""
    gpus = [FakeGpu("NVIDIA L40S", _pci(0x17 + 0x20 * i), f"GPU-l40s-{i}", (8, 9), 45, nvlink_supported=False)
            for i in range(4)]
    level = {(a, b): 10 if a // 2 == b // 2 else 30 for a in range(4) for b in range(a + 1, 4)}
    return FakeMachine(gpus, p2p_nvlink={}, pcie_level=level)


def bridged_pairs_x4() -> FakeMachine:
    """4x A100 PCIe with NVLink bridges joining GPUs 0-1 and 2-3 (12 links each, version enum 5)."""
    pcis = [_pci(0x17), _pci(0x31), _pci(0xB1), _pci(0xCA)]
    peer = {0: 1, 1: 0, 2: 3, 3: 2}
    gpus = [FakeGpu("NVIDIA A100 80GB PCIe", pcis[i], f"GPU-a100-{i}", (8, 0), 80,
                    links=[FakeLink(GPU, pcis[peer[i]]) for _ in range(12)], nvlink_version=5) for i in range(4)]
    level = {(a, b): 40 if a // 2 == b // 2 else 50 for a in range(4) for b in range(a + 1, 4)}
    return FakeMachine(gpus, p2p_nvlink={(0, 1): 0, (2, 3): 0}, pcie_level=level)


def no_driver() -> FakeMachine:
    """A machine without the NVIDIA driver: nvmlInit raises DriverNotLoaded."""
    return FakeMachine([], p2p_nvlink={}, pcie_level={}, init_error=pynvml.NVML_ERROR_DRIVER_NOT_LOADED)


MACHINES = {
    "h200_x2": h200_x2,
    "h100_hgx_x8": h100_hgx_x8,
    "dgx1_v100_x8": dgx1_v100_x8,
    "rtx3090_x2_bridge": rtx3090_x2_bridge,
    "pcie_x4": pcie_x4,
    "bridged_pairs_x4": bridged_pairs_x4,
    "no_driver": no_driver,
}


# ---- NVLink traffic counters (nvmlDeviceGetFieldValues) -------------------------------------------------------
# Real 2x H200: fields 138/139 (DATA_TX/RX) and 140/141 (RAW_TX/RX) answer cumulative KiB per link, scopeId = link;
# a 10 GiB GPU0->GPU1 peer copy added ~582k KiB on each of GPU0's 18 links (TX) and GPU1's (RX), i.e. the bytes
# spread evenly over the links. nvmlDeviceGetNvLinkUtilizationCounter raises NotSupported there.
# The fake's starting counts and RAW's protocol overhead (1/16 of the data) are made up, not measured.
# NVML stamps each value with the CPU time it was sampled, in microseconds; the fake stamps time.monotonic() (so a
# test that moves that clock moves NVML's too) plus an offset that makes the stamps look like real ones.
TRAFFIC_FIELD_IDS = (pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
                     pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX)
DATA_TX, DATA_RX, RAW_TX, RAW_RX = TRAFFIC_FIELD_IDS
LINK_COUNT = pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT
STAMP_OFFSET_US = 1_764_000_000_000_000


def nvml_stamp_us() -> int:
    return STAMP_OFFSET_US + int(round(time.monotonic() * 1e6))


def _field_value(field_id, scope_id, ret, value=0, stamp=0, value_type=pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG):
    """What one entry of pynvml's c_nvmlFieldValue_t array exposes (valueType 3: unsigned long long)."""
    return types.SimpleNamespace(fieldId=field_id, scopeId=scope_id, timestamp=stamp, latencyUsec=0,
                                 valueType=value_type, nvmlReturn=ret,
                                 value=types.SimpleNamespace(ullVal=value, uiVal=value & 0xFFFFFFFF))


def _counter(gpu: FakeGpu, field_id: int, link: int) -> int:
    return gpu.counters_kib.setdefault((field_id, link), 10_000_000 + 1_000 * link + field_id)


def _fake_field_values(self, handle, fieldIds):
    """pynvml.nvmlDeviceGetFieldValues: a list of (fieldId, scopeId) tuples (or bare ids); each value carries its
    own nvmlReturn, as real NVML answers per value and fails the whole call only for a bad handle."""
    self._check("nvmlDeviceGetFieldValues")
    gpu = self._gpu(handle)
    stamp = nvml_stamp_us() if gpu.stamps else 0
    answers = []
    for request in fieldIds:
        field_id, scope = request if isinstance(request, tuple) else (request, 0)
        if field_id == LINK_COUNT and gpu.link_count_field and gpu.nvlink_supported:
            answers.append(_field_value(field_id, scope, pynvml.NVML_SUCCESS, len(gpu.links), stamp,
                                        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT))
        elif field_id not in gpu.traffic_fields or not gpu.nvlink_supported:
            answers.append(_field_value(field_id, scope, pynvml.NVML_ERROR_NOT_SUPPORTED))
        elif not 0 <= scope < len(gpu.links):
            answers.append(_field_value(field_id, scope, pynvml.NVML_ERROR_INVALID_ARGUMENT))
        else:
            answers.append(_field_value(field_id, scope, pynvml.NVML_SUCCESS, _counter(gpu, field_id, scope), stamp))
    return answers


def _fake_utilization_counter(self, handle, link, counter):
    """The deprecated per-link counter: NotSupported on H200 (and wherever the throughput fields work)."""
    self._check("nvmlDeviceGetNvLinkUtilizationCounter")
    gpu = self._gpu(handle)
    self._link(handle, link)
    if gpu.traffic_fields:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return (0, 0)


def _fake_mig_mode(self, handle):
    self._check("nvmlDeviceGetMigMode")
    gpu = self._gpu(handle)
    if gpu.mig is None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    return [gpu.mig, gpu.mig]


FakeNvml.nvmlDeviceGetFieldValues = _fake_field_values
FakeNvml.nvmlDeviceGetNvLinkUtilizationCounter = _fake_utilization_counter
FakeNvml.nvmlDeviceGetMigMode = _fake_mig_mode


def _spread(gpu: FakeGpu, field_id: int, kib: int) -> None:
    """Add `kib` over the GPU's active links evenly (the first links take the remainder), wrapping at 2**64."""
    links = [i for i, link in enumerate(gpu.links) if link.active and gpu.nvlink_supported]
    if not links:
        return  # no NVLink: the bytes went over PCIe, which these counters do not see
    share, extra = divmod(kib, len(links))
    for n, link in enumerate(links):
        value = _counter(gpu, field_id, link) + share + (1 if n < extra else 0)
        gpu.counters_kib[(field_id, link)] = value % 2**64


def transfer(machine: FakeMachine, src: int, dst: int, nbytes: int) -> None:
    """Move `nbytes` from GPU `src` to GPU `dst` over NVLink: src's TX and dst's RX counters grow (KiB, whole)."""
    kib = nbytes // 1024
    raw = kib + kib // 16
    _spread(machine.gpus[src], DATA_TX, kib)
    _spread(machine.gpus[src], RAW_TX, raw)
    _spread(machine.gpus[dst], DATA_RX, kib)
    _spread(machine.gpus[dst], RAW_RX, raw)


def ring_allreduce(machine: FakeMachine, gpus, nbytes: int) -> None:
    """The NVLink traffic of one ring all-reduce of an `nbytes` buffer: each GPU sends (and receives)
    2(n-1)/n * nbytes to its ring neighbour."""
    n = len(gpus)
    for i, gpu in enumerate(gpus):
        transfer(machine, gpu, gpus[(i + 1) % n], 2 * (n - 1) * nbytes // n)


def mixed_t4_a100():
    """NVML 0 is a Tesla T4 (PCI 17:00.0), NVML 1 an A100 PCIe (PCI 65:00.0): CUDA's default FASTEST_FIRST order
    makes the A100 CUDA device 0, so CUDA_VISIBLE_DEVICES=0 shows TensorFlow NVML's GPU 1 (not in MACHINES: it
    exists for the CUDA-order tests)."""
    gpus = [FakeGpu("Tesla T4", _pci(0x17), "GPU-t4-0", (7, 5), 15, nvlink_supported=False),
            FakeGpu("NVIDIA A100-PCIE-40GB", _pci(0x65), "GPU-a100-1", (8, 0), 40, nvlink_supported=False)]
    return FakeMachine(gpus, p2p_nvlink={}, pcie_level={(0, 1): 50})


# TensorFlow's description of mixed_t4_a100's A100 as CUDA device 0 (what device_lib reports there).
A100_AS_CUDA_0 = ("/device:GPU:0", "device: 0, name: NVIDIA A100-PCIE-40GB, pci bus id: 0000:65:00.0, "
                                   "compute capability: 8.0")
