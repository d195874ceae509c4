"""Builds the tf.distribute strategy from a policy `Plan`.

Example:
    >>> import tf_nvlink
    >>> strategy = tf_nvlink.strategy()              # every GPU, all-reduce chosen from the topology
    >>> with strategy.scope():
    ...     model = build_model()
    ...     model.compile(optimizer="adam", loss="mse", jit_compile=True)
    >>> model.fit(x, y)
    >>> tf_nvlink.current_plan().summary()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from typing import Optional, Sequence

import tensorflow as tf

from tf_nvlink import devices as devices_lib
from tf_nvlink import nvml, policy, xla
from tf_nvlink.topology import Topology

log = logging.getLogger("tf_nvlink")


class NVLinkMirroredStrategy(xla.PerReplicaXlaStrategyMixin, tf.distribute.MirroredStrategy):
    """A `tf.distribute.MirroredStrategy` that knows its plan and runs XLA per replica.

    Everything TensorFlow and Keras do with a MirroredStrategy works unchanged (it is one); `plan` says which
    GPUs and cross-device ops were chosen and why.
    """

    def __init__(self, devices: Sequence[str], cross_device_ops=None, plan: Optional[policy.Plan] = None):
        super().__init__(devices=list(devices), cross_device_ops=cross_device_ops)
        self._tf_nvlink_plan = plan

    @property
    def plan(self) -> Optional[policy.Plan]:
        return self._tf_nvlink_plan


_LOCK = threading.Lock()
_CURRENT: dict = {}


def current_plan() -> Optional[policy.Plan]:
    """The plan of the strategy built in this process, or None."""
    return _CURRENT.get("plan")


def build_cross_device_ops(plan: policy.Plan, device_names: Sequence[str]):
    """The tf.distribute.CrossDeviceOps for a plan (None means MirroredStrategy's default, CollectiveAllReduce)."""
    name, packs = plan.cross_device_ops, plan.num_packs
    if name == "nccl":
        return tf.distribute.NcclAllReduce(num_packs=1 if packs is None else packs)
    if name == "hierarchical":
        return tf.distribute.HierarchicalCopyAllReduce(num_packs=1 if packs is None else packs)
    if name == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice(reduce_to_device=device_names[0])
    if name == "collective":
        return None
    raise ValueError(f"Unknown cross-device ops {name!r}; valid: {list(policy.OPS)}")


def _request_key(gpus, cross_device_ops, num_packs, devices, xla_allreduce):
    gpus_key = gpus.strip().lower() if isinstance(gpus, str) else tuple(gpus) if isinstance(gpus, (list, tuple)) \
        else gpus
    ops_key = cross_device_ops if isinstance(cross_device_ops, str) else ("instance", id(cross_device_ops))
    return (gpus_key, ops_key, num_packs, tuple(devices) if devices else None, xla_allreduce)


def strategy(gpus="all", cross_device_ops="auto", num_packs: Optional[int] = None, *,
             devices: Optional[Sequence[str]] = None, topology: Optional[Topology] = None,
             xla_allreduce: str = "auto", cluster_resolver=None,
             peer_timeout_s: Optional[float] = None) -> tf.distribute.MirroredStrategy:
    """A MirroredStrategy whose GPUs and all-reduce fit this machine's interconnect.

    Args:
        gpus: "all" (every GPU TensorFlow sees, like MirroredStrategy), "auto" (the largest NVLink-connected
            group; ties go to faster links, then more free memory), a list of NVML/nvidia-smi indices, or a
            string such as "0,1". Indices are mapped to TensorFlow devices by PCI bus id, so
            `CUDA_VISIBLE_DEVICES` reordering is honoured.
        cross_device_ops: "auto" (the policy decides from the topology, or a stored `tf-nvlink tune` winner
            for these GPUs), "autotune" (measure the candidates now if nothing is stored, then store the
            winner), "nccl", "hierarchical", "reduce_to_one", "collective" (TensorFlow's default
            CollectiveAllReduce), or a `tf.distribute.CrossDeviceOps` instance.
        num_packs: gradient packs for "nccl"/"hierarchical" (None: the policy's choice).
        devices: explicit TensorFlow device names, overriding `gpus` (e.g. ["/cpu:0", "/cpu:1"] in tests).
        topology: a `Topology` to plan for (default: probe NVML now).
        xla_allreduce: for models compiled with jit_compile=True: "fused" (the whole step, gradient
            all-reduce included, is one XLA program per replica; GPUs only), "split" (XLA computes gradients,
            the plan's cross-device ops all-reduce them outside XLA), or "auto" (fused on 2+ GPUs).
        cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver` (e.g. SlurmClusterResolver) for
            several hosts. Without it, a `TF_CONFIG` naming several workers does the same. Either way the result
            is a `tf.distribute.MultiWorkerMirroredStrategy` whose communication (NCCL on GPU workers, RING on
            CPU-only ones) is chosen from this host's topology; see `tf_nvlink.multi_worker`. Call it first in
            the program, before any TensorFlow op.
        peer_timeout_s: how long a worker waits for the other workers to be reachable (default 60 s).

    Only one strategy can exist per process (TensorFlow's collectives clash otherwise): calling again with the
    same request returns the same strategy; a different request raises RuntimeError.

    Example:
        >>> s = strategy(gpus="0,1", cross_device_ops="auto")
        >>> s.num_replicas_in_sync, s.plan.cross_device_ops
        (2, 'nccl')
    """
    if topology is not None and not isinstance(topology, Topology):
        raise ValueError(f"topology should be a tf_nvlink Topology (tf_nvlink.probe() returns one) or None to probe "
                         f"NVML now. Received: topology={topology!r}")
    if peer_timeout_s is not None and (isinstance(peer_timeout_s, bool) or not isinstance(peer_timeout_s, (int, float))
                                       or not 0 < peer_timeout_s < float("inf")):
        raise ValueError(f"peer_timeout_s should be a positive number of seconds, or None for "
                         f"{_default_peer_timeout()} s. Received: peer_timeout_s={peer_timeout_s!r}")
    key = _request_key(gpus, cross_device_ops, num_packs, devices, xla_allreduce) + (
        None if cluster_resolver is None else id(cluster_resolver),)
    with _LOCK:
        if _CURRENT:
            if _CURRENT["key"] == key:
                return _CURRENT["strategy"]
            raise RuntimeError(
                f"tf_nvlink.strategy() was already called in this process with a different request "
                f"({_CURRENT['plan'].summary()}); TensorFlow tolerates one MirroredStrategy per process (a second "
                f"clashes on collective keys). Reuse the first strategy (tf_nvlink.strategy() with the same "
                f"arguments returns it), or run the other configuration in its own process.")
        from tf_nvlink import multi_worker  # noqa: PLC0415 - only TF_CONFIG users need it

        cluster = None if cluster_resolver is not None else multi_worker.parse_tf_config(os.environ.get("TF_CONFIG"))
        if cluster_resolver is not None or cluster is not None:
            multi_worker.check_single_host_options(gpus, cross_device_ops, num_packs, devices, xla_allreduce)
            built, plan = multi_worker.build_strategy(
                topology if topology is not None else nvml.probe(), cluster, cluster_resolver=cluster_resolver,
                peer_timeout_s=multi_worker.DEFAULT_PEER_TIMEOUT_S if peer_timeout_s is None else peer_timeout_s)
        else:
            built, plan = _build(gpus, cross_device_ops, num_packs, devices, topology, xla_allreduce)
        _CURRENT.update(key=key, strategy=built, plan=plan)
    log.info(plan.summary())
    return built


def _build(gpus, cross_device_ops, num_packs, devices, topology, xla_allreduce):
    ops_instance = None if isinstance(cross_device_ops, str) else cross_device_ops
    if ops_instance is not None and not isinstance(ops_instance, tf.distribute.CrossDeviceOps):
        raise ValueError(f"cross_device_ops should be one of {list(policy.OPS_CHOICES)} or a "
                         f"tf.distribute.CrossDeviceOps instance. Received: cross_device_ops={cross_device_ops!r}")
    ops_name = "auto" if ops_instance is not None else cross_device_ops
    if devices is not None and (isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices
                                or not all(isinstance(d, str) and d.strip() for d in devices)):
        raise ValueError(f"devices should be a non-empty list of TensorFlow device names such as "
                         f"['/gpu:0', '/gpu:1'] or ['/cpu:0', '/cpu:1'], or None. Received: devices={devices!r}")
    if devices:
        check_devices(devices, [d.name for d in tf.config.list_logical_devices()])
    topology = topology if topology is not None else nvml.probe()
    if topology.warnings:  # one line, however many NVML calls failed (`tf-nvlink report` lists them all)
        log.warning("tf_nvlink: %s", nvml.warnings_line(topology.warnings))
    tf_gpu_count = len(tf.config.list_physical_devices("GPU"))
    visible = devices_lib.visible_nvml_indices(topology)
    if tf_gpu_count and topology.gpus and devices_lib.visible_needs_tensorflow(topology):
        # Mixed GPU models, CUDA_DEVICE_ORDER unset: CUDA's indices are not NVML's; TensorFlow's PCI ids decide.
        visible = devices_lib.visible_from_tensorflow(devices_lib.tf_gpus(topology))
    mig = devices_lib.mig_entries()
    no_gpu_warning = None
    if topology.gpus and not tf_gpu_count:
        why = _why_tensorflow_sees_no_gpu(visible)
        no_gpu_warning = (f"NVML sees {len(topology.gpus)} GPU(s) but TensorFlow sees none ({why}); falling back "
                          f"to the CPU.")
        no_gpu_reason = f"NVML sees {len(topology.gpus)} GPU(s) but TensorFlow sees none: {why}"
        visible = []
    elif topology.error and not tf_gpu_count:
        no_gpu_warning = no_gpu_reason = topology.error  # no driver / NVML: the text ends with the CPU fallback
    elif mig and tf_gpu_count and not visible:
        no_gpu_reason = (f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} names MIG instance(s), "
                         f"which no NVML GPU index names; gpus='all' mirrors over them")
    else:
        no_gpu_reason = None
    # An explicit GPU request that cannot be honoured raises here (with the reason); "all"/"auto" fall back.
    plan = policy.make_plan(topology, gpus, ops_name, num_packs, visible=visible, xla_allreduce=xla_allreduce,
                            no_gpu_reason=no_gpu_reason)
    if no_gpu_warning:
        log.warning("tf_nvlink: %s", no_gpu_warning)
    plan = _apply_tuning(plan, topology, ops_name, num_packs)
    if plan.gpus and (plan.cross_device_ops == "nccl" or plan.xla_allreduce == "fused") and not nccl_available():
        plan, warning = without_nccl(plan)
        log.warning("tf_nvlink: %s", warning)
    if devices:
        device_names = list(devices)
    elif plan.gpus:
        device_names = devices_lib.tf_device_for(plan.gpus, devices_lib.tf_gpus(topology))
    else:
        if tf_gpu_count and not topology.gpus:
            log.warning("tf_nvlink: TensorFlow sees %d GPU(s) but NVML does not (%s); mirroring over them "
                        "with TensorFlow's default all-reduce.", tf_gpu_count,
                        topology.error or nvml.warnings_line(topology.warnings) or "NVML lists no GPU")
            device_names = [d.name for d in tf.config.list_logical_devices("GPU")]
            plan = _replace(plan, cross_device_ops="collective", num_packs=None,
                            reason="GPUs without NVML: topology unknown, TensorFlow's default all-reduce")
        elif tf_gpu_count and mig:
            device_names = [d.name for d in tf.config.list_logical_devices("GPU")]
            ops_name_used = "reduce_to_one" if len(device_names) == 1 else "collective"
            log.warning("tf_nvlink: CUDA_VISIBLE_DEVICES names MIG instance(s) %s: mirroring over TensorFlow's %d "
                        "MIG device(s) with %s and no NVLink plan (a MIG instance has no NVLink of its own, and no "
                        "NVML GPU index names it).", mig, len(device_names), ops_name_used)
            plan = _replace(plan, cross_device_ops=ops_name_used, num_packs=None,
                            reason=f"MIG instance(s) {mig}: TensorFlow's MIG device(s), no NVLink plan")
        else:
            device_names = [d.name for d in tf.config.list_logical_devices("CPU")]
    if ops_instance is not None:
        plan = _replace(plan, cross_device_ops=type(ops_instance).__name__, num_packs=None,
                        reason="a CrossDeviceOps instance given by the caller")
        ops = ops_instance
    else:
        ops = build_cross_device_ops(plan, device_names)
    plan = _replace(plan, devices=tuple(device_names))
    xla.enable_per_replica_xla()
    return NVLinkMirroredStrategy(device_names, cross_device_ops=ops, plan=plan), plan


