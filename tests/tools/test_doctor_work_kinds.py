"""The step doctor's kinds of work (tf_nvlink.tools.doctor.work_kinds): each rule on kernel names and name scopes as
XLA GPU traces carry them, the HLO of a synthetic trace (fusions by kernel name, library kernels inside a command
buffer by their place in the schedule), the breakdown and outputs with the MFU, and the 1x H200 ResNet-50 fixture."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tf_nvlink.tools.doctor import outputs, work_kinds
from tf_nvlink.tools.doctor.breakdown import replica_breakdown
from tf_nvlink.tools.doctor.diagnosis import diagnose_space, diagnose_trace
from tf_nvlink.tools.doctor.trace import gpu_activity, load_space
from tf_nvlink.tools.doctor.verdict import StepContext
from tf_nvlink.tools.doctor.work_kinds import HloOp, kind_of

FIXTURE = Path(__file__).parent / "fixtures" / "step_doctor_resnet50"
MS = 10**9  # picoseconds per ms
BLOCK = "transformer_host_fed_1/transformer_lm_1/block3"


@pytest.mark.parametrize("kernel, op_name, expected", [
    # library kernels by name
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", None, "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7_64x128x64", None, "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>", None, "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80", None, "attention"),
    ("void hmma_bf16_kernel_tn", None, "matmul"),  # "hmma" holds no attention mark
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", None, "matmul"),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", None, "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", None, "matmul"),
    ("triton_gemm_dot_12", None, "matmul"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, "collective"),
    ("MemcpyH2D", None, "copy"),
    ("Memset 3", None, "copy"),
    ("loop_add_fusion_3", None, "elementwise"),          # an XLA kernel with no scope known
    ("void at::native::vectorized_elementwise_kernel<4>", None, "other"),
    # XLA kernels by the name scope of their TensorFlow ops
    ("input_reduce_fusion_12", f"{BLOCK}_ln1_1/moments/mean", "normalisation"),
    ("loop_multiply_fusion_4", f"gradient_tape/{BLOCK}_ln2_1/batchnorm/mul", "normalisation"),
    ("input_reduce_fusion_7", "resnet50_1/conv3_block1_1_bn_1/moments/mean", "normalisation"),
    ("loop_fusion_2", "model/layer_normalization_3/Rsqrt", "normalisation"),
    ("loop_divide_fusion_4", f"{BLOCK}_attention_1/softmax_1/Softmax", "attention"),
    ("loop_select_fusion", f"gradient_tape/{BLOCK}_attention_1/SelectV2", "attention"),
    ("loop_add_fusion_9", f"{BLOCK}_attention_1/query_1/add", "elementwise"),  # the projection's bias
    ("loop_gelu_fusion", f"{BLOCK}_ffn_in_1/Gelu", "elementwise"),
    ("loop_add_fusion_11", "adam_w/Add_5", "optimizer"),
    ("input_transpose_fusion_2", "sgd/update_3_1/AssignAddVariableOp", "optimizer"),
    ("input_reduce_fusion_3", "compile_loss/sparse_categorical_crossentropy/SparseSoftmaxCrossEntropyWithLogits",
     "loss"),
    ("loop_fusion_8", "gradient_tape/compile_loss/sparse_categorical_crossentropy/div_no_nan", "loss"),
    # library gemms with a scope (launched on their own: the `name` stat)
    ("nvjet_sm90_tst_128x64_64x8_2x1_v_bz_TNN", f"{BLOCK}_attention_1/einsum/Einsum", "attention"),
    ("nvjet_sm90_tst_128x64_64x8_2x1_v_bz_TNN", f"{BLOCK}_attention_1/attention_output_1/einsum/Einsum", "matmul"),
    ("nvjet_sm90_tst_128x64_64x8_2x1_v_bz_TNN", f"gradient_tape/{BLOCK}_attention_1/key_1/einsum/Einsum", "matmul"),
])
def test_each_rule_on_names_as_traces_carry_them(kernel, op_name, expected):
    trace_kind = {"MemcpyH2D": "h2d", "Memset 3": "d2d"}.get(kernel, "collective" if "nccl" in kernel else "compute")
    assert kind_of(kernel, None, op_name, trace_kind) == expected


def test_an_instructions_op_names_and_target_decide_where_its_kernel_name_cannot():
    conv = HloOp("cudnn-conv-bias-activation.198", "custom-call", "__cudnn$convBiasActivationForward",
                 ("resnet50_1/conv1_conv_1/convolution",), True)
    assert kind_of("void nhwcAddPaddingKernel<__nv_bfloat16>", conv) == "matmul"  # cuDNN's helper kernel of a conv
    fmha = HloOp("custom-call.3", "custom-call", "__cudnn$fmhaSoftmax", (f"{BLOCK}_attention_1/fmha",), False)
    assert kind_of("some_cudnn_runtime_kernel", fmha) == "attention"
    retvals = HloOp("input_convert_transpose_fusion.1", "fusion", "",
                    ("resnet50_1/conv2_conv_1/convolution/Cast", "sgd/update_4_1/Mul"), False)
    assert kind_of("input_convert_transpose_fusion_1", retvals) == "optimizer"  # any op of an update: the update
    assert kind_of("wrapped_convert_3", HloOp("wrapped_convert.3", "fusion", "", (), False)) == "elementwise"


def test_scope_parts_drop_the_suffixes_tensorflow_adds():
    assert work_kinds.scope_parts("a_1/block0_ln1_1/moments_2/mean") == ["a", "block0_ln1", "moments", "mean"]
    assert work_kinds.kernel_name_of("cudnn-conv.149") == "cudnn_conv_149"


# ---- a synthetic XLA trace: the HLO on the metadata plane, kernels on a GPU stream --------------------------------
def hlo_proto(instructions, schedule):
    """An HloProto of one module "step": `instructions` are (name, opcode, op_name, target, fused op names) in the
    entry computation (id 1), each fusion's fused computation holding one instruction per fused op name (an "add",
    or (opcode, op name)); `schedule` the entry's instruction names in order."""
    from tf_nvlink.internals import tf_runtime

    proto = tf_runtime.hlo_protobuf_module().HloProto()
    module = proto.hlo_module
    module.name, module.entry_computation_id = "step", 1
    entry = module.computations.add(name="main", id=1)
    ids, next_id = {}, 100
    for name, opcode, op_name, target, fused in instructions:
        instruction = entry.instructions.add(name=name, opcode=opcode, id=len(ids) + 10, custom_call_target=target)
        instruction.metadata.op_name = op_name
        ids[name] = instruction.id
        if opcode == "fusion":
            next_id += 1
            computation = module.computations.add(name=f"fused_{name}", id=next_id)
            for index, fused_name in enumerate(fused):
                fused_opcode, fused_name = fused_name if isinstance(fused_name, tuple) else ("add", fused_name)
                inner = computation.instructions.add(name=f"f{next_id}.{index}", opcode=fused_opcode,
                                                     id=next_id * 100 + index)
                inner.metadata.op_name = fused_name
            instruction.called_computation_ids.append(next_id)
    module.schedule.sequences[1].instruction_ids.extend(ids[name] for name in schedule)
    return proto


