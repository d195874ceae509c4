"""The PyTorch peer (benchmarks/torch_peer.py): its arguments checked before a child starts, and, with a Python that
has torch ($TORCH_PYTHON, or this one when it has torch), its Transformer computing the Keras benchmark model's loss
from the same weights and its child training on the CPU."""

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
    finally:
        peer.close()
    assert all(s > 0 for s in seconds) and peer.process.returncode == 0
