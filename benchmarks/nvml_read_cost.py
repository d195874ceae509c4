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

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load", action="store_true", help="also measure with every GPU busy (PyTorch matmuls)")
    args = parser.parse_args()

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
    loads = [False, True] if args.load else [False]
    results = {}
    for r in range(args.rounds):
        for load in loads:
            stop = threading.Event()
            worker = None
            if load:
                worker = threading.Thread(target=busy_gpus, args=(stop,), daemon=True)
                worker.start()
                time.sleep(2.0)
            for name, fn in cases.items():
                results.setdefault((name, load), []).append(timed(fn, args.repeats))
            stop.set()
            if worker:
                worker.join()
    print(f"\n{'call':<60}{'GPUs':>6}{'median ms':>11}{'spread':>8}")
    for (name, load), values in results.items():
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med if med else 0.0
        print(f"{name:<60}{'busy' if load else 'idle':>6}{1000 * med:>11.3f}{100 * spread:>7.0f}%")
    print(f"# median of {args.repeats} calls per round, {args.rounds} interleaved rounds; spread = (max-min)/median")
    reader.close()


if __name__ == "__main__":
    main()
