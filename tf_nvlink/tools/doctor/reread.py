"""Re-reading a saved doctor run with the current doctor: no training, no GPU.

A run's `step_doctor.json` holds what the trace alone cannot say: the window (`steps`, `calls`, `step_ms`: the
steps traced, the training-function calls they took, the wall time per step), the context (replicas,
steps_per_execution, gradient bytes, ...), the NVLink bytes the counters measured, and the model's FLOPs per step
when the run had them. `reread` reads the trace again with these (`diagnosis.diagnose_space`), so a run traced
before a change to the doctor gets the doctor's current reading: its kinds of work, their bounds, the verdict.

The trace, the first that exists:
1. the one named (`trace=`: a trace file, or a folder searched as in 3);
2. the path the report holds ("trace", where the profiler wrote it: gone once the run's folder moved);
3. the newest `*.xplane.pb` or `*.xplane.pb.gz` in the report's folder or below it (the profiler's
   `profile/plugins/profile/<run>/`), else `<folder>.xplane.pb.gz` beside the folder (where
   `benchmarks/compiled_execution.py` and `benchmarks/xla_flag_variants.py` keep each run's trace, gzipped).

Example:
    >>> report, why = reread("doctor_mfu/transformer_compiled")
    >>> report["reread"]["trace"]
    'doctor_mfu/transformer_compiled.xplane.pb.gz'
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Optional

from tf_nvlink.tools.costmodel import model as costmodel
from tf_nvlink.tools.costmodel.model import REPLICA_OVERHEAD_HOST_FED_MS
from tf_nvlink.tools.doctor.diagnosis import diagnose_space
from tf_nvlink.tools.doctor.trace import TraceError, load_space, newest_trace
from tf_nvlink.tools.doctor.verdict import StepContext

REPORT_NAME = "step_doctor.json"
# What a re-read takes over from the saved report as it is: measured during the run, not in the trace.
CARRIED_KEYS = ("nvlink_bytes_per_step", "fit_call", "window", "optimizer_states")
WINDOW_KEYS = ("steps", "calls", "step_ms")


class RereadError(ValueError):
    """A saved run that cannot be re-read; the message names the file and what is missing."""


def saved_report_path(path: str) -> str:
    """The step_doctor.json of a saved run: `path` itself when it is a file, else `path`/step_doctor.json.

    Example:
        >>> saved_report_path("doctor_mfu/transformer_compiled")
        'doctor_mfu/transformer_compiled/step_doctor.json'
    """
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        candidate = os.path.join(path, REPORT_NAME)
        if os.path.isfile(candidate):
            return candidate
        raise RereadError(f"no {REPORT_NAME} in the folder {path} (a doctor run's --output_dir holds one)")
    raise RereadError(f"no such file or folder: {path} (give a doctor run's {REPORT_NAME} or the folder holding it)")


def load_saved_report(path: str) -> dict:
    """The saved report as a dict; RereadError when it is not JSON or lacks the window the re-read needs."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError) as exc:
        raise RereadError(f"cannot read {path} as a doctor report: {exc}") from None
    if not isinstance(report, dict):
        raise RereadError(f"{path} holds no doctor report (a JSON object with 'window' and 'context')")
    window = report.get("window") or {}
    missing = [key for key in WINDOW_KEYS if not isinstance(window.get(key), (int, float))]
    if missing:
        raise RereadError(f"{path} has no window {'/'.join(missing)} (the doctor writes 'window' with "
                          f"{', '.join(WINDOW_KEYS)}; this file is not a step_doctor.json)")
    if not isinstance(report.get("context"), dict):
        raise RereadError(f"{path} has no 'context' (the doctor writes the replicas, steps_per_execution and gradient "
                          f"bytes there; this file is not a step_doctor.json)")
    return report