def xla_space(proto, kernels, device_name="NVIDIA H100 80GB HBM3", program_id=7):
    """An XSpace: the metadata plane with `proto`, and GPU:0 with `kernels` on one stream: (kernel name, start_ms,
    duration_ms, hlo_op or None[, graph node id]); every kernel carries the program id and module name, as XLA's do,
    and one with a graph node id the stats of a kernel inside CUDA graph 5 (`cuda_graph_id`, `cuda_graph_node_id`)."""
    from tf_nvlink.internals import tf_runtime

    pb = tf_runtime.xplane_protobuf_module()
    space = pb.XSpace()
    metadata = space.planes.add(name="/host:metadata")
    metadata.stat_metadata[1].id, metadata.stat_metadata[1].name = 1, "Hlo Proto"
    metadata.event_metadata[program_id].id = program_id
    metadata.event_metadata[program_id].stats.add(metadata_id=1, bytes_value=proto.SerializeToString())
    plane = space.planes.add(name="/device:GPU:0")
    for key, name in enumerate(("hlo_op", "program_id", "hlo_module", "gpu_device_name", "cuda_graph_id",
                                "cuda_graph_node_id"), start=1):
        plane.stat_metadata[key].id, plane.stat_metadata[key].name = key, name
    plane.stats.add(metadata_id=4, str_value=device_name)
    line = plane.lines.add(name="Stream #13(Compute)", timestamp_ns=1_000_000)
    names = {}
    for name, start_ms, duration_ms, hlo_op, *graph_node in kernels:
        if name not in names:
            names[name] = len(names) + 1
            plane.event_metadata[names[name]].id, plane.event_metadata[names[name]].name = names[name], name
        event = line.events.add(metadata_id=names[name], offset_ps=int(start_ms * MS),
                                duration_ps=int(duration_ms * MS))
        event.stats.add(metadata_id=1, str_value=hlo_op or "command_buffer")
        event.stats.add(metadata_id=2, int64_value=program_id)
        event.stats.add(metadata_id=3, str_value="step")
        if graph_node:
            event.stats.add(metadata_id=5, uint64_value=5)
            event.stats.add(metadata_id=6, uint64_value=graph_node[0])
    return space


