"""Step options of a plan: XLA flags, the gradient all-reduce dtype, the input prefetch depth. Pure: no TensorFlow.

`policy.decide` chooses them (through `choose_step_options`, with the user's `XLA_FLAGS` from `policy.Facts`);
`tf_nvlink/strategies.py` applies them (XLA_FLAGS before TensorFlow initialises its GPUs, `InputOptions` in
`experimental_distribute_dataset`, the bfloat16 hook in `tf_nvlink.training.gradient_allreduce`); `tf-nvlink report` shows them.

Example:
    >>> from tf_nvlink.plan import step_options
    >>> step_options.merge_xla_flags("--xla_dump_to=/tmp/x", step_options.FUSED_MULTI_GPU_XLA_FLAGS)[0]
    '--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=true'
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional, Sequence

from tf_nvlink.plan import execution

# XLA flags tf_nvlink may set. XLA aborts the process on a flag name it does not know, so only names checked in
# TensorFlow 2.21's XLA (its .so) are accepted.
KNOWN_XLA_FLAGS = ("xla_gpu_enable_latency_hiding_scheduler", "xla_gpu_all_reduce_combine_threshold_bytes",
                   "xla_gpu_enable_pipelined_all_reduce", "xla_gpu_enable_highest_priority_async_stream",
                   *("xla_gpu_enable_command_buffer", "xla_gpu_graph_min_graph_size",
                     "xla_gpu_graph_enable_concurrent_region", "xla_gpu_command_buffer_unroll_loops",
                     "xla_enable_command_buffers_during_profiling"))
# XLA's command buffers (CUDA graphs) for the compiled step. `--xla_gpu_enable_command_buffer=` takes a comma list
# of the thunk kinds recorded into graphs (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, COLLECTIVES, CONDITIONAL,
# WHILE, DYNAMIC_SLICE_FUSION, DYNAMIC_SLICE_COPY_FUSION); empty turns graphs off. `xla_gpu_graph_min_graph_size`
# is the fewest consecutive recordable thunks worth a graph. While a profiler session is active XLA runs the
# program thunk by thunk unless `--xla_enable_command_buffers_during_profiling=true`: a profile then shows more host
# launch time than an unprofiled step has.
COMMAND_BUFFER_KINDS = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN", "COLLECTIVES", "CONDITIONAL", "WHILE",
                        "DYNAMIC_SLICE_FUSION", "DYNAMIC_SLICE_COPY_FUSION")
# The one flag whose empty value means something (command buffers off).
_EMPTY_VALUE_OK = ("xla_gpu_enable_command_buffer",)
# Fused multi-GPU XLA: the scheduler overlaps the in-XLA NCCL all-reduce with the backward pass (ResNet-50,
# 2x H200, host-fed fit: 5518/5453 vs 5181/5182 img/s, +3-6%; training_bench auto 6535 vs 6360).
FUSED_MULTI_GPU_XLA_FLAGS = ("--xla_gpu_enable_latency_hiding_scheduler=true",)
# Every GPU plan: a profile (the step doctor's window, TensorBoard's profiler) then runs the compiled step as it
# runs unprofiled, with its CUDA graphs, instead of thunk by thunk with a launch per kernel. It changes nothing
# while no profiler session is active.
GPU_XLA_FLAGS = ("--xla_enable_command_buffers_during_profiling=true",)
XLA_FLAGS_CHOICES = ("auto", "none")
ALLREDUCE_DTYPES = ("float32", "bfloat16")
# Batches prefetched to each GPU by `experimental_distribute_dataset`: TensorFlow's default, 1. Deeper was slower on
# 2x H200 (ResNet-50 host-fed, one process, 3 rounds: scaling 0.85 with 1 against 0.82 with 2, 0.86 vs 0.88 with 4;
# docs/results.md). `strategy(input_buffer=N)` still sets another depth.
GPU_INPUT_BUFFER = 1
# What `strategy()` and `decide` take when the caller asks for nothing: (xla_flags, allreduce_dtype, input_buffer,
# compiled_execution).
DEFAULT_REQUEST = ("auto", "float32", None, True)


def xla_flag_name(flag: str) -> str:
    """"--xla_gpu_x=true" -> "xla_gpu_x"."""
    return flag.strip().lstrip("-").split("=", 1)[0]


def validate_xla_flags(xla_flags) -> tuple[str, ...]:
    """"auto", "none", or a sequence of "--name=value" flags whose names are in KNOWN_XLA_FLAGS. Returns the
    explicit flags (empty for "auto"/"none"). ValueError names the bad value and the valid choices."""
    if isinstance(xla_flags, str):
        if xla_flags in XLA_FLAGS_CHOICES:
            return ()
        raise ValueError(f"xla_flags should be one of {list(XLA_FLAGS_CHOICES)} or a list of '--name=value' flags "
                         f"named in {list(KNOWN_XLA_FLAGS)}. Received: xla_flags={xla_flags!r}")
    if not isinstance(xla_flags, (list, tuple)):
        raise ValueError(f"xla_flags should be one of {list(XLA_FLAGS_CHOICES)} or a list of '--name=value' flags. "
                         f"Received: xla_flags={xla_flags!r}")
    for flag in xla_flags:
        value_pattern = r"\S*" if isinstance(flag, str) and xla_flag_name(flag) in _EMPTY_VALUE_OK else r"\S+"
        if not isinstance(flag, str) or not re.fullmatch(r"--\w+=" + value_pattern, flag.strip()) \
                or xla_flag_name(flag) not in KNOWN_XLA_FLAGS:
            raise ValueError(f"xla_flags entries should be '--name=value' with a name in {list(KNOWN_XLA_FLAGS)} "
                             f"(XLA aborts on names it does not know). Received: {flag!r} in xla_flags={xla_flags!r}")
        if xla_flag_name(flag) == "xla_gpu_enable_command_buffer":
            kinds = [kind for kind in flag.strip().split("=", 1)[1].split(",") if kind]
            unknown = [kind for kind in kinds if kind not in COMMAND_BUFFER_KINDS]
            if unknown:
                raise ValueError(f"--xla_gpu_enable_command_buffer takes a comma list of {list(COMMAND_BUFFER_KINDS)} "
                                 f"(empty: command buffers off). Received: {unknown} in {flag!r}")
    return tuple(flag.strip() for flag in xla_flags)


def choose_xla_flags(n_gpus: int, xla_allreduce: str, request="auto") -> tuple[str, ...]:
    """The XLA flags a plan wants: on GPUs, CUDA graphs kept while profiling (GPU_XLA_FLAGS); plus the
    latency-hiding scheduler when 2+ GPUs all-reduce inside XLA ("fused": a collective inside XLA to overlap);
    nothing on CPUs or for "none"; the caller's own list as given.

    Example:
        >>> choose_xla_flags(2, "fused")
        ('--xla_enable_command_buffers_during_profiling=true', '--xla_gpu_enable_latency_hiding_scheduler=true')
    """
    explicit = validate_xla_flags(request)
    if not isinstance(request, str):
        return explicit
    if request == "none" or n_gpus < 1:
        return ()
    return GPU_XLA_FLAGS + (FUSED_MULTI_GPU_XLA_FLAGS if n_gpus >= 2 and xla_allreduce == "fused" else ())


def merge_xla_flags(user_xla_flags: str, planned: Sequence[str]) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    """Merge planned flags into the user's XLA_FLAGS value: the user's setting of a flag wins.

    Returns (new XLA_FLAGS value, the planned flags added, the user's entries kept instead of a planned flag).

    Example:
        >>> lhs = "--xla_gpu_enable_latency_hiding_scheduler"
        >>> merge_xla_flags("--xla_dump_to=/tmp/x " + lhs + "=false", (lhs + "=true",))
        ('--xla_dump_to=/tmp/x --xla_gpu_enable_latency_hiding_scheduler=false', (), ('--xla_gpu_...=false',))
    """
    user_entries = (user_xla_flags or "").split()
    user_by_name = {xla_flag_name(entry): entry for entry in user_entries if entry.startswith("-")}
    added = tuple(flag for flag in planned if xla_flag_name(flag) not in user_by_name)
    kept = tuple(user_by_name[xla_flag_name(flag)] for flag in planned if xla_flag_name(flag) in user_by_name)
    return " ".join(user_entries + list(added)), added, kept


def choose_input_buffer(n_gpus: int, request: Optional[int] = None) -> int:
    """Batches `experimental_distribute_dataset` prefetches to each replica's device: GPU_INPUT_BUFFER on GPUs,
    0 (TensorFlow's own options) on CPUs, or the caller's positive integer."""
    if request is not None:
        if isinstance(request, bool) or not isinstance(request, int) or request < 1:
            raise ValueError(f"input_buffer should be a positive integer (batches prefetched to each replica's "
                             f"device) or None for the policy's choice. Received: input_buffer={request!r}")
        return request
    return GPU_INPUT_BUFFER if n_gpus else 0


def validate_allreduce_dtype(allreduce_dtype: str) -> str:
    if allreduce_dtype not in ALLREDUCE_DTYPES:
        raise ValueError(f"allreduce_dtype should be one of {list(ALLREDUCE_DTYPES)}. "
                         f"Received: allreduce_dtype={allreduce_dtype!r}")
    return allreduce_dtype


def validate_compiled_execution(compiled_execution) -> bool:
    if not isinstance(compiled_execution, bool):
        raise ValueError(f"compiled_execution should be True (steps_per_execution=N runs as one XLA program per "
                         f"replica where the whole step is in XLA, the default) or False (one program per step). "
                         f"Received: compiled_execution={compiled_execution!r}")
    return compiled_execution


def validate_request(xla_flags="auto", allreduce_dtype: str = "float32", input_buffer: Optional[int] = None,
                     compiled_execution: bool = True) -> tuple:
    """Check a step-option request before anything is built; returns it hashable: (xla_flags, dtype, input_buffer,
    compiled_execution)."""
    validate_xla_flags(xla_flags)
    validate_allreduce_dtype(allreduce_dtype)
    choose_input_buffer(0, input_buffer)
    validate_compiled_execution(compiled_execution)
    return (tuple(xla_flags) if isinstance(xla_flags, (list, tuple)) else xla_flags, allreduce_dtype, input_buffer,
            compiled_execution)


def choose_step_options(plan, user_xla_flags: str = "", xla_flags="auto", allreduce_dtype: str = "float32",
                        input_buffer: Optional[int] = None, compiled_execution: bool = True):
    """`plan` (a `policy.Plan`) with its step options chosen: XLA flags (merged under the user's `XLA_FLAGS` value,
    which wins), the gradient all-reduce dtype (float32 unless asked: bfloat16 halves the bytes but sums in 8 bits
    of mantissa), and the input prefetch depth per replica. `policy.decide` calls it last, on the final plan.

    Example:
        >>> choose_step_options(plan, user_xla_flags="").xla_flags     # a 2-GPU fused plan
        ('--xla_enable_command_buffers_during_profiling=true', '--xla_gpu_enable_latency_hiding_scheduler=true')
    """
    validate_allreduce_dtype(allreduce_dtype)  # with one replica nothing is all-reduced: recorded, harmless
    planned = choose_xla_flags(len(plan.gpus), plan.xla_allreduce, xla_flags)
    _, added, kept = merge_xla_flags(user_xla_flags, planned)
    return dataclasses.replace(plan, xla_flags=added, xla_flags_kept=kept, allreduce_dtype=allreduce_dtype,
                               input_buffer=choose_input_buffer(len(plan.gpus), input_buffer),
                               compiled_execution=validate_compiled_execution(compiled_execution))


def execution_text(plan) -> str:
    """How `steps_per_execution=N` runs for jit-compiled models under `plan` ("" on CPU replicas, which run it
    step by step as Keras does); the model decides the rest (`tf_nvlink.training.compiled_execution`).

    Example:
        >>> execution_text(plan)     # 2 GPUs, fused
        'steps_per_execution=N runs as one XLA program per replica'
    """
    if not plan.compiled_execution:
        return "compiled execution off: steps_per_execution=N runs one program per step"
    all_gpu = bool(plan.gpus) or any("GPU" in device.upper() for device in plan.devices)
    if not all_gpu:
        return ""
    mode = execution.decide_execution(execution.StepFacts(
        replicas=max(1, len(plan.gpus) or len(plan.devices)), all_gpu=all_gpu, workers=1,
        xla_allreduce=plan.xla_allreduce, compiled_execution=True, jit_compile=True, run_eagerly=False,
        steps_per_execution=2))
    if mode.path != execution.COMPILED:
        return "steps_per_execution=N runs one program per step (split mode all-reduces outside XLA)"
    return "steps_per_execution=N runs as one XLA program per replica"


def summary_clauses(plan) -> str:
    """The step options of `plan` that differ from TensorFlow's defaults, as "; ..." clauses (empty when none)."""
    parts = []
    if plan.xla_flags:
        parts.append("XLA_FLAGS += " + " ".join(plan.xla_flags))
    if plan.xla_flags_kept:
        parts.append("user's XLA_FLAGS kept: " + " ".join(plan.xla_flags_kept))
    if plan.allreduce_dtype != "float32":
        parts.append(f"gradients all-reduced in {plan.allreduce_dtype}")
    if plan.input_buffer:
        parts.append(f"input prefetched to each replica's device, {plan.input_buffer} "
                     f"batch{'es' if plan.input_buffer != 1 else ''} deep")
    parts.append(execution_text(plan))
    return "".join("; " + p for p in parts if p)


def report_text(record: dict) -> str:
    """Every step option of a plan record (`Plan.to_dict()`), for the report's "options" line."""
    added, kept = record.get("xla_flags") or [], record.get("xla_flags_kept") or []
    flags = ("XLA_FLAGS += " + " ".join(added)) if added else "no XLA flags added"
    if kept:
        flags += " (user's XLA_FLAGS kept: " + " ".join(kept) + ")"
    buffer = record.get("input_buffer") or 0
    return (f"{flags}; gradients all-reduced in {record.get('allreduce_dtype', 'float32')}; "
            + (f"input prefetched {buffer} batch{'es' if buffer != 1 else ''} deep per GPU" if buffer
               else "TensorFlow's input options")
            + ("" if record.get("compiled_execution", True) else "; compiled execution off"))
