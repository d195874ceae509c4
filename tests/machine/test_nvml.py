"""tf_nvlink.machine.nvml.probe against every fake machine (exact topology), NVML error handling, and the real pynvml."""

import sys

import pynvml
import pytest

import fake_nvml
from fake_nvml import FakeNvml
from tf_nvlink.machine import nvml
from tf_nvlink.machine.topology import PcieRelation, RemoteType, Topology


def _rows(*rows):
    """["X NV18", "NV18 X"] -> [["X", "NV18"], ["NV18", "X"]]"""
    return [row.split() for row in rows]


# What each fake machine must probe to. `labels` is `nvidia-smi topo -m`, `pcie` the PCIe-only relation,
# `direct` the direct GPU-GPU link counts (0 for NVSwitch boards, whose links all end at switches).
EXPECTED = {
    "h200_x2": dict(
        names=["NVIDIA H200"] * 2, pcis=["0000:00:06.0", "0000:00:07.0"], links=[18, 18], version="4.0",
        link_gbps=26.562, total_gbps=478.116, remote={RemoteType.NVSWITCH}, via_nvswitch=True,
        labels=_rows("X NV18", "NV18 X"), pcie=_rows("X PHB", "PHB X"), direct=_rows("0 0", "0 0"),
        pair_gbps=478.116, groups=((0, 1),), connected=True, kind="nvswitch"),
    "h100_hgx_x8": dict(
        names=["NVIDIA H100 80GB HBM3"] * 8,
        pcis=["0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0", "0000:9a:00.0", "0000:ab:00.0",
              "0000:ba:00.0", "0000:db:00.0"],
        links=[18] * 8, version="4.0", link_gbps=26.562, total_gbps=478.116, remote={RemoteType.NVSWITCH},
        via_nvswitch=True,
        labels=[["X" if a == b else "NV18" for b in range(8)] for a in range(8)],
        pcie=_rows("X    PXB  NODE NODE SYS  SYS  SYS  SYS",
                   "PXB  X    NODE NODE SYS  SYS  SYS  SYS",
                   "NODE NODE X    PXB  SYS  SYS  SYS  SYS",
                   "NODE NODE PXB  X    SYS  SYS  SYS  SYS",
                   "SYS  SYS  SYS  SYS  X    PXB  NODE NODE",
                   "SYS  SYS  SYS  SYS  PXB  X    NODE NODE",
                   "SYS  SYS  SYS  SYS  NODE NODE X    PXB",
                   "SYS  SYS  SYS  SYS  NODE NODE PXB  X"),
        direct=[["0"] * 8 for _ in range(8)], pair_gbps=478.116, groups=(tuple(range(8)),), connected=True,
        kind="nvswitch"),
    "dgx1_v100_x8": dict(
        names=["Tesla V100-SXM2-16GB"] * 8,
        pcis=["0000:06:00.0", "0000:07:00.0", "0000:0a:00.0", "0000:0b:00.0", "0000:85:00.0", "0000:86:00.0",
              "0000:89:00.0", "0000:8a:00.0"],
        links=[6] * 8, version="2.0", link_gbps=25.781, total_gbps=154.686, remote={RemoteType.GPU},
        via_nvswitch=False,
        labels=_rows(*fake_nvml.DGX1_TOPO_MATRIX),
        pcie=_rows("X    PIX  NODE NODE SYS  SYS  SYS  SYS",
                   "PIX  X    NODE NODE SYS  SYS  SYS  SYS",
                   "NODE NODE X    PIX  SYS  SYS  SYS  SYS",
                   "NODE NODE PIX  X    SYS  SYS  SYS  SYS",
                   "SYS  SYS  SYS  SYS  X    PIX  NODE NODE",
                   "SYS  SYS  SYS  SYS  PIX  X    NODE NODE",
                   "SYS  SYS  SYS  SYS  NODE NODE X    PIX",
                   "SYS  SYS  SYS  SYS  NODE NODE PIX  X"),
        direct=_rows("0 1 1 2 2 0 0 0",
                     "1 0 2 1 0 2 0 0",
                     "1 2 0 2 0 0 1 0",
                     "2 1 2 0 0 0 0 1",
                     "2 0 0 0 0 1 1 2",
                     "0 2 0 0 1 0 2 1",
                     "0 0 1 0 1 2 0 2",
                     "0 0 0 1 2 1 2 0"),
        pair_gbps=None, groups=(tuple(range(8)),), connected=False, kind="nvlink-partial"),
    "rtx3090_x2_bridge": dict(
        names=["NVIDIA GeForce RTX 3090"] * 2, pcis=["0000:01:00.0", "0000:21:00.0"], links=[4, 4],
        version="3.1", link_gbps=14.0625, total_gbps=56.25, remote={RemoteType.GPU}, via_nvswitch=False,
        labels=_rows("X NV4", "NV4 X"), pcie=_rows("X NODE", "NODE X"), direct=_rows("0 4", "4 0"),
        pair_gbps=56.25, groups=((0, 1),), connected=True, kind="nvlink-all"),
    "pcie_x4": dict(
        names=["NVIDIA L40S"] * 4, pcis=["0000:17:00.0", "0000:37:00.0", "0000:57:00.0", "0000:77:00.0"],
        links=[0] * 4, version=None, link_gbps=None, total_gbps=0.0, remote=set(), via_nvswitch=False,
        labels=_rows("X PIX PHB PHB", "PIX X PHB PHB", "PHB PHB X PIX", "PHB PHB PIX X"),
        pcie=_rows("X PIX PHB PHB", "PIX X PHB PHB", "PHB PHB X PIX", "PHB PHB PIX X"),
        direct=[["0"] * 4 for _ in range(4)], pair_gbps=0.0, groups=((0,), (1,), (2,), (3,)), connected=False,
        kind="pcie"),
    "bridged_pairs_x4": dict(
        names=["NVIDIA A100 80GB PCIe"] * 4, pcis=["0000:17:00.0", "0000:31:00.0", "0000:b1:00.0", "0000:ca:00.0"],
        links=[12] * 4, version="3.1", link_gbps=25.0, total_gbps=300.0, remote={RemoteType.GPU},
        via_nvswitch=False,
        labels=_rows("X NV12 SYS SYS", "NV12 X SYS SYS", "SYS SYS X NV12", "SYS SYS NV12 X"),
        pcie=_rows("X NODE SYS SYS", "NODE X SYS SYS", "SYS SYS X NODE", "SYS SYS NODE X"),
        direct=_rows("0 12 0 0", "12 0 0 0", "0 0 0 12", "0 0 12 0"),
        pair_gbps=None, groups=((0, 1), (2, 3)), connected=False, kind="nvlink-partial"),
}


