"""Scale-out: `tf.distribute.MultiWorkerMirroredStrategy` across hosts, its all-reduce chosen from each worker's
local GPUs and links.

TensorFlow's multi-worker training runs one process per worker; `TF_CONFIG` (or a cluster resolver, e.g.
`tf.distribute.cluster_resolver.SlurmClusterResolver`) tells each process the cluster and which task it is.
This module

- parses `TF_CONFIG` strictly (`parse_tf_config`): bad JSON, a bad shape, a task that is not in the cluster or
  duplicate addresses fail at once with a message naming the bad value, not minutes later inside gRPC;
- picks the collective implementation from this worker's topology (`communication_options`): NCCL on GPUs,
  RING on CPU-only workers;
- waits, bounded, until every other worker accepts TCP connections (`wait_for_peers`), so a missing or
  misaddressed worker is an error naming its address instead of a silent hang;
- builds the strategy and a plan recording every worker's topology (`build_strategy`).

Example (each worker runs the same program; only TF_CONFIG's task index differs):
    >>> from tf_nvlink import multi_worker, nvml
    >>> cluster = multi_worker.parse_tf_config(os.environ.get("TF_CONFIG"))
    >>> strategy, plan = multi_worker.build_strategy(nvml.probe(), cluster)   # first thing in the program
    >>> print(plan.summary())
    tf_nvlink plan: MultiWorkerMirroredStrategy, 2 workers x 2 GPU replica(s) = 4 replicas; this is worker:0 ...

Only the standard library is imported here at module level: TensorFlow is imported when a strategy or
communication options are built, so `parse_tf_config` stays instant.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import re
import socket
import time
from typing import Any, Mapping, Optional, Sequence

from tf_nvlink import devices as devices_lib
from tf_nvlink import nvml, policy
from tf_nvlink.topology import Topology

log = logging.getLogger("tf_nvlink")

DEFAULT_PEER_TIMEOUT_S = 60.0
# The jobs MultiWorkerMirroredStrategy knows: the all-reduce runs over "chief" and "worker"; an "evaluator"
# evaluates checkpoints on the side and is not part of it.
COLLECTIVE_JOBS = ("chief", "worker")
JOBS = COLLECTIVE_JOBS + ("evaluator",)
_EXAMPLE = ('{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}')
_ADDRESS = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d{1,5})$")
_KV_PREFIX = "tf_nvlink/multi_worker/worker/"


class TfConfigError(ValueError):
    """TF_CONFIG (or a cluster resolver's cluster) cannot describe a MultiWorkerMirroredStrategy cluster."""


class PeerUnreachableError(TimeoutError):
    """Some other worker did not accept a TCP connection within the timeout."""


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """A validated cluster: job name -> task addresses ("host:port"), and which task this process is.

    Worker ids follow TensorFlow (`multi_worker_util.id_in_cluster`): the chief is 0, then the workers in order.
    """

    jobs: Mapping[str, tuple[str, ...]]
    task_type: str
    task_index: int
    rpc_layer: Optional[str] = None
    source: str = "TF_CONFIG"

    @property
    def task(self) -> str:
        """This task as "worker:1"."""
        return f"{self.task_type}:{self.task_index}"

    @property
    def address(self) -> str:
        return self.jobs[self.task_type][self.task_index]

    @property
    def members(self) -> tuple[tuple[str, str], ...]:
        """(task, address) of everyone in the all-reduce, by worker id: the chief, then the workers."""
        return tuple((f"{job}:{i}", address) for job in COLLECTIVE_JOBS
                     for i, address in enumerate(self.jobs.get(job, ())))

    @property
    def worker_count(self) -> int:
        return len(self.members)

    @property
    def worker_id(self) -> Optional[int]:
        """This task's place in the all-reduce (0 = the chief, or worker 0 without a chief); None for an evaluator."""
        tasks = [task for task, _ in self.members]
        return tasks.index(self.task) if self.task in tasks else None

    @property
    def is_chief(self) -> bool:
        """Whether this task saves the model and checkpoints (TensorFlow's rule: the chief, else worker 0)."""
        return self.worker_id == 0

    @property
    def peers(self) -> tuple[tuple[str, str], ...]:
        """(task, address) of the other members of the all-reduce."""
        return tuple(member for member in self.members if member[0] != self.task)

    def cluster_spec(self) -> dict[str, list[str]]:
        """The cluster as `tf.train.ClusterSpec` takes it."""
        return {job: list(addresses) for job, addresses in self.jobs.items()}

    def to_dict(self) -> dict:
        return {"cluster": self.cluster_spec(), "task": {"type": self.task_type, "index": self.task_index},
                "rpc_layer": self.rpc_layer, "source": self.source, "worker_count": self.worker_count,
                "worker_id": self.worker_id, "is_chief": self.is_chief}

    @classmethod
    def from_resolver(cls, resolver) -> "ClusterConfig":
        """The cluster a `tf.distribute.cluster_resolver.ClusterResolver` describes, validated like TF_CONFIG."""
        name = type(resolver).__name__
        spec = resolver.cluster_spec()
        jobs = spec.as_dict() if hasattr(spec, "as_dict") else dict(spec)
        # ClusterSpec.as_dict() gives a dict {index: address} for sparse jobs: keep them only when dense.
        for job, tasks in list(jobs.items()):
            if isinstance(tasks, dict):
                if sorted(tasks) != list(range(len(tasks))):
                    raise TfConfigError(f"{name}: job {job!r} has tasks {sorted(tasks)}; MultiWorkerMirroredStrategy "
                                        f"needs tasks numbered 0..N-1 without gaps. Received: {job}={tasks!r}")
                jobs[job] = [tasks[i] for i in range(len(tasks))]
        return _validate({"cluster": jobs, "task": {"type": resolver.task_type, "index": resolver.task_id}},
                         source=name, rpc_layer=getattr(resolver, "rpc_layer", None))


# ---- TF_CONFIG --------------------------------------------------------------------------------------------

def parse_tf_config(text: Optional[str]) -> Optional[ClusterConfig]:
    """The cluster `TF_CONFIG` describes, or None when this process trains alone.

    None when `text` is None or blank (TF_CONFIG unset), when the cluster has one member (a chief or a single
    worker: the single-host strategy is the right one), and for the evaluator task (it evaluates checkpoints on
    its own and takes no part in the all-reduce). JSON is parsed strictly: NaN/Infinity and duplicate keys are
    errors.

    Raises:
        TfConfigError (a ValueError) naming what is wrong and the value received.

    Example:
        >>> parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}').task
        'worker:1'
    """
    if text is None or not text.strip():
        return None
    data = _strict_json(text)
    if not isinstance(data, dict):
        raise TfConfigError(f"TF_CONFIG should be a JSON object such as {_EXAMPLE}; got a JSON "
                            f"{_json_type(data)}. Received: TF_CONFIG={_clip(text)}")
    rpc_layer = data.get("rpc_layer")
    if rpc_layer is not None and (not isinstance(rpc_layer, str) or not rpc_layer):
        raise TfConfigError(f'TF_CONFIG "rpc_layer" should be a protocol name such as "grpc". '
                            f"Received: rpc_layer={rpc_layer!r}")
    cluster = _validate(data, source="TF_CONFIG", rpc_layer=rpc_layer)
    if cluster.worker_id is None or cluster.worker_count == 1:
        return None
    return cluster


def _strict_json(text: str) -> Any:
    def no_duplicates(pairs):
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise TfConfigError(f"TF_CONFIG names the key {key!r} twice in one object; JSON parsers disagree "
                                    f"on which one wins, so tf_nvlink refuses it. Received: TF_CONFIG={_clip(text)}")
            seen[key] = value
        return seen

    def no_constants(name):
        raise TfConfigError(f"TF_CONFIG contains {name}, which is not JSON (only Python's json module accepts "
                            f"it). Received: TF_CONFIG={_clip(text)}")

    try:
        return json.loads(text, object_pairs_hook=no_duplicates, parse_constant=no_constants)
    except json.JSONDecodeError as error:
        raise TfConfigError(f"TF_CONFIG is not valid JSON: {error.msg} at line {error.lineno} column "
                            f"{error.colno}. It should look like {_EXAMPLE}. Received: TF_CONFIG={_clip(text)}"
                            ) from None


def _validate(data: dict, source: str, rpc_layer: Optional[str]) -> ClusterConfig:
    where = source
    if "cluster" not in data:
        raise TfConfigError(f'{where} has no "cluster": it should name every task\'s address, e.g. {_EXAMPLE}. '
                            f"Received keys: {sorted(data)}")
    cluster = data["cluster"]
    if not isinstance(cluster, dict) or not cluster:
        raise TfConfigError(f'{where} "cluster" should be a non-empty object mapping job names ("chief", "worker", '
                            f'"evaluator") to lists of "host:port". Received: cluster={cluster!r}')
    jobs: dict[str, tuple[str, ...]] = {}
    seen: dict[tuple[str, int], str] = {}
    for job, addresses in cluster.items():
        if job == "ps":
            raise TfConfigError(f'{where} names a "ps" (parameter server) job: that is the cluster of '
                                f"tf.distribute.experimental.ParameterServerStrategy. MultiWorkerMirroredStrategy "
                                f"takes the jobs {list(JOBS)}. Received: cluster={cluster!r}")
        if job not in JOBS:
            raise TfConfigError(f"{where} names an unknown job {job!r}; MultiWorkerMirroredStrategy takes the jobs "
                                f"{list(JOBS)}. Received: cluster={cluster!r}")
        if not isinstance(addresses, list) or not addresses:
            raise TfConfigError(f'{where} cluster.{job} should be a non-empty list of "host:port" strings. '
                                f"Received: {job}={addresses!r}")
        if job in ("chief", "evaluator") and len(addresses) > 1:
            raise TfConfigError(f"{where} cluster.{job} lists {len(addresses)} tasks; there can be only one {job}. "
                                f"Received: {job}={addresses!r}")
        for index, address in enumerate(addresses):
            key = _address_key(address, f"{where} cluster.{job}[{index}]")
            if key in seen:
                raise TfConfigError(f"{where} cluster.{job}[{index}] and {seen[key]} are the same address "
                                    f"{address!r}: every task needs its own host:port (on one host, give each task "
                                    f"its own port). Received: cluster={cluster!r}")
            seen[key] = f"cluster.{job}[{index}]"
        jobs[job] = tuple(addresses)
    if not any(job in jobs for job in COLLECTIVE_JOBS):
        raise TfConfigError(f'{where} cluster has no "chief" or "worker" task to train; it names only '
                            f"{sorted(jobs)}. Received: cluster={cluster!r}")

    if "task" not in data:
        raise TfConfigError(f'{where} has no "task": each process needs to know which task it is, e.g. '
                            f'"task": {{"type": "worker", "index": 0}}. Received keys: {sorted(data)}')
    task = data["task"]
    if not isinstance(task, dict):
        raise TfConfigError(f'{where} "task" should be an object such as {{"type": "worker", "index": 0}}. '
                            f"Received: task={task!r}")
    if "type" not in task or task["type"] in (None, ""):
        raise TfConfigError(f'{where} task has no "type": it should be one of the cluster\'s jobs {list(jobs)}. '
                            f"Received: task={task!r}")
    task_type = task["type"]
    if not isinstance(task_type, str):
        raise TfConfigError(f"{where} task.type should be a job name (a string) among {list(jobs)}. "
                            f"Received: type={task_type!r}")
    if task_type not in jobs:
        known = "" if task_type in JOBS else f" (MultiWorkerMirroredStrategy knows the jobs {list(JOBS)})"
        raise TfConfigError(f"{where} task.type {task_type!r} is not a job of the cluster {list(jobs)}{known}. "
                            f"Received: task={task!r}")
    if "index" not in task or task["index"] is None:
        raise TfConfigError(f'{where} task has no "index": it should say which {task_type} this process is, '
                            f"0 to {len(jobs[task_type]) - 1}. Received: task={task!r}")
    index = task["index"]
    if isinstance(index, bool) or not isinstance(index, int):
        raise TfConfigError(f"{where} task.index should be an integer (JSON number without quotes) from 0 to "
                            f"{len(jobs[task_type]) - 1}. Received: index={index!r}")
    if not 0 <= index < len(jobs[task_type]):
        raise TfConfigError(f"{where} task.index {index} is out of range: cluster.{task_type} lists "
                            f"{len(jobs[task_type])} task(s), so the index should be 0 to "
                            f"{len(jobs[task_type]) - 1}. Received: task={task!r}")
    return ClusterConfig(jobs=jobs, task_type=task_type, task_index=index, rpc_layer=rpc_layer, source=source)


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[ipv6]:port"; ValueError otherwise."""
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    port = int(match["port"]) if match else 0
    if not match or not 1 <= port <= 65535:
        raise ValueError(f'{address!r} is not "host:port" (a host name, IPv4 address or [IPv6] address, and a '
                         "port from 1 to 65535)")
    return (match["ipv6"] or match["host"]), port


def _address_key(address, where: str) -> tuple[str, int]:
    try:
        host, port = split_address(address)
    except ValueError as error:
        raise TfConfigError(f"{where}: {error}. Received: {address!r}") from None
    host = host.lower()
    if host in ("localhost", "::1", "0:0:0:0:0:0:0:1") or host.startswith("127."):
        host = "localhost"  # the same sockets: a duplicate in disguise
    return host, port


def _is_loopback(address: str) -> bool:
    return _address_key(address, "cluster")[0] == "localhost"


def loopback_nccl_env(cluster: ClusterConfig, environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """{"NCCL_SOCKET_IFNAME": "lo"} when every worker's address is loopback and NCCL_SOCKET_IFNAME is unset, else {}.

    Why: NCCL's bootstrap does not use TF_CONFIG's addresses; it picks a network interface by itself and has
    the workers connect to that interface's address. On hosts whose first interface is not reachable from the
    host itself (seen on the lent 2x H200 machine: "socketPollConnect: connect to 192.0.2.2<49843> returned
    Connection refused" from ncclCommInitRankConfig), workers on one host then fail at their first all-reduce.
    When the whole cluster is localhost, the loopback interface is the right one. Workers on several hosts keep
    NCCL's own choice (set NCCL_SOCKET_IFNAME to your network interface where it picks a wrong one).

    Example:
        >>> loopback_nccl_env(parse_tf_config('{"cluster": {"worker": ["localhost:1", "localhost:2"]}, '
        ...                                    '"task": {"type": "worker", "index": 0}}'), environ={})
        {'NCCL_SOCKET_IFNAME': 'lo'}
    """
    environ = os.environ if environ is None else environ
    if "NCCL_SOCKET_IFNAME" in environ or not all(_is_loopback(address) for _, address in cluster.members):
        return {}
    return {"NCCL_SOCKET_IFNAME": "lo"}


def _json_type(value) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


def _clip(text: str, limit: int = 300) -> str:
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


# ---- choosing the collective implementation ---------------------------------------------------------------

def choose_implementation(topology: Topology, local_gpu_count: int,
                          visible: Optional[Sequence[int]] = None) -> tuple[str, str]:
    """("NCCL" | "RING", reason) for a worker with `local_gpu_count` GPUs; pure, no TensorFlow.

    `visible` are the NVML indices of the worker's GPUs (default: the first `local_gpu_count` of those
    `CUDA_VISIBLE_DEVICES` leaves).

    Any GPU means NCCL, whatever the links; only the reason differs. TensorFlow's AUTO is no neutral default on
    GPUs: TensorFlow 2.21 runs NCCL only when the hint says "nccl" (or ConfigProto's collective_nccl is set, which
    MultiWorkerMirroredStrategy does in graph mode only: `CollectiveParamResolverLocal::AssignCollectiveType`), so
    AUTO means its own gRPC ring, which copies every gradient through host memory. NCCL uses NVLink inside the
    worker and InfiniBand/RoCE (or TCP sockets) between workers; a TensorFlow built without NCCL falls back to its
    ring by itself. CPU-only workers get RING (NCCL needs GPUs).
    """
    if isinstance(local_gpu_count, bool) or not isinstance(local_gpu_count, int) or local_gpu_count < 0:
        raise ValueError(f"local_gpu_count should be a non-negative integer. Received: "
                         f"local_gpu_count={local_gpu_count!r}")
    if local_gpu_count == 0:
        if topology.gpus:
            return ("RING", f"NVML sees {len(topology.gpus)} GPU(s) but this worker trains on none (TensorFlow "
                    "without CUDA, or CUDA_VISIBLE_DEVICES hides them): TensorFlow's ring all-reduce over gRPC "
                    "(NCCL needs GPUs)")
        return "RING", "CPU-only worker: TensorFlow's ring all-reduce over gRPC (NCCL needs GPUs)"
    if not topology.gpus:
        return ("NCCL", f"{local_gpu_count} GPU(s) without NVML (interconnect unknown): NCCL all the same, since "
                "TensorFlow's AUTO would mean its gRPC ring through host memory on GPUs")
    if visible is None:
        visible = devices_lib.visible_nvml_indices(topology)[:local_gpu_count]
    visible = tuple(visible)
    if len(visible) != local_gpu_count:
        return ("NCCL", f"this worker trains on {local_gpu_count} GPU(s) but NVML maps {len(visible)} of them "
                f"({list(visible)}), so their links are uncertain: NCCL all the same, since TensorFlow's AUTO would "
                "mean its gRPC ring through host memory on GPUs")
    shape = topology.kind(visible)
    if shape == "single":
        return ("NCCL", "one GPU per worker: NCCL all-reduces across workers (InfiniBand/RoCE when present, TCP "
                "sockets otherwise); TensorFlow's AUTO would mean its gRPC ring through host memory")
    if shape in ("nvswitch", "nvlink-all"):
        link = "through NVSwitch" if shape == "nvswitch" else "by direct NVLink"
        gbps = topology.min_pair_gbps(visible)
        return ("NCCL", f"this worker's {len(visible)} GPUs reach each other {link} ({gbps:.0f} GB/s per "
                "direction): NCCL all-reduces over NVLink inside the worker and over the network between workers")
    what = "only some GPU pairs have NVLink" if shape == "nvlink-partial" else "PCIe only, no NVLink"
    return ("NCCL", f"this worker's {len(visible)} GPUs: {what}; NCCL still (it routes over NVLink where it can "
            "and PCIe elsewhere), since TensorFlow's AUTO would mean its gRPC ring through host memory")


def communication_options(topology: Topology, local_gpu_count: int, visible: Optional[Sequence[int]] = None):
    """(`tf.distribute.experimental.CommunicationOptions`, reason) for this worker; see `choose_implementation`.

    Example:
        >>> options, reason = communication_options(nvml.probe(), local_gpu_count=2)
        >>> options.implementation
        <CommunicationImplementation.NCCL: 'NCCL'>
    """
    import tensorflow as tf  # noqa: PLC0415

    name, reason = choose_implementation(topology, local_gpu_count, visible)
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, name)
    return tf.distribute.experimental.CommunicationOptions(implementation=implementation), reason


# ---- waiting for the other workers ------------------------------------------------------------------------

def wait_for_peers(cluster: ClusterConfig, timeout_s: float = DEFAULT_PEER_TIMEOUT_S, *, listen: bool = True,
                   interval_s: float = 0.2) -> dict[str, float]:
    """Block until every other member of the all-reduce accepts a TCP connection; seconds each one took.

    While waiting, this worker listens on its own port (`listen`), so that workers started at the same time find
    each other before any of them starts TensorFlow's server, which would bind the same port (the listener is
    closed before this returns). A worker that already runs TensorFlow's server answers on that port too.

    Raises:
        PeerUnreachableError: naming each address that did not answer within `timeout_s`, and why.
        TfConfigError: this worker's own port is taken by another process.
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or not timeout_s > 0 \
            or math.isinf(timeout_s):
        raise ValueError(f"peer_timeout_s should be a positive number of seconds. Received: "
                         f"peer_timeout_s={timeout_s!r}")
    start = time.monotonic()
    deadline = start + timeout_s
    listener = _listen(cluster) if listen and cluster.worker_id is not None else None
    pending = dict(cluster.peers)  # task -> address
    reached: dict[str, float] = {}
    last_error: dict[str, str] = {}
    try:
        while True:
            for task, address in list(pending.items()):
                host, port = split_address(address)
                remaining = deadline - time.monotonic()
                try:
                    with socket.create_connection((host, port), timeout=max(0.05, min(2.0, remaining))):
                        pass
                except OSError as error:
                    last_error[task] = _describe(error)
                else:
                    reached[address] = round(time.monotonic() - start, 3)
                    del pending[task]
            _drain(listener)
            if not pending:
                return reached
            if time.monotonic() >= deadline:
                break
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
    finally:
        if listener is not None:
            _drain(listener)
            listener.close()
    missing = "; ".join(f"{task} at {address} ({last_error.get(task, 'no answer')})"
                        for task, address in pending.items())
    raise PeerUnreachableError(
        f"{cluster.task} ({cluster.address}) could not reach {len(pending)} of its {len(cluster.peers)} peer(s) "
        f"within {timeout_s:g} s: {missing}. Start every task of the cluster ({cluster.source}) with its own "
        f"task index, check the host names, ports and firewalls, or wait longer (peer_timeout_s, --peer_timeout).")


def _listen(cluster: ClusterConfig) -> Optional[socket.socket]:
    _, port = split_address(cluster.address)
    try:
        if socket.has_dualstack_ipv6():
            listener = socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        else:
            listener = socket.create_server(("", port), backlog=64)
    except OSError as error:
        raise TfConfigError(f"{cluster.task}'s own address {cluster.address} ({cluster.source}) cannot be used: port "
                            f"{port} is taken on this host ({_describe(error)}). Another process (an earlier run "
                            f"still alive?) holds it, or the task index names another task's port.") from None
    listener.setblocking(False)
    return listener


def _drain(listener: Optional[socket.socket]) -> None:
    """Accept and close whatever connections the peers' checks left queued."""
    while listener is not None:
        try:
            connection, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            return
        connection.close()


def _describe(error: OSError) -> str:
    if isinstance(error, socket.gaierror):
        return f"host name does not resolve: {error.strerror or error}"
    if isinstance(error, (socket.timeout, TimeoutError)):
        return "no answer (connection timed out)"
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: nothing listens on that port yet"
    return error.strerror or str(error) or type(error).__name__


# ---- the strategy and its plan ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """One worker's local view, as it published it after the strategy was built."""

    task: str  # "worker:1"
    address: str
    hostname: str
    fingerprint: str  # Topology.fingerprint() of the worker's machine
    shape: str  # Topology.kind() of the GPUs it trains on
    gpu_count: int  # replicas (GPUs) it trains on; 0 = CPU
    implementation: str  # NCCL / RING

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MultiWorkerPlan:
    """What `build_strategy` built, and why: this worker's `policy.Plan` plus the cluster.

    Attributes the local `Plan` has (gpus, fingerprint, shape, devices, ...) are read through, so code written
    for the single-host plan keeps working.
    """

    local: policy.Plan
    cluster: ClusterConfig
    implementation: str  # NCCL / RING: CommunicationOptions.implementation
    implementation_reason: str
    local_gpu_count: int = 0  # GPUs (replicas) this worker trains on; 0 = one CPU replica
    workers: tuple[Optional[WorkerInfo], ...] = ()  # by worker id; None where a worker's record was not received
    peer_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)  # address -> s until it answered

    def __getattr__(self, name):
        if name.startswith("__") or name == "local":
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def num_replicas(self) -> int:
        return self.cluster.worker_count * max(1, self.local_gpu_count)

    def summary(self) -> str:
        """One line for the log and the report."""
        per_worker = self.local_gpu_count
        kind = f"{per_worker} GPU replica(s)" if per_worker else "1 CPU replica"
        role = " (chief)" if self.cluster.is_chief else ""
        here = (f"GPUs {list(self.local.gpus)} ({self.local.shape}" if per_worker else "CPU (no GPU")
        if self.local.nvlink_gbps:
            here += f", {self.local.nvlink_gbps:.0f} GB/s per direction over NVLink"
        received = [w for w in self.workers if w is not None]
        if received:
            prints = sorted({w.fingerprint for w in received})
            same = "same topology everywhere" if len(prints) == 1 else f"{len(prints)} different topologies"
            others = f"; workers' topologies: {', '.join(f'{w.task} {w.fingerprint}' for w in received)} ({same})"
        else:
            others = ""
        return (f"tf_nvlink plan: MultiWorkerMirroredStrategy, {self.cluster.worker_count} workers x {kind} = "
                f"{self.num_replicas} replicas; this is {self.cluster.task}{role} at {self.cluster.address}: {here}) "
                f"-> CollectiveAllReduce {self.implementation}: {self.implementation_reason} "
                f"[topology {self.local.fingerprint}{others}]")

    def to_dict(self) -> dict:
        record = self.local.to_dict()
        record.update(strategy="MultiWorkerMirroredStrategy", implementation=self.implementation,
                      implementation_reason=self.implementation_reason, local_gpu_count=self.local_gpu_count,
                      cluster=self.cluster.to_dict(),
                      workers=[w.to_dict() if w else None for w in self.workers],
                      peer_seconds=dict(self.peer_seconds))
        return record