def _default_peer_timeout():
    from tf_nvlink import multi_worker  # noqa: PLC0415

    return multi_worker.DEFAULT_PEER_TIMEOUT_S


def check_devices(devices: Sequence[str], existing: Sequence[str]) -> None:
    """Refuse device names this process does not have, and duplicates, before TensorFlow sees them (its soft
    placement would put "/gpu:9" on CPU:0; a duplicate ends in an AssertionError).

    Example:
        >>> check_devices(["/gpu:9"], ["/device:CPU:0"])
        ValueError: devices names '/gpu:9', which this process does not have; ... Received: devices=['/gpu:9']
    """
    def key(name: str):
        spec = tf.DeviceSpec.from_string(name.strip())
        return ((spec.device_type or "").upper(), spec.device_index or 0)

    available = {key(name): name for name in existing}
    seen = {}
    for name in devices:
        try:
            wanted = key(name)
        except ValueError:
            wanted = None
        if wanted not in available:
            raise ValueError(f"devices names {name!r}, which this process does not have; its devices are "
                             f"{list(existing)}. Received: devices={list(devices)!r}")
        if wanted in seen:
            raise ValueError(f"devices names {available[wanted]} twice ({seen[wanted]!r} and {name!r}); each "
                             f"device holds one replica. Received: devices={list(devices)!r}")
        seen[wanted] = name


