"""Which `LinkModel` a probed machine's GPUs form (NVSwitch, direct-NVLink rings, or PCIe)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterable, Optional, Sequence

from tf_nvlink.tools.costmodel.model import LINKS, NCCL_HOP_NVLINK_US, NVLINK_EFFICIENCY, LinkModel
from tf_nvlink.machine.topology import RemoteType, Topology


# ---- from a probed topology --------------------------------------------------------------------------------

def link_for_topology(topology: Topology, gpus: Optional[Iterable[int]] = None, *,
                      pcie: str = "pcie-gen4") -> LinkModel:
    """The LinkModel of the chosen GPUs of a probed machine (all of them by default).

    nvswitch: the NVSwitch model scaled to the least-connected GPU's switch bandwidth (H200: 280 GB/s).
    nvlink-all / nvlink-partial: a ring over direct NVLink runs at its slowest hop, one link; busbw = efficiency x
    link rate x the most link-disjoint directed rings through all chosen GPUs (DGX-1: 8 GPUs 6, a quad 4, a
    doubled pair 2). Without any such ring the ring crosses PCIe and `pcie` applies. pcie: `LINKS[pcie]` (NVML's topology does
    not tell the PCIe generation).

    Example:
        >>> link_for_topology(nvml.probe()).name
        'nvswitch (2x NVIDIA H200, 18 x 26.562 GB/s)'
    """
    if pcie not in LINKS or not pcie.startswith("pcie"):
        raise ValueError(f"pcie must be one of {[n for n in LINKS if n.startswith('pcie')]}. Received: pcie={pcie!r}")
    chosen = sorted(set(topology.indices if gpus is None else gpus))
    kind = topology.shape(chosen)
    if kind in ("none", "single"):
        raise ValueError(f"link_for_topology needs 2 or more GPUs; the chosen GPUs {chosen} are '{kind}'. "
                         f"This machine has GPUs {list(topology.indices)}.")
    n = len(chosen)
    if kind == "nvswitch":
        weakest = min((topology.gpu(i) for i in chosen), key=lambda g: _gbps(g.links_to(RemoteType.NVSWITCH)))
        links = weakest.links_to(RemoteType.NVSWITCH)
        return LinkModel(f"nvswitch ({n}x {weakest.name}, {len(links)} x {links[0].gbps:g} GB/s)",
                         round(_gbps(links) * NVLINK_EFFICIENCY, 1), NCCL_HOP_NVLINK_US, max_gpus=n,
                         source="NVSwitch: per-GPU switch bandwidth x the efficiency measured on 2x H200")
    if kind in ("nvlink-all", "nvlink-partial"):
        rings, rate = _nvlink_rings(topology, chosen)
        if rings:
            return LinkModel(f"nvlink rings ({n}x {topology.gpu(chosen[0]).name}, {rings} x {rate:g} GB/s)",
                             round(rings * rate * NVLINK_EFFICIENCY, 1), NCCL_HOP_NVLINK_US, max_gpus=n,
                             source="direct NVLink: link-disjoint directed rings through all chosen GPUs x link "
                                    "rate x the efficiency measured on 2x H200")
    return dataclasses.replace(LINKS[pcie], max_gpus=max(n, LINKS[pcie].max_gpus))


def _gbps(links) -> float:
    return sum(link.gbps for link in links)


def _nvlink_rings(topology: Topology, chosen: Sequence[int]) -> tuple[int, float]:
    """How many link-disjoint directed rings through all `chosen` GPUs direct NVLink carries, and the per-link
    GB/s of the slowest link among them; (0, 0.0) when no ring exists (then the ring crosses PCIe).

    A ring runs at its slowest hop, one link's rate. A cycle through the GPUs whose every pair has m spare links
    carries 2m directed rings (each link is full duplex); for 2 GPUs the ring is the pair itself, one ring per
    link. Exhaustive over the cycles (at most 8 GPUs: 2520 cycles).
    """
    links = {(a, b): topology.pair(a, b).direct_links for a, b in itertools.combinations(chosen, 2)}
    used = [(a, b) for (a, b), count in links.items() if count]
    if not used:
        return 0, 0.0
    rate = min(topology.pair(a, b).nvlink_gbps / links[(a, b)] for a, b in used)
    if len(chosen) == 2:
        return links[tuple(chosen)], rate
    first, rest = chosen[0], chosen[1:]
    cycles = []
    for order in itertools.permutations(rest):
        if order[0] > order[-1]:
            continue  # the same cycle backwards
        path = (first, *order, first)
        edges = tuple(tuple(sorted(path[k:k + 2])) for k in range(len(chosen)))
        if all(links[edge] for edge in edges):
            cycles.append(edges)

    def most_rings(capacity: dict, start: int) -> int:
        best = 0
        for index in range(start, len(cycles)):
            if all(capacity[edge] for edge in cycles[index]):
                remaining = dict(capacity)
                for edge in cycles[index]:
                    remaining[edge] -= 1
                best = max(best, 2 + most_rings(remaining, index))
        return best

    return most_rings(links, 0), rate