@functools.lru_cache(maxsize=None)
def strategy_class():
    """`tf.distribute.MultiWorkerMirroredStrategy` with a `plan` (defined on first use: imports TensorFlow)."""
    import tensorflow as tf  # noqa: PLC0415

    from tf_nvlink import xla  # noqa: PLC0415 - imports TensorFlow

    class NVLinkMultiWorkerMirroredStrategy(xla.PerReplicaXlaStrategyMixin, tf.distribute.MultiWorkerMirroredStrategy):
        """A `tf.distribute.MultiWorkerMirroredStrategy` that knows its plan (`MultiWorkerPlan`) and lets Keras 3
        `fit`/`evaluate` run on several workers.

        `jit_compile=True` models run in tf_nvlink's "split" XLA mode (tf_nvlink/xla.py; `build_strategy` puts
        "split" in the plan, and the plan is None only until then, which means "split" too): gradients are computed
        in XLA and all-reduced outside it by the strategy's collectives. Keras' own path would put the all-reduce
        inside XLA, and XLA's NCCL cannot form a clique across processes in TensorFlow: on 2x H200 both workers
        failed in ncclCommInitRankConfig ("socketPollConnect: connect to 127.0.0.1<port> returned Connection
        refused"), at the first step.

        Keras 3 (3.15 and earlier; keras-team/keras#20585) calls `strategy.reduce` in two ways the stock strategy
        rejects once there are two or more workers: with a tuple of per-replica batches (`_maybe_symbolic_build`,
        "Attempt to convert a value (PerReplica...) to a Tensor") and with `axis=0` on per-replica scalars (the
        logs, in `reduce_per_replica`: "Invalid reduction dimension 0 for input with 0 dimensions"). Here a
        structure is reduced leaf by leaf, and a scalar across the replicas; every call TensorFlow accepts runs
        unchanged.
        """

        @property
        def plan(self) -> Optional[MultiWorkerPlan]:
            return self._tf_nvlink_plan

        def reduce(self, reduce_op, value, axis):
            if isinstance(value, (tuple, list, dict)):
                return tf.nest.map_structure(lambda leaf: self.reduce(reduce_op, leaf, axis), value)
            shape = getattr(value, "shape", None)
            if axis is not None and shape is not None and shape.rank == 0:
                axis = None  # one number per replica: the reduction is across replicas
            local = self.experimental_local_results(value)
            if local and getattr(local[0], "dtype", None) in (tf.int32, tf.uint8, tf.int8, tf.int16, tf.uint16):
                # GPU collectives refuse int32 ("Collective all-reduce does not support datatype DT_INT32 on
                # DEVICE_GPU", int32 lives in host memory there): Keras reduces the integer labels of a batch.
                # Collectives take no 8/16-bit integers at all: Keras reduces uint8 image batches the same way.
                wide = self.run(lambda v: tf.cast(v, tf.int64), args=(value,))
                return tf.cast(super().reduce(reduce_op, wide, axis), local[0].dtype)
            return super().reduce(reduce_op, value, axis)

    return NVLinkMultiWorkerMirroredStrategy


