"""Each kind of work against its bound (tf_nvlink.tools.doctor.hlo_cost and bounds): the bytes and FLOPs of HLO
instructions built with shapes, their counting per execution in a synthetic trace, the bounds and the verdict's kinds
furthest from them, the outputs, and the 1x H200 ResNet-50 fixture."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tf_nvlink.tools.doctor import bounds, hlo_cost, outputs
from tf_nvlink.tools.doctor.breakdown import replica_breakdown
from tf_nvlink.tools.doctor.diagnosis import diagnose_space, diagnose_trace
from tf_nvlink.tools.doctor.trace import gpu_activity
from tf_nvlink.tools.doctor.verdict import StepContext

FIXTURE = Path(__file__).parent / "fixtures" / "step_doctor_resnet50"
MS = 10**9  # picoseconds per ms
GIB = 2**30


class Hlo:
    """An HloProto of one module "step" built instruction by instruction, with shapes: `add` puts an instruction in
    the entry computation (or `computation`), `fusion` a fusion whose fused computation `body` fills."""

    def __init__(self):
        from tf_nvlink.internals import tf_runtime

        self.proto = tf_runtime.hlo_protobuf_module().HloProto()
        self.module = self.proto.hlo_module
        self.module.name, self.module.entry_computation_id = "step", 1
        self.entry = self.module.computations.add(name="main", id=1)
        self.next_id = 10
        self.schedule = []

    @staticmethod
    def set_shape(target, shape):
        """`shape`: ("BF16", [4096, 1024]), a list of those for a tuple, or a ShapeProto."""
        if hasattr(shape, "element_type"):
            target.CopyFrom(shape)
            return
        if isinstance(shape, list):
            target.element_type = target.DESCRIPTOR.fields_by_name["element_type"].enum_type.values_by_name[
                "TUPLE"].number
            for part in shape:
                Hlo.set_shape(target.tuple_shapes.add(), part)
            return
        dtype, dims = shape
        target.element_type = target.DESCRIPTOR.fields_by_name["element_type"].enum_type.values_by_name[dtype].number
        target.dimensions.extend(dims)

    def add(self, name, opcode, shape, operands=(), computation=None, op_name="", **fields):
        computation = computation or self.entry
        self.next_id += 1
        instruction = computation.instructions.add(name=name, opcode=opcode, id=self.next_id)
        self.set_shape(instruction.shape, shape)
        instruction.operand_ids.extend(operand.id for operand in operands)
        instruction.metadata.op_name = op_name
        for key, value in fields.items():
            if key == "backend_config":
                instruction.backend_config = json.dumps(value).encode()
            elif key == "lhs_contracting":
                instruction.dot_dimension_numbers.lhs_contracting_dimensions.extend(value)
            elif key == "kernel_output_feature":
                instruction.convolution_dimension_numbers.kernel_output_feature_dimension = value
            else:
                setattr(instruction, key, value)
        if computation is self.entry and opcode not in ("parameter", "constant"):
            self.schedule.append(instruction.id)
        return instruction

    def parameter(self, name, shape, number=0, computation=None):
        return self.add(name, "parameter", shape, computation=computation, parameter_number=number)

    def fusion(self, name, shape, operands, body, op_name=""):
        """`body(computation, parameters)` adds the fused instructions and returns the root."""
        self.next_id += 1
        computation = self.module.computations.add(name=f"fused_{name}", id=self.next_id)
        parameters = [self.parameter(f"p{i}.{name}", operand.shape, i, computation)
                      for i, operand in enumerate(operands)]
        root = body(computation, parameters)
        computation.root_id = root.id
        fusion = self.add(name, "fusion", shape, operands, op_name=op_name)
        fusion.called_computation_ids.append(computation.id)
        return fusion

    def done(self):
        self.module.schedule.sequences[1].instruction_ids.extend(self.schedule)
        return self.proto


def test_a_matmul_fusion_reads_its_operands_once_and_does_two_m_n_k_flops():
    hlo = Hlo()
    x = hlo.parameter("x", ("BF16", [4096, 1024]))
    w = hlo.parameter("w", ("BF16", [1024, 4096]), 1)

    def body(computation, params):
        return hlo.add("dot.1", "dot", ("BF16", [4096, 4096]), params, computation, lhs_contracting=[1])

    fusion = hlo.fusion("triton_gemm_dot.1", ("BF16", [4096, 4096]), [x, w], body)
    cost = hlo_cost.ModuleCosts(hlo.done().hlo_module).cost(fusion)
    assert cost.bytes == 2 * (4096 * 1024 * 2) + 4096 * 4096 * 2
    assert cost.flops == cost.dot_flops == 2 * 4096 * 4096 * 1024 and cost.float32_dot_flops == 0


def test_an_elementwise_fusion_counts_an_operand_passed_twice_once_and_a_flop_per_output_element_of_each_op():
    hlo = Hlo()
    x = hlo.parameter("x", ("F32", [1024, 1024]))

    def body(computation, params):
        added = hlo.add("add.1", "add", ("F32", [1024, 1024]), [params[0], params[1]], computation)
        cast = hlo.add("convert.1", "convert", ("BF16", [1024, 1024]), [added], computation)
        return hlo.add("multiply.1", "multiply", ("BF16", [1024, 1024]), [cast, cast], computation)

    fusion = hlo.fusion("loop_add_fusion.1", ("BF16", [1024, 1024]), [x, x], body)
    cost = hlo_cost.ModuleCosts(hlo.done().hlo_module).cost(fusion)
    assert cost.bytes == 1024 * 1024 * 4 + 1024 * 1024 * 2
    assert cost.flops == 2 * 1024 * 1024 and cost.dot_flops == 0  # add and multiply; the cast computes nothing


def test_a_reduction_counts_a_flop_per_input_element():
    hlo = Hlo()
    x = hlo.parameter("x", ("F32", [4096, 1024]))

    def body(computation, params):
        zero = hlo.add("zero", "constant", ("F32", []), (), computation)
        return hlo.add("reduce.1", "reduce", ("F32", [4096]), [params[0], zero], computation)

    fusion = hlo.fusion("input_reduce_fusion.1", ("F32", [4096]), [x], body)
    cost = hlo_cost.ModuleCosts(hlo.done().hlo_module).cost(fusion)
    assert cost.flops == 4096 * 1024 and cost.bytes == 4096 * 1024 * 4 + 4096 * 4


def test_a_fusion_that_slices_an_operand_reads_the_slice_and_one_updating_in_place_writes_the_update():
    """The compiled execution's loop: a step's batch sliced from the stacked batches, a step's result written into a
    buffer in place."""
    hlo = Hlo()
    stacked = hlo.parameter("stacked", ("F32", [8, 1024]))
    index = hlo.parameter("index", ("S32", []), 1)

    def take(computation, params):
        return hlo.add("dynamic-slice.1", "dynamic-slice", ("F32", [1, 1024]), [params[0], params[1], params[1]],
                       computation)

    taken = hlo.fusion("dynamic_slice_fusion.1", ("F32", [1, 1024]), [stacked, index], take)
    buffer = hlo.parameter("buffer", ("F32", [8, 1024]), 2)

    def put(computation, params):  # the buffer and the result seen through bitcasts, as XLA's layouts make them
        flat = hlo.add("bitcast.1", "bitcast", ("F32", [8, 1, 1024]), [params[0]], computation)
        update = hlo.add("bitcast.2", "bitcast", ("F32", [1, 1, 1024]), [params[1]], computation)
        updated = hlo.add("dynamic-update-slice.1", "dynamic-update-slice", ("F32", [8, 1, 1024]),
                          [flat, update, params[2], params[2], params[2]], computation)
        return hlo.add("bitcast.3", "bitcast", ("F32", [8, 1024]), [updated], computation)

    put_back = hlo.fusion("dynamic_update_slice_fusion.1", ("F32", [8, 1024]), [buffer, taken, index], put)
    costs = hlo_cost.ModuleCosts(hlo.done().hlo_module)
    assert costs.cost(taken).bytes == 1024 * 4 + 4 + 1024 * 4                  # the slice, the index, the result
    assert costs.cost(put_back).bytes == 1024 * 4 + 4 + 1024 * 4               # the update and index read, written


def test_a_cublas_gemm_leaves_its_workspace_out_and_takes_its_flops_from_the_backend_config():
    hlo = Hlo()
    lhs = hlo.parameter("lhs", ("F32", [128, 1000]))
    rhs = hlo.parameter("rhs", ("F32", [2048, 1000]), 1)
    config = {"gemm_backend_config": {"dot_dimension_numbers": {"lhs_contracting_dimensions": ["1"],
                                                                "rhs_contracting_dimensions": ["1"]}}}
    gemm = hlo.add("custom-call.1", "custom-call", [("F32", [128, 2048]), ("S8", [4352000])], [lhs, rhs],
                   custom_call_target="__cublas$gemm", backend_config=config)
    cost = hlo_cost.ModuleCosts(hlo.done().hlo_module).cost(gemm)
    assert cost.bytes == (128 * 1000 + 2048 * 1000 + 128 * 2048) * 4
    assert cost.flops == cost.dot_flops == cost.float32_dot_flops == 2 * 128 * 2048 * 1000


@pytest.mark.parametrize("target, operands, result", [
    # ResNet-50's conv5_block3_2 (3x3, 512 -> 512 features, 7x7, batch 128) as the fixture's trace holds it
    ("__cudnn$convBiasActivationForward", [("BF16", [128, 7, 7, 512]), ("BF16", [512, 3, 3, 512]), ("BF16", [512])],
     ("BF16", [128, 7, 7, 512])),
    ("__cudnn$convBackwardInput", [("BF16", [128, 7, 7, 512]), ("BF16", [512, 3, 3, 512])], ("BF16", [128, 7, 7, 512])),
    ("__cudnn$convBackwardFilter", [("BF16", [128, 7, 7, 512]), ("BF16", [128, 7, 7, 512])],
     ("BF16", [512, 3, 3, 512])),
])
def test_a_cudnn_convolution_does_the_forward_convolutions_flops_in_each_direction(target, operands, result):
    hlo = Hlo()
    inputs = [hlo.parameter(f"a{i}", shape, i) for i, shape in enumerate(operands)]
    call = hlo.add("cudnn-conv.1", "custom-call", [result, ("U8", [8389023])], inputs, custom_call_target=target,
                   kernel_output_feature=0)
    cost = hlo_cost.ModuleCosts(hlo.done().hlo_module).cost(call)
    assert cost.dot_flops == cost.flops == 2 * 128 * 7 * 7 * 512 * (3 * 3 * 512)
    moved = sum(2 * math.prod(dims) for _, dims in operands + [result])
    assert cost.bytes == moved  # the scratch buffer left out


@pytest.mark.parametrize("target, mask, factor", [("__cudnn$fmhaSoftmax", "CAUSAL", 0.5),
                                                  ("__cudnn$fmhaSoftmax", "NO_MASK", 1.0),
                                                  ("__cudnn$fmhaSoftmaxBackward", "CAUSAL", 1.25)])
def test_cudnn_fused_attention_counts_its_two_products_forward_and_five_backward(target, mask, factor):
    from tf_nvlink.plan import attention

    batch, tokens, heads, head_dim = 8, 512, 16, 64
    hlo = Hlo()
    query = hlo.parameter("q", ("BF16", [batch, tokens, heads, head_dim]))
    config = json.loads(attention.backend_config(batch, heads, tokens, tokens, "bfloat16", 0.125,
                                                 "causal" if mask == "CAUSAL" else "none", "Backward" in target))
    call = hlo.add("custom-call.2", "custom-call", [("BF16", [batch, tokens, heads, head_dim]), ("U8", [0])],
                   [query], custom_call_target=target, backend_config=config)
    cost = hlo_cost.ModuleCosts(hlo.done().hlo_module).cost(call)
    assert cost.dot_flops == pytest.approx(4 * batch * heads * tokens * tokens * head_dim * factor)


def test_the_transposes_of_fused_attention_results_count_as_attention_and_are_shown_apart():
    """cuDNN returns the fused attention's O as [B, N, T, H]; the transpose to the layers' [B, T, N, H] (XLA's
    `wrapped_transpose`, its op name outside the attention layer's scope, as the backward's are) counts as attention
    and its time is shown apart; a transpose of anything else, or one fused with arithmetic, stays elementwise."""
    from tf_nvlink.plan import attention

    heads_first, tokens_first = [8, 16, 512, 64], [8, 512, 16, 64]
    hlo = Hlo()
    q, k, v = (hlo.parameter(name, ("BF16", tokens_first), number) for number, name in enumerate("qkv"))
    fmha = hlo.add("XlaCustomCallV2.1", "custom-call", [("BF16", heads_first), ("F32", [8, 16, 512]), ("U8", [256])],
                   [q, k, v], custom_call_target="__cudnn$fmhaSoftmax", op_name="m/block0_attention_1/XlaCustomCallV2",
                   backend_config=json.loads(attention.backend_config(8, 16, 512, 512, "bfloat16", 0.125, "causal",
                                                                      False)))
    out = hlo.add("get-tuple-element.1", "get-tuple-element", ("BF16", heads_first), [fmha], tuple_index=0)

    def transpose(c, p):
        return hlo.add("transpose.1", "transpose", ("BF16", tokens_first), p, c)

    def transpose_add(c, p):
        moved = transpose(c, p)
        return hlo.add("add.2", "add", ("BF16", tokens_first), [moved, moved], c)

    hlo.fusion("wrapped_transpose.1", ("BF16", tokens_first), [out], transpose, op_name="transpose_1")
    hlo.fusion("wrapped_transpose.2", ("BF16", tokens_first), [hlo.parameter("x", ("BF16", heads_first), 3)],
               transpose, op_name="transpose_2")
    hlo.fusion("loop_add_fusion.3", ("BF16", tokens_first), [out], transpose_add, op_name="add_3")
    kernels = [("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16", 0.0, 1.0, "XlaCustomCallV2.1"),
               ("wrapped_transpose_1", 1.0, 0.25, "wrapped_transpose.1"),
               ("wrapped_transpose_2", 1.25, 0.25, "wrapped_transpose.2"),
               ("loop_add_fusion_3", 1.5, 0.5, "loop_add_fusion.3")]
    context = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4 << 20, gradient_tensors=2)
    report, why = diagnose_space(cost_space(kernels, hlo.done()), step_ms=2.0, steps=1, calls=1, context=context)
    assert why is None
    work, cost = report["mean"]["work_ms"], report["mean"]["work_cost"]
    assert (work["attention"], work["elementwise"]) == (1.25, 0.75)
    assert (cost["attention"]["attention_layout_ms"], cost["attention"]["attention_layout_ops"]) == (0.25, 1)
    assert cost["attention"]["executions"] == 2 and cost["elementwise"]["attention_layout_ms"] == 0
    tensor = math.prod(heads_first) * 2
    assert cost["attention"]["bytes"] == 3 * tensor + tensor + 8 * 16 * 512 * 4 + 2 * tensor  # the call, the transpose
    row = report["work_bounds"]["kinds"]["attention"]
    assert (row["attention_layout_ms"], row["attention_layout_ops"]) == (0.25, 1)
    assert "attention_layout_ms" not in report["work_bounds"]["kinds"]["elementwise"]
    assert ("  attention: 0.25 ms of it in 1 transposes of fused-attention results per step (cuDNN gives O, dQ, dK, "
            "dV as [B, N, T, H]; the layers read [B, T, N, H])") in outputs.render_table(report).splitlines()


# ---- a synthetic trace: instructions with shapes on the metadata plane, their kernels on a GPU stream --------------
def cost_space(kernels, hlo, device_name="NVIDIA H100 80GB HBM3", bandwidth=None):
    """An XSpace: the metadata plane holding `hlo`, GPU:0 with `kernels` on one stream: (name, start_ms, duration_ms,
    hlo_op or None for a command buffer's kernel)."""
    from tests.tools.test_doctor_work_kinds import xla_space

    space = xla_space(hlo, [k for k in kernels if not k[0].startswith("Memset")], device_name=device_name)
    plane = space.planes[1]
    line = plane.lines[0]
    for name, start_ms, duration_ms, _ in (k for k in kernels if k[0].startswith("Memset")):
        key = max(plane.event_metadata) + 1
        plane.event_metadata[key].id, plane.event_metadata[key].name = key, name
        line.events.add(metadata_id=key, offset_ps=int(start_ms * MS), duration_ps=int(duration_ms * MS))
    if bandwidth is not None:
        key = max(plane.stat_metadata) + 1
        plane.stat_metadata[key].id, plane.stat_metadata[key].name = key, "memory_bandwidth"
        plane.stats.add(metadata_id=key, uint64_value=int(bandwidth))
    return space


def layer_norm_step():
    """A LayerNorm fusion over 64 MiB of bfloat16 launched alone, a convolution whose padding kernel and main kernel
    (a memset between them) are one instruction, two projection gemms inside a command buffer (one split in K: a
    main kernel and its reduction), and an optimizer fusion."""
    hlo = Hlo()
    x = hlo.parameter("x", ("BF16", [32768, 1024]))
    w = hlo.parameter("w", ("BF16", [1024, 1024]), 1)
    ln = hlo.fusion("input_reduce_fusion.1", ("BF16", [32768, 1024]), [x],
                    lambda c, p: hlo.add("negate.1", "negate", ("BF16", [32768, 1024]), p, c),
                    op_name="model/block0_ln1_1/moments/mean")
    conv = hlo.add("cudnn-conv.1", "custom-call", [("BF16", [128, 7, 7, 512]), ("U8", [0])],
                   [hlo.parameter("i", ("BF16", [128, 7, 7, 512]), 2),
                    hlo.parameter("k", ("BF16", [512, 1, 1, 512]), 3)],
                   custom_call_target="__cudnn$convForward", op_name="model/conv_1/convolution")
    config = {"gemm_backend_config": {"dot_dimension_numbers": {"lhs_contracting_dimensions": ["1"]}}}
    gemms = [hlo.add(f"cublas-gemm.{i}", "custom-call", [("BF16", [32768, 1024]), ("S8", [1 << 20])], [ln, w],
                     custom_call_target="__cublas$gemm", backend_config=config,
                     op_name=f"model/block0_attention_1/{part}_1/einsum/Einsum")
             for i, part in ((1, "query"), (2, "key"))]
    update = hlo.fusion("loop_add_fusion.2", ("F32", [1024, 1024]), [hlo.parameter("v", ("F32", [1024, 1024]), 4)],
                        lambda c, p: hlo.add("add.9", "add", ("F32", [1024, 1024]), [p[0], p[0]], c),
                        op_name="adam_w/Add_3")
    del conv, gemms, update
    kernels = [("input_reduce_fusion_1", 0.0, 1.0, "input_reduce_fusion.1"),
               ("void nhwcAddPaddingKernel", 1.0, 0.1, "cudnn-conv.1"),
               ("Memset 3", 1.1, 0.01, None),
               ("sm90_xmma_fprop_implicit_gemm_bf16", 1.2, 0.3, "cudnn-conv.1"),
               ("nvjet_sm90_tst_64x128_splitK_TNN", 1.5, 0.5, None),
               ("cublasLt::splitKreduce_kernel", 2.0, 0.1, None),
               ("nvjet_sm90_tst_64x128_TNN", 2.1, 0.5, None),
               ("loop_add_fusion_2", 2.6, 0.4, None),
               ("mystery_kernel", 3.0, 0.2, None)]
    return hlo.done(), kernels


def test_each_instruction_is_counted_once_per_execution_whatever_kernels_it_launches():
    proto, kernels = layer_norm_step()
    (activity,) = gpu_activity(cost_space(kernels, proto)).values()
    cost = activity.work_cost
    ln_bytes = 2 * 32768 * 1024 * 2
    assert (cost["normalisation"].bytes, cost["normalisation"].executions) == (ln_bytes, 1)
    gemm_bytes = (32768 * 1024 + 1024 * 1024 + 32768 * 1024) * 2
    conv_bytes = (2 * 128 * 7 * 7 * 512 + 512 * 512) * 2
    assert cost["matmul"].executions == 3  # the convolution once, each gemm once
    assert cost["matmul"].bytes == conv_bytes + 2 * gemm_bytes
    assert cost["matmul"].dot_flops == pytest.approx(2 * 128 * 7 * 7 * 512 * 512 + 2 * 2 * 32768 * 1024 * 1024)
    assert (cost["optimizer"].bytes, cost["optimizer"].flops) == (2 * 1024 * 1024 * 4, 1024 * 1024)
    assert cost["other"].unattributed_ps == int(0.2 * MS) and cost["other"].executions == 0


def test_the_bounds_of_a_step_and_the_kinds_furthest_from_them():
    proto, kernels = layer_norm_step()
    context = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4 << 20, gradient_tensors=2)
    report, why = diagnose_space(cost_space(kernels, proto), step_ms=4.0, steps=1, calls=1, context=context)
    assert why is None
    found = report["work_bounds"]
    assert (found["memory"]["tb_per_s"], found["peak"]["tflops"]) == (3.35, 989.4)
    ln = found["kinds"]["normalisation"]
    assert ln["memory_ms"] == pytest.approx(2 * 32768 * 1024 * 2 / 3.35e12 * 1e3, abs=1e-4)
    assert ln["bound_by"] == "memory" and ln["x_bound"] == pytest.approx(1.0 / ln["bound_ms"], rel=1e-3)
    assert found["kinds"]["other"]["bound_ms"] is None
    assert found["kinds"]["other"]["why"] == "0.20 ms of its kernels have no HLO instruction in the trace"
    far = report["verdict"]["far_from_bound"]  # the gemms' 1.5 ms, then the LayerNorm's 1.0 and the update's 0.4
    assert [entry["kind"] for entry in far] == ["matmul", "normalisation", "optimizer"]
    assert far[0]["could"] is None and "xla_gpu_enable_cudnn_layer_norm" in far[1]["could"]
    table = outputs.render_table(report)
    assert "kinds of work against their bound (ms per step; H100 SXM: memory 3.35 TB/s, bf16 dense 989.4 TFLOP/s)" \
        in table
    assert "  other: no bound: 0.20 ms of its kernels have no HLO instruction in the trace" in table.splitlines()
    assert any(line.startswith("    normalisation: 1.00 ms, ") and "could: a fused LayerNorm" in line
               for line in table.splitlines())
    json.dumps(report)


