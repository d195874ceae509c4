"""The bytes an XLA GPU kernel reads and writes and the FLOPs it does, from its HLO instruction in the trace.

The profiler's trace holds each program's optimized HLO (`work_kinds.HloIndex`); an instruction that launches work is
a fusion (XLA's own kernels), a custom call (cuBLAS gemms, cuDNN convolutions and fused attention) or, rarely, a
plain instruction. Its cost:

- bytes: each operand once (a fusion reads its operands once, however often the fused code uses them) plus its
  result, XLA's scratch buffer left out (the `u8`/`s8` last element of a custom call's result). An operand a fusion
  only slices (`slice`, `dynamic-slice`, the table of a `gather`) counts the slices' bytes; a fusion whose root is a
  `dynamic-update-slice` writes the update's bytes, and the buffer it updates in place, a parameter used for nothing
  else, is not read. Buffers XLA aliases otherwise (a donated variable updated in place) count as read and written,
  which they are.
- FLOPs: a dot 2*M*N*K (2 x the result's elements x the contracted size), a cuBLAS gemm the same from its backend
  config, a convolution 2 x the forward output's elements x the filter's elements / the output features (forward,
  backward input and backward filter alike), cuDNN's fused attention 4*B*N*T*S*H forward and 2.5 times that
  backward (the backward recomputes the scores), half of it under a causal mask (flash attention skips the masked
  blocks); inside a fusion, one FLOP per output element of each arithmetic instruction (casts, copies, reshapes,
  broadcasts and slices: none) and one per input element of a reduction. `dot_flops` is the part done by dots,
  convolutions and fused attention (tensor-core work), `float32_dot_flops` the part of those on float32 or float64
  operands (which miss the bf16 tensor-core rate).

Example:
    >>> costs = ModuleCosts(proto.hlo_module)   # the program of the 1x H200 ResNet-50 trace (tests/tools/fixtures)
    >>> costs.cost(conv1)                       # its first convolution: 128 images of 224 x 224, 7 x 7 x 3 -> 64
    Cost(bytes=244075008, flops=30211571712.0, dot_flops=30211571712.0, float32_dot_flops=0.0)
"""

from __future__ import annotations

import dataclasses
import json
import math

# Bits per element of XLA's primitive types (xla_data.proto's PrimitiveType); F8*/F4* by their prefix.
_ELEMENT_BITS = {"PRED": 8, "S2": 2, "U2": 2, "S4": 4, "U4": 4, "S8": 8, "U8": 8, "S16": 16, "U16": 16, "F16": 16,
                 "BF16": 16, "S32": 32, "U32": 32, "F32": 32, "S64": 64, "U64": 64, "F64": 64, "C64": 64,
                 "C128": 128}
# Instructions that move or reshape data and compute nothing.
_NO_FLOPS = frozenset({"parameter", "constant", "bitcast", "reshape", "broadcast", "transpose", "copy", "slice",
                       "dynamic-slice", "dynamic-update-slice", "concatenate", "pad", "tuple", "get-tuple-element",
                       "iota", "gather", "convert", "bitcast-convert", "reverse", "copy-start", "copy-done",
                       "after-all", "partition-id", "replica-id"})
_SLICING = frozenset({"slice", "dynamic-slice", "gather"})


@dataclasses.dataclass(frozen=True)
class Cost:
    """What one execution of an instruction costs: bytes read and written, FLOPs, the part of the FLOPs done by
    dots, convolutions and fused attention, and the part of those on float32 or float64 operands."""

    bytes: int = 0
    flops: float = 0.0
    dot_flops: float = 0.0
    float32_dot_flops: float = 0.0


def type_name(shape) -> str:
    """The name of a ShapeProto's element type as XLA prints it ("BF16", "F32", "TUPLE", ...)."""
    value = shape.DESCRIPTOR.fields_by_name["element_type"].enum_type.values_by_number.get(shape.element_type)
    return value.name if value is not None else ""


def element_bits(shape) -> int:
    """Bits per element of a ShapeProto's element type (0 for tuples, tokens and opaque values).

    Example:
        >>> element_bits(bf16_shape)
        16
    """
    name = type_name(shape)
    if name.startswith("F8"):
        return 8
    if name.startswith("F4"):
        return 4
    return _ELEMENT_BITS.get(name, 0)


def elements(shape) -> int:
    """Elements of an array ShapeProto (1 for a scalar; a tuple's: the sum of its parts')."""
    if shape.tuple_shapes:
        return sum(elements(part) for part in shape.tuple_shapes)
    return math.prod(shape.dimensions)


def shape_bytes(shape) -> int:
    """Bytes of a ShapeProto: an array's elements at their width, a tuple's parts summed.

    Example:
        >>> shape_bytes(bf16_128x1000)
        256000
    """
    if shape.tuple_shapes:
        return sum(shape_bytes(part) for part in shape.tuple_shapes)
    return (math.prod(shape.dimensions) * element_bits(shape) + 7) // 8


