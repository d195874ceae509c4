"""GPUs, NVLink links and pairwise connectivity as plain data.

No TensorFlow and no NVML here: `tf_nvlink.machine.nvml` fills these records from the driver, tests fill them from fakes,
and everything else (policy, report, strategy) reads them.

Example:
    >>> topo = Topology(gpus=(gpu0, gpu1), pairs=(pair01,))
    >>> topo.label(0, 1)        # what `nvidia-smi topo -m` prints
    'NV18'
    >>> topo.nvlink_groups()
    ((0, 1),)
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
from typing import Iterable, Optional

# NVML's nvmlDeviceGetNvLinkVersion returns an enum, not a generation (nvml.h, NVML_NVLINK_VERSION_*).
NVLINK_VERSION_NAMES = {1: "1.0", 2: "2.0", 3: "2.2", 4: "3.0", 5: "3.1", 6: "4.0", 7: "5.0", 8: "6.0"}

# GB/s per link per direction, as `nvidia-smi nvlink -s` shows them, by decoded version.
_GBPS_BY_VERSION = {"1.0": 20.0, "2.0": 25.781, "2.2": 25.781, "3.0": 25.0, "3.1": 25.0, "4.0": 26.562,
                    "5.0": 53.125, "6.0": 106.25}
# GeForce/RTX bridges run their links slower than the data-centre parts of the same generation
# (RTX 3090: 4 links, 56.25 GB/s per direction in all).
_GBPS_CONSUMER = 14.0625


def link_gbps(version: Optional[str], gpu_name: str = "") -> float:
    """GB/s per direction of one NVLink link of `version` ("4.0") on a GPU called `gpu_name`; 0.0 if unknown.

    Example:
        >>> link_gbps("4.0", "NVIDIA H200")
        26.562
    """
    if version is None:
        return 0.0
    if re.search(r"GeForce|RTX\s*[2-5]0\d0|TITAN", gpu_name, re.IGNORECASE):
        return _GBPS_CONSUMER
    return _GBPS_BY_VERSION.get(version, 0.0)


def decode_nvlink_version(enum_value: Optional[int]) -> Optional[str]:
    """NVML's NVLink version enum to the marketing version: 6 -> "4.0"; None for unknown values."""
    return NVLINK_VERSION_NAMES.get(enum_value) if enum_value is not None else None


@dataclasses.dataclass(frozen=True, order=True)
class PciBusId:
    """A PCI address. NVML writes `00000000:00:06.0`, TensorFlow `0000:00:06.0`: parse both, compare integers.

    Example:
        >>> PciBusId.parse("00000000:00:06.0") == PciBusId.parse("0000:00:06.0")
        True
    """

    domain: int
    bus: int
    device: int
    function: int

    _PATTERN = re.compile(r"^\s*(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])\s*$")

    @classmethod
    def parse(cls, text: str) -> "PciBusId":
        match = cls._PATTERN.match(text or "")
        if not match:
            raise ValueError(f"Not a PCI bus id: {text!r}; expected DOMAIN:BUS:DEVICE.FUNCTION such as "
                             "'00000000:00:06.0' or '0000:00:06.0'.")
        domain, bus, device, function = match.groups()
        return cls(int(domain or "0", 16), int(bus, 16), int(device, 16), int(function, 16))

    @classmethod
    def try_parse(cls, text: Optional[str]) -> Optional["PciBusId"]:
        """Like `parse`, but None for what NVML says of a switch link's far end: empty text (seen on VMs), all
        zeros, or all ones (`ffffffff:ff:ff.0`, read on the 2x H200 machine)."""
        try:
            parsed = cls.parse(text or "")
        except ValueError:
            return None
        return None if parsed in (cls(0, 0, 0, 0), cls(0xFFFFFFFF, 0xFF, 0x1F, 7), cls(0xFFFFFFFF, 0xFF, 0xFF, 0)) \
            else parsed

    def __str__(self) -> str:
        return f"{self.domain:04x}:{self.bus:02x}:{self.device:02x}.{self.function:x}"


class RemoteType(str, enum.Enum):
    """What the far end of an NVLink link is (nvmlDeviceGetNvLinkRemoteDeviceType)."""

    GPU = "GPU"
    NVSWITCH = "NVSwitch"
    CPU = "CPU"
    UNKNOWN = "unknown"

    @classmethod
    def from_nvml(cls, value: Optional[int]) -> "RemoteType":
        return {0: cls.GPU, 1: cls.CPU, 2: cls.NVSWITCH}.get(value, cls.UNKNOWN)