def test_every_fake_machine_has_expectations():
    assert set(EXPECTED) | {"no_driver"} == set(fake_nvml.MACHINES)


@pytest.fixture(params=sorted(EXPECTED))
def probed(request):
    fake = FakeNvml(fake_nvml.MACHINES[request.param]())
    return request.param, nvml.probe(fake), fake, EXPECTED[request.param]


def test_gpus(probed):
    _, topo, _, want = probed
    assert topo.error is None and topo.warnings == ()
    assert topo.driver_version == "580.159.04" and topo.nvml_version == "13.580.159.04"
    assert topo.indices == tuple(range(len(want["names"])))
    assert [g.name for g in topo.gpus] == want["names"]
    assert [str(g.pci_bus_id) for g in topo.gpus] == want["pcis"]
    assert [len(g.active_links) for g in topo.gpus] == want["links"]
    assert [len(g.links) for g in topo.gpus] == want["links"]  # every link the fake has is active
    assert {g.nvlink_version for g in topo.gpus} == {want["version"]}
    for gpu in topo.gpus:
        assert {link.gbps for link in gpu.active_links} == ({want["link_gbps"]} if want["links"][0] else set())
        assert gpu.nvlink_gbps == want["total_gbps"]
        assert {link.remote_type for link in gpu.active_links} == want["remote"]
        assert gpu.uuid.startswith("GPU-")
        assert gpu.memory_total_mib and gpu.memory_free_mib == gpu.memory_total_mib - 600


