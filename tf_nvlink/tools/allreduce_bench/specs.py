"""The benchmark's request: sizes, candidates, the target devices, and the bus-bandwidth maths. No TensorFlow.

Example:
    >>> from tf_nvlink.tools.allreduce_bench import specs
    >>> specs.parse_sizes("1K,16M"), specs.parse_candidate("nccl:4")
    ([1024, 16777216], Candidate(name='nccl', num_packs=4))
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Optional, Sequence

from tf_nvlink.machine import nvml
from tf_nvlink.machine import tf_devices as devices_lib
from tf_nvlink.machine.topology import Topology
from tf_nvlink.plan import policy
from tf_nvlink.plan import gpu_request
from tf_nvlink.plan.allreduce_sizes import GIB, KIB, MAX_PACKS, MAX_SIZE, MIB

DEFAULT_SIZES = tuple(MIB * 4**i for i in range(6))  # 1, 4, 16, 64, 256, 1024 MiB
CANDIDATE_NAMES = ("collective", "nccl", "hierarchical", "reduce_to_one", "auto", "xla")
DEFAULT_CANDIDATES = "collective,nccl:1,nccl:4,hierarchical:1,reduce_to_one,auto,xla"
# What the "xla" candidate measures: the all-reduce a jit_compile=True model does in fused mode (tf_nvlink.training.install).
XLA_DOC = ("CollectiveAllReduce compiled into one XLA program per replica (replica_ctx.all_reduce, no merge_call: "
           "what jit_compile=True models all-reduce with in tf_nvlink's fused mode)")
DTYPE_BYTES = 4  # float32
# The local-work correction may remove at most this share of the chained time (so it at most doubles algbw): at
# tiny sizes per-op overhead dominates both chains and their difference is noise.
MAX_LOCAL_SHARE = 0.5
P2P_ENV = {"NCCL_P2P_DISABLE": "1"}
P2P_VARIANT = "nop2p"  # the label suffix tf_nvlink.tools.training_bench.cli uses for NCCL_P2P_DISABLE=1 runs


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
    shape: str = ""  # Topology.shape()
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
        return Target("CPU", n, fingerprint=Topology().fingerprint(), shape="cpu")
    if text != "gpu":
        raise BenchError(f"--devices should be 'gpu' (the GPUs --gpus names) or 'cpu:N' (N logical CPU devices). "
                         f"Received: {devices!r}")
    topology = topology if topology is not None else nvml.probe()
    if not topology.gpus:
        raise BenchError(f"no GPU found ({topology.error or 'NVML lists none'}). To exercise the benchmark "
                         "without GPUs, use --devices cpu:2 (2 logical CPU devices).")
    visible = devices_lib.visible_nvml_indices(topology)
    try:
        chosen = gpu_request.parse_gpus(gpus, topology, visible)
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    if not chosen:
        raise BenchError(f"--gpus {gpus!r} selects no GPU among {list(visible)}.")
    gbps = topology.min_pair_gbps(chosen) if len(chosen) > 1 else 0.0
    note = policy.nvlink_text(gbps)
    return Target("GPU", len(chosen), tuple(chosen), topology.fingerprint(), topology.shape(chosen), note)


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