def build_strategy(topology: Topology, cluster: Optional[ClusterConfig], cluster_resolver=None,
                   peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S):
    """A `tf.distribute.MultiWorkerMirroredStrategy` for this worker, and its `MultiWorkerPlan`.

    Call it first thing in the program, before any TensorFlow op runs (TensorFlow's rule: the strategy starts this
    worker's server and configures collectives, which it can only do before the runtime starts).

    Args:
        topology: this worker's machine (`tf_nvlink.nvml.probe()`).
        cluster: from `parse_tf_config`; ignored when `cluster_resolver` is given.
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver` (e.g. `SlurmClusterResolver`);
            its cluster is validated like TF_CONFIG, and its `num_accelerators()["GPU"]` is the GPUs per worker.
        peer_timeout_s: how long to wait for every other worker to accept TCP connections.

    Returns:
        (strategy, plan): the strategy (its `.plan` is the plan too).

    Raises:
        TfConfigError: no usable cluster. PeerUnreachableError: a peer did not answer within `peer_timeout_s`.
        RuntimeError: TensorFlow already ran ops in this process, or the workers disagree on the number of GPUs
            or the collective implementation (TensorFlow would hang on the first all-reduce).
    """
    import tensorflow as tf  # noqa: PLC0415

    if cluster_resolver is not None:
        if not isinstance(cluster_resolver, tf.distribute.cluster_resolver.ClusterResolver):
            raise ValueError(f"cluster_resolver should be a tf.distribute.cluster_resolver.ClusterResolver. "
                             f"Received: cluster_resolver={cluster_resolver!r}")
        cluster = ClusterConfig.from_resolver(cluster_resolver)
    if cluster is None:
        raise TfConfigError("build_strategy needs a cluster of two or more workers: TF_CONFIG (parse_tf_config), a "
                            "ClusterConfig or a cluster_resolver. Received: cluster=None")
    if cluster.worker_id is None:
        raise TfConfigError(f"{cluster.task} is not part of the all-reduce (only {list(COLLECTIVE_JOBS)} are); an "
                            f"evaluator should use the single-host strategy.")
    _check_program_start()

    local_gpu_count = _local_gpu_count(tf, cluster_resolver)
    visible = tuple(devices_lib.visible_nvml_indices(topology)[:local_gpu_count]) if topology.gpus else ()
    options, reason = communication_options(topology, local_gpu_count, visible if topology.gpus else None)
    implementation = options.implementation.name
    nccl_env = loopback_nccl_env(cluster) if implementation == "NCCL" else {}
    if nccl_env:  # NCCL reads it when its communicators start, at the first all-reduce: after this point is fine
        os.environ.update(nccl_env)
        reason += "; every worker is on this host, so NCCL bootstraps over the loopback interface " + " ".join(
            f"({key}={value})" for key, value in nccl_env.items())
    if topology.warnings:  # one line, however many NVML calls failed (`tf-nvlink report` lists them all)
        log.warning("tf_nvlink: %s", nvml.warnings_line(topology.warnings))
    log.info("tf_nvlink: %s of %d workers at %s waits up to %g s for its peers", cluster.task,
             cluster.worker_count, cluster.address, peer_timeout_s)
    peer_seconds = wait_for_peers(cluster, peer_timeout_s)

    resolver = cluster_resolver or tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec()), task_type=cluster.task_type, task_id=cluster.task_index,
        rpc_layer=cluster.rpc_layer or "grpc", num_accelerators={"GPU": local_gpu_count} if local_gpu_count else {})
    try:
        built = strategy_class()(cluster_resolver=resolver, communication_options=options)
    except (RuntimeError, ValueError, tf.errors.OpError) as error:
        raise RuntimeError(f"MultiWorkerMirroredStrategy could not start {cluster.task} at {cluster.address}: "
                           f"{type(error).__name__}: {error}") from error

    gpus = tuple(visible)  # NVML indices (fewer than local_gpu_count only where NVML cannot map them all)
    shape = topology.kind(gpus)
    me = WorkerInfo(task=cluster.task, address=cluster.address, hostname=socket.gethostname(),
                    fingerprint=topology.fingerprint(), shape=shape if local_gpu_count else "none",
                    gpu_count=local_gpu_count, implementation=implementation)
    workers = _exchange(cluster, me, peer_timeout_s)
    _check_agreement(workers)
    local = policy.Plan(
        gpus=gpus, cross_device_ops="collective", num_packs=None,
        reason=(f"MultiWorkerMirroredStrategy over {cluster.worker_count} workers ({cluster.task} here): "
                f"CollectiveAllReduce with implementation {implementation}: {reason}"),
        fingerprint=topology.fingerprint(), shape=shape,
        nvlink_gbps=round(topology.min_pair_gbps(gpus), 1) if len(gpus) > 1 else 0.0,
        devices=tuple(built.extended.worker_devices), xla_allreduce="split", requested=("all", "auto", None))
    plan = MultiWorkerPlan(local=local, cluster=cluster, implementation=implementation, implementation_reason=reason,
                           local_gpu_count=local_gpu_count, workers=workers, peer_seconds=peer_seconds)
    built._tf_nvlink_plan = plan  # noqa: SLF001
    from tf_nvlink import xla  # noqa: PLC0415

    xla.enable_per_replica_xla()
    log.info(plan.summary())
    return built, plan