ATTENTION_HLO = [
    ("input_reduce_fusion.1", "fusion", f"{BLOCK}_ln1_1/moments/mean", "", [f"{BLOCK}_ln1_1/moments/mean"]),
    ("cublas-gemm.1", "custom-call", f"{BLOCK}_attention_1/query_1/einsum/Einsum", "__cublas$gemm", []),
    ("cublas-gemm.2", "custom-call", f"{BLOCK}_attention_1/key_1/einsum/Einsum", "__cublas$gemm", []),
    ("loop_multiply_fusion.2", "fusion", "XLA_Retvals", "", [f"{BLOCK}_attention_1/Mul"]),
    ("cublas-gemm.3", "custom-call", f"{BLOCK}_attention_1/einsum/Einsum", "__cublas$gemm", []),
    ("loop_divide_fusion.3", "fusion", f"{BLOCK}_attention_1/softmax_1/Softmax", "", []),
    ("cublas-gemm.4", "custom-call", f"{BLOCK}_attention_1/einsum_1/Einsum", "__cublas$gemm", []),
    ("cublas-gemm.5", "custom-call", f"{BLOCK}_attention_1/attention_output_1/einsum/Einsum", "__cublas$gemm", []),
    ("loop_add_fusion.4", "fusion", "", "", ["adam_w/Add_3", "adam_w/Sqrt_3"]),
]
# (kernel, start, duration, hlo_op): the LayerNorm launched alone, the rest inside a command buffer; the query gemm
# splits K (a main kernel and its reduction kernel), the key gemm is one kernel.
ATTENTION_KERNELS = [
    ("input_reduce_fusion_1", 0.0, 1.0, "input_reduce_fusion.1"),
    ("nvjet_sm90_tst_64x128_splitK_TNN", 1.0, 2.0, None),
    ("cublasLt::splitKreduce_kernel", 3.0, 0.5, None),
    ("nvjet_sm90_tst_64x128_TNN", 3.5, 2.0, None),
    ("loop_multiply_fusion_2", 5.5, 0.5, None),
    ("nvjet_sm90_tst_128x128_NTN", 6.0, 3.0, None),
    ("loop_divide_fusion_3", 9.0, 1.0, None),
    ("nvjet_sm90_tst_128x64_TNN", 10.0, 3.0, None),
    ("nvjet_sm90_tst_64x64_TNN", 13.0, 2.0, None),
    ("loop_add_fusion_4", 15.0, 1.0, None),
]


