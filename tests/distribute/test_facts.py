"""tf_nvlink.distribute.facts: the one gatherer the strategy and the report share (exact fake-NVML topologies)."""

import types

import fake_nvml
from fake_nvml import FakeNvml
from fake_nvml import A100_AS_CUDA_0, mixed_t4_a100
from tf_nvlink.internals import tf_runtime as internals
from tf_nvlink.distribute import facts
from tf_nvlink.machine import nvml
from tf_nvlink.machine.tf_devices import map_tf_gpus
from tf_nvlink.tools import report

MIXED_ENV = {"CUDA_VISIBLE_DEVICES": "0"}  # CUDA's 0 is the A100, NVML's GPU 1


def test_without_tensorflow_the_visible_gpus_are_the_cuda_visible_devices_prediction(monkeypatch):
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: (_ for _ in ()).throw(AssertionError("TF asked")))
    topology = nvml.probe(FakeNvml(fake_nvml.MACHINES["h200_x2"]()))
    gathered = facts.gather_facts(topology, tensorflow=False, environ={"CUDA_VISIBLE_DEVICES": "1",
                                                                      "XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert gathered.visible == (1,)
    assert (gathered.tf_gpu_count, gathered.nccl_available) == (None, None)
    assert gathered.user_xla_flags == "--xla_dump_to=/tmp/x"


def test_with_tensorflow_a_mixed_machine_goes_by_pci_bus_ids():
    topology = nvml.probe(FakeNvml(mixed_t4_a100()))
    predicted = facts.gather_facts(topology, tensorflow=False, environ=MIXED_ENV)
    mapped = facts.gather_facts(topology, tf_gpus=map_tf_gpus(topology, [A100_AS_CUDA_0]), environ=MIXED_ENV)
    assert predicted.visible == (0,)  # NVML's order says the T4: wrong on this machine
    assert mapped.visible == (1,) and mapped.tf_gpu_count == 1  # TensorFlow's PCI ids: the A100


def test_the_report_plans_with_the_strategys_facts(monkeypatch):
    """With TensorFlow, the report's plan comes from the same facts `tf_nvlink.strategy()` gathers (the PCI
    mapping on a mixed machine); with --no-tf, from the CUDA_VISIBLE_DEVICES prediction."""
    fake_tf = types.SimpleNamespace(__version__="2.21.0", test=types.SimpleNamespace(is_built_with_cuda=lambda: True))
    monkeypatch.setattr(report, "_import_tensorflow", lambda: fake_tf)
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: [A100_AS_CUDA_0])
    monkeypatch.setattr(internals, "nccl_kernels_registered", lambda: True)
    topology = nvml.probe(FakeNvml(mixed_t4_a100()))
    with_tf = report.collect(topology, with_tf=True, environ=MIXED_ENV)
    without_tf = report.collect(topology, with_tf=False, environ=MIXED_ENV)
    assert with_tf["plan"]["gpus"] == [1]
    assert without_tf["plan"]["gpus"] == [0]
