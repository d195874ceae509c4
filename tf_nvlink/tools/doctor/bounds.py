"""Each kind of work against its bound: what its kernels read, write and compute, the time that takes at the GPU's
memory bandwidth and at its bf16 dense peak, and how far the measured time is above the larger of the two.

For a kind of compute work (matmul, attention, normalisation, elementwise, optimizer, loss, other) in ms per step:
`memory_ms` = the bytes its kernels' HLO instructions read and write (`hlo_cost`) / the GPU's memory bandwidth,
`compute_ms` = their FLOPs / the GPU's bf16 dense peak (`tf_nvlink.plan.gpu_peaks`), `bound_ms` = the larger,
`x_bound` = measured / bound and `above_bound_ms` = measured - bound. The bound is that of the kernels as XLA built
them: a formulation that moves fewer bytes (one pass over a tensor where XLA makes three) lowers the bound itself.
The bandwidth is the datasheet's (`gpu_peaks.memory_bandwidth`), else the trace's own `memory_bandwidth` stat. A GPU
without a bf16 peak in the table bounds by memory alone the kinds that do no dot work, and leaves the others without
a bound. A kind gets no bound where more than UNATTRIBUTED_SHARE of its kernels' time has no HLO instruction in the
trace. Collectives and copies are bound by the links and PCIe: the all-reduce and input-copy rows cover them.

`far_from_bound` names the kinds furthest from their bound, by the time above it, with what could be done about
each (changes the project knows of, not predicted gains).

Example:
    >>> rows = kind_bounds({"normalisation": 6.14}, {"normalisation": {"bytes": 2.0e9, "flops": 1e9}},
    ...                    "NVIDIA H100 80GB HBM3")
    >>> round(rows["kinds"]["normalisation"]["bound_ms"], 3), round(rows["kinds"]["normalisation"]["x_bound"], 2)
    (0.597, 10.28)
"""

from __future__ import annotations

from typing import Optional

from tf_nvlink.plan import gpu_peaks

BOUNDED_KINDS = ("matmul", "attention", "normalisation", "elementwise", "optimizer", "loss", "other")
# A kind within this factor of its bound is near it (the project's target for each kind of work).
NEAR_BOUND_RATIO = 1.5
# Time above the bound under this fraction of the step is not worth naming.
FAR_FROM_BOUND_FRACTION = 0.02
FAR_FROM_BOUND_KINDS = 3
# More than this share of a kind's time in kernels without an HLO instruction: no bound for it (its bytes unknown).
UNATTRIBUTED_SHARE = 0.1
TRACE_BANDWIDTH_SOURCE = ("the trace's memory_bandwidth stat (the device's memory clock x bus width as CUDA reports "
                          "them)")


def hardware(gpu_name: Optional[str], trace_bandwidth: float = 0.0) -> dict:
    """The GPU's memory bandwidth and bf16 dense peak as the bounds use them, each with its source (None where
    neither table nor trace has it).

    Example:
        >>> hardware("NVIDIA H200")["memory"]["tb_per_s"], hardware("NVIDIA H200")["peak"]["tflops"]
        (4.8, 989.4)
    """
    row, peak = gpu_peaks.memory_bandwidth(gpu_name), gpu_peaks.bf16_dense_peak(gpu_name)
    if row is not None:
        memory = {"tb_per_s": row.tb_per_s, "label": row.label, "source": row.source}
    elif trace_bandwidth > 0:
        memory = {"tb_per_s": round(trace_bandwidth / 1e12, 3), "label": gpu_name or "this GPU",
                  "source": TRACE_BANDWIDTH_SOURCE}
    else:
        memory = None
    return {"gpu": gpu_name, "memory": memory,
            "peak": {"tflops": peak.tflops, "label": peak.label, "source": peak.source} if peak else None}


def bound_row(ms: float, cost: dict, memory: Optional[dict], peak: Optional[dict]) -> dict:
    """One kind against its bound: its ms, GB and TFLOP per step, its HLO instructions' executions per step
    ("hlo_ops": a fusion, a gemm or a convolution is one, whatever kernels it launches), the memory and compute
    times, the bound and what sets it, measured / bound and the ms above it; "why" instead of a bound where there is
    none; with transposes of fused-attention results among its kernels, their ms and executions
    ("attention_layout_ms", "attention_layout_ops").

    Example:
        >>> bound_row(6.14, {"bytes": 2.0e9, "flops": 1e9}, {"tb_per_s": 3.35}, {"tflops": 989.4})["bound_by"]
        'memory'
    """
    moved, flops, dots = cost.get("bytes", 0.0), cost.get("flops", 0.0), cost.get("dot_flops", 0.0)
    unattributed = cost.get("ms_without_instruction", 0.0)
    row = {"ms": ms, "gb": moved / 1e9, "tflop": flops / 1e12, "hlo_ops": cost.get("executions", 0.0),
           "ms_without_instruction": unattributed,
           "memory_ms": moved / (memory["tb_per_s"] * 1e12) * 1e3 if memory else None,
           "compute_ms": flops / (peak["tflops"] * 1e12) * 1e3 if peak else None,
           "bound_ms": None, "bound_by": None, "x_bound": None, "above_bound_ms": None}
    if cost.get("attention_layout_ms", 0.0) > 0:
        row.update(attention_layout_ms=cost["attention_layout_ms"], attention_layout_ops=cost["attention_layout_ops"])
    if memory is None:
        row["why"] = "no memory bandwidth for this GPU (not in tf_nvlink.plan.gpu_peaks, none in the trace)"
    elif unattributed > UNATTRIBUTED_SHARE * ms:
        row["why"] = f"{unattributed:.2f} ms of its kernels have no HLO instruction in the trace"
    elif not moved and not flops:
        row["why"] = "its kernels' HLO instructions move no bytes"
    elif peak is None and dots:
        row["why"] = "no bf16 peak for this GPU (not in tf_nvlink.plan.gpu_peaks), and its kernels do dot work"
    else:
        compute = row["compute_ms"] or 0.0
        bound = max(row["memory_ms"], compute)
        row.update(bound_ms=bound, bound_by="memory" if row["memory_ms"] >= compute else "compute",
                   x_bound=ms / bound if bound > 0 else None, above_bound_ms=ms - bound)
    return row