class PcieRelation(str, enum.Enum):
    """PCIe path between two GPUs (nvmlDeviceGetTopologyCommonAncestor), named as `nvidia-smi topo -m` does."""

    INTERNAL = "X"  # the same board (multi-GPU cards)
    PIX = "PIX"  # one PCIe switch
    PXB = "PXB"  # several PCIe switches, no host bridge
    PHB = "PHB"  # through a PCIe host bridge
    NODE = "NODE"  # host bridges within one NUMA node
    SYS = "SYS"  # across NUMA nodes (SMP interconnect)
    UNKNOWN = "N/A"

    @classmethod
    def from_nvml(cls, level: Optional[int]) -> "PcieRelation":
        return {0: cls.INTERNAL, 10: cls.PIX, 20: cls.PXB, 30: cls.PHB, 40: cls.NODE, 50: cls.SYS}.get(
            level, cls.UNKNOWN)


class P2PStatus(str, enum.Enum):
    """nvmlDeviceGetP2PStatus results."""

    OK = "OK"
    CHIPSET_NOT_SUPPORTED = "chipset not supported"
    GPU_NOT_SUPPORTED = "GPU not supported"
    IOH_TOPOLOGY_NOT_SUPPORTED = "IOH topology not supported"
    DISABLED_BY_REGKEY = "disabled by regkey"
    NOT_SUPPORTED = "not supported"
    UNKNOWN = "unknown"

    @classmethod
    def from_nvml(cls, value: Optional[int]) -> "P2PStatus":
        order = [cls.OK, cls.CHIPSET_NOT_SUPPORTED, cls.GPU_NOT_SUPPORTED, cls.IOH_TOPOLOGY_NOT_SUPPORTED,
                 cls.DISABLED_BY_REGKEY, cls.NOT_SUPPORTED, cls.UNKNOWN]
        return order[value] if isinstance(value, int) and 0 <= value < len(order) else cls.UNKNOWN


@dataclasses.dataclass(frozen=True)
class NvLink:
    """One NVLink link of a GPU."""

    index: int
    active: bool
    version: Optional[str]  # decoded, e.g. "4.0"
    gbps: float  # GB/s per direction
    remote_type: RemoteType
    remote_pci: Optional[PciBusId]


@dataclasses.dataclass(frozen=True)
class Gpu:
    """One GPU as NVML sees it. `index` is NVML's (and nvidia-smi's) index."""

    index: int
    uuid: str
    name: str
    pci_bus_id: PciBusId
    compute_capability: Optional[tuple[int, int]]
    memory_total_mib: Optional[int]
    memory_free_mib: Optional[int]
    links: tuple[NvLink, ...] = ()

    @property
    def active_links(self) -> tuple[NvLink, ...]:
        return tuple(link for link in self.links if link.active)

    @property
    def nvlink_version(self) -> Optional[str]:
        versions = sorted({link.version for link in self.active_links if link.version})
        return "/".join(versions) if versions else None

    @property
    def nvlink_gbps(self) -> float:
        """Total NVLink GB/s per direction over the active links."""
        return round(sum(link.gbps for link in self.active_links), 3)

    def links_to(self, remote_type: RemoteType) -> tuple[NvLink, ...]:
        return tuple(link for link in self.active_links if link.remote_type == remote_type)


@dataclasses.dataclass(frozen=True)
class GpuPair:
    """How GPUs `a` < `b` are connected."""

    a: int
    b: int
    direct_links: int  # active links whose far end is the other GPU
    via_nvswitch: bool  # both reach the same NVSwitch fabric and NVML reports NVLink P2P
    p2p_nvlink: P2PStatus
    pcie: PcieRelation
    nvlink_gbps: float  # expected GB/s per direction over NVLink, 0.0 without NVLink
    switch_links: int = 0  # links of the less-connected GPU into the switches (nvidia-smi's NV# on HGX)

    @property
    def nvlink(self) -> bool:
        return self.direct_links > 0 or self.via_nvswitch


