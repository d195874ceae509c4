"""A cost model for data-parallel training on N GPUs: step time and scaling from compute time, gradient bytes and
the interconnect.

    step(N) = compute + (1 - overlap) * allreduce(N) + (N - 1) * replica_overhead
    allreduce(N) = calls * (framework_overhead + ring_latency(N)) + bytes * 2(N-1)/N / busbw(N)
    ring_latency(N) = 8.4 us + 2(N-1) * per-hop latency          (NCCL's own tuning model, ring / Simple)
    scaling = compute / step(N)                                   (1.0 = N times one GPU's throughput)

`compute` is one GPU's measured step at the same per-GPU batch. busbw is nccl-tests' bus bandwidth: for a ring it
is the slowest hop's bandwidth, whatever N (on a shared PCIe root complex it falls as 1/N, see `LinkModel`).
Every default below is a 2x H200 measurement (docs/results.md, shared hardware facts) or a public link rate scaled
by the efficiency measured on H200; each says which. Pure Python: no TensorFlow, no NVML.

Modules: `model` (the formulas, `Workload`, `LinkModel`, the measured `LINKS`), `links` (the link model for a
probed topology), `table` (the 1/2/4/8-GPU table and the command line).

Example:
    >>> from tf_nvlink.tools.costmodel.model import LINKS, Workload, predict
    >>> from tf_nvlink.tools.costmodel.table import render_table
    >>> resnet = Workload(compute_ms=39.7, gradient_bytes=102_236_160, gradient_tensors=161, per_gpu_batch=128)
    >>> p = predict(resnet, LINKS["nvswitch-h200"], 8)
    >>> round(p.scaling, 2)
    0.85
    >>> print(render_table([predict(resnet, LINKS[name], n) for name in LINKS for n in (1, 2, 4, 8)]))

Command line: `python -m tf_nvlink.tools.costmodel --compute_ms 39.7 --gradient_mib 97.5` prints 1/2/4/8 GPUs for
every link type.
"""
