"""tf_nvlink.machine.topology: PCI ids, NVLink version decoding, link rates, labels, groups, kinds, fingerprints."""

import dataclasses
import json

import pytest

from fake_nvml import MACHINES, FakeNvml, bridged_pairs_x4, dgx1_v100_x8, h200_x2, pcie_x4, rtx3090_x2_bridge
from tf_nvlink.machine import nvml
from tf_nvlink.machine.topology import (Gpu, GpuPair, NvLink, P2PStatus, PcieRelation, PciBusId, RemoteType, Topology,
                                decode_nvlink_version, link_gbps)


def probe(machine_factory):
    return nvml.probe(FakeNvml(machine_factory()))


# ---- PciBusId ----------------------------------------------------------------------------------------------

class TestPciBusId:
    def test_nvml_and_tensorflow_spellings_are_equal(self):
        nvml_id = PciBusId.parse("00000000:00:06.0")  # NVML: 8-hex-digit domain
        tf_id = PciBusId.parse("0000:00:06.0")  # TensorFlow device_lib: 4 digits
        assert nvml_id == tf_id == PciBusId(0, 0, 6, 0)
        assert str(nvml_id) == str(tf_id) == "0000:00:06.0"
        assert PciBusId.parse("00000000:00:07.0") != tf_id

    @pytest.mark.parametrize("text, expected", [
        ("00000000:DB:00.0", PciBusId(0, 0xDB, 0, 0)),
        ("0001:ab:1f.7", PciBusId(1, 0xAB, 0x1F, 7)),
        ("  0000:18:00.0 ", PciBusId(0, 0x18, 0, 0)),
        ("18:00.0", PciBusId(0, 0x18, 0, 0)),  # legacy form without domain
    ])
    def test_parses_hex_fields(self, text, expected):
        assert PciBusId.parse(text) == expected

    @pytest.mark.parametrize("bad", ["", "abc", "0000:00:06", "0000:00:06.8", "0000:000:06.0",
                                     "000000000:00:06.0", "0000:zz:06.0", "0000-00-06.0"])
    def test_bad_strings_raise_value_error_naming_the_value(self, bad):
        with pytest.raises(ValueError) as info:
            PciBusId.parse(bad)
        assert repr(bad) in str(info.value)
        assert "DOMAIN:BUS:DEVICE.FUNCTION" in str(info.value)

    @pytest.mark.parametrize("text", [None, "", "garbage", "00000000:00:00.0"])
    def test_try_parse_gives_none_for_empty_bad_or_zero(self, text):
        assert PciBusId.try_parse(text) is None

    def test_ordering_by_integers(self):
        assert PciBusId.parse("0000:0a:00.0") > PciBusId.parse("0000:09:00.0")


# ---- NVLink version and rate -------------------------------------------------------------------------------

@pytest.mark.parametrize("enum_value, version", [
    (1, "1.0"), (2, "2.0"), (3, "2.2"), (4, "3.0"), (5, "3.1"), (6, "4.0"), (7, "5.0"), (8, "6.0"),
    (0, None), (9, None), (255, None), (None, None),
])
def test_decode_nvlink_version_is_an_enum_not_a_generation(enum_value, version):
    assert decode_nvlink_version(enum_value) == version


@pytest.mark.parametrize("version, name, gbps", [
    ("4.0", "NVIDIA H200", 26.562),
    ("4.0", "NVIDIA H100 80GB HBM3", 26.562),
    ("2.0", "Tesla V100-SXM2-16GB", 25.781),
    ("3.1", "NVIDIA A100 80GB PCIe", 25.0),
    ("5.0", "NVIDIA B200", 53.125),
    ("3.1", "NVIDIA GeForce RTX 3090", 14.0625),  # consumer bridges run slower
    (None, "NVIDIA H200", 0.0),
    ("9.9", "NVIDIA H200", 0.0),
])
def test_link_gbps(version, name, gbps):
    assert link_gbps(version, name) == gbps


# ---- a small hand-built topology ---------------------------------------------------------------------------

