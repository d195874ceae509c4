"""The doctor's report as people read it: a short text table, a JSON file, a PNG bar chart, and TensorBoard
summaries (scalars, the table as text, the chart as an image).

A report is a plain dict (`StepDoctor.report`): "replicas" (one breakdown dict per GPU plane, with "work_ms": the
kernels' ms per step by kind of work, and "work_cost": their bytes and FLOPs per step), "mean", "verdict" (with
"far_from_bound"), "nvlink", "scaling", "context", "input_copy", "work_bounds" (each kind of work against its bound:
`bounds.kind_bounds`), "trace", "nvlink_bytes_per_step", "fit_call", "window", "doctor_hooks_s", "optimizer_states"
(the strategy's mode and the optimizer's memory rows) and, given the model's FLOPs, "mfu"; without a breakdown,
"unavailable" (why) instead of the first five.

Example:
    >>> print(render_table(doctor.report))
    >>> write_json(doctor.report, "step_doctor.json"); write_chart(doctor.report, "step_doctor.png")
"""

from __future__ import annotations

import json
import logging
import os
from typing import Optional

from tf_nvlink.plan import gpu_peaks, optimizer_sharding
from tf_nvlink.tools.doctor.work_kinds import WORK_KINDS
from tf_nvlink.util import atomic_files
from tf_nvlink.util.atomic_files import write_atomic
from tf_nvlink.util.text_table import table

# The step's parts, in the order the table and the chart show them (key in a breakdown dict, label).
PARTS = (("compute_ms", "compute"), ("exposed_collective_ms", "all-reduce exposed"),
         ("hidden_collective_ms", "all-reduce hidden"), ("exposed_h2d_ms", "input copy exposed"),
         ("idle_ms", "GPU idle"))


def render_table(report: dict) -> str:
    """A few lines: the step's parts per replica, the verdict with its advice, NVLink bytes and what NVLink buys."""
    replicas = report["replicas"]
    header = f"{'step doctor (ms/step)':<24}" + "".join(f"{r['plane'].replace('/device:', ''):>10}" for r in replicas)
    lines = [header]
    peer = (("peer_copy_ms", "all-reduce peer copies"),) if any(r.get("peer_copy_ms") for r in replicas) else ()
    for key, label in (("step_ms", "step"),) + PARTS + peer + (("h2d_ms", "input copy total"),
                                                                ("per_call_gap_ms", "gap per call"),):
        lines.append(f"{label:<24}" + "".join(f"{r[key]:>10.2f}" for r in replicas))
    kinds = [kind for kind in WORK_KINDS if any((r.get("work_ms") or {}).get(kind) for r in replicas)]
    if kinds:
        lines.append("by kind of work")
        for kind in kinds:
            lines.append(f"  {kind:<22}" + "".join(f"{(r.get('work_ms') or {}).get(kind, 0.0):>10.2f}"
                                                   for r in replicas))
    lines += bound_lines(report.get("work_bounds"))
    if report.get("mfu"):
        lines.append(mfu_line(report["mfu"]))
    copy = report.get("input_copy")
    if copy:
        lines.append(f"input copy: {copy['bytes_per_step'] / 2**20:.1f} MiB per step per replica in "
                     f"{copy['ms_per_step']:.2f} ms, {copy['gb_per_s']:.1f} GB/s"
                     + (f" ({copy['note']})" if copy.get("note") else ""))
    verdict = report["verdict"]
    lines.append(f"verdict: {verdict['kind']}")
    for advice in verdict["advice"]:
        lines.append(f"  try {advice['change']}: predicted {advice['predicted_step_ms']:.2f} ms/step "
                     f"(+{advice['gain']:.0%}); {advice['why']}")
    lines += far_from_bound_lines(verdict.get("far_from_bound") or [])
    fit_call = report.get("fit_call") or {}
    if fit_call:
        lines.append(f"fixed cost of the fit call: {fit_call['fixed_ms']:.1f} ms ({fit_call['measured']})")
    nvlink_bytes = report.get("nvlink_bytes_per_step")
    lines.append(f"NVLink bytes per step: {nvlink_bytes:.4g}" if isinstance(nvlink_bytes, (int, float))
                 else f"NVLink bytes per step: {nvlink_bytes}")
    nvlink = report.get("nvlink") or {}
    if nvlink:
        line = f"NVLink: {nvlink['answer']}"
        if "step_ms_without_nvlink" in nvlink:
            line += (f" (step {nvlink.get('step_ms_with_nvlink')} ms with, {nvlink['step_ms_without_nvlink']} ms "
                     f"without: x{nvlink['speedup_from_nvlink']})")
        lines.append(line)
    states = report.get("optimizer_states")
    if states:
        lines.append(optimizer_states_line(states))
    return "\n".join(lines)