def test_a_gpu_outside_the_tables_takes_the_traces_bandwidth_and_bounds_only_the_kinds_without_dot_work():
    proto, kernels = layer_norm_step()
    (activity,) = gpu_activity(cost_space(kernels, proto, device_name="NVIDIA GeForce RTX 4090",
                                          bandwidth=1.008e12)).values()
    assert activity.memory_bandwidth == 1.008e12
    b = replica_breakdown(activity, step_ms=4.0, steps=1, calls=1)
    found = bounds.kind_bounds(b.work_ms, b.work_cost, activity.device_name, activity.memory_bandwidth)
    assert found["memory"] == {"tb_per_s": 1.008, "label": "NVIDIA GeForce RTX 4090",
                               "source": bounds.TRACE_BANDWIDTH_SOURCE} and found["peak"] is None
    assert found["kinds"]["normalisation"]["bound_ms"] == pytest.approx(2 * 32768 * 1024 * 2 / 1.008e12 * 1e3)
    assert found["kinds"]["matmul"]["bound_ms"] is None and "no bf16 peak" in found["kinds"]["matmul"]["why"]
    bare = bounds.kind_bounds(b.work_ms, b.work_cost, "NVIDIA GeForce RTX 4090")
    assert bare["memory"] is None and all(row["bound_ms"] is None and "no memory bandwidth" in row["why"]
                                          for row in bare["kinds"].values())


