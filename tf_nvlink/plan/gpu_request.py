"""A `gpus` request ("all", "auto", indices, "0,1") resolved to NVML indices and checked. Pure: no TensorFlow.

`tf_nvlink.plan.policy` plans with these (and re-exports them); the benchmark resolves its --gpus with them too.

Example:
    >>> from tf_nvlink.plan import gpu_request
    >>> gpu_request.parse_gpus("1,0", topo)
    (1, 0)
"""

from __future__ import annotations

import re
from typing import Optional, Sequence, Union

from tf_nvlink.machine.topology import Topology

GpuSpec = Union[str, Sequence[int], int]


def parse_gpus(spec: GpuSpec, topology: Topology, visible: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Resolve a `gpus` request to NVML indices.

    `spec` is "all" (every GPU TensorFlow can see), "auto" (the largest NVLink-connected group), a list of
    indices, or a string such as "0,1" (absl-flag friendly). `visible` are the NVML indices TensorFlow can see
    (default: all of them).

    Example:
        >>> parse_gpus("1,0", topo)
        (1, 0)
    """
    visible = tuple(topology.indices if visible is None else visible)
    if isinstance(spec, str) and spec.strip().lower() in ("all", "auto"):
        return visible if spec.strip().lower() == "all" else auto_gpus(topology, visible)
    indices = gpu_indices(spec, visible)
    for index in indices:
        if index not in visible:
            hidden = " (hidden from TensorFlow by CUDA_VISIBLE_DEVICES)" if index in topology.indices else ""
            raise ValueError(f"GPU {index} does not exist on this machine{hidden}; valid GPU indices are "
                             f"{list(visible)}. Received: gpus={spec!r}")
    return indices


def gpu_indices(spec: GpuSpec, valid: Sequence[int] = ()) -> tuple[int, ...]:
    """The indices a `gpus` request names, checked for form only (not whether the GPUs exist): non-negative
    integers, each once, at least one. ValueError names the bad value and `valid` (the machine's indices).
    "all" and "auto" name no index: they are the caller's to resolve.
    """
    if isinstance(spec, str):
        text = spec.strip().lower()
        if not text:
            raise ValueError(f"gpus should be 'all', 'auto', or GPU indices such as '0,1'. Received: gpus={spec!r}")
        items: list = [item.strip() for item in text.split(",")]
    elif isinstance(spec, int) and not isinstance(spec, bool):
        items = [spec]
    elif isinstance(spec, (list, tuple)):
        items = list(spec)
    else:
        raise ValueError(f"gpus should be 'all', 'auto', a list of GPU indices or a string such as '0,1'. "
                         f"Received: gpus={spec!r}")
    if not items:
        raise ValueError(f"gpus should name at least one GPU; this machine has {list(valid)}. "
                         f"Received: gpus={spec!r}")
    indices: list[int] = []
    for item in items:
        if isinstance(item, bool) or not (isinstance(item, int) or (isinstance(item, str)
                                                                   and re.fullmatch(r"\d+", item))):
            raise ValueError(f"gpus entries should be non-negative GPU indices (nvidia-smi numbering) among "
                             f"{list(valid)}, or 'all' / 'auto'. Received: {item!r} in gpus={spec!r}")
        index = int(item)
        if index < 0:
            raise ValueError(f"gpus entries should be non-negative GPU indices (nvidia-smi numbering) among "
                             f"{list(valid)}, or 'all' / 'auto'. Received: {item!r} in gpus={spec!r}")
        if index in indices:
            raise ValueError(f"gpus names GPU {index} twice; each GPU can hold one replica. Name each of "
                             f"{list(valid)} at most once. Received: gpus={spec!r}")
        indices.append(index)
    return tuple(indices)


def auto_gpus(topology: Topology, visible: Sequence[int]) -> tuple[int, ...]:
    """The largest NVLink-connected group of visible GPUs; ties go to the faster links, then more free memory."""
    visible_set = set(visible)
    groups = [tuple(i for i in group if i in visible_set) for group in topology.nvlink_groups()]
    groups = [g for g in groups if g]
    if not groups:
        return ()

    def rank(group):
        free = sum(topology.gpu(i).memory_free_mib or 0 for i in group)
        return (-len(group), -topology.min_pair_gbps(group), -free, group)

    return min(groups, key=rank)
