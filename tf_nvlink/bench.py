"""`tf-nvlink bench`: all-reduce bandwidth through tf.distribute, per cross-device-ops candidate, nccl-tests style.

Every candidate runs in its own process (`python -m tf_nvlink.bench --worker ...`, which prints one JSON line),
because TensorFlow tolerates one MirroredStrategy per process. Inside a worker, for each size:

- each replica holds a float32 buffer filled with `replica_id + 1`;
- ONE tf.function runs `iters` all-reduces unrolled in Python, each through
  `tf.distribute.get_replica_context().merge_call` + `strategy.extended.batch_reduce_to` (what Keras optimizers
  do), each feeding the next so they serialise, and returns one scalar per replica (returning the buffer would
  time a device-to-host copy instead of the link);
- each all-reduce's input is a fresh buffer made on its replica's device: `x = tf.maximum(reduced, floor)`, with
  `floor` a per-replica -inf passed as a tf.function argument (a runtime value, so Grappler cannot fold it; max
  with -inf changes nothing, so the sums stay exact). Without it Grappler sees through the chain: for
  reduce_to_one the ArithmeticOptimizer merges the chained AddNs through the broadcast identities (on 2 logical
  CPU devices the whole chain became ONE AddN on the first device, its result sent once), so after the first
  all-reduce no data crossed between devices. That fits reduce_to_one's "483 GB/s" busbw on 2x H200 without the
  fix, above the 394 GB/s a GPU-to-GPU copy reaches (the GPU graph itself was not inspected); hierarchical, built
  from the same adds and identity copies, is probably exposed the same way; NCCL and collective ops are not.
  `tf.maximum` rather than `+ 0.0`: Grappler's AddOpsRewrite merges chained adds too (a chain of `x + d` became
  `x + 4*d`). With the fix, the partitioned graph of reduce_to_one over 2 devices holds one buffer transfer each
  way per all-reduce (`python -m tf_nvlink.bench --worker --inspect --candidate reduce_to_one
  --target cpu:2 --sizes 1K --iters 4` prints the counts; tests/test_bench.py checks them);
- the local work this adds (one elementwise max over the buffer per replica per all-reduce, ~2x buffer bytes of
  memory traffic) is timed in the same worker by the same chain with the all-reduce left out, minus the same
  call with no op at all (so the per-call overhead, dispatch and host read, stays in the figures as before), and
  subtracted: time = chained time - local time, but never below (1 - MAX_LOCAL_SHARE) of the chained time (at
  tiny sizes per-op overhead dominates and the difference is noise); the tables' footers list what was
  subtracted and where the cap applied, the JSON records carry raw_time_us, local_us and local_capped;
- for each function, `warmup` calls first (the first traces), then `repeats` timed calls, each ended by a tiny
  host read; chained time = wall time / (repeats * iters); local time = (local chain's wall time - the empty
  call's) / (repeats * iters);
- after the timed loop, one more all-reduce of the same buffers is checked on the device: every element must be
  n(n+1)/2 exactly; #wrong counts the elements that are not (summed over replicas).

algbw = bytes / time; busbw = algbw * 2(n-1)/n (nccl-tests' all-reduce factor), in GB/s (1e9 bytes/s).

Candidates: "collective" (TensorFlow's default CollectiveAllReduce), "nccl[:PACKS]" (NcclAllReduce packing the
buffer into PACKS all-reduces), "hierarchical[:PACKS]" (GPUs, even count only), "reduce_to_one", "auto"
(what tf_nvlink.strategy() picks, shown with what it resolved to), and "xla" (GPUs only: the chain is one
jit_compile=True function per replica and each all-reduce is `replica_ctx.all_reduce`, which TensorFlow compiles
into the XLA program without merge_call; this is how jit_compile=True models all-reduce in tf_nvlink's fused mode,
where the plan's cross-device ops are not used). `--devices cpu:N` runs over N logical CPU
devices (tests, machines without GPUs), where the GPU-only candidates are skipped with the reason.

Example:
    $ tf-nvlink bench --sizes 16M,256M --candidates nccl:1,collective,auto --json bench.json
    $ tf-nvlink bench --compare_p2p --candidates nccl:1      # NVLink on vs NCCL_P2P_DISABLE=1
    $ python -m tf_nvlink.bench --devices cpu:2 --sizes 1K,64K --iters 2

`import tf_nvlink.bench` does not import TensorFlow; only the workers do.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import shlex
import sys
import time
import traceback
from typing import Callable, Iterable, Optional, Sequence, TextIO

from tf_nvlink import atomic, policy, workers

HELP = "all-reduce time, algbw and busbw per cross-device-ops candidate, each in its own process (like nccl-tests)"

KIB, MIB, GIB = 2**10, 2**20, 2**30
DEFAULT_SIZES = tuple(MIB * 4**i for i in range(6))  # 1, 4, 16, 64, 256, 1024 MiB
CANDIDATE_NAMES = ("collective", "nccl", "hierarchical", "reduce_to_one", "auto", "xla")
DEFAULT_CANDIDATES = "collective,nccl:1,nccl:4,hierarchical:1,reduce_to_one,auto,xla"
# What the "xla" candidate measures: the all-reduce a jit_compile=True model does in fused mode (tf_nvlink.xla).
XLA_DOC = ("CollectiveAllReduce compiled into one XLA program per replica (replica_ctx.all_reduce, no merge_call: "
           "what jit_compile=True models all-reduce with in tf_nvlink's fused mode)")
DTYPE_BYTES = 4  # float32
MAX_PACKS = 64
MAX_SIZE = 16 * 2**30  # the largest all-reduce size accepted: 16 GiB (1G = 4 GiB buffers are already rare)
# The local-work correction may remove at most this share of the chained time (so it at most doubles algbw): at
# tiny sizes per-op overhead dominates both chains and their difference is noise.
MAX_LOCAL_SHARE = 0.5
P2P_ENV = {"NCCL_P2P_DISABLE": "1"}
P2P_VARIANT = "nop2p"  # the label suffix tf_nvlink.training_bench uses for NCCL_P2P_DISABLE=1 runs


class BenchError(ValueError):
    """A request the benchmark cannot run (bad sizes, no GPU, ...), with a message for the user."""


# --------------------------------------------------------------------------------------------------- parsing
_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """"64K", "16M", "1G" (binary, like nccl-tests' -b/-e), "16MiB" or plain bytes -> bytes.

    Example:
        >>> parse_size("16M")
        16777216
    """
    match = _SIZE.match(str(text))
    if not match:
        raise BenchError(f"a size should be bytes with an optional K, M or G suffix (binary: 1K = 1024), such "
                         f"as 1M or 256M. Received: {text!r}")
    value = int(match.group(1)) * {"": 1, "k": KIB, "m": MIB, "g": GIB}[match.group(2).lower()]
    if value <= 0 or value % DTYPE_BYTES:
        raise BenchError(f"sizes are bytes of float32 data and should be positive multiples of {DTYPE_BYTES}. "
                         f"Received: {text!r} ({value} bytes)")
    if value > MAX_SIZE:
        raise BenchError(f"sizes should be at most {MAX_SIZE // GIB}G (each GPU holds several buffers of that "
                         f"size). Received: {text!r} ({value} bytes)")
    return value


def parse_sizes(text: str) -> list[int]:
    """"1M,16M,256M" -> sorted, de-duplicated bytes."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise BenchError(f"sizes should be a comma list such as 1M,16M,256M. Received: {text!r}")
    return sorted({parse_size(item) for item in items})


def format_size(size: int) -> str:
    """16777216 -> "16M" (the inverse of parse_size where exact)."""
    for unit, scale in (("G", GIB), ("M", MIB), ("K", KIB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One cross-device-ops configuration to measure: `name` is a key of policy.OPS or "auto"."""

    name: str
    num_packs: Optional[int] = None

    @property
    def label(self) -> str:
        return f"{self.name}:{self.num_packs}" if self.num_packs is not None else self.name


def parse_candidate(text: str) -> Candidate:
    """"nccl:4" -> Candidate("nccl", 4); "nccl" -> Candidate("nccl", 1) (packs default to 1, like the policy)."""
    name, _, packs_text = str(text).strip().lower().partition(":")
    valid = ("valid candidates: collective, nccl[:PACKS], hierarchical[:PACKS], reduce_to_one, auto, xla "
             f"(PACKS 0-{MAX_PACKS}: the buffer is split into that many all-reduces; 1 by default)")
    if name not in CANDIDATE_NAMES:
        raise BenchError(f"unknown candidate {text.strip()!r}; {valid}. Received: {text!r}")
    if name not in policy.PACKED_OPS:
        if packs_text:
            raise BenchError(f"candidate {name!r} takes no PACKS (only nccl and hierarchical pack); {valid}. "
                             f"Received: {text!r}")
        return Candidate(name)
    if not packs_text:
        return Candidate(name, 1)
    if not packs_text.isdigit() or int(packs_text) > MAX_PACKS:
        raise BenchError(f"PACKS in {text.strip()!r} should be an integer from 0 to {MAX_PACKS}; {valid}.")
    return Candidate(name, int(packs_text))


def parse_candidates(text: str) -> list[Candidate]:
    """"collective,nccl:4,auto" -> candidates in order, duplicates dropped; a clear error for unknown names."""
    items = [item for item in str(text).split(",") if item.strip()]
    if not items:
        raise BenchError(f"candidates should be a comma list from {list(CANDIDATE_NAMES)} such as "
                         f"'nccl:1,collective'. Received: {text!r}")
    parsed: list[Candidate] = []
    for item in items:
        candidate = parse_candidate(item)
        if candidate not in parsed:
            parsed.append(candidate)
    return parsed


def parse_env(items: Optional[Iterable[str]]) -> dict[str, str]:
    """["NCCL_P2P_DISABLE=1", ...] -> dict, for the workers' environment."""
    env: dict[str, str] = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise BenchError(f"--env should be KEY=VALUE with KEY a variable name, such as NCCL_P2P_DISABLE=1. "
                             f"Received: {item!r}")
        env[key] = value
    return env


# ------------------------------------------------------------------------------------------- what to measure
@dataclasses.dataclass(frozen=True)
class Target:
    """The devices a benchmark runs on: GPUs by NVML index, or N logical CPU devices."""

    device_type: str  # "GPU" or "CPU"
    n: int  # replicas
    gpus: tuple[int, ...] = ()  # NVML indices (empty on CPU)
    fingerprint: str = ""
    shape: str = ""  # Topology.kind()
    note: str = ""

    @property
    def spec(self) -> str:
        """What the worker's --target gets: "cpu:2" or "gpu:0,1"."""
        return f"cpu:{self.n}" if self.device_type == "CPU" else "gpu:" + ",".join(map(str, self.gpus))

    @property
    def gpus_key(self):
        """The device-set part of a tune cache key: sorted NVML indices, or "cpu:N"."""
        return f"cpu:{self.n}" if self.device_type == "CPU" else sorted(self.gpus)

    def describe(self) -> str:
        if self.device_type == "CPU":
            return f"{self.n} logical CPU devices (--devices cpu:{self.n}); figures say nothing about NVLink"
        return f"GPUs {list(self.gpus)} (NVML numbering), {self.shape}{self.note}"


def resolve_target(devices: str = "gpu", gpus="all", topology=None) -> Target:
    """Turn --devices/--gpus into a Target, probing NVML (no TensorFlow) for "gpu".

    Raises BenchError with a hint when there is nothing to run on.
    """
    text = str(devices).strip().lower()
    match = re.fullmatch(r"cpu:(\d+)", text)
    if match:
        n = int(match.group(1))
        if not 1 <= n <= 64:
            raise BenchError(f"--devices cpu:N should have N from 1 to 64. Received: {devices!r}")
        from tf_nvlink.topology import Topology  # noqa: PLC0415

        return Target("CPU", n, fingerprint=Topology().fingerprint(), shape="cpu")
    if text != "gpu":
        raise BenchError(f"--devices should be 'gpu' (the GPUs --gpus names) or 'cpu:N' (N logical CPU devices). "
                         f"Received: {devices!r}")
    from tf_nvlink import devices as devices_lib  # noqa: PLC0415
    from tf_nvlink import nvml  # noqa: PLC0415

    topology = topology if topology is not None else nvml.probe()
    if not topology.gpus:
        raise BenchError(f"no GPU found ({topology.error or 'NVML lists none'}). To exercise the benchmark "
                         "without GPUs, use --devices cpu:2 (2 logical CPU devices).")
    visible = devices_lib.visible_nvml_indices(topology)
    try:
        chosen = policy.parse_gpus(gpus, topology, visible)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if not chosen:
        raise BenchError(f"--gpus {gpus!r} selects no GPU among {list(visible)}.")
    gbps = topology.min_pair_gbps(chosen) if len(chosen) > 1 else 0.0
    note = f", {gbps:.0f} GB/s per direction over NVLink" if gbps else ""
    return Target("GPU", len(chosen), tuple(chosen), topology.fingerprint(), topology.kind(chosen), note)


def skip_reason(candidate: Candidate, target: Target) -> Optional[str]:
    """Why `candidate` cannot run (or would measure something else) on `target`; None when it can."""
    if target.device_type == "CPU":
        if candidate.name == "xla":
            return ("the all-reduce inside XLA needs all-GPU replicas: on CPU devices TensorFlow keeps merge_call, "
                    "which an XLA program cannot hold")
        if candidate.name == "nccl":
            return "NCCL does not run on CPU devices"
        if candidate.name == "hierarchical":
            return ("HierarchicalCopyAllReduce needs GPUs: on CPU devices TensorFlow falls back to reduce-to-one, "
                    "so it would measure reduce_to_one again")
    elif candidate.name == "hierarchical" and target.n % 2:
        return (f"HierarchicalCopyAllReduce needs an even number of GPUs: with {target.n} it silently drops the "
                f"last replica's gradient")
    return None


def plan_runs(candidates: Sequence[Candidate], target: Target) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """Split candidates into those to run and (label, reason) for those skipped on this target."""
    runs, skipped = [], []
    for candidate in candidates:
        reason = skip_reason(candidate, target)
        if reason:
            skipped.append((candidate.label, reason))
        else:
            runs.append(candidate)
    return runs, skipped


# ------------------------------------------------------------------------------------------------------ math
def bus_factor(n: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n: what each link carries relative to the data size."""
    return 2.0 * (n - 1) / n if n > 0 else 0.0


def algbw_gbps(size_bytes: int, time_us: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes/s, as nccl-tests): data size / time."""
    return size_bytes / time_us / 1e3 if time_us > 0 else 0.0


def busbw_gbps(size_bytes: int, time_us: float, n: int) -> float:
    """Bus bandwidth in GB/s: algbw * 2(n-1)/n, comparable across GPU counts and with nccl-tests' figures."""
    return algbw_gbps(size_bytes, time_us) * bus_factor(n)


def subtract_local(raw_us: float, local_us: Optional[float]) -> tuple[float, bool]:
    """Time per all-reduce without the chain's local work: (raw - local, False), or (raw * (1 - MAX_LOCAL_SHARE),
    True) when the local time is more than MAX_LOCAL_SHARE of the raw time (the correction is then capped).

    `raw_us`: the chained time per all-reduce, including one local op per replica; `local_us`: the same chain
    with the all-reduce left out, per iteration (None or <= 0: nothing to subtract).

    Example:
        >>> subtract_local(1000.0, 160.0)
        (840.0, False)
        >>> subtract_local(10.0, 8.0)
        (5.0, True)
    """
    if not local_us or local_us <= 0:
        return raw_us, False
    floor = raw_us * (1.0 - MAX_LOCAL_SHARE)
    corrected = raw_us - local_us
    return (floor, True) if corrected < floor else (corrected, False)


# --------------------------------------------------------------------------------------------- the worker
def _silence_stdout():
    """Send anything TensorFlow or Python prints to stderr, so stdout carries only the result line."""
    real = sys.stdout
    sys.stdout = sys.stderr
    return real


def _worker_strategy(candidate: Candidate, target_spec: str):
    """(tf, strategy, plan, cpu) for `candidate` on `target_spec` ("cpu:N" or "gpu:0,1"), once per process."""
    cpu = re.fullmatch(r"cpu:(\d+)", target_spec)
    import tensorflow as tf  # noqa: PLC0415 - only workers import TensorFlow

    if cpu:  # before anything else touches TensorFlow's devices
        physical = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(physical,
                                                   [tf.config.LogicalDeviceConfiguration()] * int(cpu.group(1)))
    from tf_nvlink import strategies  # noqa: PLC0415
    from tf_nvlink.topology import Topology  # noqa: PLC0415

    # "xla": TensorFlow uses its CollectiveAllReduce under XLA whatever the strategy was given; ask for it.
    ops = {"auto": "auto", "xla": "collective"}.get(candidate.name, candidate.name)
    if cpu:
        strategy = strategies.strategy(
            cross_device_ops=ops, num_packs=candidate.num_packs,
            devices=[f"/cpu:{i}" for i in range(int(cpu.group(1)))],
            topology=Topology(error="benchmark over logical CPU devices (--devices cpu:N)"))
    else:
        strategy = strategies.strategy(gpus=target_spec.partition(":")[2], cross_device_ops=ops,
                                       num_packs=candidate.num_packs)
    return tf, strategy, strategies.current_plan(), bool(cpu)


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


def worker(candidate: Candidate, target_spec: str, sizes: Sequence[int], iters: int, warmup: int,
           repeats: int) -> dict:
    """Measure `candidate` at `sizes` in THIS process (call it once per process); returns a JSON-ready dict."""
    tf, strategy, plan, cpu = _worker_strategy(candidate, target_spec)
    n = strategy.num_replicas_in_sync
    xla = candidate.name == "xla"
    timed, local, empty, check = _chains(tf, strategy, iters, xla=xla)

    def host_read(value):
        return [v.numpy() for v in strategy.experimental_local_results(value)]

    def per_call_us(fn, *args):
        for _ in range(max(1, warmup)):  # the first call traces and sets up the communicators
            host_read(fn(*args))
        start = time.perf_counter()
        for _ in range(repeats):
            host_read(fn(*args))
        return (time.perf_counter() - start) * 1e6 / repeats

    results = []
    for size in sizes:
        count = size // DTYPE_BYTES
        try:
            x, floor = _worker_inputs(tf, strategy, count)
            raw_us = per_call_us(timed, x, floor) / iters
            wrong = int(sum(host_read(check(x))))
            local_us = max(0.0, per_call_us(local, x, floor) - per_call_us(empty, x, floor)) / iters
            time_us, capped = subtract_local(raw_us, local_us)
            results.append({"size_bytes": size, "count": count, "time_us": time_us, "raw_time_us": raw_us,
                            "local_us": local_us, "local_capped": capped, "wrong": wrong})
            del x, floor
        except Exception as exc:  # noqa: BLE001 - one failing size (say out of memory) is a row, not a crash
            traceback.print_exc()  # the whole story on the worker's stderr
            results.append({"size_bytes": size, "count": count, "error": short_error(exc)})
    return {
        "ok": True, "candidate": candidate.label, "ops": _reported_ops(candidate, plan),
        "num_packs": None if xla else plan.num_packs,
        "n_replicas": n, "n_gpus": len(plan.gpus), "gpus": list(plan.gpus), "devices": list(plan.devices),
        "device_type": "CPU" if cpu else "GPU", "tf_version": tf.__version__, "plan": plan.summary(),
        "iters": iters, "warmup": warmup, "repeats": repeats, "results": results,
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
    from tensorflow.python.eager import context  # noqa: PLC0415 - run metadata is only in the private API

    timed, local, _, _ = _chains(tf, strategy, iters, xla=candidate.name == "xla")
    x, floor = _worker_inputs(tf, strategy, size // DTYPE_BYTES)
    report = {"ok": True, "candidate": candidate.label, "ops": _reported_ops(candidate, plan),
              "n_replicas": strategy.num_replicas_in_sync, "iters": iters, "size_bytes": size}
    for name, fn in (("timed", timed), ("local", local)):
        context.enable_run_metadata()  # before the first call: the function graphs are recorded as it is built
        try:
            [value.numpy() for value in strategy.experimental_local_results(fn(x, floor))]
            metadata = context.export_run_metadata()
        finally:
            context.disable_run_metadata()
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


def short_error(exc: BaseException, limit: int = 400) -> str:
    """One line for a table: TensorFlow's "in user code:" errors put the actual message on their last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    message = lines[-1] if lines else ""
    text = message if message.startswith(type(exc).__name__) else f"{type(exc).__name__}: {message}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        record = {"ok": False, "candidate": args.candidate, "error": short_error(exc)}
    real_stdout.write(json.dumps(record) + "\n")
    real_stdout.flush()
    return 0 if record["ok"] else 1


# --------------------------------------------------------------------------------------------- the parent
def worker_command(candidate: Candidate, target: Target, sizes: Sequence[int], iters: int, warmup: int,
                   repeats: int) -> list[str]:
    """The argument list of one worker process (never a shell string)."""
    return [sys.executable, "-m", "tf_nvlink.bench", "--worker", "--candidate", candidate.label,
            "--target", target.spec, "--sizes", ",".join(map(str, sizes)), "--iters", str(iters),
            "--warmup", str(warmup), "--repeats", str(repeats)]


def worker_env(target: Target, extra: Optional[dict] = None) -> dict[str, str]:
    """The worker's environment: ours, tf_nvlink importable, TensorFlow's C++ chatter down, plus `extra`."""
    env = workers.package_env()
    if target.device_type == "CPU":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU run must not initialise (or hold memory on) any GPU
    env.update(extra or {})
    return env


def spawn_worker(candidate: Candidate, target: Target, sizes: Sequence[int], iters: int, warmup: int,
                 repeats: int, env: Optional[dict] = None, timeout: float = 1800) -> dict:
    """Run one worker process and return its JSON record ({"ok": False, "error": ...} when it failed)."""
    command = worker_command(candidate, target, sizes, iters, warmup, repeats)
    record, error = workers.run_json_worker(command, worker_env(target, env), timeout,
                                            accept=lambda output: "ok" in output)
    return record if record is not None else {"ok": False, "candidate": candidate.label, "error": error[:1000]}


def _one_line(error) -> str:
    """Errors go into table rows: one line, the informative (last) one for TensorFlow's "in user code:" traces."""
    lines = [line.strip() for line in str(error or "unknown error").splitlines() if line.strip()]
    return (lines[-1] if len(lines) > 1 and "in user code" in lines[0] else " ".join(lines))[:500]


_RECORD_KEYS = ("candidate", "label", "variant", "ops", "num_packs", "n_gpus", "n_replicas", "device_type",
                "size_bytes", "count", "dtype", "time_us", "algbw", "busbw", "wrong", "status", "error", "env",
                "iters", "repeats", "tf_version", "plan", "raw_time_us", "local_us", "local_capped")


def _record(**fields) -> dict:
    record = dict.fromkeys(_RECORD_KEYS)
    record.update(dtype="float32", **fields)
    return record


def to_records(output: dict, candidate: Candidate, target: Target, env: Optional[dict] = None,
               variant: str = "") -> list[dict]:
    """A worker's output -> one record per size (or one "failed" record), with algbw and busbw."""
    env = dict(env or {})
    base = {"candidate": candidate.label, "variant": variant, "env": env, "device_type": target.device_type,
            "n_gpus": len(target.gpus), "n_replicas": target.n}
    if not output.get("ok"):
        label = candidate.label + (f"@{variant}" if variant else "")
        return [_record(**base, label=label, status="failed", error=_one_line(output.get("error")))]
    resolved = output["ops"] + (f":{output['num_packs']}" if output.get("num_packs") is not None else "")
    label = f"auto({resolved})" if candidate.name == "auto" else candidate.label
    label += f"@{variant}" if variant else ""
    n = output["n_replicas"]
    common = dict(base, label=label, ops=output["ops"], num_packs=output.get("num_packs"), n_replicas=n,
                  n_gpus=output.get("n_gpus", len(target.gpus)), iters=output.get("iters"),
                  repeats=output.get("repeats"), tf_version=output.get("tf_version"), plan=output.get("plan"))
    records = []
    for result in output["results"]:
        if "error" in result:
            records.append(_record(**common, size_bytes=result["size_bytes"], count=result.get("count"),
                                   status="failed", error=_one_line(result["error"])))
            continue
        time_us = float(result["time_us"])
        wrong = int(result["wrong"])
        records.append(_record(**common, size_bytes=result["size_bytes"], count=result["count"], time_us=time_us,
                               algbw=algbw_gbps(result["size_bytes"], time_us),
                               busbw=busbw_gbps(result["size_bytes"], time_us, n), wrong=wrong,
                               status="ok" if wrong == 0 else "wrong", raw_time_us=result.get("raw_time_us"),
                               local_us=result.get("local_us"), local_capped=result.get("local_capped")))
    return records


def measure(candidates: Sequence[Candidate], target: Target, sizes: Sequence[int], *, iters: int = 10,
            warmup: int = 2, repeats: int = 3, env: Optional[dict] = None, variant: str = "",
            timeout: float = 1800, progress: Optional[TextIO] = sys.stderr,
            spawn: Callable[..., dict] = None) -> tuple[list[dict], list[tuple[str, str]]]:
    """Measure each runnable candidate in its own process, one after another.

    Returns (records, skipped): records as `to_records` makes them, skipped as (label, reason).
    """
    spawn = spawn or spawn_worker
    runs, skipped = plan_runs(candidates, target)
    records: list[dict] = []
    for i, candidate in enumerate(runs, 1):
        label = candidate.label + (f"@{variant}" if variant else "")
        if progress:
            print(f"# [{i}/{len(runs)}] {label}: measuring in a worker process ...", file=progress, flush=True)
        started = time.perf_counter()
        output = spawn(candidate, target, sizes, iters, warmup, repeats, env=env, timeout=timeout)
        new = to_records(output, candidate, target, env, variant)
        records.extend(new)
        if progress:
            failed = [r for r in new if r["status"] == "failed"]
            state = f"FAILED: {failed[0]['error']}" if failed else "done"
            print(f"# [{i}/{len(runs)}] {label}: {state} ({time.perf_counter() - started:.1f} s)", file=progress,
                  flush=True)
    return records, skipped


# ------------------------------------------------------------------------------------------------ rendering
def _measured(records: Iterable[dict]) -> list[dict]:
    return [r for r in records if r["status"] in ("ok", "wrong")]


def _labels(records: Iterable[dict]) -> list[str]:
    seen: list[str] = []
    for record in records:
        if record["label"] not in seen:
            seen.append(record["label"])
    return seen


def average_busbw(records: Iterable[dict]) -> dict[str, float]:
    """Mean busbw over sizes per label (nccl-tests' "Avg bus bandwidth"), measured records only."""
    sums: dict[str, list[float]] = {}
    for record in _measured(records):
        sums.setdefault(record["label"], []).append(record["busbw"])
    return {label: sum(values) / len(values) for label, values in sums.items()}


def render_candidate_table(records: Sequence[dict]) -> str:
    """One candidate's rows: a names row, a units row, sizes, and the nccl-tests footer."""
    first = records[0]
    ops_doc = XLA_DOC if first["ops"] == "xla" else policy.OPS.get(first["ops"] or "", first["ops"] or "?")
    if first["ops"] == "collective" and first["device_type"] == "CPU":
        ops_doc = "CollectiveAllReduce (TensorFlow's MirroredStrategy default; RING on CPU devices)"
    head = f"# {first['label']}: {ops_doc}"
    if first["status"] == "failed" and first["size_bytes"] is None:
        return head + f"\n#   FAILED: {first['error']}"
    lines = [head + f", {first['n_replicas']} replicas" + (f", env {_env_text(first['env'])}" if first["env"]
                                                            else ""),
             f"#{'size':>11} {'count':>12} {'type':>7} {'redop':>6} {'time':>10} {'algbw':>8} {'busbw':>8} "
             f"{'#wrong':>7}",
             f"#{'(B)':>11} {'(elements)':>12} {'':>7} {'':>6} {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"]
    wrong = 0
    for r in records:
        if r["status"] == "failed":
            lines.append(f"{r['size_bytes']:>12} {r['count'] or '':>12} {'float':>7} {'sum':>6}   FAILED: "
                         f"{r['error']}")
            continue
        wrong += r["wrong"]
        lines.append(f"{r['size_bytes']:>12} {r['count']:>12} {'float':>7} {'sum':>6} {r['time_us']:>10.1f} "
                     f"{r['algbw']:>8.2f} {r['busbw']:>8.2f} {r['wrong']:>7}")
    measured = _measured(records)
    local = [r for r in measured if r.get("local_us") is not None]
    if local:
        lines.append(render_local_line(local))
    lines.append(f"# Out of bounds values : {wrong} {'OK' if not wrong else 'WRONG'}")
    if measured:
        lines.append(f"# Avg bus bandwidth    : {sum(r['busbw'] for r in measured) / len(measured):.4f} GB/s")
    return "\n".join(lines)


def render_local_line(records: Sequence[dict]) -> str:
    """The footer line saying how much local work was taken out of each size's time ("capped": the most allowed)."""
    parts = [f"{format_size(r['size_bytes'])} {r['local_us']:.1f}" + (
        f" (capped: {r['raw_time_us'] - r['time_us']:.1f} subtracted)" if r.get("local_capped") else "")
        for r in records]
    return ("# Local work subtracted: " + ", ".join(parts) + " us per all-reduce (the chain without the all-reduce, "
            "less an empty call)")


def render_summary(records: Sequence[dict]) -> str:
    """busbw by size, one column per candidate, with the fastest named per size."""
    measured = _measured(records)
    labels = _labels(measured)
    if not labels:
        return "# no measurements"
    width = max(10, *(len(label) + 1 for label in labels))
    sizes = sorted({r["size_bytes"] for r in measured})
    by = {(r["label"], r["size_bytes"]): r for r in measured}
    lines = ["# busbw (GB/s) by size and candidate",
             f"#{'size':>11}" + "".join(f"{label:>{width}}" for label in labels) + "  fastest"]
    for size in sizes:
        row = f"{format_size(size):>12}"
        best, best_bw = "", -1.0
        for label in labels:
            r = by.get((label, size))
            row += f"{r['busbw']:>{width}.2f}" if r else f"{'n/a':>{width}}"
            if r and r["wrong"] == 0 and r["busbw"] > best_bw:
                best, best_bw = label, r["busbw"]
        lines.append(row + f"  {best}")
    averages = average_busbw(measured)
    lines.append(f"#{'average':>11}" + "".join(f"{averages.get(label, 0.0):>{width}.2f}" for label in labels))
    return "\n".join(lines)


def render_p2p_ratio(records: Sequence[dict]) -> str:
    """busbw normal / busbw with NCCL_P2P_DISABLE=1, per candidate and size."""
    measured = _measured(records)
    normal = {(r["candidate"], r["size_bytes"]): r for r in measured if not r["variant"]}
    off = {(r["candidate"], r["size_bytes"]): r for r in measured if r["variant"] == P2P_VARIANT}
    candidates = [c for c in dict.fromkeys(r["candidate"] for r in measured) if any(k[0] == c for k in off)]
    if not candidates:
        return "# NVLink speed-up: nothing measured both ways"
    width = max(12, *(len(c) + 2 for c in candidates))
    lines = ["# NVLink speed-up: busbw normal / busbw with NCCL_P2P_DISABLE=1 (NCCL then stages through host "
             "memory; the variable is read by NCCL only, so reduce_to_one and hierarchical should stay ~1x)",
             f"#{'size':>11}" + "".join(f"{c:>{width}}" for c in candidates)]
    for size in sorted({k[1] for k in normal}):
        row = f"{format_size(size):>12}"
        for c in candidates:
            a, b = normal.get((c, size)), off.get((c, size))
            row += f"{a['busbw'] / b['busbw']:>{width - 1}.2f}x" if a and b and b["busbw"] > 0 else \
                f"{'n/a':>{width}}"
        lines.append(row)
    return "\n".join(lines)


def _env_text(env: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env.items()))


def render_header(command: str, target: Target, records: Sequence[dict], skipped: Sequence[tuple[str, str]],
                  iters: int, warmup: int, repeats: int, env: dict, title: str = "tf-nvlink bench") -> str:
    tf_versions = sorted({r["tf_version"] for r in records if r["tf_version"]})
    lines = [
        f"# {title}: all-reduce (sum, float32) through tf.distribute, one process per candidate",
        f"# command: {command}",
        f"# devices: {target.describe()}",
        f"# TensorFlow {', '.join(tf_versions) or '?'}; topology fingerprint {target.fingerprint}",
        f"# method: {iters} all-reduces chained in one tf.function (merge_call + extended.batch_reduce_to), "
        f"scalar out; {warmup} warm-up call(s), {repeats} timed call(s); time per all-reduce",
        "# method: each all-reduce's input is tf.maximum(previous sum, floor) on its replica's device, floor a "
        "runtime -inf (Grappler can neither elide reduce_to_one's copies nor merge the chain); time = chained time "
        f"- local work (the same chain without the all-reduce, less the same call with no op; at most "
        f"{MAX_LOCAL_SHARE:.0%} of the chained time)",
        "# busbw = algbw * 2(n-1)/n; #wrong: after the timed loop replica r sends r+1, every element must be "
        "n(n+1)/2",
    ]
    if env:
        lines.append(f"# worker environment: {_env_text(env)}")
    plans = sorted({r["plan"] for r in records if r["plan"] and r["candidate"] == "auto"})
    lines += [f"# auto: {p}" for p in plans]
    lines += [f"# skipped {label}: {reason}" for label, reason in skipped]
    return "\n".join(lines)


def render_text(command: str, target: Target, records: Sequence[dict], skipped: Sequence[tuple[str, str]],
                iters: int, warmup: int, repeats: int, env: dict, compare_p2p: bool = False,
                title: str = "tf-nvlink bench") -> str:
    """The whole report: header, one table per candidate, the summary, the result line."""
    blocks = [render_header(command, target, records, skipped, iters, warmup, repeats, env, title)]
    for label in _labels(records):
        blocks.append(render_candidate_table([r for r in records if r["label"] == label]))
    blocks.append(render_summary(records))
    if compare_p2p:
        blocks.append(render_p2p_ratio(records))
    blocks.append(result_line(records))
    return "\n#\n".join(blocks) + "\n"


def result_line(records: Sequence[dict]) -> str:
    wrong = sorted({r["label"] for r in records if r["status"] == "wrong"})
    failed = sorted({r["label"] for r in records if r["status"] == "failed"})
    if not wrong and not failed:
        return "# Result: OK (every all-reduce summed correctly)"
    parts = ([f"WRONG sums from {', '.join(wrong)}"] if wrong else []) + (
        [f"failures in {', '.join(failed)}"] if failed else [])
    return "# Result: " + "; ".join(parts)


def exit_code(records: Sequence[dict]) -> int:
    """0 when every measured all-reduce was right; 1 on wrong sums or failed candidates (nccl-tests' rule)."""
    return 1 if any(r["status"] in ("wrong", "failed") for r in records) else 0


def check_plot_available() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise BenchError("--plot needs matplotlib, which is not installed: pip install tf-nvlink[plot]")


def plot(records: Sequence[dict], path: str, title: str = "") -> None:
    """busbw against size (log x), one line per candidate, saved as PNG to `path`."""
    check_plot_available()
    import matplotlib  # noqa: PLC0415 - optional dependency, imported only for --plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    measured = _measured(records)
    figure, axes = plt.subplots(figsize=(8, 5))
    # One colour per candidate; its variant (e.g. @nop2p) dashed in the same colour, so pairs read at a glance.
    colours = {c: f"C{i % 10}" for i, c in enumerate(dict.fromkeys(r["candidate"] for r in measured))}
    for label in _labels(measured):
        rows = sorted((r for r in measured if r["label"] == label), key=lambda r: r["size_bytes"])
        axes.plot([r["size_bytes"] for r in rows], [r["busbw"] for r in rows], marker="o", label=label,
                  color=colours[rows[0]["candidate"]], linestyle="--" if rows[0]["variant"] else "-")
    sizes = sorted({r["size_bytes"] for r in measured})
    axes.set_xscale("log", base=2)
    if sizes:
        axes.set_xticks(sizes)
        axes.set_xticklabels([format_size(s) for s in sizes])
    axes.set_xlabel("all-reduce size (bytes, float32)")
    axes.set_ylabel("busbw (GB/s)")
    axes.set_title(title or "tf-nvlink bench: all-reduce bus bandwidth")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    with atomic.atomic_path(path, suffix=os.path.splitext(path)[1]) as partial:  # the suffix picks the format
        figure.savefig(partial, dpi=120)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------------ CLI
def _argtype(parse):
    def convert(text):
        try:
            return parse(text)
        except BenchError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__.replace("parse_", "")
    return convert


def _positive(text: str) -> int:
    if not str(text).isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"should be a positive integer. Received: {text!r}")
    return int(text)


def _non_negative(text: str) -> int:
    if not str(text).isdigit():
        raise argparse.ArgumentTypeError(f"should be a non-negative integer. Received: {text!r}")
    return int(text)


def add_common_arguments(parser: argparse.ArgumentParser, default_candidates: str, default_sizes: Optional[str],
                         default_iters: int = 10) -> None:
    """Options `tf-nvlink bench` and `tf-nvlink tune` share (`default_sizes` None: the caller decides)."""
    parser.add_argument("--gpus", default="all",
                        help="'all', 'auto' (largest NVLink group) or nvidia-smi indices such as '0,1' "
                             "(as tf_nvlink.strategy)")
    parser.add_argument("--devices", default="gpu",
                        help="'gpu' (default: the GPUs --gpus names) or 'cpu:N' (N logical CPU devices, for "
                             "machines without GPUs and tests)")
    parser.add_argument("--candidates", type=_argtype(parse_candidates), default=default_candidates,
                        help=f"comma list from collective, nccl[:PACKS], hierarchical[:PACKS], reduce_to_one, auto, xla "
                             f"(default {default_candidates})")
    parser.add_argument("--sizes", type=_argtype(parse_sizes), default=default_sizes,
                        help="comma list of all-reduce sizes with K/M/G suffixes (binary), default "
                             + (default_sizes or "16M,256M, or only --grad_bytes when given"))
    parser.add_argument("--iters", type=_positive, default=default_iters,
                        help="all-reduces chained inside one timed tf.function call (default %(default)s)")
    parser.add_argument("--warmup", type=_non_negative, default=2,
                        help="warm-up calls before timing; the first traces (default %(default)s, at least 1 runs)")
    parser.add_argument("--repeats", type=_positive, default=3, help="timed calls per size (default %(default)s)")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment variable for the workers, repeatable (e.g. NCCL_P2P_DISABLE=1)")
    parser.add_argument("--timeout", type=_positive, default=1800, help="seconds per worker (default %(default)s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `tf-nvlink bench` options."""
    add_common_arguments(parser, DEFAULT_CANDIDATES, ",".join(format_size(s) for s in DEFAULT_SIZES))
    parser.add_argument("--max_size", "--max-size", dest="max_size", type=_argtype(parse_size), default=None,
                        help="drop sizes above this (e.g. 256M on small GPUs)")
    parser.add_argument("--compare_p2p", "--compare-p2p", dest="compare_p2p", action="store_true",
                        help="run each candidate twice, normally and with NCCL_P2P_DISABLE=1, and print the NVLink "
                             "speed-up per size")
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="FILE",
                        help="write the records as JSON to FILE; bare --json prints JSON instead of the table")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="plot busbw against size, one line per candidate (needs matplotlib: "
                             "pip install tf-nvlink[plot])")
    parser.add_argument("--from_json", "--from-json", dest="from_json", default=None, metavar="FILE",
                        help="measure nothing: print the summary (and --plot) from records an earlier --json FILE "
                             "wrote, e.g. on a machine with matplotlib")


def command_line(args: argparse.Namespace) -> str:
    """The exact command that ran, for the output header."""
    if getattr(args, "command_line", None):
        return args.command_line
    prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "tf-nvlink"
    if prog == "__main__.py":
        prog = "python -m tf_nvlink"
    elif prog in ("bench.py", "tune.py"):
        prog = "python -m tf_nvlink." + prog[:-3]
    return " ".join([prog, shlex.join(sys.argv[1:])]).strip()


def _error(args: argparse.Namespace, message: str) -> int:
    parser = getattr(args, "subparser", None)
    if parser is not None:
        parser.error(message)  # exits with status 2 and the usage line
    print(f"tf-nvlink bench: error: {message}", file=sys.stderr)
    return 2


def _listify(value, parse):
    return parse(value) if isinstance(value, str) else list(value)


def load_records(path: str) -> list[dict]:
    """The records a `--json FILE` run wrote, checked enough to render; BenchError naming the problem otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except (OSError, ValueError) as exc:
        raise BenchError(f"--from_json {path!r} cannot be read as JSON: {exc}") from None
    needed = ("label", "candidate", "variant", "size_bytes", "status", "busbw", "wrong")
    if not isinstance(records, list) or not all(isinstance(r, dict) and all(k in r for k in needed)
                                                for r in records):
        raise BenchError(f"--from_json {path!r} is not a list of tf-nvlink bench records (each with "
                         f"{', '.join(needed)}): write one with tf-nvlink bench --json FILE")
    for number, record in enumerate(records):
        problem = record_problem(record)
        if problem:
            raise BenchError(f"--from_json {path!r}: record {number} (label {record.get('label')!r}) {problem}; "
                             f"write the file again with tf-nvlink bench --json FILE")
    return [r for r in records if r["status"] != "skipped"]


def record_problem(record: dict) -> Optional[str]:
    """What is wrong with one bench record's fields (None when it can be summarised and plotted).

    Example:
        >>> record_problem({"label": "nccl:1", ..., "status": "ok", "size_bytes": "16M", ...})
        "has size_bytes='16M', expected a positive integer of bytes"
    """
    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    def integer(v, minimum):
        return isinstance(v, int) and not isinstance(v, bool) and v >= minimum

    checks = [("label", lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
              ("candidate", lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
              ("variant", lambda v: isinstance(v, str), "a string"),
              ("status", lambda v: v in ("ok", "wrong", "failed", "skipped"), "ok, wrong, failed or skipped")]
    if record.get("status") in ("ok", "wrong"):
        checks += [("size_bytes", lambda v: integer(v, 1), "a positive integer of bytes"),
                   ("busbw", number, "a finite non-negative number (GB/s)"),
                   ("wrong", lambda v: integer(v, 0), "a non-negative integer")]
    for field, ok, expected in checks:
        if not ok(record[field]):
            return f"has {field}={record[field]!r}, expected {expected}"
    return None


def run_from_json(args: argparse.Namespace) -> int:
    """`tf-nvlink bench --from_json FILE [--plot P.png]`: the summary (and plot) of earlier records."""
    try:
        records = load_records(args.from_json)
        if args.plot:
            check_plot_available()
    except BenchError as exc:
        return _error(args, str(exc))
    blocks = [f"# tf-nvlink bench: records from {args.from_json}", render_summary(records)]
    if any(r["variant"] == P2P_VARIANT for r in records):
        blocks.append(render_p2p_ratio(records))
    blocks.append(result_line(records))
    sys.stdout.write("\n#\n".join(blocks) + "\n")
    if args.plot:
        plot(records, args.plot, title=f"all-reduce busbw ({os.path.basename(args.from_json)})")
        print(f"# plot written to {args.plot}")
    return exit_code(records)


def run(args: argparse.Namespace) -> int:
    """`tf-nvlink bench`: measure, print the tables (or JSON), write --json/--plot files; 1 on wrong sums."""
    if getattr(args, "from_json", None):
        return run_from_json(args)
    try:
        candidates = _listify(args.candidates, parse_candidates)
        sizes = _listify(args.sizes, parse_sizes)
        if args.max_size:
            sizes = [s for s in sizes if s <= args.max_size]
            if not sizes:
                raise BenchError(f"--max_size {format_size(args.max_size)} leaves no size to measure.")
        env = parse_env(args.env)
        if args.compare_p2p and "NCCL_P2P_DISABLE" in env:
            raise BenchError("--compare_p2p sets NCCL_P2P_DISABLE itself; drop it from --env.")
        if args.plot:
            check_plot_available()
        for flag, path in (("--json", args.json), ("--plot", args.plot)):
            problem = atomic.unwritable_reason(path) if path and path != "-" else None
            if problem:  # now, not after minutes of measuring
                raise BenchError(f"{flag} {path!r} cannot be written: {problem}.")
        target = resolve_target(args.devices, args.gpus)
    except BenchError as exc:
        return _error(args, str(exc))
    runs, _ = plan_runs(candidates, target)
    if not runs:
        skipped = "; ".join(f"{c.label}: {skip_reason(c, target)}" for c in candidates)
        return _error(args, f"no candidate can run on {target.describe()} ({skipped}).")
    options = dict(iters=args.iters, warmup=args.warmup, repeats=args.repeats, timeout=args.timeout)
    records, skipped = measure(candidates, target, sizes, env=env, **options)
    if args.compare_p2p:
        more, _ = measure(candidates, target, sizes, env=dict(env, **P2P_ENV), variant=P2P_VARIANT, **options)
        records += more
    command = command_line(args)
    if args.json == "-":
        for label, reason in skipped:
            print(f"# skipped {label}: {reason}", file=sys.stderr)
        print(json.dumps(records + _skipped_records(skipped, target), indent=1, allow_nan=False))
    else:
        sys.stdout.write(render_text(command, target, records, skipped, args.iters, args.warmup, args.repeats, env,
                                     args.compare_p2p))
        if args.json:
            text = json.dumps(records + _skipped_records(skipped, target), indent=1, allow_nan=False)
            try:
                atomic.write_atomic(args.json, text, mode=None)
                print(f"# JSON records written to {args.json}")
            except OSError as exc:  # the folder changed while measuring: keep the measurement, say why
                print(text)
                print(f"tf-nvlink bench: error: could not write --json {args.json!r} ({exc.strerror or exc}); the "
                      f"records are printed above instead.", file=sys.stderr)
                return 1
    if args.plot:
        try:
            plot(records, args.plot, title=f"all-reduce busbw, {target.describe().split(';')[0]}")
        except OSError as exc:
            print(f"tf-nvlink bench: error: could not write --plot {args.plot!r} ({exc.strerror or exc}); the "
                  f"results are printed above.", file=sys.stderr)
            return 1
        if args.json != "-":
            print(f"# plot written to {args.plot}")
    return exit_code(records)


def _skipped_records(skipped: Sequence[tuple[str, str]], target: Target) -> list[dict]:
    return [_record(candidate=label, label=label, variant="", env={}, device_type=target.device_type,
                    n_gpus=len(target.gpus), n_replicas=target.n, status="skipped", error=reason)
            for label, reason in skipped]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m tf_nvlink.bench ...`: the same as `tf-nvlink bench ...` (plus the hidden worker mode)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m tf_nvlink.bench", description=HELP)
    add_arguments(parser)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--candidate", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--inspect", action="store_true", help=argparse.SUPPRESS)  # with --worker: graph counts
    args = parser.parse_args(argv)
    if args.worker:
        return _worker_main(args)
    args.command_line = shlex.join(["python", "-m", "tf_nvlink.bench", *argv])
    args.subparser = parser
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
