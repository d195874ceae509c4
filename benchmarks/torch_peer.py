"""The PyTorch peers of the one-GPU benchmarks, trained the way PyTorch users train them fast, each in a child
process with its own CUDA context and no TensorFlow:

- resnet50: torchvision's ResNet-50, bf16 autocast, channels_last, `torch.compile` with default options, a pinned uint8
  host batch copied to the GPU and scaled every step;
- a Transformer of `tf_nvlink.tools.bench_models.TRANSFORMER_CONFIGS` ("transformer": 8 x 512 tokens,
  "transformer_2048": 2 x 2048): the architecture of `bench_models.transformer_lm` (token and learned position
  embeddings, pre-LayerNorm blocks of causal multi-head attention and an exact-GELU feed-forward, LayerNorm eps
  1e-5, biases on every projection, a final LayerNorm, untied logits cast to float32 for the cross-entropy),
  q, k and v as one Linear of 3 x d_model outputs (the weights and FLOPs of Keras' three projections),
  `F.scaled_dot_product_attention(is_causal=True)`, bf16 autocast, `torch.compile` with default options over the
  model and its loss, fed from 8 distinct pinned int64 host batches, one copied to the GPU every step.

Both train with the optimizer of `bench_models.BENCH_OPTIMIZERS` the TensorFlow side compiles with: SGD with momentum,
or AdamW (fused on the GPU) with the same learning rate, betas, epsilon and weight decay.

    peer = TorchPeer("transformer", batch=8, steps=96, warmup_steps=15, optimizer="adamw")   # compiles while the
    peer.wait_until_ready()                                                                # TensorFlow side does
    seconds = peer.run()                                    # one timed run of `steps` steps
    work = peer.profile()                                   # torch.profiler over PROFILED_STEPS steps: ms per step
    peer.close()                                            # by kind of work, the step doctor's kinds

`python benchmarks/torch_peer.py MODEL BATCH STEPS WARMUP_STEPS OPTIMIZER [DEVICE]` is the child: it compiles and
warms up, prints "ready", then times `STEPS` steps for each "run" line on stdin and prints {"fit_s": ...}, profiles
PROFILED_STEPS steps for each "profile" line and prints `work_by_kind` of their kernels; it exits on "quit". DEVICE is
"cuda" (default) or "cpu" (a smoke run of the same code on small shapes).

The kinds of the PyTorch step's kernels (`torch_kernel_kind`) are the step doctor's (`work_kinds.WORK_KINDS`), read
from the kernel names torch.profiler records (cuBLAS, cuDNN, FlashAttention, NCCL, ATen's CUDA kernels and
TorchInductor's Triton kernels, `triton_{poi,per,red,tem,for}_fused_<ops>_<n>`, which name the ops they fused):
1. copy: memory copies and memsets (peer-to-peer copies: collective); collective: NCCL;
2. attention: fused attention (flash, fmha, sdpa, attention in the name);
3. optimizer: the optimizer's kernels (adam, sgd, lamb, lion, multi_tensor_apply: PyTorch's foreach and fused
   optimizers; Inductor's foreach kernels, triton_for_);
4. loss: log_softmax, nll_loss, cross_entropy;
5. normalisation: layer_norm, batch_norm, rms_norm, group_norm and their gradient kernels (GammaBetaBackward,
   RowwiseMoments, cuDNN's bn_fw/bn_bw);
6. attention: a softmax that is not the loss's (the scores' softmax of unfused attention);
7. matmul: gemm, gemv, nvjet, cutlass, xmma, hmma, cublas, Inductor's templates (triton_tem_), convolutions;
8. elementwise: any other Triton or ATen kernel (elementwise, reductions, casts, copies of tensors, gathers);
9. other: the rest.
The time of a kind is the union of its kernels' intervals, per step, as the doctor measures it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tf_nvlink, for the configs

from tf_nvlink.tools import bench_models  # noqa: E402 - imports neither TensorFlow nor Keras
from tf_nvlink.tools.doctor.breakdown import length, merge  # noqa: E402 - neither
from tf_nvlink.tools.doctor.work_kinds import WORK_KINDS  # noqa: E402 - neither

PEER_MODELS = ("resnet50",) + tuple(bench_models.TRANSFORMER_CONFIGS)
DISTINCT_BATCHES = 8  # the Transformer peer's host batches, one copied each step
PROFILED_STEPS = 10  # steps torch.profiler traces for "profile" (the step doctor's default window)
# (kind, regular expression over the lower-case kernel name), the first match wins (the module doc's rules 2 to 8)
TORCH_KIND_RULES = (
    ("attention", r"flash|fmha|sdpa|attention|fused_mha"),
    ("optimizer", r"adam|sgd|lamb(?!da)|(?<![a-z])lion|multi_tensor_apply|triton_for_"),  # not C++'s "{lambda()#1}"
    ("loss", r"log_?softmax|nll_loss|cross_entropy"),
    ("normalisation", r"layer_?norm|batch_?norm|rms_?norm|group_?norm|gammabeta|rowwisemoments|\bbn_(fw|bw)"),
    ("attention", r"softmax"),
    ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|hmma|cublas|triton_tem_|convolution|convolve|conv[123]d|dgrad|wgrad|"
               r"fprop"),
    ("elementwise", r"triton_|at::native|elementwise|reduce_kernel|index|gather|scatter|embedding|copy|fill"),
)


def torch_kernel_kind(name: str, category: str = "kernel") -> str:
    """The step doctor's kind of work of a kernel of the PyTorch step, from its name as torch.profiler records it and
    its category in the Chrome trace ("kernel", "gpu_memcpy", "gpu_memset"); see the module doc.

    Example:
        >>> torch_kernel_kind("triton_per_fused_native_layer_norm_native_layer_norm_backward_12")
        'normalisation'
        >>> torch_kernel_kind("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy")
        'copy'
    """
    low = name.lower()
    if category in ("gpu_memcpy", "gpu_memset") or low.startswith(("memcpy", "memset")):
        return "collective" if "ptop" in low else "copy"
    if "nccl" in low:
        return "collective"
    return next((kind for kind, pattern in TORCH_KIND_RULES if re.search(pattern, low)), "other")


def work_by_kind(trace_events: list, steps: int, top: int = 12) -> dict:
    """The GPU events of a torch.profiler Chrome trace (`export_chrome_trace`'s "traceEvents") by kind of work, per
    step: "work_ms" (per kind, the union of its events' intervals), "busy_ms" (the union of all), and the `top`
    kernels by time with their kinds ("kernels": [name, kind, ms per step]).

    Example:
        >>> work_by_kind([{"ph": "X", "cat": "kernel", "name": "flash_fwd_kernel", "ts": 0.0, "dur": 250.0}], 1)
        {'work_ms': {'attention': 0.25}, 'busy_ms': 0.25, 'kernels': [['flash_fwd_kernel', 'attention', 0.25]]}
    """
    by_kind: dict[str, list] = {}
    by_name: dict[str, float] = {}
    everything = []
    for event in trace_events:
        if event.get("ph") != "X" or event.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start, duration = float(event["ts"]), float(event.get("dur", 0.0))  # microseconds
        kind = torch_kernel_kind(event.get("name", ""), event["cat"])
        by_kind.setdefault(kind, []).append((start, start + duration))
        everything.append((start, start + duration))
        by_name[event.get("name", "")] = by_name.get(event.get("name", ""), 0.0) + duration
    per_step_ms = 1e-3 / max(steps, 1)
    work = {kind: round(length(merge(by_kind[kind])) * per_step_ms, 4) for kind in WORK_KINDS if kind in by_kind}
    busiest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {"work_ms": work, "busy_ms": round(length(merge(everything)) * per_step_ms, 4),
            "kernels": [[name[:120], torch_kernel_kind(name), round(total * per_step_ms, 4)]
                        for name, total in busiest]}


def profile_steps(step, steps: int, device) -> dict:
    """`work_by_kind` of `steps` calls of `step` traced by torch.profiler (CUDA activity; on the CPU, no kernels)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        for _ in range(steps):
            step()
        return work_by_kind([], steps)
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory(prefix="torch_peer_profile_") as folder:
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        path = os.path.join(folder, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as trace:
            events = json.load(trace).get("traceEvents", [])
    return work_by_kind(events, steps)


def torch_optimizer(name: str, parameters, device):
    """The torch optimizer of `bench_models.BENCH_OPTIMIZERS[name]`: SGD with momentum, or AdamW (fused on a GPU)."""
    import torch

    settings = bench_models.BENCH_OPTIMIZERS[name]
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=settings["learning_rate"], eps=settings["epsilon"],
                                 betas=(settings["beta_1"], settings["beta_2"]),
                                 weight_decay=settings["weight_decay"], fused=device.type == "cuda")
    return torch.optim.SGD(parameters, lr=settings["learning_rate"], momentum=settings["momentum"])


def resnet50_step(batch: int, optimizer_name: str, device):
    """One ResNet-50 training step as a function of no arguments."""
    import numpy as np
    import torch
    import torchvision

    model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
    optimizer = torch_optimizer(optimizer_name, model.parameters(), device)
    compiled = torch.compile(model)
    rng = np.random.default_rng(0)
    host_x = torch.from_numpy(rng.integers(0, 256, size=(batch, 3, 224, 224), dtype=np.uint8))
    host_y = torch.from_numpy(rng.integers(0, 10, size=(batch,)).astype("int64"))
    if device.type == "cuda":
        host_x = host_x.pin_memory()
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        x = host_x.to(device, non_blocking=True).float().div_(255.0).contiguous(memory_format=torch.channels_last)
        y = host_y.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(compiled(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def transformer_lm(vocab_size, seq_len, d_model, num_layers, num_heads, ffn_dim):
    """`bench_models.transformer_lm` in PyTorch: called on int64 tokens [batch, seq_len] and their next tokens,
    returns the mean cross-entropy of its float32 logits."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.attention_output = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
            self.ffn_in = nn.Linear(d_model, ffn_dim)
            self.ffn_out = nn.Linear(ffn_dim, d_model)

        def forward(self, x):
            batch, length, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(batch, length, 3, num_heads, d_model // num_heads).permute(
                2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, heads, length, head_dim]
            x = x + self.attention_output(h.transpose(1, 2).reshape(batch, length, d_model))
            return x + self.ffn_out(F.gelu(self.ffn_in(self.ln2(x))))  # exact GELU, as Keras' "gelu"

    class TransformerLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.token_embedding = nn.Embedding(vocab_size, d_model)
            self.position_embedding = nn.Embedding(seq_len, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(num_layers))
            self.final_ln = nn.LayerNorm(d_model, eps=1e-5)
            self.logits = nn.Linear(d_model, vocab_size)
            self.register_buffer("positions", torch.arange(seq_len), persistent=False)

        def forward(self, tokens, targets):
            x = self.token_embedding(tokens) + self.position_embedding(self.positions)
            for block in self.blocks:
                x = block(x)
            logits = self.logits(self.final_ln(x)).float()
            return F.cross_entropy(logits.view(-1, vocab_size), targets.view(-1))

    return TransformerLM()


def transformer_step(name: str, batch: int, optimizer_name: str, device):
    """One training step of Transformer `name` as a function of no arguments, each call on the next of the
    DISTINCT_BATCHES host batches."""
    import torch

    model = transformer_lm(**bench_models.TRANSFORMER_CONFIGS[name]).to(device)
    optimizer = torch_optimizer(optimizer_name, model.parameters(), device)
    compiled = torch.compile(model)
    batches = []
    for seed in range(DISTINCT_BATCHES):
        tokens, targets = bench_models.synthetic_batch(name, batch, seed=seed)
        pair = tuple(torch.from_numpy(part.astype("int64")) for part in (tokens, targets))
        batches.append(tuple(part.pin_memory() for part in pair) if device.type == "cuda" else pair)
    taken = [0]

    def step():
        tokens, targets = (part.to(device, non_blocking=True) for part in batches[taken[0] % DISTINCT_BATCHES])
        taken[0] += 1
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = compiled(tokens, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def torch_child(model_name: str, batch: int, steps: int, warmup_steps: int, optimizer_name: str,
                device_name: str = "cuda") -> int:
    import torch

    device = torch.device(device_name)
    step = (resnet50_step(batch, optimizer_name, device) if model_name == "resnet50"
            else transformer_step(model_name, batch, optimizer_name, device))

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup_steps):
        step()
    synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "profile":
            profiled = min(steps, PROFILED_STEPS)
            print(json.dumps({"steps": profiled, **profile_steps(step, profiled, device)}), flush=True)
            continue
        if line.strip() != "run":
            break
        started = time.perf_counter()
        for _ in range(steps):
            step()
        synchronize()
        print(json.dumps({"fit_s": time.perf_counter() - started}), flush=True)
    return 0


def check_arguments(model: str, optimizer: str, device: str = "cuda") -> None:
    """ValueError naming the problem and the valid choices, before a child starts."""
    if model not in PEER_MODELS:
        raise ValueError(f"the PyTorch peer's model should be one of {list(PEER_MODELS)}. Received: {model!r}")
    if optimizer not in bench_models.BENCH_OPTIMIZERS:
        raise ValueError(f"the PyTorch peer's optimizer should be one of {list(bench_models.BENCH_OPTIMIZERS)}. "
                         f"Received: {optimizer!r}")
    if device not in ("cuda", "cpu"):
        raise ValueError(f"the PyTorch peer's device should be 'cuda' or 'cpu'. Received: {device!r}")


class TorchPeer:
    """The child process running `torch_child` for `model`; `run()` returns one timed run's seconds.

    Example:
        >>> peer = TorchPeer("resnet50", batch=128, steps=96, warmup_steps=15)
    """

    def __init__(self, model: str, batch: int, steps: int, warmup_steps: int, optimizer: str = "sgd",
                 device: str = "cuda", python: str = sys.executable):
        check_arguments(model, optimizer, device)
        self.process = subprocess.Popen(
            [python, os.path.abspath(__file__), model, str(batch), str(steps), str(warmup_steps), optimizer, device],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.started = False

    def wait_until_ready(self) -> None:
        """Block until the child has compiled and warmed up."""
        line = self.process.stdout.readline().strip()
        if line != "ready":
            self.close()
            raise RuntimeError(f"the PyTorch peer did not start (said {line!r}; its stderr is above)")
        self.started = True

    def run(self) -> float:
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["fit_s"]

    def profile(self) -> dict:
        """torch.profiler over min(steps, PROFILED_STEPS) steps: `work_by_kind` of their kernels and "steps"."""
        self.process.stdin.write("profile\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            self.process.wait(timeout=60)


if __name__ == "__main__":
    model_arg, optimizer_arg, device_arg = sys.argv[1], sys.argv[5], (sys.argv[6:7] or ["cuda"])[0]
    check_arguments(model_arg, optimizer_arg, device_arg)
    sys.exit(torch_child(model_arg, *(int(arg) for arg in sys.argv[2:5]), optimizer_arg, device_arg))