def check_single_host_options(gpus="all", cross_device_ops="auto", num_packs=None, devices=None,
                              xla_allreduce="auto") -> None:
    """ValueError for `tf_nvlink.strategy()` arguments that only mean something on a single host.

    MultiWorkerMirroredStrategy trains on every GPU TensorFlow sees on each worker (restrict them with
    `CUDA_VISIBLE_DEVICES`) and all-reduces with CollectiveAllReduce, so a GPU selection, another cross-device
    op, packs, explicit devices or fused XLA all-reduce cannot be honoured; silently ignoring them would be worse.
    """
    unsupported = []
    if not (isinstance(gpus, str) and gpus.strip().lower() == "all"):
        unsupported.append(f"gpus={gpus!r} (each worker uses every GPU TensorFlow sees: set CUDA_VISIBLE_DEVICES)")
    if not (isinstance(cross_device_ops, str) and cross_device_ops in ("auto", "collective")):
        unsupported.append(f"cross_device_ops={cross_device_ops!r} (across workers it is CollectiveAllReduce, its "
                           "implementation chosen from each worker's topology)")
    if num_packs is not None:
        unsupported.append(f"num_packs={num_packs!r}")
    if devices:
        unsupported.append(f"devices={list(devices)!r}")
    if xla_allreduce == "fused":
        unsupported.append("xla_allreduce='fused'")
    if unsupported:
        raise ValueError("TF_CONFIG (or cluster_resolver) asks for multi-worker training, where these arguments do "
                         f"not apply: {'; '.join(unsupported)}. Leave them at their defaults.")