def row(kind, ms, bound_ms, **cost):
    return kind, {"ms": ms, "bound_ms": bound_ms, "bound_by": "memory", "x_bound": ms / bound_ms,
                  "above_bound_ms": ms - bound_ms, "gb": 1.0, "tflop": 0.0, "hlo_ops": 10.0}, cost


def test_far_from_bound_names_at_most_three_kinds_at_least_one_and_a_half_times_their_bound_most_time_first():
    """The 368M Transformer's fused step on 1x H100 (its 2026-12-07 profile; bounds as estimated)."""
    rows = [row("matmul", 12.37, 8.3, dot_flops=8.2e12), row("normalisation", 6.14, 0.7),
            row("optimizer", 5.24, 3.4), row("elementwise", 5.18, 1.8),
            row("attention", 2.22, 1.0, fused_attention_ms=2.2), row("loss", 0.3, 0.05)]
    found = {"kinds": {kind: r for kind, r, _ in rows}}
    costs = {kind: cost for kind, _, cost in rows}
    far = bounds.far_from_bound(found, costs, step_ms=33.7, replicas=1)
    assert [e["kind"] for e in far] == ["normalisation", "elementwise", "optimizer"]  # matmul 1.49x: near its bound
    assert "optimizer_states" not in far[2]["could"]
    two = bounds.far_from_bound(found, costs, step_ms=33.7, replicas=2)
    assert 'optimizer_states="sharded"' in two[2]["could"]
    assert bounds.far_from_bound(found, costs, step_ms=400.0) == []  # under 2% of the step above the bound
    assert bounds.far_from_bound(None, {}, step_ms=33.7) == []