def test_library_kernels_in_a_command_buffer_take_the_calls_the_schedule_runs_after_the_kernel_before_them():
    """Each gemm between two fusions is read from the schedule: the projections count as matmul, the scores and the
    weighted sum as attention (the 2nd and 3rd kernels after the query's splitK pair count by their place)."""
    space = xla_space(hlo_proto(ATTENTION_HLO, [name for name, *_ in ATTENTION_HLO]), ATTENTION_KERNELS)
    index = work_kinds.HloIndex.from_space(space)
    assert index.module(7, None) is index.module(None, "step")
    events = [work_kinds.KernelEvent(name, "compute", hlo_op, None, 7, "step")
              for name, _, _, hlo_op in ATTENTION_KERNELS]
    assert work_kinds.classify_stream(index, events) == [
        "normalisation", "matmul", "matmul", "matmul", "attention", "attention", "attention", "attention", "matmul",
        "optimizer"]
    (activity,) = gpu_activity(space).values()
    assert activity.device_name == "NVIDIA H100 80GB HBM3"
    b = replica_breakdown(activity, step_ms=20.0, steps=1, calls=1)
    assert b.work_ms["matmul"] == pytest.approx(2.0 + 0.5 + 2.0 + 2.0)
    assert b.work_ms["attention"] == pytest.approx(0.5 + 3.0 + 1.0 + 3.0)
    assert (b.work_ms["normalisation"], b.work_ms["optimizer"], b.work_ms["other"]) == (1.0, 1.0, 0.0)
    assert sum(b.work_ms.values()) == pytest.approx(b.compute_ms) == pytest.approx(16.0)


def test_a_fusions_constants_do_not_lend_it_their_op_names():
    """XLA's common-subexpression pass keeps one op name for equal constants across the program: in the 368M
    Transformer's trace (1x H100) the 1 inside block 0's GELU fusion carries `adam_w/update_0_390/sub_1` and another
    constant a LayerNorm's `moments/mean`; the fusion is the GELU's, elementwise, not the optimizer's."""
    gelu = [("loop_convert_multiply_fusion.23", "fusion", f"{BLOCK}_ffn_in_1/Gelu/mul_2", "",
             [f"{BLOCK}_ffn_in_1/Gelu/Erfc", ("constant", "adam_w/update_0_390/sub_1"),
              ("constant", f"{BLOCK}_ln1_1/moments/mean"), ("multiply", f"{BLOCK}_ffn_in_1/Gelu/mul")])]
    op = work_kinds.hlo_module(hlo_proto(gelu, [gelu[0][0]])).ops["loop_convert_multiply_fusion.23"]
    assert op.op_names == (f"{BLOCK}_ffn_in_1/Gelu/mul_2", f"{BLOCK}_ffn_in_1/Gelu/Erfc",
                           f"{BLOCK}_ffn_in_1/Gelu/mul")
    assert kind_of("loop_convert_multiply_fusion_23", op) == "elementwise"


def test_without_the_hlo_the_command_buffers_gemms_count_as_matmul_and_fusions_as_elementwise():
    events = [work_kinds.KernelEvent(name, "compute", hlo_op, None, 7, "step")
              for name, _, _, hlo_op in ATTENTION_KERNELS]
    assert work_kinds.classify_stream(work_kinds.HloIndex(), events) == [
        "elementwise", "matmul", "matmul", "matmul", "elementwise", "matmul", "elementwise", "matmul", "matmul",
        "elementwise"]


