"""Scale-out: `tf.distribute.MultiWorkerMirroredStrategy` across hosts, its all-reduce chosen from each worker's
local GPUs and links.

TensorFlow's multi-worker training runs one process per worker; `TF_CONFIG` (or a cluster resolver, e.g.
`tf.distribute.cluster_resolver.SlurmClusterResolver`) tells each process the cluster and which task it is.
The jobs are split: `tf_nvlink.machine.cluster_config` parses the cluster (pure), `policy.choose_implementation` picks the
collective implementation (NCCL on GPUs, RING on CPU-only workers), `tf_nvlink.distribute.rendezvous` waits for the peers
(network). This module builds the strategy and a plan recording every worker's topology (`build_strategy`), and
shares small facts between workers (`check_same_everywhere`). It imports TensorFlow; `tf_nvlink.machine.cluster_config` does not.
Programs call `tf_nvlink.strategy()`, which builds this strategy when TF_CONFIG names several workers and also
installs the training hooks (`tf_nvlink.training.install.install_training_hooks`); the example shows the parts.

Example (each worker runs the same program; only TF_CONFIG's task index differs):
    >>> from tf_nvlink.machine import cluster_config, nvml; from tf_nvlink.distribute import multi_worker
    >>> config = cluster_config.parse_tf_config(os.environ.get("TF_CONFIG"))
    >>> strategy, plan = multi_worker.build_strategy(nvml.probe(), config)   # first thing in the program
    >>> os.environ.update(plan.process_env)   # what tf_nvlink.strategy() does: NCCL reads it at its first all-reduce
    >>> install.install_training_hooks(strategy)   # from tf_nvlink.training import install; so does it
    >>> print(plan.summary())
    tf_nvlink plan: MultiWorkerMirroredStrategy, 2 workers x 2 GPU replica(s) = 4 replicas; this is worker:0 ...
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
from typing import Mapping, Optional, Sequence

import tensorflow as tf

from tf_nvlink.internals import tf_runtime
from tf_nvlink.distribute import base
from tf_nvlink.distribute.rendezvous import DEFAULT_PEER_TIMEOUT_S, wait_for_peers
from tf_nvlink.machine import nvml
from tf_nvlink.machine import tf_devices as devices_lib
from tf_nvlink.machine.cluster_config import COLLECTIVE_JOBS, ClusterConfig, TfConfigError, loopback_nccl_env
from tf_nvlink.machine.topology import Topology
from tf_nvlink.plan import policy
from tf_nvlink.plan.policy import choose_implementation

log = logging.getLogger("tf_nvlink")

_KV_PREFIX = "tf_nvlink/multi_worker/worker/"

def communication_options(topology: Topology, local_gpu_count: int, visible: Optional[Sequence[int]] = None):
    """(`tf.distribute.experimental.CommunicationOptions`, reason) for this worker; see `choose_implementation`.

    Example:
        >>> options, reason = communication_options(nvml.probe(), local_gpu_count=2)
        >>> options.implementation
        <CommunicationImplementation.NCCL: 'NCCL'>
    """
    name, reason = choose_implementation(topology, local_gpu_count, visible)
    implementation = getattr(tf.distribute.experimental.CommunicationImplementation, name)
    return tf.distribute.experimental.CommunicationOptions(implementation=implementation), reason



# ---- the strategy and its plan ----------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """One worker's local view, as it published it after the strategy was built."""

    task: str  # "worker:1"
    address: str
    hostname: str
    fingerprint: str  # Topology.fingerprint() of the worker's machine
    shape: str  # Topology.shape() of the GPUs it trains on
    gpu_count: int  # replicas (GPUs) it trains on; 0 = CPU
    implementation: str  # NCCL / RING

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MultiWorkerPlan:
    """What `build_strategy` built, and why: this worker's `policy.Plan` plus the cluster.

    The properties below read the local `Plan`'s fields that code written for either plan uses (the device
    list, the XLA mode); anything else is in `local`.
    """

    local: policy.Plan
    cluster: ClusterConfig
    implementation: str  # NCCL / RING: CommunicationOptions.implementation
    implementation_reason: str
    local_gpu_count: int = 0  # GPUs (replicas) this worker trains on; 0 = one CPU replica
    workers: tuple[Optional[WorkerInfo], ...] = ()  # by worker id; None where a worker's record was not received
    peer_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)  # address -> s until it answered
    # Environment variables this process needs before its first all-reduce (tf_nvlink.strategy() exports them).
    process_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def gpus(self) -> tuple[int, ...]:
        """NVML indices of this worker's GPUs."""
        return self.local.gpus

    @property
    def devices(self) -> tuple[str, ...]:
        """This worker's TensorFlow devices."""
        return self.local.devices

    @property
    def fingerprint(self) -> str:
        """This worker's topology fingerprint."""
        return self.local.fingerprint

    @property
    def shape(self) -> str:
        """The shape of this worker's GPUs (`Topology.kind`)."""
        return self.local.shape

    @property
    def on_cpu(self) -> bool:
        """True when this worker trains on its CPU (no GPU)."""
        return self.local.on_cpu

    @property
    def cross_device_ops(self) -> str:
        """Always "collective": MultiWorkerMirroredStrategy all-reduces with CollectiveAllReduce."""
        return self.local.cross_device_ops

    @property
    def xla_allreduce(self) -> str:
        """Always "split" (see `NVLinkMultiWorkerMirroredStrategy`)."""
        return self.local.xla_allreduce

    @property
    def allreduce_dtype(self) -> str:
        """The gradient all-reduce's dtype ("float32": the option is single-host only)."""
        return self.local.allreduce_dtype

    @property
    def input_buffer(self) -> int:
        """Batches prefetched per replica (the single-host option; its default here)."""
        return self.local.input_buffer

    @property
    def num_replicas(self) -> int:
        return self.cluster.worker_count * max(1, self.local_gpu_count)

    def summary(self) -> str:
        """One line for the log and the report."""
        per_worker = self.local_gpu_count
        kind = f"{per_worker} GPU replica(s)" if per_worker else "1 CPU replica"
        role = " (chief)" if self.cluster.is_chief else ""
        here = policy.gpus_text(self.local.gpus, self.local.shape, self.local.nvlink_gbps, on_gpu=bool(per_worker))
        received = [w for w in self.workers if w is not None]
        if received:
            prints = sorted({w.fingerprint for w in received})
            same = "same topology everywhere" if len(prints) == 1 else f"{len(prints)} different topologies"
            others = f"; workers' topologies: {', '.join(f'{w.task} {w.fingerprint}' for w in received)} ({same})"
        else:
            others = ""
        return (f"tf_nvlink plan: MultiWorkerMirroredStrategy, {self.cluster.worker_count} workers x {kind} = "
                f"{self.num_replicas} replicas; this is {self.cluster.task}{role} at {self.cluster.address}: {here} "
                f"-> CollectiveAllReduce {self.implementation}: {self.implementation_reason} "
                f"[topology {self.local.fingerprint}{others}]")

    def to_dict(self) -> dict:
        record = self.local.to_dict()
        record.update(strategy="MultiWorkerMirroredStrategy", implementation=self.implementation,
                      implementation_reason=self.implementation_reason, local_gpu_count=self.local_gpu_count,
                      cluster=self.cluster.to_dict(),
                      workers=[w.to_dict() if w else None for w in self.workers],
                      peer_seconds=dict(self.peer_seconds), process_env=dict(self.process_env))
        return record