def _result_bytes(instruction) -> int:
    """The result's bytes, a custom call's scratch buffer (its result's last element, u8 or s8) left out."""
    parts = instruction.shape.tuple_shapes
    if instruction.opcode == "custom-call" and len(parts) > 1 and type_name(parts[-1]) in ("U8", "S8"):
        return sum(shape_bytes(part) for part in parts[:-1])
    return shape_bytes(instruction.shape)


def _backend_config(instruction) -> dict:
    try:
        config = json.loads(instruction.backend_config or b"{}")
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _result_part(instruction, index: int = 0):
    shape = instruction.shape
    return shape.tuple_shapes[index] if shape.tuple_shapes else shape


def dot_flops(lhs_shape, result_shape, lhs_contracting) -> float:
    """2 x the result's elements x the contracted size: 2*M*N*K (times the batch) for a dot or a gemm.

    Example:
        >>> dot_flops(lhs_4096x1024, result_4096x4096, [1])   # [4096, 1024] @ [1024, 4096]
        34359738368.0
    """
    contracted = math.prod(lhs_shape.dimensions[int(d)] for d in lhs_contracting)
    return 2.0 * elements(result_shape) * contracted


def convolution_flops(forward_output_shape, filter_shape, output_feature_dimension: int) -> float:
    """2 x the forward output's elements x the filter's elements per output feature (grouped convolutions too:
    the filter holds only its group's input features)."""
    features = filter_shape.dimensions[output_feature_dimension] if filter_shape.dimensions else 1
    return 2.0 * elements(forward_output_shape) * math.prod(filter_shape.dimensions) / max(features, 1)