# A layer as the 368M Transformer's compiled step holds it (1x H100): the schedule runs a query gemm, cuDNN's fused
# attention, a GELU, the attention's backward and an FFN gemm's weight gradient; inside the CUDA graph, the FFN gemm
# (independent of the rest) runs first and the backward launches three kernels, cuDNN's dO.O before its main kernel
# and its dQ conversion after it. The graph's node ids keep the schedule's order: XLA's kernels first, then the
# library calls' kernels as they were traced into the graph.
GRAPH_HLO = [
    ("loop_add_fusion.1", "fusion", f"{BLOCK}_ln1_1/add", "", []),
    ("cublas-gemm.1", "custom-call", f"{BLOCK}_attention_1/query_1/einsum/Einsum", "__cublas$gemm", []),
    ("XlaCustomCallV2.1", "custom-call", f"{BLOCK}_attention_1/XlaCustomCallV2", "__cudnn$fmhaSoftmax", []),
    ("loop_multiply_fusion.2", "fusion", f"{BLOCK}_ffn_in_1/Gelu/mul", "", []),
    ("XlaCustomCallV2.2", "custom-call", "XlaCustomCallV2_1", "__cudnn$fmhaSoftmaxBackward", []),
    ("cublas-gemm.2", "custom-call", f"gradient_tape/{BLOCK}_ffn_in_1/MatMul/MatMul_1", "__cublas$gemm", []),
]
GRAPH_KERNELS = [  # (kernel, start, duration, hlo_op, graph node id), in the order they ran
    ("loop_add_fusion_1", 0.0, 1.0, None, 100),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT", 1.0, 2.0, None, 207),
    ("cublasLt::splitKreduce_kernel", 3.0, 0.5, None, 208),
    ("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", 3.5, 1.5, None, 201),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_32", 5.0, 1.0, None, 202),
    ("loop_multiply_fusion_2", 6.0, 1.0, None, 103),
    ("void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*, void*)", 7.0, 0.5,
     None, 204),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64", 7.5, 2.0, None, 205),
    ("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)", 9.5, 0.5, None, 206),
]


def test_library_kernels_in_a_cuda_graph_take_their_calls_from_the_graphs_node_order():
    """Each library kernel gets the call of its place in node order, whatever order the graph ran them in: the FFN
    gemm's two kernels its weight gradient (matmul), the query gemm the projection (matmul), the three kernels of
    the backward one fMHA call (attention, counted once)."""
    space = xla_space(hlo_proto(GRAPH_HLO, [name for name, *_ in GRAPH_HLO]), GRAPH_KERNELS)
    index = work_kinds.HloIndex.from_space(space)
    events = [work_kinds.KernelEvent(name, "compute", None, None, 7, "step", 5, node)
              for name, _, _, _, node in GRAPH_KERNELS]
    assert [op.name if op else None for _, op in work_kinds.resolve_stream(index, events)] == [
        "loop_add_fusion.1", "cublas-gemm.2", "cublas-gemm.2", "cublas-gemm.1", "XlaCustomCallV2.1",
        "loop_multiply_fusion.2", "XlaCustomCallV2.2", "XlaCustomCallV2.2", "XlaCustomCallV2.2"]
    (activity,) = gpu_activity(space).values()
    b = replica_breakdown(activity, step_ms=10.0, steps=1, calls=1)
    assert b.work_ms["matmul"] == pytest.approx(2.0 + 0.5 + 1.5)
    assert b.work_ms["attention"] == pytest.approx(1.0 + 0.5 + 2.0 + 0.5)
    assert b.work_cost["attention"]["executions"] == b.work_cost["matmul"]["executions"] == 2
    assert b.work_cost["matmul"]["ms_without_instruction"] == b.work_cost["attention"]["ms_without_instruction"] == 0
    # by time alone (no node ids), the FFN gemm's kernels would take the query gemm's and the fMHA's calls
    timed = [dataclasses.replace(event, graph_node=None) for event in events]
    assert [op.name if op else None for _, op in work_kinds.resolve_stream(index, timed)][1:4] == [
        "cublas-gemm.1", "cublas-gemm.1", "XlaCustomCallV2.1"]