def kind_bounds(work_ms: dict, work_cost: dict, gpu_name: Optional[str], trace_bandwidth: float = 0.0) -> dict:
    """The report's "work_bounds": `hardware` and, for each kind of compute work with time, its `bound_row`.

    Example:
        >>> kind_bounds({"matmul": 8.35}, {"matmul": {"bytes": 16.9e9, "flops": 2.93e12, "dot_flops": 2.93e12}},
        ...             "NVIDIA H200")["kinds"]["matmul"]["bound_by"]
        'memory'
    """
    found = hardware(gpu_name, trace_bandwidth)
    found["kinds"] = {kind: bound_row(work_ms[kind], work_cost.get(kind, {}), found["memory"], found["peak"])
                      for kind in BOUNDED_KINDS if work_ms.get(kind, 0.0) > 0}
    return found


def what_could_be_done(kind: str, row: dict, cost: dict, replicas: int) -> Optional[str]:
    """A change that could bring a kind of work nearer its bound, as far as the project knows one (None otherwise).

    Example:
        >>> what_could_be_done("attention", {"ms": 6.0}, {"fused_attention_ms": 0.0}, 1)[:46]
        'tf_nvlink.strategy(fused_attention="auto") run'
    """
    if kind == "normalisation":
        return ("a fused LayerNorm that reads its input once forward and once backward moves fewer bytes than "
                "separate statistics and normalisation kernels; XLA's cuDNN layer-norm rewriter "
                "(XLA_FLAGS=--xla_gpu_enable_cudnn_layer_norm=true) runs the layer norms it recognises as cuDNN kernels, "
                "but left Keras' LayerNormalization unchanged in the 368M Transformer on an H100 (docs/results.md)")
    if kind == "optimizer":
        text = ("fewer passes over the variables: an update that reads each variable, its gradient and its slots "
                "once and writes them once, in few kernels rather than several per variable")
        if replicas > 1:
            text += ("; tf_nvlink.strategy(optimizer_states=\"sharded\") has each replica update only its share of "
                     "the variables")
        return text
    if kind == "elementwise":
        return ("where a matmul's output goes on to a bias add or an activation, keep them in the matmul's epilogue: "
                "XLA's cuBLASLt gemms (XLA_FLAGS=--xla_gpu_enable_cublaslt=true) can add a bias and apply ReLU or "
                "the tanh approximation of GELU inside the gemm, where a separate kernel reads and writes the "
                "activations again")
    if kind == "attention" and cost.get("fused_attention_ms", 0.0) < 0.5 * row["ms"]:
        return ("tf_nvlink.strategy(fused_attention=\"auto\") runs Keras' attention as cuDNN's flash attention where "
                "it applies (one kernel forward, one backward; the default): the scores are then never written to "
                "memory; its INFO lines say why a call kept Keras' attention (a mask tensor, float32, a head size)")
    if kind == "matmul" and cost.get("float32_dot_flops", 0.0) > 0.5 * cost.get("dot_flops", 0.0) > 0:
        return ("bfloat16 matmuls (keras.mixed_precision.set_global_policy(\"mixed_bfloat16\")): most of these "
                "FLOPs run on float32 operands, below the bf16 tensor-core rate the bound assumes")
    return None


def far_from_bound(bounds: Optional[dict], work_cost: dict, step_ms: float, replicas: int = 1) -> list[dict]:
    """The kinds furthest from their bound, most ms above it first: at most FAR_FROM_BOUND_KINDS of those at least
    NEAR_BOUND_RATIO times their bound and FAR_FROM_BOUND_FRACTION of the step above it, each with its row's
    figures and `could` (what could be done, or None).

    Example:
        >>> [entry["kind"] for entry in far_from_bound(bounds, work_cost, step_ms=33.7)]
        ['normalisation', 'elementwise', 'optimizer']
    """
    rows = ((kind, row) for kind, row in ((bounds or {}).get("kinds") or {}).items()
            if row.get("x_bound") is not None and row["x_bound"] >= NEAR_BOUND_RATIO
            and row["above_bound_ms"] >= FAR_FROM_BOUND_FRACTION * step_ms)
    chosen = sorted(rows, key=lambda item: -item[1]["above_bound_ms"])[:FAR_FROM_BOUND_KINDS]
    return [{"kind": kind, "ms": row["ms"], "bound_ms": row["bound_ms"], "bound_by": row["bound_by"],
             "x_bound": row["x_bound"], "above_bound_ms": row["above_bound_ms"], "gb": row["gb"],
             "tflop": row["tflop"], "hlo_ops": row["hlo_ops"],
             "could": what_could_be_done(kind, row, work_cost.get(kind, {}), replicas)} for kind, row in chosen]
