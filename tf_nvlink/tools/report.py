"""What this machine's GPUs, NVLink links and TensorFlow look like, and what tf_nvlink would do with them.

Collect first, render later (as gpustat does): `collect` builds plain JSON-ready data, `render_text` and
`to_json` are two views of it. `import tf_nvlink.tools.report` does not import TensorFlow; `collect(with_tf=True)` does.

Example:
    >>> from tf_nvlink.tools import report
    >>> data = report.collect(with_tf=False)      # NVML only: instant
    >>> print(report.render_text(data))           # or report.to_json(data)

Command line: `tf-nvlink report [--json] [--no-tf]` (see `tf_nvlink.__main__`); `tf-nvlink report --memory MODEL
[--optimizer NAME] [--replicas N]`: the bytes per GPU of a benchmark model's weights, gradients and optimizer states,
replicated and sharded (`tools/memory_report`).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Mapping, Optional

from tf_nvlink.distribute import facts as facts_lib
from tf_nvlink.machine import tf_devices
from tf_nvlink.plan import compile_cache, step_options
from tf_nvlink.machine import nvlink_traffic
from tf_nvlink.plan import policy
from tf_nvlink.machine.nvml import probe as nvml_probe
from tf_nvlink.tools import memory_report
from tf_nvlink.tools.bench_models import BENCH_MODELS
from tf_nvlink.util.cli_args import positive, usage_error
from tf_nvlink.util.text_table import table
from tf_nvlink.machine.topology import RemoteType, Topology
from tf_nvlink.util.version import __version__

LEGEND = ("Legend: X = self; NV# = a bonded set of # NVLinks (direct, or through NVSwitch); PIX = one PCIe "
          "switch; PXB = several PCIe switches; PHB = a PCIe host bridge; NODE = host bridges within one NUMA "
          "node; SYS = across NUMA nodes; N/A = NVML could not tell")


# ---- collect ---------------------------------------------------------------------------------------------------

def collect(topology: Optional[Topology] = None, with_tf: bool = True, nvml: Any = None, plan: Any = None,
            environ: Optional[Mapping[str, str]] = None) -> dict:
    """Everything the report shows, as plain data (dicts, lists, str, numbers, None).

    Args:
        topology: the machine to describe; default: probe NVML (through `nvml`, the pynvml module by default).
        with_tf: also ask TensorFlow which GPUs it sees (imports TensorFlow and initialises the GPUs).
        nvml: a pynvml stand-in, used only when `topology` is None.
        plan: a `policy.Plan` (or its `to_dict()`) to show, such as `tf_nvlink.current_plan()`; default: the plan
            `tf_nvlink.strategy()` would make (gpus="all", cross_device_ops="auto").
        environ: where to read CUDA_VISIBLE_DEVICES and XLA_FLAGS (default `os.environ`).

    Example:
        >>> collect(with_tf=False)["no_gpu"]       # on a machine without the NVIDIA driver
        True
    """
    environ = os.environ if environ is None else environ
    if topology is None:
        topology = nvml_probe(nvml)
    data = topology.to_dict()
    visible = tf_devices.visible_nvml_indices(topology, environ)
    data.update({
        "tf_nvlink_version": __version__,
        "no_gpu": not topology.gpus,
        "shape": topology.shape(),
        "fully_nvlink_connected": bool(topology.gpus) and topology.is_nvlink_connected(topology.indices),
        "pairs_without_nvlink": [[p.a, p.b] for p in topology.pairs if not p.nvlink],
        "matrix": _matrix(topology),
        "cuda_visible_devices": environ.get("CUDA_VISIBLE_DEVICES"),
        "visible_nvml_indices": visible,
    })
    for record, gpu in zip(data["gpus"], topology.gpus):
        rates = sorted({link.gbps for link in gpu.active_links})
        record["link_gbps"] = rates[0] if len(rates) == 1 else None  # None: no links, or links of mixed speed
        record["reaches"] = _reaches(topology, gpu)
    data["tensorflow"], tf_gpus = _collect_tf(topology, environ) if with_tf else ({"checked": False}, None)
    # The strategy's own gatherer: without TensorFlow, the CUDA_VISIBLE_DEVICES prediction; with it, its GPUs.
    facts = facts_lib.gather_facts(topology, tensorflow=with_tf, tf_gpus=tf_gpus, environ=environ,
                                   user_xla_flags=environ.get("XLA_FLAGS", ""),
                                   no_gpu_cause=data["tensorflow"].get("problem") or "see TensorFlow's view above")
    data["plan"] = _plan_record(plan) if plan is not None else _make_plan(facts, "all")
    data["auto_plan"] = _make_plan(facts, "auto")
    data["compile_cache"] = compile_cache.summary()
    return data


def _matrix(topology: Topology) -> dict:
    indices = list(topology.indices)
    return {
        "gpus": indices,
        "labels": [[topology.label(a, b) for b in indices] for a in indices],
        "nvlink_gbps": [[None if a == b else topology.pair(a, b).nvlink_gbps for b in indices] for a in indices],
    }


def _reaches(topology: Topology, gpu) -> str:
    """What the active links of `gpu` lead to: "NVSwitch x18", "GPU1 x4, GPU3 x2", "none (PCIe only)"."""
    if not gpu.active_links:
        down = len(gpu.links)
        return f"none (PCIe only; {down} link(s) down)" if down else "none (PCIe only)"
    by_pci = {g.pci_bus_id: g.index for g in topology.gpus}
    counts: dict[tuple, int] = {}
    for link in gpu.active_links:
        if link.remote_type == RemoteType.GPU:
            index = by_pci.get(link.remote_pci)
            key = (0, index if index is not None else 10**6, f"GPU{index}" if index is not None
                   else f"GPU {link.remote_pci or '?'} (not listed by NVML)")
        elif link.remote_type == RemoteType.NVSWITCH:
            key = (1, 0, "NVSwitch")
        else:
            key = (2, 0, link.remote_type.value)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{key[2]} x{count}" for key, count in sorted(counts.items()))


def _plan_record(plan: Any) -> dict:
    record = dict(plan) if isinstance(plan, Mapping) else plan.to_dict()
    if "summary" not in record and hasattr(plan, "summary"):
        record["summary"] = plan.summary()
    record.setdefault("error", None)
    return record


def _make_plan(facts: policy.Facts, gpus: str) -> dict:
    """The plan `tf_nvlink.strategy(gpus=gpus)` builds from these facts: the same `policy.decide` call."""
    try:
        plan, warnings = policy.decide(facts, gpus, "auto")
    except ValueError as exc:  # not expected for "all"/"auto", but a report must not die on it
        return {"requested": [gpus, "auto", None], "error": str(exc)}
    record = _plan_record(plan)
    record["warnings"] = warnings
    return record


def _import_tensorflow():
    """TensorFlow, imported only here (tests replace this function)."""
    import tensorflow as tf  # noqa: PLC0415 - the one place the report imports TensorFlow

    return tf


def _collect_tf(topology: Topology, environ: Mapping[str, str]) -> tuple[dict, list]:
    """TensorFlow's view for the report, and its GPUs mapped to NVML's (empty when it could not list them)."""
    section: dict = {"checked": True, "version": None, "built_with_cuda": None, "problem": None, "gpus": [],
                     "unmapped": [], "hidden_nvml": [], "notes": []}
    try:
        tf = _import_tensorflow()
    except Exception as exc:  # noqa: BLE001 - a broken install raises all sorts (ImportError, AttributeError...)
        section["problem"] = f"TensorFlow cannot be imported ({type(exc).__name__}: {exc}); TensorFlow's view skipped"
        return section, []
    section["version"] = getattr(tf, "__version__", None)
    try:
        section["built_with_cuda"] = bool(tf.test.is_built_with_cuda())
    except Exception as exc:  # noqa: BLE001
        section["problem"] = f"TensorFlow cannot say whether it has GPU support ({type(exc).__name__}: {exc})"
        return section, []
    if not section["built_with_cuda"]:
        section["problem"] = (f"TensorFlow {section['version']} has no GPU support (tf.test.is_built_with_cuda() "
                              "is False): it runs on the CPU only; on Linux, pip install 'tensorflow[and-cuda]'")
        return section, []
    try:
        mapped = facts_lib.tensorflow_gpus(topology)
    except Exception as exc:  # noqa: BLE001 - device_lib can fail on a half-installed CUDA
        section["problem"] = f"TensorFlow could not list its GPUs ({type(exc).__name__}: {exc})"
        return section, []
    section["gpus"] = [{"tf_name": g.tf_name, "tf_index": g.tf_index, "name": g.name,
                        "pci_bus_id": str(g.pci_bus_id) if g.pci_bus_id else None,
                        "compute_capability": g.compute_capability, "nvml_index": g.nvml_index,
                        "physical_device_desc": g.physical_device_desc} for g in mapped]
    section["unmapped"] = [g.tf_name for g in mapped if g.nvml_index is None]
    seen = [g.nvml_index for g in mapped if g.nvml_index is not None]
    section["hidden_nvml"] = [i for i in topology.indices if i not in seen]
    predicted = tf_devices.visible_nvml_indices(topology, environ)
    if not section["unmapped"] and seen != predicted:
        section["notes"].append(f"CUDA_VISIBLE_DEVICES predicts NVML GPUs {predicted} in TensorFlow's order, but "
                                f"TensorFlow's PCI bus ids say {seen}; tf_nvlink goes by the PCI bus ids")
    return section, mapped


# ---- render ----------------------------------------------------------------------------------------------------

def to_json(data: dict) -> str:
    """The collected data as indented JSON."""
    return json.dumps(data, indent=2)


def render_text(data: dict) -> str:
    """The collected data as text for a terminal (needs only `data`, so JSON read back renders the same)."""
    sections = [_render_header(data)]
    if data["gpus"]:
        sections += [_render_matrix(data), _render_nvlink_table(data), _render_gbps_matrix(data),
                     _render_facts(data)]
    elif data.get("warnings"):
        sections.append(_render_warnings(data))
    sections += [_render_tf(data), _render_plans(data)]
    if "compile_cache" in data:  # reports written before the compile cache have none
        sections.append(compile_cache.summary_line(data["compile_cache"]))
    return "\n\n".join(sections) + "\n"


def _render_header(data: dict) -> str:
    title = f"tf_nvlink {data['tf_nvlink_version']} report"
    if not data["gpus"]:
        reason = data.get("error") or "NVML lists no GPUs"
        return f"{title}\nNo NVIDIA GPU found: {reason}"
    count = len(data["gpus"])
    driver = data.get("driver_version") or "N/A"
    nvml = data.get("nvml_version") or "N/A"
    return f"{title}: {count} GPU{'s' if count != 1 else ''}, driver {driver}, NVML {nvml}"


def _grid(indices: list[int], cells: list[list[str]]) -> list[str]:
    """`nvidia-smi topo -m`-style rows: a GPU# header, then one centred cell per GPU."""
    names = [f"GPU{i}" for i in indices]
    first = max(len(n) for n in names) + 3
    width = max(6, max(len(c) for row in cells for c in row) + 2, max(len(n) for n in names) + 2)
    lines = [" " * first + "".join(n.center(width) for n in names)]
    for name, row in zip(names, cells):
        lines.append(name.ljust(first) + "".join(cell.center(width) for cell in row))
    return [line.rstrip() for line in lines]


