"""Multi-worker cluster descriptions, parsed strictly: `TF_CONFIG` (`parse_tf_config`) or a cluster resolver
(`ClusterConfig.from_resolver`). Pure: no TensorFlow, no network.

Bad JSON, a bad shape, a task that is not in the cluster or duplicate addresses fail at once with a message naming
the bad value, not minutes later inside gRPC.

Example:
    >>> from tf_nvlink.machine import cluster_config
    >>> cluster_config.parse_tf_config('{"cluster": {"worker": ["a:1", "b:1"]}, "task": {"type": "worker", "index": 1}}').task
    'worker:1'
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Mapping, Optional

from tf_nvlink.util.strict_json import StrictJsonError, strict_loads

# The jobs MultiWorkerMirroredStrategy knows: the all-reduce runs over "chief" and "worker"; an "evaluator"
# evaluates checkpoints on the side and is not part of it.
COLLECTIVE_JOBS = ("chief", "worker")
JOBS = COLLECTIVE_JOBS + ("evaluator",)
_EXAMPLE = ('{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}')
_ADDRESS = re.compile(r"^(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.\-]+)):(?P<port>\d{1,5})$")


class TfConfigError(ValueError):
    """TF_CONFIG (or a cluster resolver's cluster) cannot describe a MultiWorkerMirroredStrategy cluster."""


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
    try:
        return strict_loads(text, overflow_ok=True)  # an index of 1e999 is named as index=inf
    except StrictJsonError as error:
        if error.kind == "duplicate":
            raise TfConfigError(f"TF_CONFIG names the key {error.detail!r} twice in one object; JSON parsers "
                                f"disagree on which one wins, so tf_nvlink refuses it. Received: "
                                f"TF_CONFIG={_clip(text)}") from None
        raise TfConfigError(f"TF_CONFIG contains {error.detail}, which is not JSON (only Python's json module "
                            f"accepts it). Received: TF_CONFIG={_clip(text)}") from None
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
