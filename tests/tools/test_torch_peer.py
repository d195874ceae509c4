"""The PyTorch peer (benchmarks/torch_peer.py): its arguments checked before a child starts, its kernels' kinds of work
from realistic kernel names and its Chrome trace read into ms per step by kind, and, with a Python that has torch
($TORCH_PYTHON, or this one when it has torch), its Transformer computing the Keras benchmark model's loss from the same
weights, its child training on the CPU and, on a GPU, its profiled kernels falling into the step doctor's kinds."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TORCH_PYTHON = os.environ.get("TORCH_PYTHON") or (sys.executable if importlib.util.find_spec("torch") else None)
needs_torch = pytest.mark.skipif(TORCH_PYTHON is None, reason="torch is not installed here; set TORCH_PYTHON to a "
                                                              "Python that has it (pip install torch numpy)")


@pytest.fixture(scope="module")
def torch_peer():
    spec = importlib.util.spec_from_file_location("torch_peer_script", ROOT / "benchmarks" / "torch_peer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_peer_module_imports_neither_torch_nor_tensorflow():
    code = ("import runpy, sys\n"
            "runpy.run_path('benchmarks/torch_peer.py', run_name='imported')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'tensorflow', 'keras')))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("model, optimizer, device, message", [
    ("bert", "sgd", "cuda", "the PyTorch peer's model should be one of ['resnet50', 'transformer', 'transformer_2048', "
                            "'transformer_tiny']. Received: 'bert'"),
    ("transformer", "lamb", "cuda", "the PyTorch peer's optimizer should be one of ['sgd', 'adamw']. Received: "
                                    "'lamb'"),
    ("transformer", "adamw", "tpu", "the PyTorch peer's device should be 'cuda' or 'cpu'. Received: 'tpu'"),
])
def test_bad_arguments_are_refused_before_a_child_starts(torch_peer, model, optimizer, device, message):
    with pytest.raises(ValueError) as raised:
        torch_peer.TorchPeer(model, 8, 4, 2, optimizer=optimizer, device=device, python="/nonexistent/python")
    assert str(raised.value) == message


@pytest.mark.parametrize("name, kind", [
    # cuBLAS and cuBLASLt gemms, cuDNN convolutions, CUTLASS, Inductor's gemm templates
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__"
     "5x_cublas", "matmul"),
    ("ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn", "matmul"),
    ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNN", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "matmul"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "matmul"),
    ("triton_tem_fused_addmm_gelu_4", "matmul"),
    # fused attention: FlashAttention in PyTorch, its memory-efficient kernels, cuDNN's SDPA
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, false, true, false, false, "
     "true, true, false, false>(pytorch_flash::Flash_fwd_params)", "attention"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, 2, 4, "
     "2, false, false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 8, cutlass::bfloat16_t> >>", "attention"),
    ("fmha_cutlassB_bf16_aligned_64x64_k64_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80>)",
     "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0", "attention"),
    ("triton_per_fused__softmax_9", "attention"),  # the scores' softmax of attention that is not fused
    # the optimizer: fused AdamW, foreach kernels, Inductor's foreach kernels
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, "
     "(at::native::ADAM_MODE)1, false>, double*, double, double, double, double, double, bool, float const*, float "
     "const*>", "optimizer"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<float, 2, 2, 0>>",
     "optimizer"),
    ("triton_for_fused_0", "optimizer"),
    # the loss, normalisation (Inductor's fusions name their ops; ATen's and cuDNN's kernels)
    ("triton_red_fused__log_softmax__to_copy_nll_loss_forward_21", "loss"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, "
     "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>", "loss"),
    ("triton_per_fused_native_layer_norm_native_layer_norm_backward_12", "normalisation"),
    ("triton_per_fused_add_native_layer_norm_5", "normalisation"),   # the residual add fused into the LayerNorm
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "normalisation"),
    ("void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernel<c10::BFloat16, float>", "normalisation"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<__nv_bfloat16, float, 512, true, 1>(cudnnTensorStruct, "
     "__nv_bfloat16 const*)", "normalisation"),
    # elementwise: Inductor's pointwise and reductions, ATen's elementwise kernels (C++ lambdas are no LAMB)
    ("triton_poi_fused_gelu_gelu_backward_7", "elementwise"),
    ("triton_red_fused_sum_3", "elementwise"),
    ("triton_poi_fused__to_copy_add_convert_element_type_3", "elementwise"),  # "convert" is no convolution
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::"
     "direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}> >",
     "elementwise"),
    ("void at::native::(anonymous namespace)::embedding_backward_feature_kernel<float, float, long>", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collective"),
    ("some_library_kernel_without_a_mark", "other"),
])
def test_the_peers_kernels_take_the_step_doctors_kinds(torch_peer, name, kind):
    assert torch_peer.torch_kernel_kind(name) == kind


def test_copies_and_memsets_are_copies_and_peer_copies_collective(torch_peer):
    assert torch_peer.torch_kernel_kind("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy") == "copy"
    assert torch_peer.torch_kernel_kind("Memset (Device)", "gpu_memset") == "copy"
    assert torch_peer.torch_kernel_kind("Memcpy PtoP (Device -> Device)", "gpu_memcpy") == "collective"
    assert {kind for kind, _ in torch_peer.TORCH_KIND_RULES} < set(torch_peer.WORK_KINDS)


def chrome_event(name, start_us, duration_us, category="kernel"):
    return {"ph": "X", "cat": category, "name": name, "ts": start_us, "dur": duration_us, "pid": 0, "tid": 7}


def test_work_by_kind_gives_each_kinds_union_per_step_as_the_doctor_measures_it(torch_peer):
    """Two steps: a gemm, two LayerNorm kernels side by side on two streams (their union counted), a copy, the
    optimizer; CPU-side events and flow events are not GPU work."""
    events = []
    for step in range(2):
        base = step * 10_000.0
        events += [chrome_event("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNN", base, 3000.0),
                   chrome_event("triton_per_fused_native_layer_norm_0", base + 3000.0, 1000.0),
                   chrome_event("triton_per_fused_native_layer_norm_1", base + 3500.0, 1000.0),
                   chrome_event("Memcpy HtoD (Pinned -> Device)", base + 3200.0, 100.0, "gpu_memcpy"),
                   chrome_event("triton_for_fused_0", base + 5000.0, 2000.0),
                   chrome_event("aten::mm", base, 50.0, "cpu_op"),
                   {"ph": "f", "cat": "ac2g", "name": "flow", "ts": base}]
    found = torch_peer.work_by_kind(events, steps=2, top=3)
    assert found["work_ms"] == {"matmul": 3.0, "normalisation": 1.5, "optimizer": 2.0, "copy": 0.1}
    assert list(found["work_ms"]) == ["matmul", "normalisation", "optimizer", "copy"]  # the doctor's order
    assert found["busy_ms"] == 6.5
    assert found["kernels"] == [["nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNN", "matmul", 3.0],
                                ["triton_for_fused_0", "optimizer", 2.0],
                                ["triton_per_fused_native_layer_norm_0", "normalisation", 1.0]]
    assert torch_peer.work_by_kind([], steps=10) == {"work_ms": {}, "busy_ms": 0.0, "kernels": []}


# Runs in the Python with torch: the Keras weights (npz, Keras' paths with "/" as "|") into the peer's model, its loss
# on the same tokens printed.
LOAD_KERAS_WEIGHTS = r"""
import json, sys
sys.path.insert(0, "benchmarks")
import numpy as np, torch
import torch_peer
from tf_nvlink.tools import bench_models

