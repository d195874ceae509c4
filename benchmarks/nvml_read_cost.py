"""What does one NVLink counter read cost? Times NVML calls on this machine's GPUs (no TensorFlow needed).

Each line is the median of --repeats calls, with the spread (max - min) / median over --rounds interleaved rounds:
- `reader.read()`: tf_nvlink's NvLinkCounterReader over every GPU (one nvmlDeviceGetFieldValues per GPU, the
  data and raw TX/RX fields of every active link): what NVLinkMonitor pays per read;
- the same call with fewer values (data TX/RX only; one field; one link), to see whether the cost grows with the
  number of values asked for;
- with `--load`, the same while PyTorch keeps every GPU busy with matmuls (NVML may answer slower then).

    python benchmarks/nvml_read_cost.py --repeats 50 --rounds 3 [--load]
"""

from __future__ import annotations

import os
import sys
import threading
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tf_nvlink.tools import bench_stats  # noqa: E402 - after the source checkout's path

_REPEATS = flags.DEFINE_integer("repeats", 50, "calls per round; each round's figure is their median", lower_bound=1)
_ROUNDS = flags.DEFINE_integer("rounds", 3, "interleaved rounds", lower_bound=1)
_LOAD = flags.DEFINE_bool("load", False, "also measure with every GPU busy (PyTorch matmuls)")


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return bench_stats.summarize(times).median


def busy_gpus(stop):
    """Keep every GPU busy with bf16 matmuls until `stop` is set (PyTorch, when present)."""
    import torch

    streams = []
    for d in range(torch.cuda.device_count()):
        a = torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16)
        streams.append(a)
    while not stop.is_set():
        for a in streams:
            for _ in range(4):
                a @ a
        torch.cuda.synchronize()


def main(argv):
    del argv
    import pynvml

    from tf_nvlink.machine.nvml import TRAFFIC_FIELDS, NvLinkCounterReader

    reader = NvLinkCounterReader().open()
    print(f"GPUs {reader.gpus}; readable {reader.readable}; unavailable {reader.unavailable}", flush=True)
    if not reader.readable:
        return
    gpu = reader.readable[0]
    handle = reader._handles[gpu]
    links = sorted({link for _, link in reader._requests[gpu]})
    data = [TRAFFIC_FIELDS["data_tx"], TRAFFIC_FIELDS["data_rx"]]
    cases = {
        f"reader.read() all {len(reader.readable)} GPU(s), {len(reader._requests[gpu])} values each": reader.read,
        f"GPU {gpu}: data TX+RX x {len(links)} links": lambda: pynvml.nvmlDeviceGetFieldValues(
            handle, [(f, link) for f in data for link in links]),
        f"GPU {gpu}: data TX x {len(links)} links": lambda: pynvml.nvmlDeviceGetFieldValues(
            handle, [(data[0], link) for link in links]),
        f"GPU {gpu}: data TX, link {links[0]}": lambda: pynvml.nvmlDeviceGetFieldValues(handle, [(data[0], links[0])]),
        f"GPU {gpu}: nvmlDeviceGetNvLinkState link {links[0]}": lambda: pynvml.nvmlDeviceGetNvLinkState(
            handle, links[0]),
        f"GPU {gpu}: nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
    }
    loads = [False, True] if _LOAD.value else [False]
    results = {}
    for r in range(_ROUNDS.value):
        for load in loads:
            stop = threading.Event()
            worker = None
            if load:
                worker = threading.Thread(target=busy_gpus, args=(stop,), daemon=True)
                worker.start()
                time.sleep(2.0)
            for name, fn in cases.items():
                results.setdefault((name, load), []).append(timed(fn, _REPEATS.value))
            stop.set()
            if worker:
                worker.join()
    print(f"\n{'call':<60}{'GPUs':>6}{'median ms':>11}{'spread':>8}")
    for (name, load), values in results.items():
        stats = bench_stats.summarize(values)
        print(f"{name:<60}{'busy' if load else 'idle':>6}{1000 * stats.median:>11.3f}{100 * stats.spread:>7.0f}%")
    print(f"# median of {_REPEATS.value} calls per round, {_ROUNDS.value} interleaved rounds; "
          f"spread = (max-min)/median")
    reader.close()


if __name__ == "__main__":
    app.run(main)