@dataclasses.dataclass(frozen=True)
class Topology:
    """The GPUs of one machine and how they are connected.

    `error` is set when NVML could not be read at all (no driver, no library); then `gpus` is empty.
    """

    gpus: tuple[Gpu, ...] = ()
    pairs: tuple[GpuPair, ...] = ()
    driver_version: Optional[str] = None
    nvml_version: Optional[str] = None
    error: Optional[str] = None
    warnings: tuple[str, ...] = ()

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(gpu.index for gpu in self.gpus)

    def gpu(self, index: int) -> Gpu:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"No GPU with NVML index {index}; this machine has {list(self.indices)}.")

    def pair(self, a: int, b: int) -> GpuPair:
        low, high = sorted((a, b))
        for pair in self.pairs:
            if (pair.a, pair.b) == (low, high):
                return pair
        raise KeyError(f"No GPU pair ({a}, {b}); this machine has GPUs {list(self.indices)}.")

    def label(self, a: int, b: int) -> str:
        """The `nvidia-smi topo -m` cell for GPUs a and b: "X", "NV18", "PHB", ..."""
        if a == b:
            return "X"
        pair = self.pair(a, b)
        if pair.direct_links:
            return f"NV{pair.direct_links}"
        if pair.via_nvswitch:
            return f"NV{pair.switch_links}"
        return pair.pcie.value

    def is_nvlink_connected(self, indices: Iterable[int]) -> bool:
        """True when every two of `indices` talk over NVLink (directly or through NVSwitch)."""
        chosen = sorted(set(indices))
        return all(self.pair(a, b).nvlink for i, a in enumerate(chosen) for b in chosen[i + 1:])

    def nvlink_groups(self) -> tuple[tuple[int, ...], ...]:
        """Connected components of the NVLink graph, largest first (a GPU without NVLink is its own group).

        Components, not cliques: on a DGX-1 cube-mesh all 8 GPUs form one group although not every pair is
        linked; use `is_nvlink_connected` for "every pair".
        """
        parent = {index: index for index in self.indices}

        def root(i: int) -> int:
            while parent[i] != i:
                parent[i] = parent[parent[i]]
                i = parent[i]
            return i

        for pair in self.pairs:
            if pair.nvlink:
                parent[root(pair.a)] = root(pair.b)
        groups: dict[int, list[int]] = {}
        for index in self.indices:
            groups.setdefault(root(index), []).append(index)
        return tuple(sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: (-len(g), g)))

    def min_pair_gbps(self, indices: Iterable[int]) -> float:
        """The slowest NVLink pair among `indices` (0.0 if any pair lacks NVLink)."""
        chosen = sorted(set(indices))
        rates = [self.pair(a, b).nvlink_gbps for i, a in enumerate(chosen) for b in chosen[i + 1:]]
        return min(rates) if rates else 0.0

    def shape(self, indices: Optional[Iterable[int]] = None) -> str:
        """A one-word shape of the chosen GPUs: none, single, nvswitch, nvlink-all, nvlink-partial, pcie."""
        chosen = sorted(set(self.indices if indices is None else indices))
        if not chosen:
            return "none"
        if len(chosen) == 1:
            return "single"
        pairs = [self.pair(a, b) for i, a in enumerate(chosen) for b in chosen[i + 1:]]
        if all(p.via_nvswitch for p in pairs):
            return "nvswitch"
        if all(p.nvlink for p in pairs):
            return "nvlink-all"
        if any(p.nvlink for p in pairs):
            return "nvlink-partial"
        return "pcie"

    def fingerprint(self) -> str:
        """A stable 12-hex-digit id of the hardware and wiring (not of free memory or the driver's mood)."""
        wiring = {
            "gpus": [[g.name, str(g.pci_bus_id), list(g.compute_capability or ()), g.memory_total_mib,
                      len(g.active_links), g.nvlink_version] for g in self.gpus],
            "pairs": [[p.a, p.b, p.direct_links, p.via_nvswitch, p.pcie.value] for p in self.pairs],
        }
        text = json.dumps(wiring, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def to_dict(self) -> dict:
        """Plain JSON-ready data (enums as their names, PCI ids as strings)."""

        def convert(value):
            if isinstance(value, enum.Enum):
                return value.value
            if isinstance(value, PciBusId):
                return str(value)
            if isinstance(value, (list, tuple)):
                return [convert(v) for v in value]
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            return value

        gpus = []
        for gpu in self.gpus:
            record = convert({f.name: getattr(gpu, f.name) for f in dataclasses.fields(gpu) if f.name != "links"})
            # Not dataclasses.asdict: it would turn each link's remote PciBusId into a dict of integers.
            record["links"] = [convert({f.name: getattr(link, f.name) for f in dataclasses.fields(link)})
                               for link in gpu.links]
            record["active_links"] = len(gpu.active_links)
            record["nvlink_version"] = gpu.nvlink_version
            record["nvlink_gbps"] = gpu.nvlink_gbps
            gpus.append(record)
        pairs = []
        for pair in self.pairs:
            record = convert(dataclasses.asdict(pair))
            record["nvlink"] = pair.nvlink
            record["label"] = self.label(pair.a, pair.b)
            pairs.append(record)
        return {
            "gpus": gpus,
            "pairs": pairs,
            "driver_version": self.driver_version,
            "nvml_version": self.nvml_version,
            "error": self.error,
            "warnings": list(self.warnings),
            "nvlink_groups": [list(g) for g in self.nvlink_groups()],
            "fingerprint": self.fingerprint(),
        }
