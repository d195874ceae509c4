"""Predictions as an nccl-tests style table, and the command line `python -m tf_nvlink.tools.costmodel`."""

from __future__ import annotations

import argparse
from typing import Iterable, Optional, Sequence

from tf_nvlink.plan import optimizer_sharding
from tf_nvlink.tools.costmodel.model import (ALLREDUCE_BYTES_PER_ELEMENT, DEFAULT_FUSED_OVERLAP, DEFAULT_REPLICA_OVERHEAD_MS,
                                      LINKS, MIB, OPTIMIZER_STATES, REPLICA_OVERHEAD_HOST_FED_MS, SHARDED_NOTE,
                                      Prediction, Workload, predict)
from tf_nvlink.util.cli_args import argtype, non_negative, positive, run_as_module, usage_error


# ---- tables ------------------------------------------------------------------------------------------------

_COLUMNS = (  # name, unit, width, attribute, format
    ("workload", "", 12, "workload", "s"),
    ("link", "", 14, "link", "s"),
    ("gpus", "", 4, "n_gpus", "d"),
    ("dtype", "", 8, "allreduce_dtype", "s"),
    ("states", "", 10, "optimizer_states", "s"),
    ("busbw", "(GB/s)", 7, "busbw_gbps", ".1f"),
    ("comm", "(ms)", 7, "comm_ms", ".2f"),
    ("exposed", "(ms)", 7, "exposed_comm_ms", ".2f"),
    ("overhead", "(ms)", 8, "overhead_ms", ".2f"),
    ("step", "(ms)", 7, "step_ms", ".2f"),
    ("scaling", "", 7, "scaling", ".3f"),
    ("samples/s", "", 10, "samples_per_s", ".0f"),
)


def render_table(predictions: Iterable[Prediction]) -> str:
    """Predictions as an nccl-tests style table: a '#' names row, a '#' units row, one row per prediction.

    Example:
        >>> print(render_table([predict(resnet, LINKS["nvswitch-h200"], n) for n in (1, 2)]))
    """
    predictions = list(predictions)
    widths = [max(width, len(name), *(len(format(getattr(p, attr), fmt)) for p in predictions))
              for name, _, width, attr, fmt in _COLUMNS]

    def line(cells: Sequence[str], prefix: str) -> str:
        return prefix + " ".join(cell.rjust(w) if k > 1 else cell.ljust(w)
                                 for k, (cell, w) in enumerate(zip(cells, widths))).rstrip()

    rows = [line([name for name, *_ in _COLUMNS], "# "), line([unit for _, unit, *_ in _COLUMNS], "# ")]
    rows += [line([format(getattr(p, attr), fmt) for *_, attr, fmt in _COLUMNS], "  ") for p in predictions]
    return "\n".join(rows)


