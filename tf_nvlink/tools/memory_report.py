"""`tf-nvlink report --memory MODEL`: the bytes per GPU of a benchmark model's weights, gradients and optimizer
states, with `optimizer_states` replicated and sharded, for several GPU counts, and whether each fits the GPUs.

The model (`bench_models.bench_body`) and its optimizer's slots are built on the CPU under a one-CPU tf_nvlink
strategy, which records each slot as Keras makes it (`training.sharded_states.memory_table`); the bytes per
replica for N GPUs then follow from the plan's partition (`plan.optimizer_sharding.memory_rows`), as
`optimizer_states="sharded"` places the slots on N GPUs. `import tf_nvlink.tools.memory_report` does not import
TensorFlow; `collect` does, and builds a strategy (so call it in a process of its own, as the command does).

Example:
    >>> data = collect("resnet50", "adamw", gpu_counts=(1, 2, 4, 8), device_bytes=141 * 10**9)
    >>> print(render_text(data))
"""

from __future__ import annotations

from typing import Optional, Sequence

from tf_nvlink.machine.topology import Topology
from tf_nvlink.plan import optimizer_sharding
from tf_nvlink.tools.bench_models import BENCH_MODELS

# `--optimizer` names: the Keras optimizers sharded states keeps exact, lower case, to their Keras class
OPTIMIZERS = {name.lower(): name for name in optimizer_sharding.SHARDABLE}
DEFAULT_OPTIMIZER = "adamw"
DEFAULT_GPU_COUNTS = (1, 2, 4, 8)


def gpu_facts(topology: Topology) -> tuple[int, Optional[int]]:
    """(the machine's GPU count, the smallest GPU's memory in bytes, or None when NVML does not give every GPU's).

    Example:
        >>> gpu_facts(nvml.probe())          # 2x H200
        (2, 150754820096)
    """
    sizes = [gpu.memory_total_mib for gpu in topology.gpus]
    if not sizes or any(size is None for size in sizes):
        return len(sizes), None
    return len(sizes), min(sizes) * 2**20


def gpu_counts(replicas: Optional[int], machine_gpus: int) -> list[int]:
    """The GPU counts to show: `replicas` when given, else 1, 2, 4, 8 and the machine's own count.

    Example:
        >>> gpu_counts(None, 3), gpu_counts(16, 2)
        ([1, 2, 3, 4, 8], [16])
    """
    if replicas is not None:
        return [replicas]
    return sorted(set(DEFAULT_GPU_COUNTS) | ({machine_gpus} if machine_gpus else set()))


def collect(model: str, optimizer: str = DEFAULT_OPTIMIZER, gpu_counts: Sequence[int] = DEFAULT_GPU_COUNTS,
            device_bytes: Optional[int] = None) -> dict:
    """The memory rows of benchmark model `model` trained with Keras optimizer `optimizer` (a key of OPTIMIZERS,
    Keras' defaults), one `memory_rows` dict per GPU count, as plain data.

    Example:
        >>> collect("mlp", "adam", [2])["rows"][0]["sharded"]["optimizer_states"]
        1605644
    """
    if model not in BENCH_MODELS:
        raise ValueError(f"model should be one of {list(BENCH_MODELS)}. Received: {model!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer should be one of {list(OPTIMIZERS)}. Received: {optimizer!r}")
    import keras  # noqa: PLC0415 - TensorFlow only when a report asks for memory

    from tf_nvlink.tools import bench_models  # noqa: PLC0415
    from tf_nvlink.training import install, sharded_states  # noqa: PLC0415

    strategy = install.build_strategy(devices=["/cpu:0"])
    with strategy.scope():
        built = bench_models.bench_body(model, keras)
        keras_optimizer = getattr(keras.optimizers, OPTIMIZERS[optimizer])()
        keras_optimizer.build(built.trainable_variables)
    variables = built.trainable_variables
    return {"model": model, "optimizer": OPTIMIZERS[optimizer],
            "parameters": sum(_elements(v) for v in variables),
            "variables": len(variables), "device_bytes": device_bytes,
            "rows": [sharded_states.memory_table(keras_optimizer, n, device_bytes) for n in gpu_counts]}


def _elements(variable) -> int:
    count = 1
    for dim in variable.shape:
        count *= int(dim)
    return count


def render_text(data: dict) -> str:
    """`collect`'s data as a title, the table of bytes per GPU and, with the GPUs' memory, what fits.

    Example:
        >>> print(render_text(collect("mlp", "adam", [1, 2])))
    """
    size = (f"{optimizer_sharding.format_bytes(data['device_bytes'])} per GPU (NVML)"
            if data["device_bytes"] is not None else "GPU memory unknown (NVML gives none): fits not checked")
    lines = [f"Memory per GPU: {data['model']} ({data['parameters']:,} parameters in {data['variables']} variables), "
             f"{data['optimizer']}, Keras' defaults; before activations; {size}",
             *optimizer_sharding.memory_table_lines(data["rows"])]
    lines += [f"  {rows['replicas']} GPUs: {optimizer_sharding.fit_verdict(rows)}" for rows in data["rows"]
              if data["device_bytes"] is not None]
    lines.append("sharded: tf_nvlink.strategy(optimizer_states=\"sharded\") (docs/sharded_optimizer_states.md)")
    return "\n".join(lines) + "\n"