def _render_matrix(data: dict) -> str:
    matrix = data["matrix"]
    lines = ["GPU topology (as `nvidia-smi topo -m`):"] + _grid(matrix["gpus"], matrix["labels"])
    return "\n".join(lines + _wrap_legend(LEGEND))


def _wrap_legend(text: str, width: int = 100) -> list[str]:
    """Break the legend between its "; "-separated entries, never inside one."""
    lines = [""]
    for entry in text.split("; "):
        candidate = f"{lines[-1]}; {entry}" if lines[-1] else entry
        if len(candidate) > width and lines[-1]:
            lines[-1] += ";"
            lines.append("        " + entry)
        else:
            lines[-1] = candidate
    return lines


def _number(value: Optional[float], digits: int) -> str:
    if value is None:
        return "N/A"
    return f"{round(value, digits):g}" if digits > 1 else f"{value:.{digits}f}"


def _render_nvlink_table(data: dict) -> str:
    rows = [["GPU", "name", "PCI bus id", "active", "NVLink", "per link", "total", "reaches"],
            ["", "", "", "links", "version", "(GB/s)", "(GB/s)", ""]]
    for gpu in data["gpus"]:
        has_links = gpu["active_links"] > 0
        rows.append([str(gpu["index"]), gpu["name"], gpu["pci_bus_id"], str(gpu["active_links"]),
                     (gpu["nvlink_version"] or "N/A") if has_links else "-",
                     _number(gpu["link_gbps"], 3) if has_links else "-",
                     _number(gpu["nvlink_gbps"], 1), gpu["reaches"]])
    title = "NVLink per GPU (as `nvidia-smi nvlink -s`; GB/s per direction):"
    return "\n".join([title] + table(rows, right={0, 3, 4, 5, 6}, header_rows=2))