def _why_tensorflow_sees_no_gpu(visible: Sequence[int]) -> str:
    if not tf.test.is_built_with_cuda():
        return "this TensorFlow is built without CUDA: pip install 'tensorflow[and-cuda]'"
    hidden_by = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden_by is not None and not visible:
        return f"CUDA_VISIBLE_DEVICES={hidden_by!r} hides them"
    return ("TensorFlow could not initialise CUDA; its log above says why: with pip, 'tensorflow[and-cuda]' "
            "installs the CUDA libraries, and the NVIDIA driver must be new enough for them")


def nccl_available() -> bool:
    """True when this TensorFlow build has NCCL's GPU kernels (CUDA builds do; CPU-only and ROCm ones may not)."""
    from tensorflow.python.framework import kernels  # noqa: PLC0415

    try:
        return any(k.device_type == "GPU" for k in kernels.get_registered_kernels_for_op("NcclAllReduce").kernel)
    except Exception:  # noqa: BLE001 - an op TensorFlow does not know at all: no NCCL
        return False


def without_nccl(plan: policy.Plan) -> tuple[policy.Plan, str]:
    """The plan for a TensorFlow without NCCL kernels, and the one warning line that says so.

    NcclAllReduce becomes ReductionToOneDevice (copies over NVLink/PCIe); the XLA all-reduce stays split,
    since XLA's GPU all-reduce is NCCL too. Other ops are kept (CollectiveAllReduce falls back to its ring).
    """
    ops = "reduce_to_one" if plan.cross_device_ops == "nccl" else plan.cross_device_ops
    change = f"using {ops} instead of {plan.cross_device_ops}" if ops != plan.cross_device_ops else f"keeping {ops}"
    warning = (f"this TensorFlow has no NCCL GPU kernels: {change}, and jit_compile=True models all-reduce "
               f"outside XLA (split mode)")
    return _replace(plan, cross_device_ops=ops, num_packs=None if ops == "reduce_to_one" else plan.num_packs,
                    xla_allreduce="split",
                    reason=f"NCCL kernels missing from this TensorFlow build: {ops} (planned "
                           f"{plan.cross_device_ops}: {plan.reason})"), warning


def _apply_tuning(plan: policy.Plan, topology: Topology, ops_name: str, num_packs) -> policy.Plan:
    """"autotune": the stored winner, or measure now; "auto": a stored winner beats the rules when one exists."""
    if len(plan.gpus) < 2 or ops_name not in ("auto", "autotune") or num_packs is not None:
        return plan
    from tf_nvlink import tune  # noqa: PLC0415 - only multi-GPU plans need it

    # Before devices_lib.tf_gpus(): measuring runs in worker processes that need the GPUs' memory.
    if ops_name == "auto":
        return tune.with_stored_choice(plan, topology)
    ops, packs, reason = tune.autotune_choice(topology, plan.gpus)
    return _replace(plan, cross_device_ops=ops, num_packs=packs, reason=reason,
                    gpus=policy.replica_order(topology, plan.gpus, ops))


def _replace(plan: policy.Plan, **changes) -> policy.Plan:
    return dataclasses.replace(plan, **changes)
