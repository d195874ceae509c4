"""The DGX-1 hybrid cube-mesh, and the replica order HierarchicalCopyAllReduce needs on it. Pure: no TensorFlow.

HierarchicalCopyAllReduce (TensorFlow) splits the replicas by position into two halves, reduces within each half,
then copies position k to position k + 4. It is fast only on the wiring it was written for: two NVLink quads with
one direct link across per GPU, and only when the replica order puts each quad in one half. `policy` chooses
hierarchical only when `cube_mesh_order` finds that wiring, and orders the replicas with `replica_order`.

Example:
    >>> from tf_nvlink.plan import cube_mesh
    >>> cube_mesh.cube_mesh_order(dgx1_topology, [0, 4, 1, 5, 2, 6, 3, 7])
    (0, 1, 2, 3, 4, 5, 6, 7)
"""

from __future__ import annotations

import itertools
from typing import Optional, Sequence

from tf_nvlink.machine.topology import Topology


def is_dgx1_like(topology: Topology, chosen: Sequence[int]) -> bool:
    """8 GPUs wired as the DGX-1 hybrid cube-mesh HierarchicalCopyAllReduce was written for (see `cube_mesh_order`).

    Example:
        >>> is_dgx1_like(topo_of("dgx1_v100_x8"), range(8))
        True
    """
    return cube_mesh_order(topology, chosen) is not None


def replica_order(topology: Topology, gpus: Sequence[int], cross_device_ops: str) -> tuple[int, ...]:
    """`gpus` in the order the strategy should mirror them for `cross_device_ops`: HierarchicalCopyAllReduce's
    halves are positions 0-3 and 4-7, so on a cube-mesh they are made the NVLink quads; other ops keep the order.

    Example:
        >>> replica_order(topo_of("dgx1_v100_x8"), (0, 4, 1, 5, 2, 6, 3, 7), "hierarchical")
        (0, 1, 2, 3, 4, 5, 6, 7)
    """
    gpus = tuple(gpus)
    if cross_device_ops != "hierarchical":
        return gpus
    return cube_mesh_order(topology, gpus) or gpus


def cube_mesh_order(topology: Topology, chosen: Sequence[int]) -> Optional[tuple[int, ...]]:
    """`chosen` ordered for HierarchicalCopyAllReduce, or None when the GPUs are not a DGX-1 hybrid cube-mesh.

    HierarchicalCopyAllReduce splits the replicas by position: the first half reduces among itself, the second
    half too, and position k copies to position k + 4. That is fast only when each half is an NVLink quad (4 GPUs
    all directly linked) and positions k and k + 4 are directly linked. So: 8 GPUs, two disjoint quads, every GPU
    with exactly one direct link across. A mesh where each GPU merely has 4 peers (no quads) is not one.

    Example:
        >>> cube_mesh_order(topo_of("dgx1_v100_x8"), [0, 4, 1, 5, 2, 6, 3, 7])
        (0, 1, 2, 3, 4, 5, 6, 7)
    """
    gpus = tuple(chosen)
    if len(gpus) != 8 or len(set(gpus)) != 8:
        return None

    def linked(a: int, b: int) -> bool:
        return topology.pair(a, b).direct_links > 0

    for quad in itertools.combinations(sorted(gpus), 4):
        if quad[0] != min(gpus):
            break  # the quad holding the lowest GPU decides; the other one is its complement
        other = tuple(g for g in sorted(gpus) if g not in quad)
        if not all(linked(a, b) for half in (quad, other) for a, b in itertools.combinations(half, 2)):
            continue
        partners = [[b for b in other if linked(a, b)] for a in quad]
        if all(len(p) == 1 for p in partners) and len({p[0] for p in partners}) == 4:
            return quad + tuple(p[0] for p in partners)
    return None