def _render_gbps_matrix(data: dict) -> str:
    matrix = data["matrix"]
    if not any(v for row in matrix["nvlink_gbps"] for v in row):
        return "Expected NVLink GB/s per direction between GPUs: none (no GPU pair has NVLink; PCIe only)."
    cells = [["-" if v is None else _number(v, 1) for v in row] for row in matrix["nvlink_gbps"]]
    title = "Expected NVLink GB/s per direction between GPUs (0.0 = no NVLink, PCIe only):"
    return "\n".join([title] + _grid(matrix["gpus"], cells))


def _render_facts(data: dict) -> str:
    groups = " ".join(str(group) for group in data["nvlink_groups"])
    if len(data["gpus"]) == 1:
        connected = "yes (one GPU)"
    elif data["fully_nvlink_connected"]:
        connected = f"yes ({data['shape']})"
    else:
        missing = data["pairs_without_nvlink"]
        total = len(data["pairs"])
        example = ", ".join(f"GPU{a}-GPU{b}" for a, b in missing[:3]) + (", ..." if len(missing) > 3 else "")
        connected = f"no ({len(missing)} of {total} GPU pairs have no NVLink: {example})"
    lines = [f"NVLink groups: {groups}", f"Fully NVLink-connected: {connected}",
             f"Topology fingerprint: {data['fingerprint']}", _render_warnings(data)]
    return "\n".join(lines)


