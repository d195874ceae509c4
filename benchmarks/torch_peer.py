"""The PyTorch peer of the one-GPU benchmarks: torchvision's ResNet-50 trained the way PyTorch users train it fast
(bf16 autocast, channels_last, `torch.compile` with default options, SGD momentum, a pinned uint8 host batch copied
to the GPU and scaled every step), in a child process with its own CUDA context and no TensorFlow.

    peer = TorchPeer(batch=128, steps=96, warmup_steps=15)   # compiles while the TensorFlow side does
    peer.wait_until_ready()
    seconds = peer.run()                                    # one timed run of `steps` steps
    peer.close()

`python benchmarks/torch_peer.py BATCH STEPS WARMUP_STEPS` is the child: it compiles and warms up, prints "ready",
then times `STEPS` steps for each "run" line on stdin and prints {"fit_s": ...}; it exits on "quit".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time


def torch_child(batch: int, steps: int, warmup_steps: int) -> int:
    import numpy as np
    import torch
    import torchvision

    device = torch.device("cuda")
    model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    compiled = torch.compile(model)
    rng = np.random.default_rng(0)
    host_x = torch.from_numpy(rng.integers(0, 256, size=(batch, 3, 224, 224), dtype=np.uint8)).pin_memory()
    host_y = torch.from_numpy(rng.integers(0, 10, size=(batch,)).astype("int64"))
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        x = host_x.to(device, non_blocking=True).float().div_(255.0).contiguous(memory_format=torch.channels_last)
        y = host_y.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(compiled(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    for _ in range(warmup_steps):
        step()
    torch.cuda.synchronize()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        started = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        print(json.dumps({"fit_s": time.perf_counter() - started}), flush=True)
    return 0


class TorchPeer:
    """The child process running `torch_child`; `run()` returns one timed run's seconds."""

    def __init__(self, batch: int, steps: int, warmup_steps: int):
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(batch), str(steps), str(warmup_steps)],
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

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            self.process.wait(timeout=60)


if __name__ == "__main__":
    sys.exit(torch_child(*(int(arg) for arg in sys.argv[1:4])))
