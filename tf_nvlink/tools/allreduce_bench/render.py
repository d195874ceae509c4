"""The benchmark's output: nccl-tests style tables, the summary, the NVLink ratio, the plot."""

from __future__ import annotations

import importlib.util
import math
import os
from typing import Iterable, Optional, Sequence

from tf_nvlink.util import atomic_files

from tf_nvlink.plan import policy
from tf_nvlink.plan.allreduce_sizes import format_size
from tf_nvlink.tools.allreduce_bench.specs import MAX_LOCAL_SHARE, P2P_VARIANT, XLA_DOC, BenchError, Target

def _measured(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r["status"] in ("ok", "wrong")]


def _labels(records: Iterable[dict]) -> list[str]:
    seen: list[str] = []
    for record in records:
        if record["label"] not in seen:
            seen.append(record["label"])
    return seen


def average_busbw(records: Iterable[dict]) -> dict[str, float]:
    """Mean busbw over sizes per label (nccl-tests' "Avg bus bandwidth"), measured records only."""
    sums: dict[str, list[float]] = {}
    for record in _measured(records):
        sums.setdefault(record["label"], []).append(record["busbw"])
    return {label: sum(values) / len(values) for label, values in sums.items()}


def render_candidate_table(records: Sequence[dict]) -> str:
    """One candidate's rows: a names row, a units row, sizes, and the nccl-tests footer."""
    first = records[0]
    ops_doc = XLA_DOC if first["ops"] == "xla" else policy.OPS.get(first["ops"] or "", first["ops"] or "?")
    if first["ops"] == "collective" and first["device_type"] == "CPU":
        ops_doc = "CollectiveAllReduce (TensorFlow's MirroredStrategy default; RING on CPU devices)"
    head = f"# {first['label']}: {ops_doc}"
    if first["status"] == "failed" and first["size_bytes"] is None:
        return head + f"\n#   FAILED: {first['error']}"
    nvlink = any(r.get("nvlink_bytes") is not None for r in records)  # NVML counted NVLink bytes per all-reduce
    lines = [head + f", {first['n_replicas']} replicas" + (f", env {_env_text(first['env'])}" if first["env"]
                                                            else ""),
             f"#{'size':>11} {'count':>12} {'type':>7} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} "
             f"{'#wrong':>7}" + (f" {'NVLink':>9} {'expected':>9}" if nvlink else ""),
             f"#{'(B)':>11} {'(elements)':>12} {'':>7} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"
             + (f" {'(MiB/GPU)':>9} {'(MiB/GPU)':>9}" if nvlink else "")]
    wrong = 0
    for r in records:
        if r["status"] == "failed":
            lines.append(f"{r['size_bytes']:>12} {r['count'] or '':>12} {'float':>7} {'sum':>6}   FAILED: "
                         f"{r['error']}")
            continue
        wrong += r["wrong"]
        lines.append(f"{r['size_bytes']:>12} {r['count']:>12} {'float':>7} {'sum':>6} {r['time_us']:>10.1f} "
                     f"{r['algbw']:>8.2f} {r['busbw']:>8.2f} {r['wrong']:>7}" + (_nvlink_cells(r) if nvlink else ""))
    measured = _measured(records)
    local = [r for r in measured if r.get("local_us") is not None]
    if local:
        lines.append(render_local_line(local))
    if nvlink:
        lines.append("# NVLink: bytes each GPU sent and received per all-reduce over NVLink (NVML counters, mean of "
                     "TX and RX); expected: the ring's 2(n-1)/n x size")
    elif first.get("nvlink_unavailable") and first["device_type"] == "GPU":
        lines.append(f"# NVLink bytes not measured: {first['nvlink_unavailable']}")
    lines.append(f"# Out of bounds values : {wrong} {'OK' if not wrong else 'WRONG'}")
    if measured:
        lines.append(f"# Avg bus bandwidth    : {sum(r['busbw'] for r in measured) / len(measured):.4f} GB/s")
    return "\n".join(lines)


def _nvlink_cells(record: dict) -> str:
    def mib(value):
        return f"{value / 2**20:>9.3f}" if value is not None else f"{'n/a':>9}"

    return f" {mib(record.get('nvlink_bytes'))} {mib(record.get('nvlink_expected_bytes'))}"