def test_h200_total_is_18_links_of_26_562():
    gpu = nvml.probe(FakeNvml(fake_nvml.h200_x2())).gpu(0)
    assert gpu.nvlink_gbps == round(18 * 26.562, 3) == 478.116
    assert gpu.compute_capability == (9, 0) and gpu.memory_total_mib == 141 * 1024


def test_pairs(probed):
    _, topo, _, want = probed
    n = len(topo.gpus)
    assert [[topo.label(a, b) for b in range(n)] for a in range(n)] == want["labels"]
    for a in range(n):
        for b in range(a + 1, n):
            pair = topo.pair(a, b)
            assert pair.pcie.value == want["pcie"][a][b]
            assert pair.direct_links == int(want["direct"][a][b]), (a, b)
            assert pair.via_nvswitch is want["via_nvswitch"]
            assert pair.nvlink is (want["labels"][a][b].startswith("NV"))
            if want["pair_gbps"] is not None:
                assert pair.nvlink_gbps == want["pair_gbps"]
            else:
                assert pair.nvlink_gbps == round(pair.direct_links * want["link_gbps"], 3)
            if pair.via_nvswitch:
                assert pair.switch_links == 18
    assert len(topo.pairs) == n * (n - 1) // 2


def test_groups_and_connectivity(probed):
    _, topo, _, want = probed
    assert topo.nvlink_groups() == want["groups"]
    assert topo.is_nvlink_connected(topo.indices) is want["connected"]
    assert topo.shape() == want["kind"]


def test_remote_pci_of_direct_links_is_the_peer(probed):
    _, topo, _, _ = probed
    gpu_pcis = {g.pci_bus_id for g in topo.gpus}
    for gpu in topo.gpus:
        for link in gpu.links_to(RemoteType.GPU):
            assert link.remote_pci in gpu_pcis and link.remote_pci != gpu.pci_bus_id


# ---- how the probe talks to NVML ---------------------------------------------------------------------------

def test_init_and_shutdown_are_paired(probed):
    _, _, fake, _ = probed
    assert fake.init_calls == fake.shutdown_calls == 1
    assert fake.calls[0] == "nvmlInit" and fake.calls[-1] == "nvmlShutdown"


def test_shutdown_even_when_a_call_in_the_middle_fails_with_nvml_error():
    machine = fake_nvml.h200_x2()
    machine.failing_calls = {"nvmlDeviceGetP2PStatus": pynvml.NVML_ERROR_UNKNOWN,
                             "nvmlDeviceGetTopologyCommonAncestor": pynvml.NVML_ERROR_UNKNOWN}
    fake = FakeNvml(machine)
    topo = nvml.probe(fake)
    assert fake.init_calls == fake.shutdown_calls == 1
    assert topo.pair(0, 1).pcie is PcieRelation.UNKNOWN


