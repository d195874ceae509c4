"""Raw NCCL all-reduce bandwidth between this host's GPUs, through PyTorch: the ceiling `tf-nvlink bench` is
compared with (TensorFlow adds its own work around the same NCCL kernel).

Not part of tf_nvlink (it needs PyTorch, which tf_nvlink does not); run it next to `tf-nvlink bench` on the same
machine to take ratios from one session:

    python benchmarks/raw_nccl_torch.py --sizes 1M,16M,256M,1G --json raw_nccl.json

One process per GPU (torch.multiprocessing), float32 sum, `iters` all-reduces timed with CUDA events after
`warmup` ones, like nccl-tests' all_reduce_perf (out of place). busbw = algbw * 2(n-1)/n, GB/s = 1e9 bytes/s.
Leave NVLink multicast (NCCL_NVLS_ENABLE) as the environment sets it.
"""

import json
import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tf_nvlink.util import atomic_files  # noqa: E402
from tf_nvlink.util import json_workers
# the same size syntax as tf-nvlink bench
from tf_nvlink.tools.allreduce_bench import format_size, parse_sizes  # noqa: E402


def _rank_main(rank, world, sizes, iters, warmup, port, queue):
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    rows = []
    for size in sizes:
        x = torch.full((size // 4,), float(rank + 1), device="cuda", dtype=torch.float32)
        for _ in range(warmup):
            y = x.clone()
            dist.all_reduce(y)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        buffers = [x.clone() for _ in range(iters)]  # out of place: the copies are made before timing
        torch.cuda.synchronize()
        start.record()
        for y in buffers:
            dist.all_reduce(y)
        end.record()
        torch.cuda.synchronize()
        time_us = start.elapsed_time(end) * 1e3 / iters
        wrong = int((buffers[-1] != world * (world + 1) / 2).sum().item())
        rows.append({"size_bytes": size, "time_us": time_us, "wrong": wrong})
        del buffers
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


_SIZES = flags.DEFINE_string("sizes", "1M,16M,256M,1G", "all-reduce sizes, the syntax of tf-nvlink bench --sizes")
_ITERS = flags.DEFINE_integer("iters", 20, "timed all-reduces per size", lower_bound=1)
_WARMUP = flags.DEFINE_integer("warmup", 5, "untimed all-reduces per size first", lower_bound=0)
_JSON = flags.DEFINE_string("json", "", "also write the rows to this JSON file")


def main(argv):
    del argv
    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count()
    if world < 2:
        sys.exit(f"raw_nccl_torch.py needs 2 or more GPUs; torch sees {world}.")
    port = json_workers.free_ports(1, host="127.0.0.1")[0]
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.spawn(_rank_main, args=(world, parse_sizes(_SIZES.value), _ITERS.value, _WARMUP.value, port, queue),
             nprocs=world)
    rows = queue.get()
    factor = 2 * (world - 1) / world
    nccl = torch.cuda.nccl.version()
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    print(f"# raw NCCL all-reduce through PyTorch {torch.__version__} (NCCL {nccl}), "
          f"{world} GPUs, float32 sum, {_ITERS.value} timed after {_WARMUP.value} warm-up")
    print(f"#{'size':>11} {'time(us)':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}")
    for row in rows:
        row["algbw"] = row["size_bytes"] / row["time_us"] / 1e3
        row["busbw"] = row["algbw"] * factor
        row["n_gpus"] = world
        print(f"{format_size(row['size_bytes']):>12} {row['time_us']:>10.1f} {row['algbw']:>8.2f} "
              f"{row['busbw']:>8.2f} {row['wrong']:>7}")
    if _JSON.value:
        atomic_files.write_atomic(_JSON.value, json.dumps(rows, indent=1), mode=None)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    app.run(main)