def _gpu(index, links=(), free=1000):
    return Gpu(index=index, uuid=f"GPU-{index}", name="Test GPU", pci_bus_id=PciBusId(0, index + 1, 0, 0),
               compute_capability=(9, 0), memory_total_mib=80000, memory_free_mib=free, links=tuple(links))


def _direct_link(i, to):
    return NvLink(index=i, active=True, version="4.0", gbps=26.562, remote_type=RemoteType.GPU,
                  remote_pci=PciBusId(0, to + 1, 0, 0))


def _pair(a, b, direct=0, pcie=PcieRelation.SYS):
    return GpuPair(a=a, b=b, direct_links=direct, via_nvswitch=False,
                   p2p_nvlink=P2PStatus.OK if direct else P2PStatus.NOT_SUPPORTED, pcie=pcie,
                   nvlink_gbps=round(26.562 * direct, 3))


def three_gpus(free=1000, direct01=2):
    """GPU0 and GPU1 joined by `direct01` links, GPU2 on PCIe only (PHB to both)."""
    gpus = (_gpu(0, [_direct_link(i, 1) for i in range(direct01)], free),
            _gpu(1, [_direct_link(i, 0) for i in range(direct01)], free), _gpu(2, free=free))
    pairs = (_pair(0, 1, direct01, PcieRelation.PIX), _pair(0, 2, pcie=PcieRelation.PHB),
             _pair(1, 2, pcie=PcieRelation.PHB))
    return Topology(gpus=gpus, pairs=pairs, driver_version="580.159.04")


class TestTopology:
    def test_labels(self):
        topo = three_gpus()
        assert topo.label(0, 0) == "X"
        assert topo.label(0, 1) == topo.label(1, 0) == "NV2"
        assert topo.label(0, 2) == "PHB"
        assert probe(h200_x2).label(0, 1) == "NV18"  # through NVSwitch: the links into the switches
        assert probe(pcie_x4).label(0, 1) == "PIX"

    def test_groups_and_connectivity(self):
        topo = three_gpus()
        assert topo.nvlink_groups() == ((0, 1), (2,))
        assert topo.is_nvlink_connected([0, 1])
        assert not topo.is_nvlink_connected([0, 1, 2])
        assert topo.is_nvlink_connected([2])
        assert probe(bridged_pairs_x4).nvlink_groups() == ((0, 1), (2, 3))
        # DGX-1: one component, but not every pair is linked
        dgx1 = probe(dgx1_v100_x8)
        assert dgx1.nvlink_groups() == ((0, 1, 2, 3, 4, 5, 6, 7),)
        assert not dgx1.is_nvlink_connected(range(8))
        assert dgx1.is_nvlink_connected([0, 1, 2, 3])

    @pytest.mark.parametrize("factory, indices, kind", [
        (h200_x2, None, "nvswitch"),
        (dgx1_v100_x8, None, "nvlink-partial"),
        (dgx1_v100_x8, [0, 1, 2, 3], "nvlink-all"),
        (rtx3090_x2_bridge, None, "nvlink-all"),
        (pcie_x4, None, "pcie"),
        (pcie_x4, [2], "single"),
        (pcie_x4, [], "none"),
        (bridged_pairs_x4, None, "nvlink-partial"),
    ])
    def test_kind(self, factory, indices, kind):
        assert probe(factory).shape(indices) == kind

    def test_min_pair_gbps(self):
        topo = three_gpus()
        assert topo.min_pair_gbps([0, 1]) == 53.124
        assert topo.min_pair_gbps([0, 1, 2]) == 0.0
        assert topo.min_pair_gbps([0]) == 0.0

    def test_lookups_raise_key_error_naming_the_gpus(self):
        topo = three_gpus()
        with pytest.raises(KeyError, match=r"\[0, 1, 2\]"):
            topo.gpu(7)
        with pytest.raises(KeyError, match=r"\(0, 9\)"):
            topo.pair(0, 9)

    def test_gpu_properties(self):
        gpu = probe(h200_x2).gpu(0)
        assert len(gpu.active_links) == 18
        assert gpu.nvlink_version == "4.0"
        assert gpu.nvlink_gbps == 478.116
        assert len(gpu.links_to(RemoteType.NVSWITCH)) == 18 and not gpu.links_to(RemoteType.GPU)