def _check_program_start() -> None:
    from tensorflow.python.eager import context  # noqa: PLC0415

    if getattr(context.context(), "_initialized", False):
        raise RuntimeError(
            "MultiWorkerMirroredStrategy must be created at program start, before any TensorFlow op runs: this "
            "process has already started TensorFlow's runtime, so the strategy can no longer start this worker's "
            "server. Build the strategy first thing in main() (before loading data with tf.data, creating tensors "
            "or models).")


def _local_gpu_count(tf, cluster_resolver) -> int:
    """The GPUs MultiWorkerMirroredStrategy will use on this worker (its own rule, without starting TensorFlow)."""
    if cluster_resolver is None or isinstance(cluster_resolver,
                                              tf.distribute.cluster_resolver.TFConfigClusterResolver):
        return len(tf.config.list_physical_devices("GPU"))
    return int(cluster_resolver.num_accelerators().get("GPU", 0))


def _exchange(cluster: ClusterConfig, me: WorkerInfo, timeout_s: float) -> tuple[Optional[WorkerInfo], ...]:
    """Every worker's `WorkerInfo`, through the coordination service's key-value store (a few small RPCs, no
    collective, so workers with different devices can still tell each other so). Unknown entries stay None."""
    workers: list[Optional[WorkerInfo]] = [None] * cluster.worker_count
    workers[cluster.worker_id] = me
    try:
        for worker_id, data in _share(cluster, "", me.to_dict(), timeout_s):
            if worker_id != cluster.worker_id:
                workers[worker_id] = WorkerInfo(**data)
    except Exception as error:  # noqa: BLE001 - the records are informative; training does not need them
        log.warning("tf_nvlink: could not gather the other workers' topologies (%s: %s); the plan lists this "
                    "worker's only", type(error).__name__, str(error).splitlines()[0] if str(error) else "")
    return tuple(workers)


