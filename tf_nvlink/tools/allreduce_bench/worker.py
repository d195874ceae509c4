"""The benchmark's TensorFlow worker: one candidate in this process, one JSON line on stdout.

Run by the runner as `python -m tf_nvlink.tools.allreduce_bench.worker --candidate nccl:1 --target gpu:0,1 --sizes 1M ...`
(`--inspect`: the op and transfer counts of the chains instead of timings). The method is the package docstring's
(`tf_nvlink.tools.allreduce_bench`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from typing import Optional, Sequence

from tf_nvlink.machine import nvlink_traffic

from tf_nvlink.machine.nvml import NvLinkCounterReader
from tf_nvlink.tools.allreduce_bench.specs import DTYPE_BYTES, Candidate, parse_candidate, parse_sizes, subtract_local
from tf_nvlink.util.error_lines import one_line_error
from tf_nvlink.machine.topology import Topology

def _silence_stdout():
    """Send anything TensorFlow or Python prints to stderr, so stdout carries only the result line."""
    real = sys.stdout
    sys.stdout = sys.stderr
    return real


def _worker_strategy(candidate: Candidate, target_spec: str):
    """(tf, strategy, plan, cpu) for `candidate` on `target_spec` ("cpu:N" or "gpu:0,1"), once per process."""
    cpu = re.fullmatch(r"cpu:(\d+)", target_spec)
    import tensorflow as tf  # noqa: PLC0415 - only workers import TensorFlow

    from tf_nvlink.distribute import single_host  # noqa: PLC0415
    from tf_nvlink.training import install  # noqa: PLC0415

    if cpu:  # before anything else touches TensorFlow's devices
        physical = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(physical,
                                                   [tf.config.LogicalDeviceConfiguration()] * int(cpu.group(1)))
    # "xla": TensorFlow uses its CollectiveAllReduce under XLA whatever the strategy was given; ask for it.
    ops = {"auto": "auto", "xla": "collective"}.get(candidate.name, candidate.name)
    if cpu:
        strategy = install.build_strategy(
            cross_device_ops=ops, num_packs=candidate.num_packs,
            devices=[f"/cpu:{i}" for i in range(int(cpu.group(1)))],
            topology=Topology(error="benchmark over logical CPU devices (--devices cpu:N)"))
    else:
        strategy = install.build_strategy(gpus=target_spec.partition(":")[2], cross_device_ops=ops,
                                          num_packs=candidate.num_packs)
    return tf, strategy, single_host.current_plan(), bool(cpu)


def _chains(tf, strategy, iters: int, xla: bool = False):
    """The worker's tf.functions: (timed, local, empty, check).

    timed(x, floor): `iters` chained all-reduces, each input a fresh `tf.maximum(previous sum, floor)` on its
    replica's device (see the module docstring: without it Grappler elides reduce_to_one's transfers);
    local(x, floor): the same chain with the all-reduce left out (the local work, timed alone);
    empty(x, floor): the same call with no chain at all (local - empty: the local work without the per-call
    overhead, which stays in the figures as before);
    check(x): one all-reduce, the number of elements that are not n(n+1)/2.
    With `xla`, every replica function is jit-compiled (one XLA program per replica, tf_nvlink's strategy run
    gives each replica its own copy) and all-reduces with `replica_ctx.all_reduce`, which TensorFlow compiles into
    the program on all-GPU replicas.
    """
    n = strategy.num_replicas_in_sync
    expected = float(n * (n + 1) // 2)
    reduce_op = tf.distribute.ReduceOp.SUM

    def merge_fn(distribution, value):
        return distribution.extended.batch_reduce_to(reduce_op, [(value, value)])

    def all_reduce(x):
        ctx = tf.distribute.get_replica_context()
        if xla:
            return ctx.all_reduce(reduce_op, x)
        # tf.identity under the replica's device scope: NCCL ops need inputs with a device assignment (a
        # tf.function's inputs and unpacked outputs have none); it does not copy.
        return ctx.merge_call(merge_fn, args=(tf.identity(x),))[0]

    def per_replica(fn):
        return tf.function(fn, jit_compile=True) if xla else fn

    def chain(x, floor):
        for _ in range(iters):  # unrolled: merge_call inside a tf.range loop raises
            # A new buffer on this replica's device from a runtime value: Grappler can neither forward the
            # first device's copy into the next reduction nor merge the chain (max(v, -inf) == v: sums exact).
            x = tf.maximum(all_reduce(x), floor)
        return x[0]  # one scalar per replica: returning the buffer would time a device-to-host copy

    chain_fn = per_replica(chain)

    @tf.function
    def timed(x, floor):
        return strategy.run(chain_fn, args=(x, floor))

    def local_chain(length):
        def replica_fn(x, floor):
            for _ in range(length):
                x = tf.maximum(tf.identity(x), floor)
            return x[0]

        replica_fn = per_replica(replica_fn)

        @tf.function
        def local(x, floor):
            return strategy.run(replica_fn, args=(x, floor))

        return local

    def count_wrong(x):
        return tf.math.count_nonzero(tf.not_equal(all_reduce(x), expected))

    count_fn = per_replica(count_wrong)

    @tf.function
    def check(x):
        return strategy.run(count_fn, args=(x,))

    return timed, local_chain(iters), local_chain(0), check


def _reported_ops(candidate: Candidate, plan) -> str:
    """What did the all-reduce: the plan's cross-device ops, or "xla" (TensorFlow's collective inside XLA)."""
    return "xla" if candidate.name == "xla" else plan.cross_device_ops


def _worker_inputs(tf, strategy, count: int):
    """(x, floor): per-replica buffers filled with replica_id + 1, and per-replica -inf scalars."""
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.fill([count], float(ctx.replica_id_in_sync_group + 1)))
    floor = strategy.experimental_distribute_values_from_function(lambda ctx: tf.constant(float("-inf")))
    return x, floor


def _nvlink_reader(plan, n: int, cpu: bool, nvml=None):
    """(an open NvLinkCounterReader over the plan's GPUs, None), or (None, why NVLink bytes are not measured)."""
    if cpu or n < 2 or len(plan.gpus) < 2:
        return None, "fewer than 2 GPUs: nothing crosses NVLink"
    reader = NvLinkCounterReader(plan.gpus, nvml, payload_only=True).open()
    if reader.error or len(reader.readable) < 2:
        reader.close()
        return None, reader.error or nvlink_traffic.unreadable_reasons(reader)
    return reader, None


def worker(candidate: Candidate, target_spec: str, sizes: Sequence[int], iters: int, warmup: int,
           repeats: int) -> dict:
    """Measure `candidate` at `sizes` in THIS process (call it once per process); returns a JSON-ready dict."""
    tf, strategy, plan, cpu = _worker_strategy(candidate, target_spec)
    n = strategy.num_replicas_in_sync
    xla = candidate.name == "xla"
    timed, local, empty, check = _chains(tf, strategy, iters, xla=xla)
    reader, nvlink_unavailable = _nvlink_reader(plan, n, cpu)

    def host_read(value):
        return [v.numpy() for v in strategy.experimental_local_results(value)]

    def per_call_us(fn, *args, nvlink_bytes: Optional[list] = None):
        for _ in range(max(1, warmup)):  # the first call traces and sets up the communicators
            host_read(fn(*args))
        before = reader.read() if reader is not None and nvlink_bytes is not None else None
        start = time.perf_counter()
        for _ in range(repeats):
            host_read(fn(*args))
        seconds = time.perf_counter() - start
        if before is not None:  # NVLink bytes per GPU per all-reduce, read outside the timed loop
            traffic = nvlink_traffic.traffic_delta(before, reader.read())
            nvlink_bytes.append(nvlink_traffic.per_gpu_bytes(traffic) / (repeats * iters) if traffic else None)
        return seconds * 1e6 / repeats

    results = []
    for size in sizes:
        count = size // DTYPE_BYTES
        try:
            x, floor = _worker_inputs(tf, strategy, count)
            measured_nvlink: list = []
            raw_us = per_call_us(timed, x, floor, nvlink_bytes=measured_nvlink) / iters
            wrong = int(sum(host_read(check(x))))
            local_us = max(0.0, per_call_us(local, x, floor) - per_call_us(empty, x, floor)) / iters
            time_us, capped = subtract_local(raw_us, local_us)
            results.append({"size_bytes": size, "count": count, "time_us": time_us, "raw_time_us": raw_us,
                            "local_us": local_us, "local_capped": capped, "wrong": wrong,
                            "nvlink_bytes": measured_nvlink[0] if measured_nvlink else None,
                            "nvlink_expected_bytes": nvlink_traffic.expected_allreduce_bytes(size, n)})
            del x, floor
        except Exception as exc:  # noqa: BLE001 - one failing size (say out of memory) is a row, not a crash
            traceback.print_exc()  # the whole story on the worker's stderr
            results.append({"size_bytes": size, "count": count, "error": one_line_error(exc)})
    if reader is not None:
        reader.close()
    return {
        "ok": True, "candidate": candidate.label, "ops": _reported_ops(candidate, plan),
        "num_packs": None if xla else plan.num_packs,
        "n_replicas": n, "n_gpus": len(plan.gpus), "gpus": list(plan.gpus), "devices": list(plan.devices),
        "device_type": "CPU" if cpu else "GPU", "tf_version": tf.__version__, "plan": plan.summary(),
        "iters": iters, "warmup": warmup, "repeats": repeats, "results": results,
        "nvlink_unavailable": nvlink_unavailable,
    }


def cross_device_transfers(run_metadata) -> list[dict]:
    """Every cross-device receive in the partitioned function graphs of a RunMetadata.

    Returns one dict per _Recv: {"from": device, "to": device, "op": the op type whose output travels ("_Arg" for
    a function input), "node": that op's name}.
    """
    transfers = []
    for function_graph in run_metadata.function_graphs:
        nodes = {node.name: node for graph in function_graph.partition_graphs for node in graph.node}
        sources = {}
        for node in nodes.values():
            if node.op in ("_Send", "_HostSend") and node.input:
                source = nodes.get(node.input[0].lstrip("^").split(":")[0])
                sources[node.attr["tensor_name"].s] = source
        for node in nodes.values():
            if node.op in ("_Recv", "_HostRecv"):
                source = sources.get(node.attr["tensor_name"].s)
                transfers.append({"from": node.attr["send_device"].s.decode(),
                                  "to": node.attr["recv_device"].s.decode(),
                                  "op": source.op if source is not None else "?",
                                  "node": source.name if source is not None else "?"})
    return transfers


def inspect_worker(candidate: Candidate, target_spec: str, size: int, iters: int) -> dict:
    """What Grappler and the partitioner left of the chains, in THIS process: per function (timed, local), the ops
    after optimisation by type and the cross-device transfers of computed tensors (function inputs left out)."""
    tf, strategy, plan, _ = _worker_strategy(candidate, target_spec)
    from tf_nvlink.internals import tf_runtime  # noqa: PLC0415 - run metadata is only in TensorFlow's private API

    timed, local, _, _ = _chains(tf, strategy, iters, xla=candidate.name == "xla")
    x, floor = _worker_inputs(tf, strategy, size // DTYPE_BYTES)
    report = {"ok": True, "candidate": candidate.label, "ops": _reported_ops(candidate, plan),
              "n_replicas": strategy.num_replicas_in_sync, "iters": iters, "size_bytes": size}
    for name, fn in (("timed", timed), ("local", local)):
        # Recording starts before the first call: the function graphs are recorded as it is built.
        with tf_runtime.recorded_run_metadata() as recorded:
            [value.numpy() for value in strategy.experimental_local_results(fn(x, floor))]
        metadata = recorded[0]
        op_counts: dict[str, int] = {}
        for function_graph in metadata.function_graphs:
            for node in function_graph.post_optimization_graph.node:
                op_counts[node.op] = op_counts.get(node.op, 0) + 1
        transfers = [t for t in cross_device_transfers(metadata) if t["op"] != "_Arg"]
        routes: dict[str, int] = {}
        for t in transfers:
            route = "->".join(t[end].rsplit("/", 1)[-1].replace("device:", "") for end in ("from", "to"))
            routes[route] = routes.get(route, 0) + 1
        report[name] = {"op_counts": op_counts, "transfers": len(transfers), "routes": routes,
                        "sources": sorted({t["op"] for t in transfers})}
    return report


def _worker_main(args: argparse.Namespace) -> int:
    real_stdout = _silence_stdout()
    try:
        sizes = parse_sizes(args.sizes) if isinstance(args.sizes, str) else list(args.sizes)
        if args.inspect:
            record = inspect_worker(parse_candidate(args.candidate), args.target, sizes[0], args.iters)
        else:
            record = worker(parse_candidate(args.candidate), args.target, sizes, args.iters, args.warmup,
                            args.repeats)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as a failed candidate
        traceback.print_exc()
        record = {"ok": False, "candidate": args.candidate, "error": one_line_error(exc)}
    real_stdout.write(json.dumps(record) + "\n")
    real_stdout.flush()
    return 0 if record["ok"] else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.tools.allreduce_bench.worker ...`: measure one candidate, print one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m tf_nvlink.tools.allreduce_bench.worker", description=__doc__.split("\n")[0])
    parser.add_argument("--candidate", required=True)
    parser.add_argument("--target", required=True, help='"cpu:N" or "gpu:0,1"')
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--inspect", action="store_true", help="op and transfer counts instead of timings")
    return _worker_main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
