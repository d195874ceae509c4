"""What kind of work each GPU kernel of a profiled step does, read from what an XLA GPU trace carries per kernel.

Kinds (WORK_KINDS): matmul, attention, normalisation, elementwise, optimizer (the optimizer's update), loss,
collective, copy, other.

What the trace carries:
- each kernel's name: library kernels (cuBLAS/cuBLASLt `sm90_xmma_gemm_...`, `nvjet_...`, `cutlass...`; cuDNN
  convolutions `sm80_xmma_fprop_implicit_gemm...`; cuDNN fused attention
  `cudnn_generated_fort_native_sdpa_sm90_flash_fprop...` / `..._bprop...`), XLA's own kernels (its fusions,
  `loop_add_fusion_3`, `input_reduce_fusion_12`, `triton_gemm_dot_4`, and `wrapped_*`), NCCL's kernels, CUPTI's
  copies and memsets;
- a kernel launched on its own has the stats `hlo_op` (its HLO instruction: `loop_add_fusion.3`,
  `cudnn-conv-bias-activation.198`) and `name` (the TensorFlow op it came from, with its name scope:
  `model/block3_attention_1/softmax_1/Softmax`); a kernel XLA runs inside a CUDA graph (a command buffer) has
  `hlo_op` "command_buffer" and no `name`;
- the `/host:metadata` plane holds each program's optimized HLO (`tf_runtime.hlo_protobuf_module`): every
  instruction's `metadata.op_name`, what a fusion fused, a custom call's target, each computation's schedule, and
  the shapes `hlo_cost` reads an instruction's bytes and FLOPs from (`HloOp.cost`; `resolve_stream` gives each
  kernel the instruction whose cost it carries).

A kernel's HLO instruction: its `hlo_op` stat; else, for an XLA kernel, the instruction whose name it is ("." and
"-" written "_"); else, for a library kernel inside a CUDA graph (a command buffer), the library call of its place
in the graph's node order (`place_graph_calls`: the graph's library kernels, grouped by call, are the schedule's
library calls in order); else its place in time: the custom calls the schedule runs after the instruction of the
kernel before it on its stream and before the next fusion (the k-th library kernel after that kernel takes the k-th
call; where the calls are all of one kind, that kind). Its op names: the instruction's op_name and those of the
instructions fused into it (XLA gives a fusion the op_name of one root, at times only "XLA_Retvals"), its constants
aside: XLA's common-subexpression pass keeps one op name for equal constants across the program, so a GELU's
constant 1 may carry an optimizer's op name; without the HLO, the `name` stat.

The rules, the first that matches wins (the name scope's parts are read without Keras' "_1" suffixes):
1. collective: NCCL and all-reduce kernels, peer-to-peer copies; copy: other copies and memsets (`trace.classify`);
2. attention: fused attention kernels by name (fmha, flash, sdpa, fused_mha, attention), cuDNN's fMHA custom calls,
   and the transposes of their results into the layers' layout (`is_attention_layout`);
3. optimizer: an op name in an optimizer's scope (as Keras names it: sgd, adam, adam_w, lion, ...);
4. loss: an op name in the loss's scope (compile_loss, loss, *crossentropy*);
5. attention: an op name inside an attention layer (a scope part containing "attention") and not inside its
   projections (query, key, value, attention_output, q_proj, ...): the scores, mask, softmax and weighted sum,
   forward and backward, whether XLA runs them as gemms or fusions;
6. matmul: gemm and convolution kernels by name (gemm, nvjet, cutlass, xmma, hmma, cublas, cudnn, cask), cuBLAS, cuDNN
   convolution custom calls, dots and convolutions, fusions holding one (Triton gemms);
7. normalisation: an op name inside a normalisation layer (layer_normalization, *_ln, *_bn, *norm*, batchnorm);
8. elementwise: any other XLA kernel (elementwise ops, reductions, transposes, casts, gathers: GELU, residual adds,
   bias gradients, embedding lookups);
9. other: the rest (library kernels with neither a known name nor an instruction).

Limits: the scope rules read the layers' names, so a model whose attention or normalisation layers are named
otherwise has those kernels counted as matmul and elementwise; a fusion holding ops of several kinds counts once, by
the first rule one of its op names meets (an optimizer update fused with the cast of the weight for the next step
counts as optimizer); the place of a library kernel in a command buffer assumes one main kernel per custom call
(kernels named *reduce*, *memcpy*, *memset*, *epilogue* or `cudnn::fusion::*` go with the one before them, or the
next one where only that one is of the same library, and cuDNN's `compute_dot_do_o` with the next); an XLA kernel
that several instructions share (XLA compiles identical fusions once, under the first one's name) counts as that
first instruction, of the same cost, and of its kind; without the HLO in the trace, a command buffer's gemms count as
matmul, whatever layer they belong to.

Example:
    >>> kind_of("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", None, "model/block0_ffn_in_1/Tensordot")
    'matmul'
    >>> kind_of("loop_divide_fusion_4", None, "model/block0_attention_1/softmax_1/Softmax")
    'attention'
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Iterable, Optional, Sequence

from tf_nvlink.tools.doctor import hlo_cost

WORK_KINDS = ("matmul", "attention", "normalisation", "elementwise", "optimizer", "loss", "collective", "copy",
              "other")
# Keras' names of its optimizers (their name scope in the step)
OPTIMIZER_SCOPES = frozenset({"sgd", "adam", "adam_w", "adamw", "adamax", "adadelta", "adagrad", "adafactor", "ftrl",
                              "lamb", "lion", "nadam", "rmsprop", "muon", "loss_scale_optimizer"})
# The projections inside an attention layer (Keras' MultiHeadAttention, and the usual names elsewhere): matmul work.
ATTENTION_PROJECTIONS = frozenset({"query", "key", "value", "attention_output", "q_proj", "k_proj", "v_proj",
                                   "o_proj", "out_proj", "qkv", "qkv_proj"})
_FUSED_ATTENTION = re.compile(r"fmha|flash|sdpa|fused_mha|attention")
_MATMUL_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|hmma|cublas|cudnn|cask")
# XLA names a kernel after its instruction, an identifier (`loop_add_fusion_3`, `wrapped_transpose_29`); a library's
# kernel names can hold "fusion" too (cuDNN's `void cudnn::fusion::compute_dot_do_o_specialized<...>`).
_XLA_KERNEL = re.compile(r"^(\w*fusion\w*|wrapped_\w+)$")
_AUXILIARY = re.compile(r"reduce|memcpy|memset|epilogue")
# Kernels a library call launches beside its main kernel: split-K reductions, epilogues, copies, and cuDNN's helper
# kernels (fused attention's backward runs `cudnn::fusion::compute_dot_do_o...` before its main kernel and
# `cudnn::fusion::convert_dq_to_16bits` after it).
_HELPER = re.compile(r"reduce|memcpy|memset|epilogue|cudnn::fusion::")
# Helpers that run before their call's main kernel: the backward's D = rowsum(dO * O), which flash attention's
# backward reads.
_LEADING_HELPER = re.compile(r"dot_do_o")
_BACKWARD = re.compile(r"bprop|backward|bwd")
_NORMALISATION = re.compile(r"(^|_)(ln|bn|norm|layernorm|batchnorm|rmsnorm|groupnorm)\d*$|normali[sz]ation|"
                            r"layer_norm|batch_norm|rms_norm|group_norm")
_NOT_AN_OP = ("", "XLA_Args", "XLA_Retvals")


@dataclasses.dataclass(frozen=True)
class HloOp:
    """One instruction of a program's HLO as the rules read it: its name, opcode, custom-call target, op names (its
    own first, then those of the instructions fused into it), whether it is a matmul (a dot, a convolution, a
    cuBLAS or cuDNN-convolution call, or a fusion holding a dot or convolution), what one execution costs
    (`hlo_cost.Cost`: bytes read and written, FLOPs) and whether it only transposes or copies a result of cuDNN's
    fused attention (`is_attention_layout`)."""

    name: str
    opcode: str
    target: str
    op_names: tuple[str, ...]
    matmul: bool
    cost: hlo_cost.Cost = hlo_cost.Cost()
    attention_layout: bool = False


@dataclasses.dataclass
class HloModule:
    """One program: its instructions by name, its XLA kernels by kernel name, for each instruction that launches
    work the custom calls its computation's schedule runs after it and before the next fusion, the library calls
    (custom calls, unfused dots and convolutions) in the order a command buffer records them (each computation's
    schedule, a loop's or a call's computations where the schedule reaches them), and the computation (id) of each
    instruction."""

    ops: dict[str, HloOp]
    by_kernel: dict[str, HloOp]
    calls_after: dict[str, tuple[HloOp, ...]]
    library_calls: tuple[HloOp, ...] = ()
    computation_of: dict[str, int] = dataclasses.field(default_factory=dict)


def kernel_name_of(instruction_name: str) -> str:
    """The name XLA gives the kernel of an instruction: "." and "-" written "_".

    Example:
        >>> kernel_name_of("input_reduce_fusion.142")
        'input_reduce_fusion_142'
    """
    return re.sub(r"[.\-]", "_", instruction_name)


def scope_parts(op_name: str) -> list[str]:
    """The parts of a TensorFlow op name, each without the "_N" TensorFlow appends to repeated scopes.

    Example:
        >>> scope_parts("gradient_tape/model_1/block0_ln1_1/moments/mean")
        ['gradient_tape', 'model', 'block0_ln1', 'moments', 'mean']
    """
    return [re.sub(r"_\d+$", "", part) for part in op_name.split("/") if part]


def _attention_core(parts: Sequence[str]) -> bool:
    inside = [i for i, part in enumerate(parts) if "attention" in part and part not in ATTENTION_PROJECTIONS]
    return bool(inside) and not any(part in ATTENTION_PROJECTIONS for part in parts[inside[-1] + 1:])


def is_fused_attention(kernel_name: str, op: Optional[HloOp] = None) -> bool:
    """Whether a kernel is fused attention: by its name (fmha, flash, sdpa, fused_mha, attention) or its instruction
    (cuDNN's fMHA custom calls).

    Example:
        >>> is_fused_attention("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64")
        True
    """
    return bool(_FUSED_ATTENTION.search(kernel_name.lower())) or (op is not None and "fmha" in op.target.lower())


@functools.lru_cache(maxsize=1 << 16)  # a step repeats its kernels: each (name, instruction, op name) once
def kind_of(kernel_name: str, op: Optional[HloOp], tf_op_name: Optional[str] = None,
            trace_kind: str = "compute") -> str:
    """The work kind of one kernel from its name, its HLO instruction (or None) and the TensorFlow op name of its
    `name` stat (or None); `trace_kind` is `trace.classify`'s kind of the event (copies and collectives).

    Example:
        >>> kind_of("ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, trace_kind="collective")
        'collective'
    """
    if trace_kind in ("collective", "p2p"):
        return "collective"
    if trace_kind in ("h2d", "d2h", "d2d"):
        return "copy"
    low = kernel_name.lower()
    if is_fused_attention(kernel_name, op) or (op is not None and op.attention_layout):
        return "attention"
    names = op.op_names if op is not None and op.op_names else ((tf_op_name,) if tf_op_name else ())
    parts = [scope_parts(name) for name in names]
    if any(part in OPTIMIZER_SCOPES for each in parts for part in each):
        return "optimizer"
    if any(part == "compile_loss" or part == "loss" or "crossentropy" in part for each in parts for part in each):
        return "loss"
    if any(_attention_core(each) for each in parts):
        return "attention"
    if _MATMUL_KERNEL.search(low) or (op is not None and op.matmul):
        return "matmul"
    if any(_NORMALISATION.search(part) for each in parts for part in each):
        return "normalisation"
    if op is not None or _XLA_KERNEL.search(low):
        return "elementwise"
    return "other"


def _is_matmul(instruction, fused_opcodes: Iterable[str]) -> bool:
    target = instruction.custom_call_target
    return (instruction.opcode in ("dot", "convolution") or target.startswith("__cublas")
            or target.startswith("__cudnn$conv") or any(code in ("dot", "convolution") for code in fused_opcodes))


# What a fusion that only moves a fused-attention result into another layout holds.
_LAYOUT_OPCODES = frozenset({"parameter", "transpose", "copy", "bitcast"})


def is_attention_layout(instruction, fused_opcodes: Sequence[str], instructions: dict) -> bool:
    """Whether an instruction only transposes or copies a result of cuDNN's fused attention: a transpose, a copy, or
    a fusion of nothing else, whose operand is (through get-tuple-element and bitcast) an fMHA custom call. cuDNN
    returns O, and in the backward dQ, dK and dV, as [B, N, T, H]; the layers read [B, T, N, H], and TensorFlow's
    XlaCustomCallV2 op, which cannot declare its results' layouts, leaves the transposes to XLA.

    Example:
        >>> is_attention_layout(wrapped_transpose, ["parameter", "transpose"], instructions_by_id)
        True
    """
    if instruction.opcode == "fusion":
        opcodes = set(fused_opcodes)
        if not opcodes <= _LAYOUT_OPCODES or not opcodes & {"transpose", "copy"}:
            return False
    elif instruction.opcode not in ("transpose", "copy"):
        return False
    for operand_id in instruction.operand_ids:
        source = instructions.get(operand_id)
        while source is not None and source.opcode in ("get-tuple-element", "bitcast") and source.operand_ids:
            source = instructions.get(source.operand_ids[0])
        if source is not None and source.opcode == "custom-call" and "fmha" in source.custom_call_target.lower():
            return True
    return False


def hlo_module(proto) -> HloModule:
    """The HloModule of an `HloProto` (`tf_runtime.hlo_protobuf_module().HloProto`)."""
    module = proto.hlo_module
    instructions = {i.id: i for c in module.computations for i in c.instructions}
    costs = hlo_cost.ModuleCosts(module)
    computations = {c.id: c for c in module.computations}
    fused = {cid for c in module.computations for i in c.instructions if i.opcode == "fusion"
             for cid in i.called_computation_ids}

    def inside(computation_ids, seen):
        names, opcodes = [], []
        for cid in computation_ids:
            if cid in seen or cid not in computations:
                continue
            seen.add(cid)
            for instruction in computations[cid].instructions:
                if instruction.opcode != "constant":  # CSE keeps one op name for equal constants program-wide
                    names.append(instruction.metadata.op_name)
                opcodes.append(instruction.opcode)
                deeper = inside(instruction.called_computation_ids, seen)
                names += deeper[0]
                opcodes += deeper[1]
        return names, opcodes

    ops, by_kernel, by_id, computation_of = {}, {}, {}, {}
    for computation in module.computations:
        if computation.id in fused:
            continue
        for instruction in computation.instructions:
            computation_of[instruction.name] = computation.id
            fused_names, fused_opcodes = inside(instruction.called_computation_ids, set()) \
                if instruction.opcode == "fusion" else ([], [])
            names = tuple(dict.fromkeys(n for n in [instruction.metadata.op_name, *fused_names] if n not in _NOT_AN_OP))
            op = HloOp(instruction.name, instruction.opcode, instruction.custom_call_target, names,
                       _is_matmul(instruction, fused_opcodes), costs.cost(instruction),
                       is_attention_layout(instruction, fused_opcodes, instructions))
            ops[op.name] = by_id[instruction.id] = op
            by_kernel.setdefault(kernel_name_of(op.name), op)
    calls_after: dict[str, tuple[HloOp, ...]] = {}
    for sequence in module.schedule.sequences.values():
        scheduled = [by_id[i] for i in sequence.instruction_ids if i in by_id]
        for position, op in enumerate(scheduled):
            if op.opcode not in ("fusion", "custom-call"):
                continue
            following = []
            for later in scheduled[position + 1:]:
                if later.opcode == "fusion":
                    break
                if later.opcode == "custom-call" or later.matmul:
                    following.append(later)
            calls_after[op.name] = tuple(following)
    return HloModule(ops, by_kernel, calls_after, _library_calls(module, by_id, instructions), computation_of)


def _is_library_call(op: HloOp) -> bool:
    return op.opcode == "custom-call" or (op.matmul and op.opcode != "fusion")


def _library_calls(module, by_id: dict, instructions: dict) -> tuple[HloOp, ...]:
    """The module's library calls in the order its schedule reaches them from the entry computation, a while's,
    conditional's or call's computations where the instruction stands."""
    sequences = module.schedule.sequences
    found: list[HloOp] = []

    def walk(computation_id: int, seen: set) -> None:
        if computation_id in seen or computation_id not in sequences:
            return
        seen.add(computation_id)
        for instruction_id in sequences[computation_id].instruction_ids:
            op = by_id.get(instruction_id)
            if op is None:
                continue
            if _is_library_call(op):
                found.append(op)
            elif op.opcode in ("while", "conditional", "call"):
                for called in instructions[instruction_id].called_computation_ids:
                    walk(called, seen)

    walk(module.entry_computation_id, set())
    return tuple(found)


class HloIndex:
    """The programs of a trace's `/host:metadata` plane, by program id and by module name.

    Example:
        >>> index = HloIndex.from_space(space)
        >>> index.module(1908, "").ops["loop_multiply_fusion.6"].op_names[0]
        'resnet50_host_fed_1/uint8_to_float_1/mul'
    """

    def __init__(self, modules: Optional[dict] = None):
        self.modules: dict = modules or {}

    @classmethod
    def from_space(cls, space) -> "HloIndex":
        """Every `Hlo Proto` stat of the space's `/host:metadata` plane (none: an empty index)."""
        from tf_nvlink.internals import tf_runtime  # noqa: PLC0415 - TensorFlow only when a trace is read

        modules = {}
        for plane in space.planes:
            if plane.name != "/host:metadata":
                continue
            proto_stats = {key for key, meta in plane.stat_metadata.items() if meta.name == "Hlo Proto"}
            for program_id, metadata in plane.event_metadata.items():
                for stat in metadata.stats:
                    if stat.metadata_id in proto_stats and stat.bytes_value:
                        proto = tf_runtime.hlo_protobuf_module().HloProto()
                        proto.ParseFromString(stat.bytes_value)
                        module = hlo_module(proto)
                        modules[int(program_id)] = modules[proto.hlo_module.name] = module
        return cls(modules)

    def module(self, program_id: Optional[int], module_name: Optional[str]) -> Optional[HloModule]:
        return self.modules.get(program_id) or self.modules.get(module_name)


@dataclasses.dataclass(frozen=True)
class KernelEvent:
    """What a stream's event says of itself: its name, `trace.classify`'s kind, and its stats `hlo_op`, `name`,
    `program_id`, `hlo_module`, `cuda_graph_id` and `cuda_graph_node_id` (None where absent)."""

    name: str
    trace_kind: str
    hlo_op: Optional[str] = None
    tf_op_name: Optional[str] = None
    program_id: Optional[int] = None
    module_name: Optional[str] = None
    graph_id: Optional[int] = None
    graph_node: Optional[int] = None


def classify_stream(index: HloIndex, events: Sequence[KernelEvent]) -> list[str]:
    """The work kind of each event of one stream, `events` in the order they ran (see the module doc).

    Example:
        >>> classify_stream(HloIndex(), [KernelEvent("loop_add_fusion", "compute"), KernelEvent("MemcpyH2D", "h2d")])
        ['elementwise', 'copy']
    """
    return [kind for kind, _ in resolve_stream(index, events)]


def resolve_stream(index: HloIndex, events: Sequence[KernelEvent]) -> list[tuple[str, Optional[HloOp]]]:
    """(work kind, HLO instruction or None) of each event of one stream, `events` in the order they ran: the
    instruction whose cost the event's execution carries (for a library kernel in a command buffer, the custom call
    that `place_graph_calls` gives it, else its place among the kernels that ran before it).

    Example:
        >>> resolve_stream(HloIndex(), [KernelEvent("loop_add_fusion", "compute")])
        [('elementwise', None)]
    """
    placed = place_graph_calls(index, events)
    resolved = []
    calls: tuple[HloOp, ...] = ()
    taken = -1
    for position, event in enumerate(events):
        if event.trace_kind != "compute":
            resolved.append((kind_of(event.name, None, None, event.trace_kind), None))
            continue
        if position in placed:
            resolved.append((kind_of(event.name, placed[position], event.tf_op_name), placed[position]))
            continue
        module = index.module(event.program_id, event.module_name)
        op = None
        if module is not None:
            if event.hlo_op and event.hlo_op != "command_buffer":
                op = module.ops.get(event.hlo_op)
            else:
                op = module.by_kernel.get(event.name)
        low = event.name.lower()
        kind_op = op
        if op is not None:
            calls, taken = module.calls_after.get(op.name, ()), -1
        elif calls and not _XLA_KERNEL.search(low):
            if taken < 0 or not _AUXILIARY.search(low):
                taken += 1
            op = calls[min(taken, len(calls) - 1)]
            kind_op = calls[0] if len({kind_of(event.name, call) for call in calls}) == 1 else op
        resolved.append((kind_of(event.name, kind_op, event.tf_op_name), op))
    return resolved


def _library_family(name: str) -> str:
    """Which call a library kernel's name can be the main kernel of: fused attention forward or backward, or any."""
    low = name.lower()
    if _FUSED_ATTENTION.search(low):
        return "attention backward" if _BACKWARD.search(low) else "attention"
    return "library"


def _call_family(op: HloOp) -> str:
    target = op.target.lower()
    if "fmha" in target:
        return "attention backward" if "backward" in target else "attention"
    return "library"


def _is_cudnn(name: str) -> bool:
    low = name.lower()
    return "cudnn" in low or bool(_FUSED_ATTENTION.search(low))


def group_library_kernels(names: Sequence[str]) -> list[list[int]]:
    """The library kernels of a command buffer, `names` in the order its graph nodes were made, grouped by the call
    that launched them: each main kernel starts a call; a helper kernel (`_HELPER`: split-K reductions, epilogues,
    cuDNN's `cudnn::fusion::` kernels) joins the call before it when both are cuDNN's or both not, else the next
    (fused attention's backward's `compute_dot_do_o`, which runs before its main kernel, always the next).

    Example:
        >>> group_library_kernels(["sdpa_sm90_flash_fprop", "void cudnn::fusion::compute_dot_do_o_specialized<true>",
        ...                        "sdpa_sm90_flash_bprop", "void cudnn::fusion::convert_dq_to_16bits<true>",
        ...                        "nvjet_tst_TNT", "cublasLt::splitKreduce_kernel"])
        [[0], [1, 2, 3], [4, 5]]
    """
    groups: list[list[int]] = []
    waiting: list[int] = []
    for position, name in enumerate(names):
        if not _HELPER.search(name.lower()):
            groups.append(waiting + [position])
            waiting = []
        elif groups and _is_cudnn(names[groups[-1][-1]]) == _is_cudnn(name) and not waiting \
                and not _LEADING_HELPER.search(name.lower()):
            groups[-1].append(position)
        else:
            waiting.append(position)
    if waiting and groups:
        groups[-1].extend(waiting)
    return groups


def place_graph_calls(index: HloIndex, events: Sequence[KernelEvent]) -> dict[int, HloOp]:
    """{position in `events`: the library call it ran for} for the library kernels inside CUDA graphs.

    A CUDA graph runs its nodes in an order of its own (independent kernels swap), so a library kernel's neighbours
    in time do not say which custom call it ran for. The graph's node ids do: XLA makes the nodes of a command
    buffer in its computation's schedule order, and a library call's kernels (traced into the graph) get their ids
    in the order of the calls. So the library kernels of one graph, in node-id order and grouped by call
    (`group_library_kernels`), are the library calls of the computations its XLA kernels belong to, in schedule
    order (`HloModule.library_calls`). Used where the counts agree and each call's main kernel fits it (fused
    attention's kernels to cuDNN's fMHA calls, forward and backward); elsewhere the kernels keep the rule of their
    place in time (`resolve_stream`).

    Example:
        >>> place_graph_calls(index, events)[12].target
        '__cudnn$fmhaSoftmaxBackward'
    """
    graphs: dict[tuple, dict] = {}
    for position, event in enumerate(events):
        if event.trace_kind != "compute" or event.graph_node is None or \
                (event.hlo_op and event.hlo_op != "command_buffer"):
            continue
        module = index.module(event.program_id, event.module_name)
        if module is None:
            continue
        graph = graphs.setdefault((id(module), event.graph_id), {"module": module, "nodes": {}, "computations": set()})
        if _XLA_KERNEL.search(event.name.lower()):
            op = module.by_kernel.get(event.name)
            if op is not None:
                graph["computations"].add(module.computation_of.get(op.name))
        else:
            graph["nodes"].setdefault(event.graph_node, (event.name, []))[1].append(position)
    placed: dict[int, HloOp] = {}
    for graph in graphs.values():
        module, nodes = graph["module"], sorted(graph["nodes"].items())
        if not nodes:
            continue
        calls = [op for op in module.library_calls if module.computation_of.get(op.name) in graph["computations"]]
        groups = group_library_kernels([name for _, (name, _) in nodes])
        if len(groups) != len(calls):
            continue
        mains = [next((nodes[i][1][0] for i in group if not _HELPER.search(nodes[i][1][0].lower())),
                      nodes[group[0]][1][0]) for group in groups]
        if any(_library_family(main) != _call_family(call) for main, call in zip(mains, calls)):
            continue
        for group, call in zip(groups, calls):
            for i in group:
                for position in nodes[i][1][1]:
                    placed[position] = call
    return placed