def memory_lines(gradient_bytes: int, tensors: int, slots: int, gpu_counts: Sequence[int],
                 device_bytes: Optional[int] = None, name: str = "workload") -> list[str]:
    """The bytes per GPU of a workload's weights, gradients and optimizer states, replicated and sharded, for each GPU
    count (`optimizer_sharding.memory_rows`): float32 parameters of `gradient_bytes` / 4, in `tensors` variables of
    equal size (the first ones one parameter larger when they do not divide), `slots` optimizer states per
    parameter (AdamW: 2); with `device_bytes`, whether each fits one GPU (before activations).

    Example:
        >>> print("\\n".join(memory_lines(28 * 10**9, 32, 2, [8], device_bytes=80 * 10**9)))
    """
    params = gradient_bytes // 4
    sizes = [params // tensors + (1 if index < params % tensors else 0) for index in range(tensors)]
    weights = [4 * size for size in sizes]
    all_rows = [optimizer_sharding.memory_rows(weights, [slots * b for b in weights], n, device_bytes=device_bytes)
                for n in gpu_counts]
    size = f", {optimizer_sharding.format_bytes(device_bytes)} per GPU" if device_bytes is not None else ""
    lines = [f"memory per GPU of {name} ({params:,} float32 parameters in {tensors} equal variables, {slots} optimizer "
             f"state(s) per parameter{size}; before activations):"]
    lines += optimizer_sharding.memory_table_lines(all_rows)
    lines += [f"  {n} GPUs: {verdict}" for n, verdict in
              ((rows["replicas"], optimizer_sharding.fit_verdict(rows)) for rows in all_rows) if verdict]
    return lines


# ---- command line ------------------------------------------------------------------------------------------

HELP = ("predicted step time and scaling on 1/2/4/8 GPUs of every link type, from one GPU's step and the gradients, "
        "and the memory per GPU, optimizer states replicated or sharded")
STATES_CHOICES = OPTIMIZER_STATES + ("both",)


def _gpu_counts(text: str) -> list[int]:
    counts = [part.strip() for part in str(text).split(",")]
    if not counts or not all(c.isdigit() and int(c) >= 1 for c in counts):
        raise ValueError(f"should be a comma list of positive GPU counts such as 1,2,4,8. Received: {text!r}")
    return [int(c) for c in counts]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"should be a positive number. Received: {text!r}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"should be a number from 0 to 1. Received: {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"should be a number >= 0. Received: {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink costmodel` options."""
    parser.add_argument("--compute_ms", type=_positive_float, required=True, help="one GPU's step time (ms)")
    parser.add_argument("--gradient_mib", type=_positive_float, default=None,
                        help="float32 gradients (MiB); or --params")
    parser.add_argument("--params", type=_positive_float, default=None,
                        help="parameters (such as 7e9), float32: 4 bytes of gradients each; or --gradient_mib")
    parser.add_argument("--gradient_tensors", type=positive, default=1)
    parser.add_argument("--batch", type=positive, default=128, help="samples per GPU per step")
    parser.add_argument("--packs", type=non_negative, default=1, help="all-reduce calls per step (0: one per tensor)")
    parser.add_argument("--name", default="workload")
    parser.add_argument("--allreduce_dtype", default="float32", choices=sorted(ALLREDUCE_BYTES_PER_ELEMENT))
    parser.add_argument("--fused_overlap", type=_fraction, default=DEFAULT_FUSED_OVERLAP)
    parser.add_argument("--replica_overhead_ms", type=_non_negative_float, default=DEFAULT_REPLICA_OVERHEAD_MS,
                        help=f"per extra replica; host-fed ResNet-50 measured {REPLICA_OVERHEAD_HOST_FED_MS}")
    parser.add_argument("--gpus", type=argtype(_gpu_counts), default=[1, 2, 4, 8],
                        help="comma-separated GPU counts (default 1,2,4,8)")
    parser.add_argument("--optimizer_states", default="replicated", choices=STATES_CHOICES,
                        help="the rows of tf_nvlink.strategy(optimizer_states=...): replicated (default), sharded "
                             "or both")
    parser.add_argument("--slots", type=non_negative, default=2,
                        help="optimizer states per parameter, for the memory rows (AdamW, Adam: 2; SGD with "
                             "momentum: 1)")
    parser.add_argument("--gpu_memory_gb", type=_positive_float, default=None,
                        help="one GPU's memory in GB (10^9 bytes; H200: 141): say whether each row fits")


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink costmodel --compute_ms 39.7 --gradient_mib 97.5`: 1/2/4/8 GPUs on every link type, optimizer
    states replicated and sharded, then the memory per GPU."""
    if (args.gradient_mib is None) == (args.params is None):
        return usage_error(args, "give one of --gradient_mib (float32 gradients in MiB) or --params (parameters)")
    gradient_bytes = round(args.gradient_mib * MIB) if args.params is None else 4 * round(args.params)
    workload = Workload(args.compute_ms, gradient_bytes, args.gradient_tensors, args.batch, args.packs, args.name)
    states = OPTIMIZER_STATES if args.optimizer_states == "both" else (args.optimizer_states,)
    predictions = [predict(workload, link, n, allreduce_dtype=args.allreduce_dtype,
                           fused_overlap=args.fused_overlap, replica_overhead_ms=args.replica_overhead_ms,
                           optimizer_states=state)
                   for link in LINKS.values() for n in args.gpus for state in states]
    lines = [render_table(predictions)]
    if "sharded" in states:
        lines.append(f"note: {SHARDED_NOTE}")
    device_bytes = None if args.gpu_memory_gb is None else round(args.gpu_memory_gb * 1e9)
    lines += ["", *memory_lines(gradient_bytes, args.gradient_tensors, args.slots, args.gpus, device_bytes,
                                args.name)]
    print("\n".join(lines))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tools.costmodel ...`: the same as `tf-nvlink costmodel ...`."""
    return run_as_module("tf_nvlink.tools.costmodel", HELP, add_arguments, run, argv)