class ModuleCosts:
    """The costs of the instructions of one HloModuleProto, each computed once.

    Example:
        >>> ModuleCosts(proto.hlo_module).cost(uint8_to_bfloat16).bytes   # 128 uint8 images read, bfloat16 written
        57802752
    """

    def __init__(self, module):
        self.instructions = {i.id: i for c in module.computations for i in c.instructions}
        self.computations = {c.id: c for c in module.computations}
        self._costs: dict[int, Cost] = {}

    def _operand(self, instruction, index: int):
        ids = instruction.operand_ids
        return self.instructions.get(ids[index]) if index < len(ids) else None

    def cost(self, instruction) -> Cost:
        """The Cost of one execution of `instruction` (see the module doc)."""
        if instruction.id not in self._costs:
            if instruction.opcode == "fusion" and instruction.called_computation_ids:
                read, written = self._fusion_bytes(instruction)
            else:
                read = sum(shape_bytes(self.instructions[i].shape) for i in dict.fromkeys(instruction.operand_ids)
                           if i in self.instructions)
                written = _result_bytes(instruction)
            self._costs[instruction.id] = Cost(read + written, *self._flops(instruction, set()))
        return self._costs[instruction.id]

    # -- bytes of a fusion ---------------------------------------------------------------------------------------
    def _fusion_bytes(self, fusion) -> tuple[int, int]:
        """(bytes read, bytes written) of a fusion: each operand once, slices and in-place updates as the module doc
        says."""
        computation = self.computations.get(fusion.called_computation_ids[0])
        if computation is None or not computation.instructions:
            return sum(shape_bytes(self.instructions[i].shape) for i in dict.fromkeys(fusion.operand_ids)
                       if i in self.instructions), _result_bytes(fusion)
        inner = {i.id: i for i in computation.instructions}
        users: dict[int, list] = {}
        for instruction in computation.instructions:
            for operand in dict.fromkeys(instruction.operand_ids):
                users.setdefault(operand, []).append(instruction)
        root = inner.get(computation.root_id) or computation.instructions[-1]
        outputs = [inner[i] for i in root.operand_ids if i in inner] if root.opcode == "tuple" else [root]
        written, updated_in_place = 0, set()
        for output in outputs:
            while output.opcode == "bitcast" and output.operand_ids and output.operand_ids[0] in inner:
                output = inner[output.operand_ids[0]]
            if output.opcode == "dynamic-update-slice" and len(output.operand_ids) > 1:
                written += shape_bytes(inner[output.operand_ids[1]].shape) if output.operand_ids[1] in inner else 0
                chain, target = [output], inner.get(output.operand_ids[0])
                while target is not None and target.opcode == "bitcast":
                    chain.append(target)
                    target = inner.get(target.operand_ids[0]) if target.operand_ids else None
                if target is not None and target.opcode == "parameter" \
                        and [u.id for u in users.get(target.id, [])] == [chain[-1].id]:
                    updated_in_place.add(target.parameter_number)
            else:
                written += shape_bytes(output.shape)
        parameters = {i.parameter_number: i for i in computation.instructions if i.opcode == "parameter"}
        read, seen = 0, set()
        for number, operand_id in enumerate(fusion.operand_ids):
            parameter = parameters.get(number)
            if operand_id in seen or parameter is None or number in updated_in_place:
                continue
            seen.add(operand_id)
            full = shape_bytes(parameter.shape)
            uses = users.get(parameter.id, [])
            if uses and all(u.opcode in _SLICING and u.operand_ids[0] == parameter.id for u in uses):
                read += min(full, sum(shape_bytes(u.shape) for u in uses))
            else:
                read += full
        return read, written

    # -- FLOPs ----------------------------------------------------------------------------------------------------
    def _flops(self, instruction, seen: set) -> tuple[float, float, float]:
        """(FLOPs, of which dots, convolutions and fused attention, of which on float32 or float64 operands) of one
        instruction, a fusion's fused code included."""
        opcode = instruction.opcode
        if opcode == "fusion":
            totals = [0.0, 0.0, 0.0]
            for computation_id in instruction.called_computation_ids:
                if computation_id in seen or computation_id not in self.computations:
                    continue
                seen.add(computation_id)
                for inner in self.computations[computation_id].instructions:
                    totals = [a + b for a, b in zip(totals, self._flops(inner, seen))]
            return totals[0], totals[1], totals[2]
        if opcode in ("dot", "convolution", "custom-call"):
            flops = self._dot_flops(instruction)
            lhs = self._operand(instruction, 0)
            wide = flops if lhs is not None and type_name(lhs.shape) in ("F32", "F64") else 0.0
            return flops, flops, wide
        if opcode in ("reduce", "reduce-window"):
            data = self._operand(instruction, 0)
            return (float(elements(data.shape)) if data is not None else 0.0), 0.0, 0.0
        if opcode == "scatter":
            updates = self._operand(instruction, len(instruction.operand_ids) - 1)
            return (float(elements(updates.shape)) if updates is not None else 0.0), 0.0, 0.0
        if opcode in _NO_FLOPS or opcode in ("while", "conditional", "call") \
                or opcode.startswith(("all-", "collective-", "reduce-scatter", "send", "recv", "async-")):
            return 0.0, 0.0, 0.0
        return float(elements(instruction.shape)), 0.0, 0.0

    def _dot_flops(self, instruction) -> float:
        """FLOPs of a dot, a convolution, or a library call (`_library_flops`)."""
        if instruction.opcode == "custom-call":
            return self._library_flops(instruction)
        lhs, rhs = self._operand(instruction, 0), self._operand(instruction, 1)
        if instruction.opcode == "dot":
            return dot_flops(lhs.shape, instruction.shape,
                             instruction.dot_dimension_numbers.lhs_contracting_dimensions) if lhs else 0.0
        return convolution_flops(instruction.shape, rhs.shape,
                                 instruction.convolution_dimension_numbers.kernel_output_feature_dimension) \
            if rhs else 0.0

    def _library_flops(self, call) -> float:
        """FLOPs of a cuBLAS gemm, a cuDNN convolution or cuDNN's fused attention (0 for other custom calls)."""
        target = call.custom_call_target
        if target.startswith("__cublas"):
            lhs = self._operand(call, 0)
            numbers = (_backend_config(call).get("gemm_backend_config") or {}).get("dot_dimension_numbers") or {}
            contracting = numbers.get("lhs_contracting_dimensions")
            if lhs is None or contracting is None:
                return 0.0
            return dot_flops(lhs.shape, _result_part(call), contracting)
        if target.startswith("__cudnn$conv"):
            if "BackwardInput" in target:
                output, kernel = self._operand(call, 0), self._operand(call, 1)
                output_shape, kernel_shape = (output.shape if output else None), (kernel.shape if kernel else None)
            elif "BackwardFilter" in target:
                output = self._operand(call, 1)
                output_shape, kernel_shape = (output.shape if output else None), _result_part(call)
            else:
                kernel = self._operand(call, 1)
                output_shape, kernel_shape = _result_part(call), (kernel.shape if kernel else None)
            if output_shape is None or kernel_shape is None:
                return 0.0
            return convolution_flops(output_shape, kernel_shape,
                                     call.convolution_dimension_numbers.kernel_output_feature_dimension)
        if target.startswith("__cudnn$fmha"):
            config = _backend_config(call).get("cudnn_fmha_backend_config") or {}
            scores = [int(d) for d in (config.get("intermediate_tensor_shape") or {}).get("dimensions", [])]
            query = self._operand(call, 0)
            if len(scores) != 4 or query is None:
                return 0.0
            batch, heads, seq_q, seq_kv = scores
            head_dim = elements(query.shape) / max(batch * heads * seq_q, 1)
            flops = 4.0 * batch * heads * seq_q * seq_kv * head_dim
            if "Backward" in target:
                flops *= 2.5
            if config.get("mask_type") in ("CAUSAL", "PADDING_CAUSAL"):
                flops *= 0.5
            return flops
        return 0.0