def test_shutdown_even_when_an_unexpected_exception_escapes(monkeypatch):
    fake = FakeNvml(fake_nvml.h200_x2())

    def explode(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(fake, "nvmlDeviceGetTopologyCommonAncestor", explode)
    with pytest.raises(RuntimeError, match="boom"):
        nvml.probe(fake)
    assert fake.init_calls == fake.shutdown_calls == 1


@pytest.mark.parametrize("link_count_field", [True, False], ids=["nvml link count", "asked until invalid"])
@pytest.mark.parametrize("name, per_gpu", [("h200_x2", 18), ("h100_hgx_x8", 18), ("dgx1_v100_x8", 6),
                                           ("rtx3090_x2_bridge", 4), ("bridged_pairs_x4", 12), ("pcie_x4", 0)])
def test_asks_the_links_nvml_counts_or_up_to_the_first_invalid_argument(name, per_gpu, link_count_field, monkeypatch):
    """NVML_FI_DEV_NVLINK_LINK_COUNT bounds the links asked; without it, link 0, 1, ... until Invalid Argument (one
    more call: the link past the last). A PCIe-only GPU answers neither: its link 0 says Not Supported."""
    machine = fake_nvml.MACHINES[name]()
    for gpu in machine.gpus:
        gpu.link_count_field = link_count_field
    per_gpu = per_gpu if link_count_field and per_gpu else per_gpu + 1
    fake = FakeNvml(machine)
    asked = []
    original = fake.nvmlDeviceGetNvLinkState

    def state(handle, link):
        asked.append((handle, link))
        return original(handle, link)

    monkeypatch.setattr(fake, "nvmlDeviceGetNvLinkState", state)
    topo = nvml.probe(fake)
    assert fake.calls.count("nvmlDeviceGetNvLinkState") == per_gpu * len(topo.gpus)
    for gpu in topo.gpus:
        assert [link for handle, link in asked if handle == gpu.index] == list(range(per_gpu))


def test_h200_asks_links_0_to_17_only():
    fake = FakeNvml(fake_nvml.h200_x2())
    topo = nvml.probe(fake)
    assert fake.calls.count("nvmlDeviceGetNvLinkState") == 2 * 18 and not topo.warnings
    assert all(len(gpu.links) == 18 for gpu in topo.gpus)


def test_p2p_index_is_a_plain_integer(monkeypatch):
    fake = FakeNvml(fake_nvml.h100_hgx_x8())
    indices = []
    original = fake.nvmlDeviceGetP2PStatus

    def p2p(h1, h2, index):
        indices.append(index)
        return original(h1, h2, index)

    monkeypatch.setattr(fake, "nvmlDeviceGetP2PStatus", p2p)
    nvml.probe(fake)
    assert len(indices) == 28
    assert all(type(i) is int for i in indices)  # pynvml's NVML_P2P_CAPS_INDEX_READ is the tuple (0,)
    assert set(indices) == {pynvml.NVML_P2P_CAPS_INDEX_NVLINK}


def test_lost_gpu_is_left_out_with_a_warning():
    machine = fake_nvml.h100_hgx_x8()
    machine.gpus[3].lost = True
    fake = FakeNvml(machine)
    topo = nvml.probe(fake)
    assert topo.indices == (0, 1, 2, 4, 5, 6, 7)
    assert len(topo.pairs) == 21 and all(3 not in (p.a, p.b) for p in topo.pairs)
    assert len(topo.warnings) == 1
    assert "GPU 3" in topo.warnings[0] and "GPU is lost" in topo.warnings[0] and "left out" in topo.warnings[0]
    assert fake.init_calls == fake.shutdown_calls == 1


def test_unknown_error_becomes_na_and_a_warning():
    machine = fake_nvml.h200_x2()
    machine.failing_calls = {"nvmlDeviceGetUUID": pynvml.NVML_ERROR_UNKNOWN}
    topo = nvml.probe(FakeNvml(machine))
    assert [g.uuid for g in topo.gpus] == ["N/A", "N/A"]
    assert [g.name for g in topo.gpus] == ["NVIDIA H200"] * 2  # everything else still read
    assert topo.warnings == ("NVML GPU 0 UUID failed: Unknown Error; shown as N/A",
                             "NVML GPU 1 UUID failed: Unknown Error; shown as N/A")


def test_unknown_error_in_link_version_gives_unknown_rate_not_a_crash():
    machine = fake_nvml.h200_x2()
    machine.failing_calls = {"nvmlDeviceGetNvLinkVersion": pynvml.NVML_ERROR_UNKNOWN}
    topo = nvml.probe(FakeNvml(machine))
    gpu = topo.gpu(0)
    assert len(gpu.active_links) == 18 and gpu.nvlink_version is None and gpu.nvlink_gbps == 0.0
    assert topo.label(0, 1) == "NV18"  # the wiring is still known
    assert len(topo.warnings) == 36 and all("version failed: Unknown Error" in w for w in topo.warnings)


def test_unknown_error_in_link_state_stops_counting_with_a_warning():
    machine = fake_nvml.rtx3090_x2_bridge()
    machine.failing_calls = {"nvmlDeviceGetNvLinkState": pynvml.NVML_ERROR_UNKNOWN}
    topo = nvml.probe(FakeNvml(machine))
    assert [len(g.links) for g in topo.gpus] == [0, 0]
    assert len(topo.warnings) == 2 and "NVLink 0 state failed: Unknown Error" in topo.warnings[0]


def test_not_supported_nvlink_means_no_links_and_no_warnings():
    fake = FakeNvml(fake_nvml.pcie_x4())
    topo = nvml.probe(fake)
    assert [g.links for g in topo.gpus] == [()] * 4
    assert topo.warnings == () and topo.error is None
    assert "nvmlDeviceGetNvLinkVersion" not in fake.calls


def test_no_driver():
    fake = FakeNvml(fake_nvml.no_driver())
    topo = nvml.probe(fake)
    assert topo.gpus == () and topo.pairs == ()
    assert "no NVIDIA driver / NVML" in topo.error and "Driver Not Loaded" in topo.error
    assert fake.init_calls == fake.shutdown_calls == 0
    assert fake.calls == ["nvmlInit"]


def test_library_not_found_is_also_a_plain_error():
    machine = fake_nvml.no_driver()
    machine.init_error = pynvml.NVML_ERROR_LIBRARY_NOT_FOUND
    topo = nvml.probe(FakeNvml(machine))
    assert "no NVIDIA driver / NVML" in topo.error and topo.gpus == ()


def test_real_pynvml_on_this_machine_does_not_raise():
    """On this GPU-less machine the real pynvml cannot load libnvidia-ml.so; on a GPU machine it finds GPUs."""
    topo = nvml.probe()
    if topo.gpus:
        pytest.skip(f"this machine has {len(topo.gpus)} NVIDIA GPU(s)")
    assert topo.error and "no NVIDIA driver / NVML" in topo.error
    assert topo.gpus == () and topo.pairs == ()
    assert topo.shape() == "none" and topo.nvlink_groups() == ()


# ---------------------------------------------------------------- any NVML failure: one warning line, a stated fallback
def machine_of(name, **changes):
    machine = fake_nvml.MACHINES[name]()
    for key, value in changes.items():
        setattr(machine, key, value)
    return machine


def topo_of(name, **changes):
    return nvml.probe(FakeNvml(machine_of(name, **changes)))


NVML_CALLS = {  # every call the probe makes -> the words its warning uses
    "nvmlInit": "nvmlInit failed", "nvmlSystemGetDriverVersion": "driver version",
    "nvmlSystemGetNVMLVersion": "NVML version", "nvmlDeviceGetCount": "device count",
    "nvmlDeviceGetHandleByIndex": "handle", "nvmlDeviceGetPciInfo": "PCI info", "nvmlDeviceGetName": "name",
    "nvmlDeviceGetUUID": "UUID", "nvmlDeviceGetCudaComputeCapability": "compute capability",
    "nvmlDeviceGetMemoryInfo": "memory", "nvmlDeviceGetNvLinkState": "state",
    "nvmlDeviceGetNvLinkVersion": "version", "nvmlDeviceGetNvLinkRemoteDeviceType": "remote type",
    "nvmlDeviceGetNvLinkRemotePciInfo": "remote PCI", "nvmlDeviceGetP2PStatus": "P2P status",
    "nvmlDeviceGetTopologyCommonAncestor": "PCIe topology", "nvmlShutdown": None,
}
# Calls without which a GPU (or all of them) cannot be used: even NotSupported must be said.
LOSES_GPUS = {"nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetPciInfo"}
ERRORS = {"NotSupported": pynvml.NVML_ERROR_NOT_SUPPORTED, "Unknown": pynvml.NVML_ERROR_UNKNOWN,
          "GpuIsLost": pynvml.NVML_ERROR_GPU_IS_LOST, "NoPermission": pynvml.NVML_ERROR_NO_PERMISSION}


# NVLink traffic calls (issue 17), not the probe's: nvml.NvLinkCounterReader's (its failures are tested in
# tests/training/test_nvlink_monitor.py) and the old utilization counter it does not use. The fake answers them;
# the table above is the probe's.
COUNTER_CALLS = {"nvmlDeviceGetMigMode", "nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkUtilizationCounter"}


def test_nvml_call_table_is_complete():
    assert set(NVML_CALLS) | {"nvmlDeviceGetNvLinkCapability"} == {
        name for name in dir(FakeNvml) if name.startswith("nvml")} - COUNTER_CALLS
    assert not COUNTER_CALLS & set(NVML_CALLS)


@pytest.mark.parametrize("machine", ["h200_x2", "dgx1_v100_x8", "pcie_x4"])
@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("call", sorted(NVML_CALLS))
def test_any_nvml_call_failing_never_breaks_the_probe(machine, call, error):
    fake = FakeNvml(machine_of(machine, failing_calls={call: ERRORS[error]}))
    topo = nvml.probe(fake)  # never raises
    assert fake.init_calls == (0 if call == "nvmlInit" else 1)
    assert fake.shutdown_calls == (0 if call in ("nvmlInit", "nvmlShutdown") else 1)  # paired whenever possible
    said = " ".join((topo.error or "",) + topo.warnings)
    if call in LOSES_GPUS:  # every GPU is lost this way: said, with the fallback
        assert topo.gpus == () and NVML_CALLS[call] in said, said
        assert "left out" in said or "no GPU listed" in said or "falls back to the CPU" in said, said
    elif error != "NotSupported" and NVML_CALLS[call] and call in fake.calls:
        assert NVML_CALLS[call] in said, said  # a real failure is reported, naming the call
        assert len(topo.gpus) == len(fake.machine.gpus)  # and costs only that fact
    if topo.warnings:
        line = nvml.warnings_line(topo.warnings)
        assert "\n" not in line and line.startswith(topo.warnings[0])
        if len(topo.warnings) > 1:
            assert f"and {len(topo.warnings) - 1} more NVML warning" in line


def test_nvml_init_raising_oserror_is_a_plain_error():
    fake = FakeNvml(fake_nvml.h200_x2())

    def broken():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    fake.nvmlInit = broken
    topo = nvml.probe(fake)
    assert topo.gpus == () and "cannot load NVML" in topo.error and "falls back to the CPU" in topo.error


def test_pynvml_not_installed_is_a_plain_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    topo = nvml.probe()
    assert topo.gpus == () and "pip install nvidia-ml-py" in topo.error and "falls back to the CPU" in topo.error


def test_real_nvml_library_missing_on_this_machine():
    topo = nvml.probe()
    if topo.gpus:
        pytest.skip(f"this machine has {len(topo.gpus)} NVIDIA GPU(s)")
    assert topo.error.startswith("no NVIDIA driver / NVML: ") and "falls back to the CPU" in topo.error
    assert "\n" not in topo.error


def test_topology_error_stays_one_line():
    """The no-NVML message is used as a log line: no newline in it whatever NVML said."""
    topo = topo_of("no_driver", init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert isinstance(topo, Topology) and "\n" not in topo.error
