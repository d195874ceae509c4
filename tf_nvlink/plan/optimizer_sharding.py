"""Optimizer states sharded over the replicas (`tf_nvlink.strategy(optimizer_states="sharded")`): which replica
owns each variable's optimizer state, and the bytes each replica holds, replicated and sharded.

Pure: no TensorFlow. The partition is by whole variables (every Keras optimizer's `update_step` works on one
variable at a time, and LAMB's and Adafactor's need the whole variable, its norms or its factored rows and
columns), balanced by size: the largest variable first, each to the replica holding the fewest bytes so far (ties:
the lower replica index; among equal sizes the earlier variable first), so that the assignment depends only on
the variables' order and sizes, and every replica computes the same one. Each replica then holds at most
1/N of the states plus one largest variable's.

Example:
    >>> assign_owners([400, 100, 300, 200], replicas=2)
    (0, 0, 1, 1)
    >>> memory_per_replica([4000, 1000], bytes_per_element=4, slots_per_variable=2, replicas=2)["sharded"]
    {'weights': 20000, 'gradients': 20000, 'optimizer_states': 32000}
"""

from __future__ import annotations

from typing import Sequence

OPTIMIZER_STATES = ("replicated", "sharded")


def validate_optimizer_states(value) -> str:
    """`value` when it is one of OPTIMIZER_STATES, else ValueError naming the valid choices."""
    if not isinstance(value, str) or value not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_states should be one of {list(OPTIMIZER_STATES)}: \"replicated\" (every replica "
                         f"holds every optimizer state) or \"sharded\" (each replica holds and updates its share). "
                         f"Received: optimizer_states={value!r}")
    return value


def assign_owners(sizes: Sequence[int], replicas: int) -> tuple[int, ...]:
    """The owning replica of each variable, `sizes` being their sizes (elements or bytes) in the optimizer's order.

    Example:
        >>> assign_owners([10, 10, 10], replicas=2)
        (0, 1, 0)
    """
    if replicas < 1:
        raise ValueError(f"replicas should be at least 1. Received: replicas={replicas!r}")
    load = [0] * replicas
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        owner = min(range(replicas), key=lambda r: (load[r], r))
        owners[index] = owner
        load[owner] += int(sizes[index])
    return tuple(owners)


def bytes_per_replica(sizes: Sequence[int], owners: Sequence[int], replicas: int) -> list[int]:
    """The sum of `sizes` each replica owns.

    Example:
        >>> bytes_per_replica([400, 100, 300, 200], (0, 0, 1, 1), 2)
        [500, 500]
    """
    held = [0] * replicas
    for size, owner in zip(sizes, owners):
        held[owner] += int(size)
    return held


def memory_per_replica(variable_elements: Sequence[int], bytes_per_element: int, slots_per_variable: int,
                       replicas: int) -> dict:
    """Bytes on the fullest replica of the weights, the gradients and the optimizer states, replicated and sharded
    (weights and gradients are whole on every replica either way; the states of the replica owning the most).

    Example:
        >>> memory_per_replica([10], 4, 2, 1)["replicated"]["optimizer_states"]
        80
    """
    elements = [int(n) for n in variable_elements]
    weights = sum(elements) * bytes_per_element
    states = [n * bytes_per_element * slots_per_variable for n in elements]
    sharded = max(bytes_per_replica(states, assign_owners(states, replicas), replicas)) if states else 0
    return {"replicated": {"weights": weights, "gradients": weights, "optimizer_states": sum(states)},
            "sharded": {"weights": weights, "gradients": weights, "optimizer_states": sharded}}


def format_memory_table(table: dict, replicas: int) -> str:
    """`memory_per_replica`'s answer as a few aligned lines, in GB (10^9 bytes).

    Example:
        >>> print(format_memory_table(memory_per_replica([10**9, 10**9], 4, 2, 2), 2))
        per replica (2 replicas)  weights  gradients  optimizer states  total
        replicated                    8.00       8.00             16.00  32.00
        sharded                       8.00       8.00              8.00  24.00
    """
    rows = [f"per replica ({replicas} replicas)  weights  gradients  optimizer states  total"]
    for name in ("replicated", "sharded"):
        part = table[name]
        total = part["weights"] + part["gradients"] + part["optimizer_states"]
        rows.append(f"{name:<25}{part['weights'] / 1e9:>9.2f}{part['gradients'] / 1e9:>11.2f}"
                    f"{part['optimizer_states'] / 1e9:>18.2f}{total / 1e9:>7.2f}")
    return "\n".join(rows)
