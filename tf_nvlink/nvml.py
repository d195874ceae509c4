"""The only module that talks to NVML (through `pynvml`, from the nvidia-ml-py distribution).

Every NVML quirk we know of is handled here, so that the rest of tf_nvlink sees a clean `Topology`:

- NVSwitch boards (HGX/DGX H100, H200): every link's far end is a switch, not a GPU. Peers are found from
  the remote device type plus NVML's P2P status over NVLink, not by matching remote PCI ids.
- Links are counted by asking link 0, 1, ... until NVML answers Invalid Argument or Not Supported;
  `NVML_NVLINK_MAX_LINKS` (36 in current pynvml, 6/12/18 in old headers) is only an upper bound.
- pynvml's `NVML_P2P_CAPS_INDEX_READ` is the tuple `(0,)`, which ctypes rejects: we pass plain integers.
- NotSupported from NVLink calls (PCIe-only and consumer GPUs) means "no NVLink", not an error.
- `nvmlInit` failures (and a missing pynvml) become `Topology(error=...)`; every successful `nvmlInit` is paired
  with `nvmlShutdown`. Any other call that fails (NotSupported, Unknown, GPU lost, ...) costs that one fact, never
  the probe: the fact reads N/A (or the GPU is left out) and `Topology.warnings` says which call failed and how.

Example:
    >>> from tf_nvlink import nvml
    >>> topo = nvml.probe()           # same facts as `nvidia-smi topo -m` and `nvidia-smi nvlink -s`
    >>> topo.error or topo.label(0, 1)
    'NV18'
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Optional

from tf_nvlink.topology import (Gpu, GpuPair, NvLink, P2PStatus, PcieRelation, PciBusId, RemoteType, Topology,
                                decode_nvlink_version, link_gbps)

log = logging.getLogger("tf_nvlink")

# NVML constants, as plain integers (see the module docstring for why not pynvml's).
P2P_INDEX_NVLINK = 2
NVLINK_CAP_P2P_SUPPORTED = 0
_ERROR_INVALID_ARGUMENT = 2
_ERROR_NOT_SUPPORTED = 3
_ERROR_NO_PERMISSION = 4
_ERROR_DRIVER_NOT_LOADED = 9
_ERROR_LIBRARY_NOT_FOUND = 12
_ERROR_FUNCTION_NOT_FOUND = 13
_ERROR_GPU_IS_LOST = 15
# Newest GPUs have 18 links; never ask past this even if pynvml's constant says more.
_LINK_SEARCH_LIMIT = 64

NO_NVML_HINT = ("no NVIDIA driver / NVML: {detail}. tf_nvlink needs the NVIDIA driver (libnvidia-ml.so) to see "
                "GPUs; on a machine without GPUs it falls back to the CPU.")


def _load_pynvml():
    """The pynvml module; RuntimeError naming the fix when it cannot be imported."""
    try:
        import pynvml  # noqa: PLC0415 - imported lazily so `import tf_nvlink` stays cheap
    except ImportError as exc:  # nvidia-ml-py is a dependency, but a broken install must not stop training
        raise RuntimeError(f"pynvml cannot be imported ({exc}): pip install nvidia-ml-py") from exc
    return pynvml


def warnings_line(warnings) -> str:
    """All of a probe's warnings as one log line: the first in full, then how many more (the report lists all).

    Example:
        >>> warnings_line(("NVML GPU 0 UUID failed: Unknown Error; shown as N/A",
        ...                "NVML GPU 1 UUID failed: Unknown Error; shown as N/A"))
        'NVML GPU 0 UUID failed: Unknown Error; shown as N/A (and 1 more NVML warning: `tf-nvlink report` lists them)'
    """
    warnings = list(warnings)
    if len(warnings) <= 1:
        return warnings[0] if warnings else ""
    more = len(warnings) - 1
    return f"{warnings[0]} (and {more} more NVML warning{'s' if more > 1 else ''}: `tf-nvlink report` lists them)"


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _error_code(exc: BaseException) -> Optional[int]:
    return getattr(exc, "value", None)


class _Session:
    """Calls into one NVML module, turning "not supported"-like errors into None and remembering warnings."""

    def __init__(self, nvml: Any):
        self.nvml = nvml
        self.warnings: list[str] = []

    def query(self, what: str, fn: Callable, *args, quiet_codes: tuple[int, ...] = (_ERROR_NOT_SUPPORTED,),
              outcome: str = "shown as N/A"):
        """fn(*args), or None when NVML says this GPU cannot answer. Other errors are noted once as warnings."""
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if _error_code(exc) not in quiet_codes:
                self.warnings.append(f"NVML {what} failed: {exc}; {outcome}")
            return None


def probe(nvml: Any = None) -> Topology:
    """Read GPUs, NVLink links and pairwise connectivity from NVML.

    `nvml` is the pynvml module (default) or a stand-in with the same functions, as the tests use.
    Never raises for a machine without GPUs or driver: the result then has `error` set and no GPUs.

    Example:
        >>> topo = probe()
        >>> [g.name for g in topo.gpus], topo.nvlink_groups()
        (['NVIDIA H200', 'NVIDIA H200'], ((0, 1),))
    """
    if nvml is None:
        try:
            nvml = _load_pynvml()
        except RuntimeError as exc:
            return Topology(error=NO_NVML_HINT.format(detail=str(exc)))
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        return Topology(error=NO_NVML_HINT.format(detail=f"nvmlInit failed: {exc}"))
    except OSError as exc:  # a broken libnvidia-ml.so can surface as OSError from ctypes
        return Topology(error=NO_NVML_HINT.format(detail=f"cannot load NVML: {exc}"))
    try:
        return _probe_initialised(_Session(nvml))
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def _probe_initialised(session: _Session) -> Topology:
    nvml = session.nvml
    driver = session.query("driver version", nvml.nvmlSystemGetDriverVersion)
    nvml_version = session.query("NVML version", nvml.nvmlSystemGetNVMLVersion)
    count = session.query("device count", nvml.nvmlDeviceGetCount, quiet_codes=(),
                          outcome="no GPU listed (tf_nvlink plans as if there were none)") or 0
    handles: dict[int, Any] = {}
    gpus: list[Gpu] = []
    for index in range(count):
        handle = session.query(f"GPU {index} handle", nvml.nvmlDeviceGetHandleByIndex, index, quiet_codes=(),
                               outcome="GPU left out")
        if handle is None:
            continue  # a lost GPU is reported in warnings and left out, not a crashed probe
        gpu = _read_gpu(session, index, handle)
        if gpu is not None:
            handles[index] = handle
            gpus.append(gpu)
    pairs = [_read_pair(session, a, b, handles)
             for i, a in enumerate(gpus) for b in gpus[i + 1:]]
    return Topology(gpus=tuple(gpus), pairs=tuple(pairs), driver_version=_text(driver) if driver else None,
                    nvml_version=_text(nvml_version) if nvml_version else None,
                    warnings=tuple(dict.fromkeys(session.warnings)))


def _read_gpu(session: _Session, index: int, handle: Any) -> Optional[Gpu]:
    nvml = session.nvml
    # TensorFlow's GPUs are matched to NVML's by PCI bus id: a GPU without one cannot be used safely.
    pci = session.query(f"GPU {index} PCI info", nvml.nvmlDeviceGetPciInfo, handle, quiet_codes=(),
                        outcome="GPU left out")
    if pci is None:
        return None
    bus_id = PciBusId.try_parse(_text(getattr(pci, "busId", "")))
    if bus_id is None:
        session.warnings.append(f"GPU {index}: NVML gave no PCI bus id; GPU left out")
        return None
    name = session.query(f"GPU {index} name", nvml.nvmlDeviceGetName, handle)
    uuid = session.query(f"GPU {index} UUID", nvml.nvmlDeviceGetUUID, handle)
    capability = session.query(f"GPU {index} compute capability", nvml.nvmlDeviceGetCudaComputeCapability, handle)
    memory = session.query(f"GPU {index} memory", nvml.nvmlDeviceGetMemoryInfo, handle)
    name = _text(name) if name else "N/A"
    return Gpu(
        index=index,
        uuid=_text(uuid) if uuid else "N/A",
        name=name,
        pci_bus_id=bus_id,
        compute_capability=tuple(int(v) for v in capability) if capability else None,
        memory_total_mib=int(memory.total) // 2**20 if memory is not None else None,
        memory_free_mib=int(memory.free) // 2**20 if memory is not None else None,
        links=_read_links(session, index, handle, name),
    )


def _read_links(session: _Session, index: int, handle: Any, gpu_name: str) -> tuple[NvLink, ...]:
    nvml = session.nvml
    links = []
    for link in range(_LINK_SEARCH_LIMIT):
        try:
            state = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as exc:
            if _error_code(exc) not in (_ERROR_INVALID_ARGUMENT, _ERROR_NOT_SUPPORTED):
                session.warnings.append(f"GPU {index} NVLink {link} state failed: {exc}; links from here on "
                                        "not counted")
            break  # past the last link (Invalid Argument) or no NVLink at all (Not Supported)
        active = bool(state)
        version = remote_type = remote_pci = None
        if active:
            version = session.query(f"GPU {index} NVLink {link} version", nvml.nvmlDeviceGetNvLinkVersion,
                                    handle, link)
            remote_type = session.query(f"GPU {index} NVLink {link} remote type",
                                        nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link)
            remote = session.query(f"GPU {index} NVLink {link} remote PCI", nvml.nvmlDeviceGetNvLinkRemotePciInfo,
                                   handle, link)
            remote_pci = PciBusId.try_parse(_text(remote.busId)) if remote is not None else None
        decoded = decode_nvlink_version(version)
        links.append(NvLink(index=link, active=active, version=decoded,
                            gbps=link_gbps(decoded, gpu_name) if active else 0.0,
                            remote_type=RemoteType.from_nvml(remote_type), remote_pci=remote_pci))
    return tuple(links)


def _read_pair(session: _Session, a: Gpu, b: Gpu, handles: dict[int, Any]) -> GpuPair:
    nvml = session.nvml
    ha, hb = handles[a.index], handles[b.index]
    status = session.query(f"GPU {a.index}-{b.index} NVLink P2P status", nvml.nvmlDeviceGetP2PStatus, ha, hb,
                           P2P_INDEX_NVLINK)
    level = session.query(f"GPU {a.index}-{b.index} PCIe topology", nvml.nvmlDeviceGetTopologyCommonAncestor,
                          ha, hb)
    p2p = P2PStatus.from_nvml(status) if status is not None else P2PStatus.UNKNOWN
    direct_ab = [lk for lk in a.links_to(RemoteType.GPU) if lk.remote_pci == b.pci_bus_id]
    direct_ba = [lk for lk in b.links_to(RemoteType.GPU) if lk.remote_pci == a.pci_bus_id]
    direct = max(len(direct_ab), len(direct_ba))
    switch_a, switch_b = a.links_to(RemoteType.NVSWITCH), b.links_to(RemoteType.NVSWITCH)
    # Both GPUs hang off switches, and the driver says NVLink P2P works between them (UNKNOWN when NVML
    # cannot say: give the switches the benefit of the doubt, as nvidia-smi's matrix does).
    via_switch = bool(switch_a and switch_b) and p2p in (P2PStatus.OK, P2PStatus.UNKNOWN)
    direct_gbps = sum(lk.gbps for lk in (direct_ab if len(direct_ab) >= len(direct_ba) else direct_ba))
    switch_gbps = min(sum(lk.gbps for lk in switch_a), sum(lk.gbps for lk in switch_b)) if via_switch else 0.0
    return GpuPair(a=a.index, b=b.index, direct_links=direct, via_nvswitch=via_switch, p2p_nvlink=p2p,
                   pcie=PcieRelation.from_nvml(level), nvlink_gbps=round(direct_gbps + switch_gbps, 3),
                   switch_links=min(len(switch_a), len(switch_b)) if via_switch else 0)
