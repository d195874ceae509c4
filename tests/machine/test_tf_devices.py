"""tf_nvlink.machine.tf_devices: TensorFlow GPUs mapped to NVML GPUs by PCI bus id, CUDA_VISIBLE_DEVICES as CUDA reads it."""

import pytest

import fake_nvml
from fake_nvml import FakeNvml, h100_hgx_x8, h200_x2
from tf_nvlink.machine import tf_devices
from tf_nvlink.machine import nvml
from tf_nvlink.machine.topology import PciBusId
from tf_nvlink.plan import policy

# device_lib's physical_device_desc on the lent 2x H200 machine (../shared/hardware-facts.md)
H200_DESC = "device: 0, name: NVIDIA H200, pci bus id: 0000:00:06.0, compute capability: 9.0a"
H200_DESC_1 = "device: 1, name: NVIDIA H200, pci bus id: 0000:00:07.0, compute capability: 9.0a"


@pytest.fixture(scope="module")
def h200():
    return nvml.probe(FakeNvml(h200_x2()))


@pytest.fixture(scope="module")
def h100():
    return nvml.probe(FakeNvml(h100_hgx_x8()))


def test_parse_physical_device_desc_h200():
    assert tf_devices.parse_physical_device_desc(H200_DESC) == {
        "device": "0", "name": "NVIDIA H200", "pci bus id": "0000:00:06.0", "compute capability": "9.0a"}


@pytest.mark.parametrize("desc", ["", None, "garbage"])
def test_parse_physical_device_desc_empty(desc):
    assert tf_devices.parse_physical_device_desc(desc) == {}


def test_map_tf_pci_id_to_nvml_pci_id(h200):
    assert str(h200.gpu(0).pci_bus_id) == "0000:00:06.0"
    mapped = tf_devices.map_tf_gpus(h200, [("/device:GPU:0", H200_DESC), ("/device:GPU:1", H200_DESC_1)])
    assert [(g.tf_name, g.tf_index, g.nvml_index) for g in mapped] == [("/device:GPU:0", 0, 0),
                                                                      ("/device:GPU:1", 1, 1)]
    first = mapped[0]
    assert first.pci_bus_id == PciBusId.parse("00000000:00:06.0")  # NVML's spelling, parsed
    assert first.name == "NVIDIA H200" and first.compute_capability == "9.0a"
    assert first.physical_device_desc == H200_DESC


def test_unknown_pci_id_maps_to_none(h200):
    desc = "device: 0, name: NVIDIA H200, pci bus id: 0000:00:09.0, compute capability: 9.0a"
    mapped = tf_devices.map_tf_gpus(h200, [("/device:GPU:0", desc), ("/device:GPU:1", "no pci here")])
    assert [g.nvml_index for g in mapped] == [None, None]
    assert mapped[1].pci_bus_id is None and mapped[1].name == "N/A" and mapped[1].tf_index == 1


def test_cuda_visible_devices_reorders(h200):
    """CUDA_VISIBLE_DEVICES=1,0: TensorFlow's GPU:0 is NVML GPU 1."""
    env = {"CUDA_VISIBLE_DEVICES": "1,0"}
    assert tf_devices.visible_nvml_indices(h200, env) == [1, 0]
    # what device_lib then reports: CUDA ordinal 0 is the GPU at 00:07.0
    descs = [("/device:GPU:0", H200_DESC_1.replace("device: 1", "device: 0")),
             ("/device:GPU:1", H200_DESC.replace("device: 0", "device: 1"))]
    mapped = tf_devices.map_tf_gpus(h200, descs)
    assert [(g.tf_name, g.nvml_index) for g in mapped] == [("/device:GPU:0", 1), ("/device:GPU:1", 0)]
    assert tf_devices.tf_device_for([1], mapped) == ["/gpu:0"]
    assert tf_devices.tf_device_for([0, 1], mapped) == ["/gpu:1", "/gpu:0"]