def _render_warnings(data: dict) -> str:
    warnings = data.get("warnings") or []
    if not warnings:
        return "Probe warnings: none"
    return "\n".join([f"Probe warnings ({len(warnings)}):"] + [f"  WARNING: {w}" for w in warnings])


def _cvd_text(data: dict) -> str:
    value = data.get("cuda_visible_devices")
    return "CUDA_VISIBLE_DEVICES unset" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def _render_tf(data: dict) -> str:
    tf = data["tensorflow"]
    cvd = _cvd_text(data)
    if not tf.get("checked"):
        if not data["gpus"]:
            return f"TensorFlow: not checked (--no-tf). {cvd}."
        return (f"TensorFlow: not checked (--no-tf). {cvd}: TensorFlow would see NVML GPUs "
                f"{data['visible_nvml_indices']}.")
    if tf.get("problem"):
        return f"{tf['problem']}."  # one line, starting with "TensorFlow"
    build = f"TensorFlow {tf.get('version') or '(unknown version)'}, CUDA build, {cvd}:"
    lines = [build]
    if tf["gpus"]:
        rows = [["TF device", "NVML", "PCI bus id", "physical_device_desc"],
                ["", "GPU", "", "(device_lib)"]]
        for gpu in tf["gpus"]:
            nvml_index = "?" if gpu["nvml_index"] is None else str(gpu["nvml_index"])
            rows.append([gpu["tf_name"], nvml_index, gpu["pci_bus_id"] or "N/A", gpu["physical_device_desc"]])
        lines += table(rows, right={1}, header_rows=2)
    else:
        lines.append("  TensorFlow sees no GPU.")
    if tf["unmapped"]:
        lines.append(f"  WARNING: TensorFlow GPU(s) {', '.join(tf['unmapped'])} match no NVML GPU by PCI bus id; "
                     "tf_nvlink cannot place replicas on them.")
    if tf["hidden_nvml"] and data["gpus"]:
        why = (f"hidden by {cvd}" if data.get("cuda_visible_devices") is not None
               else "CUDA_VISIBLE_DEVICES is unset, so TensorFlow's CUDA libraries are likely missing "
                    "(pip install 'tensorflow[and-cuda]')")
        lines.append(f"  NOTE: NVML GPU(s) {tf['hidden_nvml']} are not visible to TensorFlow: {why}.")
    lines += [f"  NOTE: {note}." for note in tf.get("notes", [])]
    return "\n".join(lines)


_XLA_MODES = {
    "fused": "jit_compile=True models: the whole step per GPU in XLA, gradient all-reduce inside XLA (fused)",
    "split": "jit_compile=True models: XLA gradients per replica, all-reduce through the ops above (split)",
}


