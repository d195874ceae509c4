"""tf_nvlink.plan.cube_mesh: the DGX-1 cube-mesh order, and meshes that look like one but are not."""

import pytest

import fake_nvml
from fake_nvml import FakeGpu, FakeLink, FakeMachine, FakeNvml
from tf_nvlink.machine import nvml
from tf_nvlink.plan import cube_mesh, policy


def topo_of(name):
    return nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))


def mesh_of(edges, n=8, name="Tesla V100-SXM2-16GB"):
    """A machine of `n` GPUs wired by direct NVLink along `edges` ({(a, b): links})."""
    buses = [0x06 + 0x10 * i for i in range(n)]
    links = {i: [] for i in range(n)}
    for (a, b), count in edges.items():
        for _ in range(count):
            links[a].append(FakeLink(fake_nvml.GPU, fake_nvml._pci(buses[b])))
            links[b].append(FakeLink(fake_nvml.GPU, fake_nvml._pci(buses[a])))
    gpus = [FakeGpu(name, fake_nvml._pci(bus), f"GPU-mesh-{i}", (7, 0), 16, links=links[i], nvlink_version=2)
            for i, bus in enumerate(buses)]
    machine = FakeMachine(gpus, p2p_nvlink={tuple(sorted(e)): 0 for e in edges}, pcie_level={})
    return nvml.probe(FakeNvml(machine))


DGX1 = "dgx1_v100_x8"
QUADS_FIRST = [0, 1, 2, 3, 4, 5, 6, 7]  # DGX-1: quads 0-3 and 4-7, i <-> i+4 linked


def test_cube_mesh_order_of_the_dgx1():
    topo = topo_of(DGX1)
    assert cube_mesh.cube_mesh_order(topo, [0, 4, 1, 5, 2, 6, 3, 7]) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert cube_mesh.cube_mesh_order(topo, QUADS_FIRST[:4]) is None
    assert cube_mesh.replica_order(topo, (0, 4, 1, 5, 2, 6, 3, 7), "nccl") == (0, 4, 1, 5, 2, 6, 3, 7)  # kept


# Every GPU has exactly 4 NVLink peers, yet there is no quad (4 GPUs all linked): circulant C8(1, 2), and the
# 4-regular "two squares crossed" graph. Neither is a DGX-1 cube-mesh.
CIRCULANT = {tuple(sorted((i, (i + d) % 8))): 1 for i in range(8) for d in (1, 2)}
SQUARES = {**{(i, (i + 1) % 4): 1 for i in range(4)}, **{(4 + i, 4 + (i + 1) % 4): 1 for i in range(4)},
           **{(i, 4 + j): 1 for i in range(4) for j in ((i + 1) % 4, (i + 3) % 4)}}
SQUARES = {tuple(sorted(e)): c for e, c in SQUARES.items()}


@pytest.mark.parametrize("edges", [CIRCULANT, SQUARES], ids=["circulant C8(1,2)", "two squares crossed"])
def test_four_nvlink_peers_without_quads_is_not_a_cube_mesh(edges):
    topo = mesh_of(edges)
    assert all(sum(1 for b in range(8) if b != a and topo.pair(a, b).direct_links) == 4 for a in range(8))
    assert not cube_mesh.is_dgx1_like(topo, range(8))
    plan = policy.make_plan(topo, "all")
    assert plan.shape == "nvlink-partial" and plan.cross_device_ops == "nccl", plan.summary()