def test_a_graph_whose_library_kernels_do_not_fit_its_calls_keeps_the_rule_of_their_place_in_time():
    """One kernel of the six calls missing from the trace (a count that disagrees), or a gemm kernel where the
    schedule has cuDNN's fused attention: no placement by node order."""
    index = work_kinds.HloIndex.from_space(xla_space(hlo_proto(GRAPH_HLO, [n for n, *_ in GRAPH_HLO]), []))
    events = [work_kinds.KernelEvent(name, "compute", None, None, 7, "step", 5, node)
              for name, _, _, _, node in GRAPH_KERNELS]
    assert len(work_kinds.place_graph_calls(index, events)) == 7  # every library kernel
    assert work_kinds.place_graph_calls(index, events[:4] + events[5:]) == {}   # the forward fMHA's kernel missing
    swapped = [dataclasses.replace(e, graph_node={201: 202, 202: 201}.get(e.graph_node, e.graph_node)) for e in events]
    assert work_kinds.place_graph_calls(index, swapped) == {}   # a gemm kernel in the fMHA call's place


def test_cudnns_helper_kernels_are_library_kernels_not_xla_fusions():
    """`void cudnn::fusion::...` holds "fusion" but is no XLA kernel: it joins its cuDNN call, the backward's
    dO.O the call after it even behind another cuDNN call, its dQ conversion the call before it."""
    in_node_order = [name for name, *_, node in sorted(GRAPH_KERNELS, key=lambda k: k[-1]) if node > 200]
    assert work_kinds.group_library_kernels(in_node_order) == [[0], [1], [2, 3, 4], [5, 6]]
    assert kind_of("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*, unsigned int)", None) == \
        "matmul"  # placed nowhere, the name alone: a cuDNN kernel
    assert kind_of("loop_add_fusion_1", None) == "elementwise"


def test_calls_of_one_kind_give_that_kind_whatever_the_count():
    """Two projection gemms scheduled after a fusion and three kernels in the trace: all matmul."""
    hlo = [("loop_add_fusion.1", "fusion", "m/x/add", "", []),
           ("cublas-gemm.1", "custom-call", f"{BLOCK}_ffn_in_1/Tensordot/MatMul", "__cublas$gemm", []),
           ("cublas-gemm.2", "custom-call", f"{BLOCK}_ffn_out_1/Tensordot/MatMul", "__cublas$gemm", [])]
    kernels = [("loop_add_fusion_1", 0, 1, None), ("nvjet_a", 1, 1, None), ("nvjet_b", 2, 1, None),
               ("nvjet_c", 3, 1, None)]
    space = xla_space(hlo_proto(hlo, [n for n, *_ in hlo]), kernels)
    (activity,) = gpu_activity(space).values()
    assert replica_breakdown(activity, step_ms=4.0, steps=1, calls=1).work_ms["matmul"] == pytest.approx(3.0)


def test_the_report_gives_the_mfu_against_the_gpu_the_trace_names_and_the_outputs_show_the_kinds(tmp_path):
    space = xla_space(hlo_proto(ATTENTION_HLO, [name for name, *_ in ATTENTION_HLO]), ATTENTION_KERNELS)
    context = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4 << 20, gradient_tensors=10)
    report, why = diagnose_space(space, step_ms=20.0, steps=1, calls=1, context=context,
                                 model_flops_per_step=4.0e12)
    assert why is None
    mfu = report["mfu"]
    assert (mfu["gpu"], mfu["peak_label"], mfu["tflops_per_gpu"]) == ("NVIDIA H100 80GB HBM3", "H100 SXM", 200.0)
    assert mfu["mfu"] == pytest.approx(200 / 989.4, abs=1e-4)
    assert mfu["mfu_of_kernel_time"] == pytest.approx(4.0e12 / 0.016 / 989.4e12, abs=1e-4)  # 16 ms of kernels
    assert report["mean"]["work_ms"]["attention"] == pytest.approx(7.5)
    table = outputs.render_table(report)
    assert "by kind of work" in table and "  attention                   7.50" in table.splitlines()
    assert "MFU 20.2% of the H100 SXM's 989.4 TFLOP/s (bf16 dense); on the kernels' time alone 25.3%" in table
    json.loads(open(outputs.write_json(report, str(tmp_path / "r.json"))).read())  # the kinds and MFU as JSON
    unknown, _ = diagnose_space(xla_space(hlo_proto(ATTENTION_HLO, []), ATTENTION_KERNELS, device_name="NVIDIA A10"),
                                step_ms=20.0, steps=1, calls=1, context=context, model_flops_per_step=4.0e12)
    assert unknown["mfu"]["mfu"] is None
    assert "MFU n/a (the GPU 'NVIDIA A10' is not in tf_nvlink.plan.gpu_peaks)" in outputs.render_table(unknown)
    no_flops, _ = diagnose_space(space, step_ms=20.0, steps=1, calls=1, context=context)
    assert "mfu" not in no_flops and "MFU" not in outputs.render_table(no_flops)