def _number(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def bound_lines(bounds: Optional[dict]) -> list[str]:
    """The report's "work_bounds" as a table: per kind of compute work its ms, GB and TFLOP per step, HLO ops per
    step (instruction executions), its bound (ms) and what sets it, measured / bound and the ms above it; then why
    a kind has no bound, and the part of a kind's time in transposes of fused-attention results.

    Example:
        >>> print("\\n".join(bound_lines(report["work_bounds"])))
        kinds of work against their bound (ms per step; H200 SXM: memory 4.8 TB/s, bf16 dense 989.4 TFLOP/s)
        # kind             ms      GB  TFLOP  HLO ops  bound ms  bound by  x bound  above
          matmul         8.35  16.909  2.933    161.0      3.52  memory       2.37   4.82
    """
    kinds = (bounds or {}).get("kinds") or {}
    if not kinds:
        return []
    memory, peak = bounds.get("memory"), bounds.get("peak")
    against = ", ".join(part for part in (
        f"memory {memory['tb_per_s']:g} TB/s" if memory else "no memory bandwidth",
        f"bf16 dense {peak['tflops']:g} TFLOP/s" if peak else "no bf16 peak") if part)
    label = (memory or {}).get("label") or (peak or {}).get("label") or bounds.get("gpu") or "unknown GPU"
    rows = [["kind", "ms", "GB", "TFLOP", "HLO ops", "bound ms", "bound by", "x bound", "above"]]
    for kind, row in kinds.items():
        rows.append([kind, f"{row['ms']:.2f}", f"{row['gb']:.3f}", f"{row['tflop']:.3f}", f"{row['hlo_ops']:.1f}",
                     _number(row["bound_ms"], 2), row["bound_by"] or "-", _number(row["x_bound"], 2),
                     _number(row["above_bound_ms"], 2)])
    lines = [f"kinds of work against their bound (ms per step; {label}: {against})"]
    lines += table(rows, right={1, 2, 3, 4, 5, 7, 8}, header_rows=1)
    lines += [f"  {kind}: no bound: {row['why']}" for kind, row in kinds.items() if row.get("why")]
    lines += [f"  {kind}: {row['attention_layout_ms']:.2f} ms of it in {row['attention_layout_ops']:.0f} transposes "
              f"of fused-attention results per step (cuDNN gives O, dQ, dK, dV as [B, N, T, H]; the layers read "
              f"[B, T, N, H])" for kind, row in kinds.items() if row.get("attention_layout_ms")]
    return lines


def far_from_bound_lines(entries: list) -> list[str]:
    """The verdict's kinds furthest from their bound, one line each with what could be done.

    Example:
        >>> far_from_bound_lines([{"kind": "normalisation", "ms": 6.14, "bound_ms": 0.6, "bound_by": "memory",
        ...                        "x_bound": 10.2, "above_bound_ms": 5.54, "gb": 2.0, "tflop": 0.001,
        ...                        "hlo_ops": 98.0, "could": None}])[1][:80]
        '    normalisation: 6.14 ms, 10.2x its bound of 0.60 ms (memory: 2.00 GB in 98 HLO'
    """
    if not entries:
        return []
    lines = ["  furthest from their bound (ms per step above it):"]
    for entry in entries:
        could = f"could: {entry['could']}" if entry.get("could") else "no change the doctor knows of"
        lines.append(f"    {entry['kind']}: {entry['ms']:.2f} ms, {entry['x_bound']:.1f}x its bound of "
                     f"{entry['bound_ms']:.2f} ms ({entry['bound_by']}: {entry['gb']:.2f} GB in "
                     f"{entry['hlo_ops']:.0f} HLO ops, {entry['tflop']:.3f} TFLOP), {entry['above_bound_ms']:.2f} ms "
                     f"above it; {could}")
    return lines


def mfu_line(entry: dict) -> str:
    """The report's "mfu" in one line: the model's FLOPs per step, its TFLOP/s per GPU and the MFU against the GPU's
    bf16 dense peak, or why there is no MFU.

    Example:
        >>> print(mfu_line({"model_flops_per_step": 8.854e12, "tflops_per_gpu": 209.3, "gpu": "NVIDIA H100 PCIe",
        ...                 "peak_label": "H100 PCIe", "peak_tflops": 756.5, "mfu": 0.2767}))
        model FLOPs 8.854 TFLOP a step: 209.3 TFLOP/s per GPU, MFU 27.7% of the H100 PCIe's 756.5 TFLOP/s (bf16 dense)
    """
    line = (f"model FLOPs {entry['model_flops_per_step'] / 1e12:.3f} TFLOP a step: {entry['tflops_per_gpu']:.1f} "
            f"TFLOP/s per GPU, ")
    if entry.get("mfu") is None:
        return line + f"MFU n/a (the GPU {entry.get('gpu')!r} is not in tf_nvlink.plan.gpu_peaks)"
    line += (f"MFU {gpu_peaks.mfu_text(entry['mfu'])} of the {entry['peak_label']}'s {entry['peak_tflops']:g} "
             f"TFLOP/s (bf16 dense)")
    if entry.get("mfu_of_kernel_time") is not None:
        line += f"; on the kernels' time alone {gpu_peaks.mfu_text(entry['mfu_of_kernel_time'])}"
    return line


def optimizer_states_line(states: dict) -> str:
    """The report's "optimizer_states" in one line: the mode and, with the memory rows, the optimizer states per
    replica replicated and sharded.

    Example:
        >>> optimizer_states_line({"mode": "replicated", "memory": None})
        "optimizer_states='replicated'"
    """
    line = f"optimizer_states={states['mode']!r}"
    if states.get("memory"):
        line += f": {optimizer_sharding.states_summary(states['memory'])}"
    return line


def write_json(report: dict, path: str) -> str:
    """Write the report as JSON (atomically) and return the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(path, json.dumps(report, indent=1, sort_keys=True) + "\n", mode=0o644)
    return path


def write_chart(report: dict, path: str) -> Optional[str]:
    """A stacked bar per replica of the step's parts as a PNG; None (nothing written) without matplotlib, or with
    one that fails to import (a warning says why: the report is not lost for a chart)."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    except Exception as exc:  # noqa: BLE001 - an install built against another numpy raises anything
        logging.getLogger("tf_nvlink").warning("StepDoctor: no chart: matplotlib cannot be imported (%s)",
                                               " ".join(str(exc).split())[:200])
        return None
    replicas = report["replicas"]
    labels = [r["plane"].replace("/device:", "") for r in replicas]
    figure, axes = plt.subplots(figsize=(1.8 * len(labels) + 3.5, 4))
    bottoms = [0.0] * len(replicas)
    for key, label in PARTS:
        values = [r[key] for r in replicas]
        axes.bar(labels, values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    axes.set_ylabel("ms per step")
    axes.set_title(f"step doctor: {report['verdict']['kind']}")
    axes.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_files.atomic_path(path, suffix=".png") as partial:
        figure.savefig(partial, dpi=100)
    plt.close(figure)
    return path


def render_markdown(report: dict) -> str:
    """The report for TensorBoard's text dashboard (Markdown): the verdict, then the table as a code block; without
    a breakdown, why there is none."""
    if "unavailable" in report:
        return f"**step doctor: no step breakdown.** {report['unavailable']}"
    return f"**step doctor: {report['verdict']['kind']}**\n\n```\n{render_table(report)}\n```"


def write_tensorboard(report: dict, log_dir: str, step: int, chart: Optional[str] = None) -> str:
    """Under <log_dir>/step_doctor: the mean breakdown (its parts, the ms of each kind of work, each kind's bound and
    measured / bound and, given the model's FLOPs, the MFU) and the advice's predicted gains as scalars, the table and
    verdict as text (`step_doctor/verdict`; without a breakdown, why) and the chart PNG, when given, as an image
    (`step_doctor/chart`)."""
    import tensorflow as tf  # noqa: PLC0415

    directory = os.path.join(log_dir, "step_doctor")
    writer = tf.summary.create_file_writer(directory)
    with writer.as_default(step=step):
        if "unavailable" not in report:
            for key, _ in (("step_ms", "step"),) + PARTS:
                tf.summary.scalar(f"step_doctor/{key}", report["mean"][key])
            for kind, ms in (report["mean"].get("work_ms") or {}).items():
                tf.summary.scalar(f"step_doctor/work_{kind}_ms", ms)
            for kind, row in ((report.get("work_bounds") or {}).get("kinds") or {}).items():
                if row.get("bound_ms") is not None:
                    tf.summary.scalar(f"step_doctor/work_{kind}_bound_ms", row["bound_ms"])
                    tf.summary.scalar(f"step_doctor/work_{kind}_x_bound", row["x_bound"])
            if (report.get("mfu") or {}).get("mfu") is not None:
                tf.summary.scalar("step_doctor/mfu", report["mfu"]["mfu"])
            for index, advice in enumerate(report["verdict"]["advice"]):
                tf.summary.scalar(f"step_doctor/advice{index}_predicted_gain", advice["gain"])
        tf.summary.text("step_doctor/verdict", render_markdown(report))
        if chart:
            with open(chart, "rb") as f:
                image = tf.image.decode_png(f.read(), channels=4)
            tf.summary.image("step_doctor/chart", image[tf.newaxis], max_outputs=1)
    writer.close()
    return directory