class MultiWorkerKerasReduceMixin:
    """`reduce` as Keras 3 calls it on a MultiWorkerMirroredStrategy (put it before the strategy class).

    Why: Keras 3 (3.15 and earlier; keras-team/keras#20585) calls `strategy.reduce` in two ways the stock strategy
    rejects once there are two or more workers: with a tuple of per-replica batches (`_maybe_symbolic_build`,
    "Attempt to convert a value (PerReplica...) to a Tensor") and with `axis=0` on per-replica scalars (the
    logs, in `reduce_per_replica`: "Invalid reduction dimension 0 for input with 0 dimensions"). Here a
    structure is reduced leaf by leaf, and a scalar across the replicas; every call TensorFlow accepts runs
    unchanged. GPU collectives refuse int32 ("Collective all-reduce does not support datatype DT_INT32 on
    DEVICE_GPU"; int32 lives in host memory there), and Keras reduces the integer labels of a batch: int32 is
    reduced as int64, and so are 8/16-bit integers, which collectives take on no device (uint8 image batches).
    """

    def reduce(self, reduce_op, value, axis):
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(lambda leaf: self.reduce(reduce_op, leaf, axis), value)
        shape = getattr(value, "shape", None)
        if axis is not None and shape is not None and shape.rank == 0:
            axis = None  # one number per replica: the reduction is across replicas
        local = self.experimental_local_results(value)
        if local and getattr(local[0], "dtype", None) in (tf.int32, tf.uint8, tf.int8, tf.int16, tf.uint16):
            wide = self.run(lambda v: tf.cast(v, tf.int64), args=(value,))
            return tf.cast(super().reduce(reduce_op, wide, axis), local[0].dtype)
        return super().reduce(reduce_op, value, axis)


