"""The only module that talks to NVML (through `pynvml`, from the nvidia-ml-py distribution).

Every NVML quirk we know of is handled here, so that the rest of tf_nvlink sees a clean `Topology`:

- NVSwitch boards (HGX/DGX H100, H200): every link's far end is a switch, not a GPU. Peers are found from
  the remote device type plus NVML's P2P status over NVLink, not by matching remote PCI ids.
- Links: the count NVML states (NVML_FI_DEV_NVLINK_LINK_COUNT); where NVML does not answer it, link 0, 1, ... are
  asked until NVML answers Invalid Argument or Not Supported. `NVML_NVLINK_MAX_LINKS` (36 in current pynvml,
  6/12/18 in old headers) is not a link count.
- NVLink traffic counters are read by pynvml's named field ids (NVML_FI_DEV_NVLINK_THROUGHPUT_*), and each value
  keeps NVML's own timestamp, so a rate divides by the time between NVML's two samples, not between our calls.
- pynvml's `NVML_P2P_CAPS_INDEX_READ` is the tuple `(0,)`, which ctypes rejects: we pass plain integers.
- NotSupported from NVLink calls (PCIe-only and consumer GPUs) means "no NVLink", not an error.
- `nvmlInit` failures (and a missing pynvml) become `Topology(error=...)`; every successful `nvmlInit` is paired
  with `nvmlShutdown`. Any other call that fails (NotSupported, Unknown, GPU lost, ...) costs that one fact, never
  the probe: the fact reads N/A (or the GPU is left out) and `Topology.warnings` says which call failed and how.

Example:
    >>> from tf_nvlink.machine import nvml
    >>> topo = nvml.probe()           # same facts as `nvidia-smi topo -m` and `nvidia-smi nvlink -s`
    >>> topo.error or topo.label(0, 1)
    'NV18'
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Callable, Iterable, NamedTuple, Optional

from tf_nvlink.machine.topology import (Gpu, GpuPair, NvLink, P2PStatus, PcieRelation, PciBusId, RemoteType, Topology,
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
    count = nvlink_link_count(nvml, handle)  # None: NVML does not say; ask until Invalid Argument
    for link in range(_LINK_SEARCH_LIMIT if count is None else count):
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


# ---- NVLink traffic counters (cumulative KiB per link; tf_nvlink.machine.nvlink_traffic turns them into deltas, rates) ----
# nvmlDeviceGetFieldValues field ids, link index as scopeId. DATA: payload; RAW: payload and protocol. Each is
# pynvml's named constant (`field_ids(nvml)`); the numbers here are nvml.h's, for a pynvml too old to name them.
TRAFFIC_FIELD_NAMES = {"data_tx": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", "data_rx": "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
                       "raw_tx": "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX", "raw_rx": "NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX"}
TRAFFIC_FIELDS = {"data_tx": 138, "data_rx": 139, "raw_tx": 140, "raw_rx": 141}
# The number of NVLink links a GPU has (nvml.h NVML_FI_DEV_NVLINK_LINK_COUNT, scopeId 0).
LINK_COUNT_FIELD_NAME, LINK_COUNT_FIELD = "NVML_FI_DEV_NVLINK_LINK_COUNT", 91
_SUCCESS, _MIG_ENABLED = 0, 1  # nvmlReturn_t success; nvmlDeviceGetMigMode's 'enabled'
# nvmlValueType_t -> (c_nvmlValue_t member, counter width in bits; the counter wraps at 2**bits)
_VALUE_MEMBERS = {0: ("dVal", 64), 1: ("uiVal", 32), 2: ("ulVal", 64), 3: ("ullVal", 64), 4: ("sllVal", 63),
                  5: ("siVal", 31), 6: ("usVal", 16)}
NO_THROUGHPUT_FIELDS = ("NVML has no NVLink throughput counters (NVML_FI_DEV_NVLINK_THROUGHPUT_DATA/RAW_TX/RX) on "
                        "this GPU or driver")


def field_ids(nvml: Any) -> dict[str, int]:
    """{"data_tx": id, ...}: pynvml's named NVLink throughput field ids (nvml.h's numbers where it has no name)."""
    return {key: int(getattr(nvml, name, TRAFFIC_FIELDS[key])) for key, name in TRAFFIC_FIELD_NAMES.items()}


def nvlink_link_count(nvml: Any, handle: Any) -> Optional[int]:
    """The GPU's NVLink link count as NVML states it (NVML_FI_DEV_NVLINK_LINK_COUNT); None where NVML does not
    answer it (older drivers, a failed call): the caller then asks link 0, 1, ... until Invalid Argument."""
    field = int(getattr(nvml, LINK_COUNT_FIELD_NAME, LINK_COUNT_FIELD))
    try:
        answers = list(nvml.nvmlDeviceGetFieldValues(handle, [(field, 0)]))
    except (nvml.NVMLError, AttributeError, TypeError):
        return None
    if len(answers) != 1 or int(answers[0].nvmlReturn) != _SUCCESS:
        return None
    member, _ = _VALUE_MEMBERS.get(int(answers[0].valueType), ("uiVal", 32))
    count = int(getattr(answers[0].value, member))
    return count if 0 <= count <= _LINK_SEARCH_LIMIT else None


class CounterValue(NamedTuple):
    """One cumulative NVLink counter as NVML read it."""

    field: str  # a key of TRAFFIC_FIELDS: "data_tx", "data_rx", "raw_tx", "raw_rx"
    link: int  # NVLink index (NVML scopeId)
    kib: int  # KiB counted since the driver loaded (NVML's unit)
    bits: int  # counter width: it wraps to 0 after 2**bits - 1 KiB
    at_us: int = 0  # NVML's timestamp of this value (microseconds, CPU clock); 0 where NVML gave none


class GpuCounters(NamedTuple):
    """Every supported NVLink counter of one GPU, read by one nvmlDeviceGetFieldValues call."""

    gpu: int  # NVML (nvidia-smi) index
    read_at_s: float  # time.monotonic() seconds when the values came back (rates use the values' own `at_us`)
    values: tuple  # CounterValue per (field, active link); empty when `error` is set
    error: Optional[str] = None  # why this read gave no values (the GPU fell off, NVML failed)

    def kib(self, field: str) -> int:
        """The sum over links of one field in KiB (not wrap-safe: nvlink_traffic.traffic_delta for differences)."""
        return sum(v.kib for v in self.values if v.field == field)


class NvLinkCounterReader:
    """NVLink TX/RX counters of chosen GPUs, cheap to read repeatedly: NVML is opened once (handles, active links,
    which fields this driver answers), then each `read()` is one nvmlDeviceGetFieldValues call per GPU.

    GPUs whose counters cannot be read are in `unavailable` ({gpu: why}), never an exception: no NVML, PCIe-only
    GPUs, MIG, no active link, fields not supported (older drivers, GPUs). `error` says why no GPU at all.

    Example:
        >>> with NvLinkCounterReader([0, 1]) as reader:
        ...     before = reader.read()            # {0: GpuCounters(...), 1: GpuCounters(...)}
        ...     run_training_steps()
        ...     after = reader.read()                # reader.unavailable: {} on 2x H200
    """

    def __init__(self, gpus: Optional[Iterable[int]] = None, nvml: Any = None, payload_only: bool = False):
        self.gpus = tuple(int(g) for g in gpus) if gpus is not None else None  # None: every GPU NVML lists
        self._nvml, self.payload_only = nvml, payload_only  # True: no RAW fields where DATA answers (half the values)
        self._initialised, self._handles = False, {}
        self._requests: dict[int, list[tuple[int, int]]] = {}  # gpu -> [(field id, link), ...]
        self.unavailable: dict[int, str] = {}
        self.error: Optional[str] = None

    @property
    def readable(self) -> tuple[int, ...]:
        """The GPUs whose counters `read()` returns."""
        return tuple(g for g in self.gpus or () if g in self._requests)

    def open(self) -> "NvLinkCounterReader":
        nvml = self._nvml
        if nvml is None:
            try:
                nvml = self._nvml = _load_pynvml()
            except RuntimeError as exc:
                return self._fail(f"no NVML: {exc}")
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            return self._fail(f"no NVIDIA driver / NVML (nvmlInit failed: {exc})")
        except OSError as exc:
            return self._fail(f"cannot load NVML: {exc}")
        self._initialised = True
        if self.gpus is None:
            try:
                self.gpus = tuple(range(nvml.nvmlDeviceGetCount()))
            except nvml.NVMLError as exc:
                return self._fail(f"NVML cannot count the GPUs: {exc}")
        for gpu in self.gpus:
            why = self._prepare(nvml, gpu)
            if why:
                self.unavailable[gpu] = why
        return self

    def _fail(self, why: str) -> "NvLinkCounterReader":
        self.error = why
        self.unavailable = {gpu: why for gpu in self.gpus or ()}
        return self

    def _prepare(self, nvml: Any, gpu: int) -> Optional[str]:
        """Set up one GPU's request; the reason its counters cannot be read, or None."""
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu)
        except nvml.NVMLError as exc:
            return f"NVML has no GPU {gpu} ({exc})"
        try:
            if nvml.nvmlDeviceGetMigMode(handle)[0] == _MIG_ENABLED:
                return "MIG mode is on: NVLink is not used between MIG instances, and its counters are not exposed"
        except nvml.NVMLError:
            pass  # NotSupported: a GPU without MIG
        count = nvlink_link_count(nvml, handle)
        links = []
        for link in range(_LINK_SEARCH_LIMIT if count is None else count):
            try:
                if nvml.nvmlDeviceGetNvLinkState(handle, link):
                    links.append(link)
            except nvml.NVMLError as exc:
                if link == 0 and _error_code(exc) == _ERROR_NOT_SUPPORTED:
                    return "no NVLink (a PCIe-only GPU: NVML answers Not Supported for its NVLink state)"
                if count is None:
                    break  # Invalid Argument: past the last link
        if not links:
            return "no active NVLink link"
        ids = field_ids(nvml)
        request = [(field_id, link) for field_id in ids.values() for link in links]
        try:
            answers = list(nvml.nvmlDeviceGetFieldValues(handle, request))
        except nvml.NVMLError as exc:
            return f"nvmlDeviceGetFieldValues failed: {exc}"
        failed_fields = {int(a.fieldId) for a in answers if int(a.nvmlReturn) != _SUCCESS}
        fields = [f for f in ids.values() if f not in failed_fields]
        data = [ids["data_tx"], ids["data_rx"]]
        if self.payload_only and set(data) <= set(fields):
            fields = data
        if not fields:
            return NO_THROUGHPUT_FIELDS + _utilization_note(nvml, handle, links[0])
        self._handles[gpu] = handle
        self._requests[gpu] = [(field_id, link) for field_id in fields for link in links]
        return None

    def read(self) -> dict[int, GpuCounters]:
        """{gpu: GpuCounters} for the readable GPUs: one nvmlDeviceGetFieldValues call each."""
        nvml = self._nvml
        names = {v: k for k, v in field_ids(nvml).items()}
        result = {}
        for gpu in self.readable:
            try:
                answers = nvml.nvmlDeviceGetFieldValues(self._handles[gpu], self._requests[gpu])
            except nvml.NVMLError as exc:
                result[gpu] = GpuCounters(gpu, time.monotonic(), (), f"nvmlDeviceGetFieldValues failed: {exc}")
                continue
            now = time.monotonic()
            values = []
            for answer in answers:
                if int(answer.nvmlReturn) != _SUCCESS:
                    continue  # this value alone failed; its field's delta is left out (nvlink_traffic.traffic_delta)
                member, bits = _VALUE_MEMBERS.get(int(answer.valueType), ("ullVal", 64))
                values.append(CounterValue(names[int(answer.fieldId)], int(answer.scopeId),
                                           int(getattr(answer.value, member)), bits,
                                           max(0, int(getattr(answer, "timestamp", 0) or 0))))
            result[gpu] = GpuCounters(gpu, now, tuple(values))
        return result

    def close(self) -> None:
        if self._initialised:
            self._initialised = False
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()

    def __enter__(self) -> "NvLinkCounterReader":
        return self.open()

    def __exit__(self, *exc_info) -> None:
        self.close()


def _utilization_note(nvml: Any, handle: Any, link: int) -> str:
    """Older GPUs and drivers answer only the deprecated utilization counter, which needs root to set up."""
    try:
        nvml.nvmlDeviceGetNvLinkUtilizationCounter(handle, link, 0)
    except (nvml.NVMLError, AttributeError):
        return ""
    return (" (only the deprecated nvmlDeviceGetNvLinkUtilizationCounter answers; its unit must be set by root "
            "with nvmlDeviceSetNvLinkUtilizationControl, so tf_nvlink does not read it)")