config = bench_models.TRANSFORMER_CONFIGS["transformer_tiny"]
d = config["d_model"]
saved = np.load(sys.argv[1])
w = {key.replace("|", "/"): saved[key] for key in saved.files}
model = torch_peer.transformer_lm(**config)
t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).float()
with torch.no_grad():
    model.token_embedding.weight.copy_(t(w["token_embedding/embeddings"]))
    model.position_embedding.weight.copy_(t(w["positions"]))
    for i, block in enumerate(model.blocks):
        for norm, name in ((block.ln1, "ln1"), (block.ln2, "ln2")):
            norm.weight.copy_(t(w[f"block{i}_{name}/gamma"]))
            norm.bias.copy_(t(w[f"block{i}_{name}/beta"]))
        parts = ("query", "key", "value")
        block.qkv.weight.copy_(t(np.concatenate([w[f"block{i}_attention/{p}/kernel"].reshape(d, d).T for p in parts])))
        block.qkv.bias.copy_(t(np.concatenate([w[f"block{i}_attention/{p}/bias"].reshape(d) for p in parts])))
        block.attention_output.weight.copy_(t(w[f"block{i}_attention/attention_output/kernel"].reshape(d, d).T))
        block.attention_output.bias.copy_(t(w[f"block{i}_attention/attention_output/bias"]))
        for dense in ("ffn_in", "ffn_out"):
            getattr(block, dense).weight.copy_(t(w[f"block{i}_{dense}/kernel"].T))
            getattr(block, dense).bias.copy_(t(w[f"block{i}_{dense}/bias"]))
    model.final_ln.weight.copy_(t(w["final_ln/gamma"]))
    model.final_ln.bias.copy_(t(w["final_ln/beta"]))
    model.logits.weight.copy_(t(w["logits/kernel"].T))
    model.logits.bias.copy_(t(w["logits/bias"]))
    loss = model(torch.from_numpy(saved["tokens"].astype("int64")), torch.from_numpy(saved["targets"].astype("int64")))