@pytest.mark.parametrize("kind, cost, expected", [
    ("attention", {"fused_attention_ms": 0.0}, 'tf_nvlink.strategy(fused_attention="auto")'),
    ("attention", {"fused_attention_ms": 5.0}, None),                 # cuDNN's flash attention already runs
    ("matmul", {"dot_flops": 1e12, "float32_dot_flops": 0.9e12}, "mixed_bfloat16"),
    ("matmul", {"dot_flops": 1e12, "float32_dot_flops": 0.0}, None),
    ("elementwise", {}, "--xla_gpu_enable_cublaslt=true"),
    ("normalisation", {}, "--xla_gpu_enable_cudnn_layer_norm=true"),
    ("loss", {}, None),
    ("other", {}, None),
])
def test_what_could_be_done_about_each_kind(kind, cost, expected):
    could = bounds.what_could_be_done(kind, {"ms": 6.0}, cost, replicas=1)
    assert could is None if expected is None else expected in could


def test_tensorboard_gets_each_kinds_bound_and_ratio(tf, tmp_path):
    proto, kernels = layer_norm_step()
    context = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4 << 20, gradient_tensors=2)
    report, _ = diagnose_space(cost_space(kernels, proto), step_ms=4.0, steps=1, calls=1, context=context)
    directory = outputs.write_tensorboard(report, str(tmp_path), step=0)
    tags = {}
    for path in Path(directory).glob("events.out.tfevents.*"):
        for record in tf.compat.v1.train.summary_iterator(str(path)):
            for value in record.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    tags[value.tag] = float(tf.make_ndarray(value.tensor))
    ln = report["work_bounds"]["kinds"]["normalisation"]
    assert tags["step_doctor/work_normalisation_bound_ms"] == pytest.approx(ln["bound_ms"], abs=1e-4)
    assert tags["step_doctor/work_normalisation_x_bound"] == pytest.approx(ln["x_bound"], rel=1e-4)
    assert "step_doctor/work_other_bound_ms" not in tags  # no bound: no scalar