def check_same_everywhere(strategy, name: str, value, timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                          hint: str = "") -> None:
    """Raise RuntimeError on every worker unless all workers pass the same JSON-able `value` for `name`.

    For facts the workers must share before training, such as the epoch a resumed run starts from: workers that
    disagree would run different numbers of steps, and the first all-reduce one of them misses hangs the rest.
    The values travel through the coordination service's key-value store (no collective). `name` must be unique
    per check in a run; `hint` ends the error message (what to fix).

    Example:
        >>> multi_worker.check_same_everywhere(strategy, "resume_epoch", 3,
        ...                                    hint="Put --model_dir on storage every worker reaches.")
    """
    plan = getattr(strategy, "plan", None)
    if not isinstance(plan, MultiWorkerPlan):
        raise ValueError(f"check_same_everywhere needs a tf_nvlink MultiWorkerMirroredStrategy (from TF_CONFIG or "
                         f"cluster_resolver=). Received: {type(strategy).__name__}")
    cluster = plan.cluster
    tasks = [task for task, _ in cluster.members]
    values = {tasks[worker_id]: shared for worker_id, shared in _share(cluster, f"agree/{name}/", value, timeout_s)}
    if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
        table = ", ".join(f"{task}: {v!r}" for task, v in values.items())
        raise RuntimeError(f"The workers disagree on {name} ({table}); {cluster.task} stops here rather than hang "
                           f"at the first all-reduce." + (f" {hint}" if hint else ""))


