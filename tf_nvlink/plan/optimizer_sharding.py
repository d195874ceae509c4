"""Optimizer states sharded over the replicas (`tf_nvlink.strategy(optimizer_states="sharded")`): which replica
owns each variable's optimizer state, and the bytes each replica holds, replicated and sharded.

Pure: no TensorFlow. The partition is by whole variables (every Keras optimizer's `update_step` works on one
variable at a time, and LAMB's and Adafactor's need the whole variable, its norms or its factored rows and
columns), balanced by size: the largest variable first, each to the replica holding the fewest bytes so far (ties:
the lower replica index; among equal sizes the earlier variable first), so that the assignment depends only on
the variables' order and sizes, and every replica computes the same one. Each replica then holds at most
1/N of the states plus one largest variable's.

The memory rows (`memory_rows`: bytes per replica of the weights, the gradients and the optimizer states,
replicated and sharded, and whether each fits a GPU) are what `tf-nvlink report --memory`, `tf-nvlink costmodel`,
the step doctor and the log line of a sharded optimizer show.

Example:
    >>> assign_owners([400, 100, 300, 200], replicas=2)
    (0, 0, 1, 1)
    >>> memory_per_replica([4000, 1000], bytes_per_element=4, slots_per_variable=2, replicas=2)["sharded"]
    {'weights': 20000, 'gradients': 20000, 'optimizer_states': 32000, 'total': 72000, 'largest_share': 32000, 'fits': None}
"""

from __future__ import annotations

from typing import Optional, Sequence

from tf_nvlink.util.text_table import table

OPTIMIZER_STATES = ("replicated", "sharded")
# The Keras optimizers whose update under sharded states is checked to be one device's (tests/training/
# test_sharded_states.py); each updates one whole variable at a time from its own slots.
SHARDABLE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Lion", "Lamb", "Adamax", "Adadelta", "Ftrl", "Nadam")


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


def memory_rows(weight_bytes: Sequence[int], state_bytes: Sequence[int], replicas: int, *,
                other_state_bytes: int = 0, device_bytes: Optional[int] = None) -> dict:
    """Bytes on the fullest replica of the weights, the gradients and the optimizer states, replicated and sharded
    over `replicas`, and whether each fits one GPU of `device_bytes` (before activations).

    `weight_bytes` are the trainable variables' bytes and `state_bytes` each one's optimizer states (its slots), in
    the optimizer's order; `other_state_bytes` what the optimizer keeps whole on every replica (step counters,
    gradient accumulators). Weights and gradients are whole on every replica either way; sharded, a replica holds
    the states of the variables it owns (`assign_owners` over `weight_bytes`, as at run time), and the fullest
    replica's share is "largest_share". "fits" and "sharding_lets_it_fit" are None without `device_bytes`.

    Example:
        >>> rows = memory_rows([4000, 1000], [8000, 2000], 2, other_state_bytes=12, device_bytes=20_000)
        >>> rows["replicated"]
        {'weights': 5000, 'gradients': 5000, 'optimizer_states': 10012, 'total': 20012, 'fits': False}
        >>> rows["sharded"]["optimizer_states"], rows["sharded"]["largest_share"], rows["sharding_lets_it_fit"]
        (8012, 8000, True)
    """
    if len(weight_bytes) != len(state_bytes):
        raise ValueError(f"weight_bytes and state_bytes should have one entry per variable. Received: "
                         f"{len(weight_bytes)} and {len(state_bytes)} entries")
    weights = sum(int(b) for b in weight_bytes)
    owned = bytes_per_replica(state_bytes, assign_owners(weight_bytes, replicas), replicas)
    largest = max(owned)
    replicated_states = sum(int(b) for b in state_bytes) + int(other_state_bytes)
    sharded_states = largest + int(other_state_bytes)

    def fits(total: int) -> Optional[bool]:
        return None if device_bytes is None else total <= device_bytes

    replicated = {"weights": weights, "gradients": weights, "optimizer_states": replicated_states,
                  "total": 2 * weights + replicated_states}
    replicated["fits"] = fits(replicated["total"])
    sharded = {"weights": weights, "gradients": weights, "optimizer_states": sharded_states,
               "total": 2 * weights + sharded_states, "largest_share": largest}
    sharded["fits"] = fits(sharded["total"])
    lets_fit = None if device_bytes is None else bool(sharded["fits"] and not replicated["fits"])
    return {"replicas": replicas, "device_bytes": device_bytes, "replicated": replicated, "sharded": sharded,
            "sharding_lets_it_fit": lets_fit}


def memory_per_replica(variable_elements: Sequence[int], bytes_per_element: int, slots_per_variable: int,
                       replicas: int, device_bytes: Optional[int] = None) -> dict:
    """`memory_rows` of variables of `variable_elements` elements each, `bytes_per_element` bytes an element and
    `slots_per_variable` slots of their shape (AdamW in float32: 4 and 2).

    Example:
        >>> memory_per_replica([10], 4, 2, 1)["replicated"]["optimizer_states"]
        80
    """
    weights = [int(n) * bytes_per_element for n in variable_elements]
    return memory_rows(weights, [b * slots_per_variable for b in weights], replicas, device_bytes=device_bytes)


_UNITS = ((10**9, "GB"), (10**6, "MB"), (10**3, "KB"))


def _unit(nbytes: int) -> tuple[int, str]:
    return next(((size, name) for size, name in _UNITS if nbytes >= size), (1, "B"))