@pytest.mark.skipif(not (FIXTURE / "observation.json").exists(), reason=f"no GPU trace fixture at {FIXTURE}")
def test_the_resnet50_fixture_against_its_bounds():
    """1x H200, ResNet-50 v1 at 128 images, SGD: the convolutions' FLOPs are 3 x 3.87 GMAC x 2 x 128 less the first
    convolution's unneeded input gradient (2.93 TFLOP); every kernel has its instruction; the convolutions move more
    bytes at 4.8 TB/s than their FLOPs take at 989.4 TFLOP/s."""
    observation = json.loads((FIXTURE / "observation.json").read_text())
    context = StepContext(**{k: v for k, v in observation["context"].items() if k != "link"})
    report, why = diagnose_trace(str(FIXTURE / "profile"), observation["step_ms"], observation["steps"],
                                 observation["calls"], context)
    assert why is None
    kinds = report["work_bounds"]["kinds"]
    assert list(kinds) == ["matmul", "normalisation", "elementwise", "optimizer", "loss"]
    assert all(r["ms_without_instruction"] == 0 and r["bound_ms"] > 0 for r in kinds.values())
    matmul = kinds["matmul"]
    assert matmul["tflop"] == pytest.approx(2.933, abs=0.001) and matmul["gb"] == pytest.approx(16.91, abs=0.01)
    assert matmul["compute_ms"] == pytest.approx(2.933 / 989.4 * 1e3, abs=0.01) and matmul["bound_by"] == "memory"
    assert matmul["hlo_ops"] == 161  # 158 cuDNN convolutions (53 forward, 52 input and 53 filter gradients), 3 gemms
    assert kinds["normalisation"]["gb"] == pytest.approx(31.41, abs=0.01)
    assert kinds["normalisation"]["x_bound"] == pytest.approx(1.48, abs=0.01)
    far = report["verdict"]["far_from_bound"]
    assert [(e["kind"], round(e["above_bound_ms"], 2)) for e in far] == [("matmul", 4.82), ("elementwise", 0.87)]
    assert far[0]["could"] is None and "epilogue" in far[1]["could"]
    lines = outputs.render_table(report).splitlines()
    assert "  matmul         8.35  16.909  2.933    161.0      3.52  memory       2.37   4.82" in lines