class TestFingerprint:
    def test_free_memory_does_not_change_it(self):
        assert three_gpus(free=1000).fingerprint() == three_gpus(free=5).fingerprint()

    def test_driver_and_warnings_do_not_change_it(self):
        topo = three_gpus()
        assert dataclasses.replace(topo, driver_version="999.0", warnings=("x",)).fingerprint() == topo.fingerprint()

    def test_wiring_changes_it(self):
        base = three_gpus().fingerprint()
        assert three_gpus(direct01=4).fingerprint() != base
        topo = three_gpus()
        other_pcie = dataclasses.replace(topo, pairs=(topo.pairs[0], dataclasses.replace(
            topo.pairs[1], pcie=PcieRelation.SYS), topo.pairs[2]))
        assert other_pcie.fingerprint() != base
        fewer_gpus = Topology(gpus=topo.gpus[:2], pairs=topo.pairs[:1])
        assert fewer_gpus.fingerprint() != base

    def test_stable_across_probes_and_distinct_across_machines(self):
        prints = {name: nvml.probe(FakeNvml(factory())).fingerprint() for name, factory in MACHINES.items()}
        assert prints == {name: nvml.probe(FakeNvml(factory())).fingerprint() for name, factory in MACHINES.items()}
        assert len(set(prints.values())) == len(prints)
        assert all(len(p) == 12 and int(p, 16) >= 0 for p in prints.values())


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_to_dict_is_json_serialisable(name):
    topo = nvml.probe(FakeNvml(MACHINES[name]()))
    data = topo.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["fingerprint"] == topo.fingerprint()
    assert [g["index"] for g in data["gpus"]] == list(topo.indices)
    for gpu in data["gpus"]:
        assert isinstance(gpu["pci_bus_id"], str)
        for link in gpu["links"]:
            assert link["remote_pci"] is None or isinstance(link["remote_pci"], str)
            assert isinstance(link["remote_type"], str)


def test_to_dict_fields():
    data = probe(rtx3090_x2_bridge).to_dict()
    assert data["gpus"][0]["pci_bus_id"] == "0000:01:00.0"
    assert data["gpus"][0]["links"][0] == {"index": 0, "active": True, "version": "3.1", "gbps": 14.0625,
                                           "remote_type": "GPU", "remote_pci": "0000:21:00.0"}
    assert data["gpus"][0]["active_links"] == 4 and data["gpus"][0]["nvlink_gbps"] == 56.25
    assert data["pairs"] == [{"a": 0, "b": 1, "direct_links": 4, "via_nvswitch": False, "p2p_nvlink": "OK",
                              "pcie": "NODE", "nvlink_gbps": 56.25, "switch_links": 0, "nvlink": True,
                              "label": "NV4"}]
    assert data["nvlink_groups"] == [[0, 1]]


def test_enum_decoding_from_nvml_values():
    assert RemoteType.from_nvml(2) is RemoteType.NVSWITCH and RemoteType.from_nvml(0) is RemoteType.GPU
    assert RemoteType.from_nvml(255) is RemoteType.UNKNOWN and RemoteType.from_nvml(None) is RemoteType.UNKNOWN
    assert [PcieRelation.from_nvml(v).value for v in (0, 10, 20, 30, 40, 50, 7, None)] == [
        "X", "PIX", "PXB", "PHB", "NODE", "SYS", "N/A", "N/A"]
    assert P2PStatus.from_nvml(0) is P2PStatus.OK and P2PStatus.from_nvml(5) is P2PStatus.NOT_SUPPORTED
    assert P2PStatus.from_nvml(99) is P2PStatus.UNKNOWN and P2PStatus.from_nvml((0,)) is P2PStatus.UNKNOWN