def render_local_line(records: Sequence[dict]) -> str:
    """The footer line saying how much local work was taken out of each size's time ("capped": the most allowed)."""
    parts = [f"{format_size(r['size_bytes'])} {r['local_us']:.1f}" + (
        f" (capped: {r['raw_time_us'] - r['time_us']:.1f} subtracted)" if r.get("local_capped") else "")
        for r in records]
    return ("# Local work subtracted: " + ", ".join(parts) + " us per all-reduce (the chain without the all-reduce, "
            "less an empty call)")


def render_summary(records: Sequence[dict]) -> str:
    """busbw by size, one column per candidate, with the fastest named per size."""
    measured = _measured(records)
    labels = _labels(measured)
    if not labels:
        return "# no measurements"
    width = max(10, *(len(label) + 1 for label in labels))
    sizes = sorted({r["size_bytes"] for r in measured})
    by = {(r["label"], r["size_bytes"]): r for r in measured}
    lines = ["# busbw (GB/s) by size and candidate",
             f"#{'size':>11}" + "".join(f"{label:>{width}}" for label in labels) + "  fastest"]
    for size in sizes:
        row = f"{format_size(size):>12}"
        best, best_bw = "", -1.0
        for label in labels:
            r = by.get((label, size))
            row += f"{r['busbw']:>{width}.2f}" if r else f"{'n/a':>{width}}"
            if r and r["wrong"] == 0 and r["busbw"] > best_bw:
                best, best_bw = label, r["busbw"]
        lines.append(row + f"  {best}")
    averages = average_busbw(measured)
    lines.append(f"#{'average':>11}" + "".join(f"{averages.get(label, 0.0):>{width}.2f}" for label in labels))
    return "\n".join(lines)


def render_p2p_ratio(records: Sequence[dict]) -> str:
    """busbw normal / busbw with NCCL_P2P_DISABLE=1, per candidate and size."""
    measured = _measured(records)
    normal = {(r["candidate"], r["size_bytes"]): r for r in measured if not r["variant"]}
    off = {(r["candidate"], r["size_bytes"]): r for r in measured if r["variant"] == P2P_VARIANT}
    candidates = [c for c in dict.fromkeys(r["candidate"] for r in measured) if any(k[0] == c for k in off)]
    if not candidates:
        return "# NVLink speed-up: nothing measured both ways"
    width = max(12, *(len(c) + 2 for c in candidates))
    lines = ["# NVLink speed-up: busbw normal / busbw with NCCL_P2P_DISABLE=1 (NCCL then stages through host "
             "memory; the variable is read by NCCL only, so reduce_to_one and hierarchical should stay ~1x)",
             f"#{'size':>11}" + "".join(f"{c:>{width}}" for c in candidates)]
    for size in sorted({k[1] for k in normal}):
        row = f"{format_size(size):>12}"
        for c in candidates:
            a, b = normal.get((c, size)), off.get((c, size))
            row += f"{a['busbw'] / b['busbw']:>{width - 1}.2f}x" if a and b and b["busbw"] > 0 else \
                f"{'n/a':>{width}}"
        lines.append(row)
    return "\n".join(lines)