class NVLinkMultiWorkerMirroredStrategy(base.TfNvlinkStrategyMixin, MultiWorkerKerasReduceMixin,
                                        tf.distribute.MultiWorkerMirroredStrategy):
    """A `tf.distribute.MultiWorkerMirroredStrategy` that knows its plan (`MultiWorkerPlan`) and lets Keras 3
    `fit`/`evaluate` run on several workers (`MultiWorkerKerasReduceMixin` says how).

    `jit_compile=True` models run in tf_nvlink's "split" XLA mode (tf_nvlink.training.install; `build_strategy` puts
    "split" in the plan, and the plan is None only until then, which means "split" too): gradients are computed
    in XLA and all-reduced outside it by the strategy's collectives. Keras' own path would put the all-reduce
    inside XLA, and XLA's NCCL cannot form a clique across processes in TensorFlow: on 2x H200 both workers
    failed in ncclCommInitRankConfig ("socketPollConnect: connect to 127.0.0.1<port> returned Connection
    refused"), at the first step.
    """



def build_strategy(topology: Topology, cluster: Optional[ClusterConfig], cluster_resolver=None,
                   peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S):
    """A `tf.distribute.MultiWorkerMirroredStrategy` for this worker, and its `MultiWorkerPlan`.

    Call it first thing in the program, before any TensorFlow op runs (TensorFlow's rule: the strategy starts this
    worker's server and configures collectives, which it can only do before the runtime starts).

    Args:
        topology: this worker's machine (`tf_nvlink.machine.nvml.probe()`).
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
    cluster = _checked_cluster(cluster, cluster_resolver)
    _check_program_start()
    local_gpu_count = _local_gpu_count(tf, cluster_resolver)
    visible = tuple(devices_lib.visible_nvml_indices(topology)[:local_gpu_count]) if topology.gpus else ()
    options, reason, nccl_env = _communication(topology, cluster, local_gpu_count, visible)
    if topology.warnings:  # one line, however many NVML calls failed (`tf-nvlink report` lists them all)
        log.warning("tf_nvlink: %s", nvml.warnings_line(topology.warnings))
    log.info("tf_nvlink: %s of %d workers at %s waits up to %g s for its peers", cluster.task,
             cluster.worker_count, cluster.address, peer_timeout_s)
    peer_seconds = wait_for_peers(cluster, peer_timeout_s)
    built = _start_strategy(cluster, cluster_resolver, local_gpu_count, options)

    implementation = options.implementation.name
    shape = topology.shape(visible)  # of NVML indices (fewer than local_gpu_count only where NVML cannot map all)
    me = WorkerInfo(task=cluster.task, address=cluster.address, hostname=socket.gethostname(),
                    fingerprint=topology.fingerprint(), shape=shape if local_gpu_count else "none",
                    gpu_count=local_gpu_count, implementation=implementation)
    workers = _exchange(cluster, me, peer_timeout_s)
    _check_agreement(workers)
    local = policy.Plan(
        gpus=visible, cross_device_ops="collective", num_packs=None,
        reason=(f"MultiWorkerMirroredStrategy over {cluster.worker_count} workers ({cluster.task} here): "
                f"CollectiveAllReduce with implementation {implementation}: {reason}"),
        fingerprint=topology.fingerprint(), shape=shape,
        nvlink_gbps=round(topology.min_pair_gbps(visible), 1) if len(visible) > 1 else 0.0,
        devices=tuple(built.extended.worker_devices), xla_allreduce="split", requested=("all", "auto", None))
    plan = MultiWorkerPlan(local=local, cluster=cluster, implementation=implementation, implementation_reason=reason,
                           local_gpu_count=local_gpu_count, workers=workers, peer_seconds=peer_seconds,
                           process_env=nccl_env)
    base.attach_plan(built, plan)
    log.info(plan.summary())
    return built, plan


def _checked_cluster(cluster: Optional[ClusterConfig], cluster_resolver) -> ClusterConfig:
    """The cluster of the resolver (when given) or of TF_CONFIG; TfConfigError when there is none to join."""
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
    return cluster


def _communication(topology: Topology, cluster: ClusterConfig, local_gpu_count: int, visible: tuple):
    """(CommunicationOptions, reason, the environment NCCL needs) for this worker."""
    options, reason = communication_options(topology, local_gpu_count, visible if topology.gpus else None)
    nccl_env = loopback_nccl_env(cluster) if options.implementation.name == "NCCL" else {}
    if nccl_env:  # the caller exports plan.process_env: NCCL reads it when its communicators start
        reason += "; every worker is on this host, so NCCL bootstraps over the loopback interface " + " ".join(
            f"({key}={value})" for key, value in nccl_env.items())
    return options, reason, nccl_env


def _start_strategy(cluster: ClusterConfig, cluster_resolver, local_gpu_count: int, options):
    """The strategy (it starts this worker's server); RuntimeError naming the worker when TensorFlow refuses."""
    resolver = cluster_resolver or tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(cluster.cluster_spec()), task_type=cluster.task_type, task_id=cluster.task_index,
        rpc_layer=cluster.rpc_layer or "grpc", num_accelerators={"GPU": local_gpu_count} if local_gpu_count else {})
    try:
        return NVLinkMultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)
    except (RuntimeError, ValueError, tf.errors.OpError) as error:
        raise RuntimeError(f"MultiWorkerMirroredStrategy could not start {cluster.task} at {cluster.address}: "
                           f"{type(error).__name__}: {error}") from error


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
    if tf_runtime.tensorflow_runtime_started():
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
    tf_runtime.coordination_set(f"{_KV_PREFIX}{key}{cluster.worker_id}", json.dumps(value))
    for worker_id in range(cluster.worker_count):
        if worker_id == cluster.worker_id:
            yield worker_id, value
        else:
            yield worker_id, json.loads(tf_runtime.coordination_get(f"{_KV_PREFIX}{key}{worker_id}",
                                                                   int(timeout_s * 1000)))


def _check_agreement(workers: Sequence[Optional[WorkerInfo]]) -> None:
    known = [w for w in workers if w is not None]
    if len({w.gpu_count for w in known}) > 1 or len({w.implementation for w in known}) > 1:
        table = "; ".join(f"{w.task} on {w.hostname}: {w.gpu_count} GPU(s), {w.implementation}" for w in known)
        raise RuntimeError(
            f"The workers disagree: {table}. MultiWorkerMirroredStrategy needs the same number of GPUs on every "
            f"worker (and so the same collective implementation); otherwise the first all-reduce hangs. Give "
            f"every worker the same GPUs (CUDA_VISIBLE_DEVICES) or leave out the odd one.")