print(json.dumps({"loss": float(loss), "parameters": sum(p.numel() for p in model.parameters())}))
"""


@needs_torch
def test_the_transformer_peer_computes_the_keras_models_loss_from_the_same_weights(tf, tmp_path):
    """Same architecture: with the Keras model's weights (float32) the peer's loss is the Keras loss. The Keras model
    adds its position table as a constant (read back here from the first block's input), so the peer has that many
    more trainable parameters."""
    import keras
    import numpy as np

    from tf_nvlink.tools import bench_models

    keras.utils.set_random_seed(3)
    model = bench_models.bench_body("transformer_tiny", keras)
    tokens, targets = bench_models.synthetic_batch("transformer_tiny", 3, seed=5)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(targets, model(tokens))
    first_block_input = keras.Model(model.input, model.get_layer("block0_ln1").input)(tokens)
    table = model.get_layer("token_embedding").embeddings.numpy()
    weights = {w.path.replace("/", "|"): w.numpy() for w in model.weights}
    weights["positions"] = (np.asarray(first_block_input) - table[tokens])[0]
    np.savez(tmp_path / "keras.npz", tokens=tokens, targets=targets, **weights)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run([TORCH_PYTHON, "-c", LOAD_KERAS_WEIGHTS, str(tmp_path / "keras.npz")], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer["loss"] == pytest.approx(float(loss), rel=1e-5)
    config = bench_models.TRANSFORMER_CONFIGS["transformer_tiny"]
    assert answer["parameters"] == model.count_params() + config["seq_len"] * config["d_model"]


@needs_torch
@pytest.mark.slow  # torch.compile of the tiny model and its backward on a CPU: about 80 s on 2 cores
def test_the_transformer_peer_trains_on_the_cpu_through_its_protocol(torch_peer):
    peer = torch_peer.TorchPeer("transformer_tiny", batch=2, steps=3, warmup_steps=2, optimizer="adamw",
                                device="cpu", python=TORCH_PYTHON)
    try:
        peer.wait_until_ready()
        seconds = [peer.run(), peer.run()]
        work = peer.profile()  # on the CPU the steps run, and no kernel is traced
    finally:
        peer.close()
    assert all(s > 0 for s in seconds) and peer.process.returncode == 0
    assert work == {"steps": 3, "work_ms": {}, "busy_ms": 0.0, "kernels": []}


@needs_torch
@pytest.mark.gpu
def test_the_transformer_peers_kernels_on_a_gpu_fall_into_the_doctors_kinds(torch_peer):
    """torch.compile's kernels of the tiny Transformer with AdamW on a GPU: every kind the step has gets time, and the
    kernels no rule knows take under 5% of the step."""
    peer = torch_peer.TorchPeer("transformer_tiny", batch=4, steps=12, warmup_steps=3, optimizer="adamw",
                                python=TORCH_PYTHON)
    try:
        peer.wait_until_ready()
        work = peer.profile()
    finally:
        peer.close()
    assert work["steps"] == torch_peer.PROFILED_STEPS
    assert all(work["work_ms"].get(kind, 0) > 0 for kind in ("matmul", "attention", "normalisation", "elementwise",
                                                             "optimizer", "loss")), work
    assert work["work_ms"].get("other", 0) < 0.05 * work["busy_ms"], work["kernels"]