def _share(cluster: ClusterConfig, key: str, value, timeout_s: float):
    """Publish this worker's JSON-able `value` under `key` in the coordination service's key-value store, then
    yield (worker id, value) for every worker in worker-id order (this worker's own without a round trip), each
    waiting up to `timeout_s` for that worker to publish."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    ctx = context.context()
    ctx.set_config_key_value(f"{_KV_PREFIX}{key}{cluster.worker_id}", json.dumps(value))
    for worker_id in range(cluster.worker_count):
        if worker_id == cluster.worker_id:
            yield worker_id, value
        else:
            yield worker_id, json.loads(ctx.get_config_key_value(f"{_KV_PREFIX}{key}{worker_id}",
                                                                 int(timeout_s * 1000)))


def _check_agreement(workers: Sequence[Optional[WorkerInfo]]) -> None:
    known = [w for w in workers if w is not None]
    if len({w.gpu_count for w in known}) > 1 or len({w.implementation for w in known}) > 1:
        table = "; ".join(f"{w.task} on {w.hostname}: {w.gpu_count} GPU(s), {w.implementation}" for w in known)
        raise RuntimeError(
            f"The workers disagree: {table}. MultiWorkerMirroredStrategy needs the same number of GPUs on every "
            f"worker (and so the same collective implementation); otherwise the first all-reduce hangs. Give "
            f"every worker the same GPUs (CUDA_VISIBLE_DEVICES) or leave out the odd one.")