@pytest.mark.parametrize("value, expected", [
    (None, [0, 1, 2, 3, 4, 5, 6, 7]),  # unset: all
    ("", []),  # empty: none
    ("3", [3]),
    ("7,0", [7, 0]),
    (" 2 , 5 ", [2, 5]),
    ("GPU-h100-3", [3]),  # full UUID
    ("gpu-H100-6,1", [6, 1]),  # UUIDs are matched case-insensitively, and mix with indices
    ("GPU-h100-", []),  # a prefix matching 8 GPUs is ambiguous: invalid, so nothing after it either
    ("0,9,1", [0]),  # stops at the first index that names no GPU
    ("0,abc,1", [0]),
    ("1,1,2", [1]),  # a repeated entry ends the list, as in CUDA
    ("-1,0", []),
    ("MIG-abc,0", []),
])
def test_visible_nvml_indices(h100, value, expected):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert tf_devices.visible_nvml_indices(h100, env) == expected


def test_uuid_prefix_unique_on_h200(h200):
    full_uuid = h200.gpu(1).uuid
    assert full_uuid == "GPU-5c2f0e1a-0000-4000-8000-000000000001"
    assert tf_devices.visible_nvml_indices(h200, {"CUDA_VISIBLE_DEVICES": full_uuid}) == [1]
    assert tf_devices.visible_nvml_indices(h200, {"CUDA_VISIBLE_DEVICES": "GPU-5c2f"}) == []  # both GPUs match


def test_visible_defaults_to_os_environ(h200, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert tf_devices.visible_nvml_indices(h200) == [1]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert tf_devices.visible_nvml_indices(h200) == [0, 1]


def test_tf_device_for_hidden_gpu_raises_clear_error(h200, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    mapped = tf_devices.map_tf_gpus(h200, [("/device:GPU:0", H200_DESC_1.replace("device: 1", "device: 0"))])
    assert tf_devices.tf_device_for([1], mapped) == ["/gpu:0"]
    with pytest.raises(ValueError) as info:
        tf_devices.tf_device_for([0, 1], mapped)
    message = str(info.value)
    assert "GPU(s) [0]" in message and "not visible to TensorFlow" in message
    assert "Choose among [1]" in message and "CUDA_VISIBLE_DEVICES='1'" in message


# ---------------------------------------------------------------- mixed GPU models, MIG
A100_AS_CUDA_0 = fake_nvml.A100_AS_CUDA_0


def test_mixed_gpu_models_map_by_pci_both_ways():
    topo = nvml.probe(FakeNvml(fake_nvml.mixed_t4_a100()))
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert tf_devices.visible_needs_tensorflow(topo, env)
    assert not tf_devices.visible_needs_tensorflow(topo, dict(env, CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    assert not tf_devices.visible_needs_tensorflow(topo, {})  # unset: every GPU, order decided by PCI mapping
    assert not tf_devices.visible_needs_tensorflow(nvml.probe(FakeNvml(h200_x2())), env)  # one model: the orders agree
    mapped = tf_devices.map_tf_gpus(topo, [A100_AS_CUDA_0])
    visible = tf_devices.visible_from_tensorflow(mapped)
    assert visible == [1]
    plan = policy.make_plan(topo, "all", visible=visible)
    assert plan.gpus == (1,) and tf_devices.tf_device_for(plan.gpus, mapped) == ["/gpu:0"]
    assert policy.make_plan(topo, [1], visible=visible).gpus == (1,)  # the advice below works
    with pytest.raises(ValueError, match=r"valid GPU indices are \[1\]"):
        policy.make_plan(topo, [0], visible=visible)
    with pytest.raises(ValueError, match=r"Choose among \[1\]"):
        tf_devices.tf_device_for([0], mapped)


def test_mig_entries_of_cuda_visible_devices():
    assert tf_devices.mig_entries({"CUDA_VISIBLE_DEVICES": "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"}) == [
        "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"]
    assert tf_devices.mig_entries({"CUDA_VISIBLE_DEVICES": "0,1"}) == [] == tf_devices.mig_entries({})