def saved_trace_path(report_path: str, report: dict, trace: Optional[str] = None) -> tuple[str, str]:
    """(the trace of a saved run, where it was found: "given", "the report" or "beside the report"), in the order
    the module doc gives; RereadError naming every place looked at when there is none.

    Example:
        >>> saved_trace_path("doctor_mfu/transformer_compiled/step_doctor.json", report)
        ('doctor_mfu/transformer_compiled.xplane.pb.gz', 'beside the report')
    """
    if trace is not None:
        if os.path.isfile(trace):
            return trace, "given"
        found = newest_trace(os.path.join(glob.escape(trace), "**")) if os.path.isdir(trace) else None
        if found:
            return found, "given"
        raise RereadError(f"no trace at {trace} (give an .xplane.pb or .xplane.pb.gz file, or a folder holding one)")
    stored = report.get("trace")
    if isinstance(stored, str) and os.path.isfile(stored):
        return stored, "the report"
    folder = os.path.dirname(report_path) or os.curdir
    found = newest_trace(os.path.join(glob.escape(folder), "**"))
    if found:
        return found, "beside the report"
    beside = [os.path.abspath(folder) + suffix for suffix in (".xplane.pb.gz", ".xplane.pb")]
    kept = [path if os.path.isabs(report_path) else os.path.relpath(path) for path in beside if os.path.isfile(path)]
    if kept:
        return kept[0], "beside the report"
    looked = ([f"the report's trace {stored} (gone)"] if isinstance(stored, str) else []) + [
        f"{folder} and below", f"{os.path.abspath(folder)}.xplane.pb.gz"]
    raise RereadError(f"no trace for {report_path}: looked at {'; '.join(looked)}; pass --trace PATH")


def context_from_dict(saved: dict, where: str = REPORT_NAME) -> tuple[StepContext, list[str]]:
    """(the StepContext of a saved report's "context", notes on what could not be restored). The link's model comes
    from its saved fields ("link_model"), else from `costmodel.LINKS` by its name; a link known by name alone is left
    out (the predictions then use the reference machines) and a note says so.

    Example:
        >>> context_from_dict({"replicas": 1, "steps_per_execution": 8, "gradient_bytes": 1473614848,
        ...                    "gradient_tensors": 390, "link": None})[0].steps_per_execution
        8
    """
    fields = {f.name for f in dataclasses.fields(StepContext)}
    required = [f.name for f in dataclasses.fields(StepContext)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in saved]
    if missing:
        raise RereadError(f"the context in {where} lacks {', '.join(missing)} (needed: {', '.join(required)})")
    values = {key: value for key, value in saved.items() if key in fields and key != "link"}
    notes = []
    link_model, link_name = saved.get("link_model"), saved.get("link")
    link = None
    if isinstance(link_model, dict):
        link_fields = {f.name for f in dataclasses.fields(costmodel.LinkModel)}
        known = {key: value for key, value in link_model.items() if key in link_fields}
        if "busbw_by_gpus" in known:
            known["busbw_by_gpus"] = tuple(tuple(pair) for pair in known["busbw_by_gpus"])
        link = costmodel.LinkModel(**known)
    elif link_name in costmodel.LINKS:
        link = costmodel.LINKS[link_name]
    elif link_name:
        notes.append(f"the link {link_name!r} is saved by its name alone: the scaling predictions use the reference "
                     f"machines only")
    return StepContext(link=link, **values), notes


def reread(path: str, trace: Optional[str] = None,
           replica_overhead_ms: float = REPLICA_OVERHEAD_HOST_FED_MS) -> tuple[dict, Optional[str]]:
    """(the report the current doctor reads from a saved run, why there is no breakdown or None). `path`: the run's
    step_doctor.json or its folder; `trace`: its trace when not where the module doc looks. The report has what the
    run measured beside the trace (`CARRIED_KEYS`), the MFU from the saved model FLOPs, and "reread": the report and
    trace read, where the trace was found and notes. RereadError for a missing or unreadable report or trace.

    Example:
        >>> report, why = reread("step_doctor/step_doctor.json", trace="step_doctor/profile")
        >>> why or report["verdict"]["kind"]
        'host-bound'
    """
    report_path = saved_report_path(path)
    saved = load_saved_report(report_path)
    trace_path, found = saved_trace_path(report_path, saved, trace)
    context, notes = context_from_dict(saved["context"], report_path)
    window = saved["window"]
    flops = (saved.get("mfu") or {}).get("model_flops_per_step")
    nvlink_bytes = saved.get("nvlink_bytes_per_step")
    try:
        space = load_space(trace_path)
    except TraceError as exc:
        raise RereadError(str(exc)) from None
    report, why = diagnose_space(space, float(window["step_ms"]), int(window["steps"]), int(window["calls"]), context,
                                 nvlink_bytes_per_step=nvlink_bytes, replica_overhead_ms=replica_overhead_ms,
                                 model_flops_per_step=flops if isinstance(flops, (int, float)) and flops > 0 else None)
    report["trace"] = trace_path
    for key in CARRIED_KEYS:
        if key in saved:
            report[key] = saved[key]
    report["reread"] = {"report": report_path, "trace": trace_path, "trace_found": found,
                        "saved_trace": saved.get("trace"), "notes": notes}
    return report, why