def test_tensorboard_gets_a_scalar_per_kind_and_the_mfu(tf, tmp_path):
    space = xla_space(hlo_proto(ATTENTION_HLO, [name for name, *_ in ATTENTION_HLO]), ATTENTION_KERNELS)
    context = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4 << 20, gradient_tensors=10)
    report, _ = diagnose_space(space, step_ms=20.0, steps=1, calls=1, context=context, model_flops_per_step=4.0e12)
    directory = outputs.write_tensorboard(report, str(tmp_path), step=0)
    tags = {}
    for path in Path(directory).glob("events.out.tfevents.*"):
        for record in tf.compat.v1.train.summary_iterator(str(path)):
            for value in record.summary.value:
                tags[value.tag] = float(tf.make_ndarray(value.tensor)) if value.metadata.plugin_data.plugin_name \
                    == "scalars" else None
    assert tags["step_doctor/work_attention_ms"] == pytest.approx(7.5)
    assert tags["step_doctor/work_matmul_ms"] == pytest.approx(6.5)
    assert tags["step_doctor/mfu"] == pytest.approx(0.2021, abs=1e-4)


@pytest.mark.skipif(not (FIXTURE / "observation.json").exists(), reason=f"no GPU trace fixture at {FIXTURE}")
def test_the_resnet50_fixture_splits_its_kernel_time_into_kinds():
    """1x H200, ResNet-50, SGD, spe=1: the kinds add up to the kernels' time; convolutions (matmul) and BatchNorm
    (normalisation) take 8.35 and 9.69 ms of the 19.89; no attention."""
    observation = json.loads((FIXTURE / "observation.json").read_text())
    context = StepContext(**{k: v for k, v in observation["context"].items() if k != "link"})
    report, why = diagnose_trace(str(FIXTURE / "profile"), observation["step_ms"], observation["steps"],
                                 observation["calls"], context, model_flops_per_step=1.0e12)
    assert why is None
    work, mean = report["mean"]["work_ms"], report["mean"]
    assert sum(work[k] for k in ("matmul", "attention", "normalisation", "elementwise", "optimizer", "loss",
                                 "other")) == pytest.approx(mean["compute_ms"], abs=0.05)
    assert work["matmul"] == pytest.approx(8.347, abs=0.01) and work["normalisation"] == pytest.approx(9.687, abs=0.01)
    assert 0.4 < work["optimizer"] < 0.7 and 0 < work["loss"] < 0.05 and 1.0 < work["elementwise"] < 1.6
    assert work["attention"] == work["collective"] == work["other"] == 0
    # the copies' union: the input copy and the device copies, which overlap a little
    assert mean["h2d_ms"] < work["copy"] <= mean["h2d_ms"] + mean["other_copies_ms"]
    assert report["mfu"]["gpu"] == "NVIDIA H200" and report["mfu"]["peak_label"] == "H200 SXM"


@pytest.mark.parametrize("flops", [0, -1.0, "8e12", True])
def test_the_doctor_refuses_model_flops_that_are_not_a_positive_number(flops):
    from tf_nvlink.tools.doctor.callback import StepDoctor

    with pytest.raises(ValueError) as raised:
        StepDoctor(model_flops_per_step=flops)
    assert str(raised.value) == (f"model_flops_per_step should be a positive number of FLOPs (or None: no MFU). "
                                 f"Received: {flops!r}")
    assert StepDoctor(model_flops_per_step=8.854e12).model_flops_per_step == 8.854e12