def _env_text(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def render_header(command: str, target: Target, records: Sequence[dict], skipped: Sequence[tuple[str, str]],
                  iters: int, warmup: int, repeats: int, env: dict, title: str = "tf-nvlink bench") -> str:
    tf_versions = sorted({r["tf_version"] for r in records if r["tf_version"]})
    lines = [
        f"# {title}: all-reduce (sum, float32) through tf.distribute, one process per candidate",
        f"# command: {command}",
        f"# devices: {target.describe()}",
        f"# TensorFlow {', '.join(tf_versions) or '?'}; topology fingerprint {target.fingerprint}",
        f"# method: {iters} all-reduces chained in one tf.function (merge_call + extended.batch_reduce_to), "
        f"scalar out; {warmup} warm-up call(s), {repeats} timed call(s); time per all-reduce",
        "# method: each all-reduce's input is tf.maximum(previous sum, floor) on its replica's device, floor a "
        "runtime -inf (Grappler can neither elide reduce_to_one's copies nor merge the chain); time = chained time "
        f"- local work (the same chain without the all-reduce, less the same call with no op; at most "
        f"{MAX_LOCAL_SHARE:.0%} of the chained time)",
        "# busbw = algbw * 2(n-1)/n; #wrong: after the timed loop replica r sends r+1, every element must be "
        "n(n+1)/2",
    ]
    if env:
        lines.append(f"# worker environment: {_env_text(env)}")
    plans = sorted({r["plan"] for r in records if r["plan"] and r["candidate"] == "auto"})
    lines += [f"# auto: {p}" for p in plans]
    lines += [f"# skipped {label}: {reason}" for label, reason in skipped]
    return "\n".join(lines)


def render_text(command: str, target: Target, records: Sequence[dict], skipped: Sequence[tuple[str, str]],
                iters: int, warmup: int, repeats: int, env: dict, compare_p2p: bool = False,
                title: str = "tf-nvlink bench") -> str:
    """The whole report: header, one table per candidate, the summary, the result line."""
    blocks = [render_header(command, target, records, skipped, iters, warmup, repeats, env, title)]
    for label in _labels(records):
        blocks.append(render_candidate_table([r for r in records if r["label"] == label]))
    blocks.append(render_summary(records))
    if compare_p2p:
        blocks.append(render_p2p_ratio(records))
    blocks.append(result_line(records))
    return "\n#\n".join(blocks) + "\n"


def result_line(records: Sequence[dict]) -> str:
    wrong = sorted({r["label"] for r in records if r["status"] == "wrong"})
    failed = sorted({r["label"] for r in records if r["status"] == "failed"})
    if not wrong and not failed:
        return "# Result: OK (every all-reduce summed correctly)"
    parts = ([f"WRONG sums from {', '.join(wrong)}"] if wrong else []) + (
        [f"failures in {', '.join(failed)}"] if failed else [])
    return "# Result: " + "; ".join(parts)


def exit_code(records: Sequence[dict]) -> int:
    """0 when every measured all-reduce was right; 1 on wrong sums or failed candidates (nccl-tests' rule)."""
    return 1 if any(r["status"] in ("wrong", "failed") for r in records) else 0


def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install tf-nvlink[plot]")


def plot(records: Sequence[dict], path: str, title: str = "") -> None:
    """busbw against size (log x), one line per candidate, saved as PNG to `path`."""
    check_plot_available()
    import matplotlib  # noqa: PLC0415 - optional dependency, imported only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    measured = _measured(records)
    figure, axes = plt.subplots(figsize=(8, 5))
    # One colour per candidate; its variant (e.g. @nop2p) dashed in the same colour, so pairs read at a glance.
    colours = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(r["candidate"] for r in measured))}
    for label in _labels(measured):
        rows = sorted((r for r in measured if r["label"] == label), key=lambda r: r["size_bytes"])
        axes.plot([r["size_bytes"] for r in rows], [r["busbw"] for r in rows], marker="o", label=label,
                  color=colours[rows[0]["candidate"]], linestyle="--" if rows[0]["variant"] else "-")
    sizes = sorted({r["size_bytes"] for r in measured})
    axes.set_xscale("log", base=2)
    if sizes:
        axes.set_xticks(sizes)
        axes.set_xticklabels([format_size(s) for s in sizes])
    axes.set_xlabel("all-reduce size (bytes, float32)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(title or "tf-nvlink bench: all-reduce bus bandwidth")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    with atomic_files.atomic_path(path, suffix=os.path.splitext(path)[1]) as partial:  # the suffix picks the format
        figure.savefig(partial, dpi=120)
    plt.close(figure)



def record_problem(record: dict) -> Optional[str]:
    """What is wrong with one bench record's fields for the summary and plot (None when nothing is).

    Example:
        >>> record_problem({"label": "nccl:1", ..., "status": "ok", "size_bytes": "16M", ...})
        "has size_bytes='16M', expected a positive integer of bytes"
    """
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    def integer(v, minimum):
        return isinstance(v, int) and not isinstance(v, bool) and v >= minimum

    checks = [("label", lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
              ("candidate", lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
              ("variant", lambda v: isinstance(v, str), "a string"),
              ("status", lambda v: v in ("ok", "wrong", "failed", "skipped"), "ok, wrong, failed or skipped")]
    if record.get("status") in ("ok", "wrong"):
        checks += [("size_bytes", lambda v: integer(v, 1), "a positive integer of bytes"),
                   ("busbw", number, "a finite non-negative number (GB/s)"),
                   ("wrong", lambda v: integer(v, 0), "a non-negative integer")]
    for field, ok, expected in checks:
        if not ok(record[field]):
            return f"has {field}={record[field]!r}, expected {expected}"
    return None