def _render_plans(data: dict) -> str:
    plan, auto = data["plan"], data["auto_plan"]
    requested = plan.get("requested") or ["all", "auto", None]
    lines = [f"Plan for tf_nvlink.strategy(gpus={requested[0]!r}, cross_device_ops={requested[1]!r}):"]
    if plan.get("error"):
        lines.append(f"  ERROR: {plan['error']}")
    else:
        lines += [f"  GPUs       {_plan_where(plan)}",
                  f"  ops        {_plan_ops(plan)}" + (f" ({plan['tensorflow_class']})"
                                                       if plan.get("tensorflow_class") else ""),
                  f"  XLA        {_XLA_MODES.get(plan.get('xla_allreduce'), plan.get('xla_allreduce'))}",
                  f"  options    {step_options.report_text(plan)}",
                  f"  reason     {plan['reason']}"]
    if auto.get("error"):
        lines.append(f"gpus='auto' would fail: {auto['error']}")
    else:
        same = " (the same)" if _plan_key(auto) == _plan_key(plan) else ""
        lines.append(f"gpus='auto' would choose: {_plan_where(auto)} -> {_plan_ops(auto)}{same}")
    return "\n".join(lines)


def _plan_where(plan: dict) -> str:
    return policy.gpus_text(plan["gpus"], plan["shape"], plan.get("nvlink_gbps"), prefix="", cpu="none (CPU)")


def _plan_ops(plan: dict) -> str:
    packs = plan.get("num_packs")
    return plan["cross_device_ops"] + (f", num_packs={packs}" if packs is not None else "")


def _plan_key(plan: dict) -> tuple:
    return (tuple(plan.get("gpus") or ()), plan.get("cross_device_ops"), plan.get("num_packs"))


# ---- command line (wired up in tf_nvlink.__main__) -------------------------------------------------------------

HELP = "GPUs, NVLink links, TensorFlow's view and the plan tf_nvlink would use (like nvidia-smi topo -m)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink report` options."""
    parser.add_argument("--json", action=argparse.BooleanOptionalAction, default=False,
                        help="print JSON instead of text")
    parser.add_argument("--tf", action=argparse.BooleanOptionalAction, default=True,
                        help="ask TensorFlow too (default); --no-tf: NVML facts only, instant, does not touch the GPUs")
    nvlink_traffic.add_traffic_argument(parser)
    parser.add_argument("--memory", metavar="MODEL", choices=BENCH_MODELS, default=None,
                        help=f"instead: the bytes per GPU of a benchmark model ({', '.join(BENCH_MODELS)}): weights, "
                             f"gradients and optimizer states, replicated and sharded (builds it on the CPU)")
    parser.add_argument("--optimizer", choices=tuple(memory_report.OPTIMIZERS), default=None,
                        help=f"with --memory: the Keras optimizer (default {memory_report.DEFAULT_OPTIMIZER})")
    parser.add_argument("--replicas", type=positive, default=None,
                        help="with --memory: this GPU count only (default: 1, 2, 4, 8 and this machine's)")


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink report`: print the report; 0 also on a machine without GPUs."""
    if getattr(args, "nvlink_traffic", None) is not None or getattr(args, "nvlink_watch", None) is not None:
        return nvlink_traffic.traffic_command_from_args(args)
    if any(getattr(args, name, None) is not None for name in ("memory", "optimizer", "replicas")):
        return memory_command(args)
    if args.tf:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow's start-up chatter off the report
    data = collect(with_tf=args.tf)
    print(to_json(data) if args.json else render_text(data), end="\n" if args.json else "")
    return 0


def memory_command(args: argparse.Namespace) -> int:
    """`tf-nvlink report --memory MODEL [--optimizer NAME] [--replicas N]`: the memory table (`tools/memory_report`)
    for this machine's GPU count and memory (NVML); exit 2 with one line for --no-tf or a flag without --memory.

    Example:
        >>> memory_command(build_parser().parse_args(["report", "--memory", "resnet50"]))
    """
    if args.memory is None:
        return usage_error(args, "--optimizer and --replicas go with --memory MODEL")
    if not args.tf:
        return usage_error(args, "--memory builds the model and its optimizer with TensorFlow; drop --no-tf")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    machine_gpus, device_bytes = memory_report.gpu_facts(nvml_probe())
    data = memory_report.collect(args.memory, args.optimizer or memory_report.DEFAULT_OPTIMIZER,
                                 memory_report.gpu_counts(args.replicas, machine_gpus), device_bytes)
    print(to_json(data) if args.json else memory_report.render_text(data), end="\n" if args.json else "")
    return 0


__all__ = ["collect", "render_text", "to_json", "add_arguments", "run", "memory_command"]