def format_bytes(nbytes: int, like: Optional[int] = None) -> str:
    """Bytes in decimal units (GB = 10^9 bytes), two decimals; bytes below 1 KB as they are. With `like`, in the
    unit `like` would take (several numbers in one unit).

    Example:
        >>> format_bytes(1_234_567_890), format_bytes(4_108), format_bytes(12), format_bytes(8 * 10**8, like=10**9)
        ('1.23 GB', '4.11 KB', '12 B', '0.80 GB')
    """
    size, name = _unit(nbytes if like is None else like)
    return f"{nbytes} B" if size == 1 else f"{nbytes / size:.2f} {name}"


def states_summary(rows: dict) -> str:
    """`memory_rows`' optimizer states in words: replicated and sharded per replica, and the largest share.

    Example:
        >>> states_summary(memory_rows([4000, 1000], [8000, 2000], 2, other_state_bytes=12))
        '10.01 KB per replica replicated, 8.01 KB sharded over 2 replicas (largest share 8.00 KB)'
    """
    replicated = rows["replicated"]["optimizer_states"]
    return (f"{format_bytes(replicated)} per replica replicated, "
            f"{format_bytes(rows['sharded']['optimizer_states'], like=replicated)} sharded over {rows['replicas']} "
            f"replicas (largest share {format_bytes(rows['sharded']['largest_share'], like=replicated)})")


def summary_line(rows: dict) -> str:
    """The log line of a sharded optimizer: "optimizer states: " and `states_summary`.

    Example:
        >>> summary_line(memory_rows([4000, 1000], [8000, 2000], 2, other_state_bytes=12))
        'optimizer states: 10.01 KB per replica replicated, 8.01 KB sharded over 2 replicas (largest share 8.00 KB)'
    """
    return f"optimizer states: {states_summary(rows)}"


def fit_verdict(rows: dict) -> Optional[str]:
    """What `memory_rows`' fits say in words, or None without a device size.

    Example:
        >>> fit_verdict(memory_rows([4000, 1000], [8000, 2000], 2, device_bytes=19_000))
        'sharding lets this model fit (2 replicas: 18.00 KB sharded, 20.00 KB replicated, 19.00 KB per GPU)'
    """
    if rows.get("device_bytes") is None:
        return None
    replicated, sharded = rows["replicated"], rows["sharded"]
    sizes = (f"{rows['replicas']} replicas: {format_bytes(sharded['total'])} sharded, "
             f"{format_bytes(replicated['total'])} replicated, {format_bytes(rows['device_bytes'])} per GPU")
    if replicated["fits"]:
        return f"fits replicated ({sizes})"
    if sharded["fits"]:
        return f"sharding lets this model fit ({sizes})"
    return f"does not fit, even sharded ({sizes})"


def memory_table_lines(all_rows: Sequence[dict]) -> list[str]:
    """`memory_rows` for several replica counts as an aligned table: per replica count, a replicated and a sharded
    row of bytes per GPU, in one unit (that of the largest total), and whether each fits (before activations).

    Example:
        >>> for line in memory_table_lines([memory_per_replica([10**9, 10**9], 4, 2, n) for n in (1, 2)]):
        ...     print(line)
        # GPUs  states      weights  gradients  optimizer states  total  fits
        #                      (GB)       (GB)              (GB)   (GB)
             1  replicated     8.00       8.00             16.00  32.00     -
             1  sharded        8.00       8.00             16.00  32.00     -
             2  replicated     8.00       8.00             16.00  32.00     -
             2  sharded        8.00       8.00              8.00  24.00     -
    """
    size, name = _unit(max((rows["replicated"]["total"] for rows in all_rows), default=0))

    def number(value: int) -> str:
        return str(value) if size == 1 else f"{value / size:.2f}"

    lines = [["GPUs", "states", "weights", "gradients", "optimizer states", "total", "fits"],
             ["", "", f"({name})", f"({name})", f"({name})", f"({name})", ""]]
    for rows in all_rows:
        for mode in OPTIMIZER_STATES:
            part = rows[mode]
            fits = "-" if part["fits"] is None else "yes" if part["fits"] else "no"
            lines.append([str(rows["replicas"]), mode, number(part["weights"]), number(part["gradients"]),
                          number(part["optimizer_states"]), number(part["total"]), fits])
    return table(lines, right={0, 2, 3, 4, 5, 6}, header_rows=2)


def format_memory_table(table_rows: dict, replicas: int) -> str:
    """`memory_rows`' answer as a few aligned lines, in GB (10^9 bytes).

    Example:
        >>> print(format_memory_table(memory_per_replica([10**9, 10**9], 4, 2, 2), 2))
        per replica (2 replicas)  weights  gradients  optimizer states  total
        replicated                    8.00       8.00             16.00  32.00
        sharded                       8.00       8.00              8.00  24.00
    """
    rows = [f"per replica ({replicas} replicas)  weights  gradients  optimizer states  total"]
    for name in OPTIMIZER_STATES:
        part = table_rows[name]
        total = part["weights"] + part["gradients"] + part["optimizer_states"]
        rows.append(f"{name:<25}{part['weights'] / 1e9:>9.2f}{part['gradients'] / 1e9:>11.2f}"
                    f"{part['optimizer_states'] / 1e9:>18.2f}{total / 1e9:>7.2f}")
    return "\n".join(rows)
