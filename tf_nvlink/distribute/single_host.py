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

from tf_nvlink.distribute import base, multi_worker, rendezvous
from tf_nvlink.distribute import facts as facts_lib
from tf_nvlink.machine import cluster_config as cluster_lib
from tf_nvlink.machine import nvml
from tf_nvlink.machine import tf_devices as devices_lib
from tf_nvlink.machine.topology import Topology
from tf_nvlink.internals import tf_runtime
from tf_nvlink.plan import attention as attention_plan
from tf_nvlink.plan import compile_cache as compile_cache_lib
from tf_nvlink.plan import compile_cache_link
from tf_nvlink.plan import optimizer_sharding, policy, step_options

log = logging.getLogger("tf_nvlink")

class NVLinkMirroredStrategy(base.TfNvlinkStrategyMixin, tf.distribute.MirroredStrategy):
    """A `tf.distribute.MirroredStrategy` that knows its plan and runs XLA per replica.

    Everything TensorFlow and Keras do with a MirroredStrategy works unchanged (it is one); `plan` says which
    GPUs and cross-device ops were chosen and why.
    """

    def __init__(self, devices: Sequence[str], cross_device_ops=None, plan: Optional[policy.Plan] = None):
        super().__init__(devices=list(devices), cross_device_ops=cross_device_ops)
        base.attach_plan(self, plan)

    def experimental_distribute_dataset(self, dataset, options=None):
        """What Keras' `fit` calls: without the caller's `options`, prefetch `plan.input_buffer` batches to each
        replica's device, so the host split and the copies overlap the step (TensorFlow's default is 1)."""
        buffer = getattr(self.plan, "input_buffer", 0)
        if options is None and buffer:
            options = tf.distribute.InputOptions(experimental_fetch_to_device=True,
                                                 experimental_per_replica_buffer_size=buffer)
        return super().experimental_distribute_dataset(dataset, options=options)


_LOCK = threading.Lock()
_CURRENT: dict = {}
_COMPILE_CACHE: dict = {}


def current_plan() -> Optional[policy.Plan]:
    """The plan of the strategy built in this process, or None."""
    return _CURRENT.get("plan")


def build_cross_device_ops(plan: policy.Plan, device_names: Sequence[str]):
    """The tf.distribute.CrossDeviceOps for a plan (None means MirroredStrategy's default, CollectiveAllReduce).

    The class comes from `policy.OPS`, the one name -> class table."""
    name = plan.cross_device_ops
    if name not in policy.OPS:
        raise ValueError(f"Unknown cross-device ops {name!r}; valid: {list(policy.OPS)}")
    if name == "collective":
        return None
    ops_class = getattr(tf.distribute, policy.OPS[name].rpartition(".")[2])
    if name == "reduce_to_one":
        return ops_class(reduce_to_device=device_names[0])
    return ops_class(num_packs=1 if plan.num_packs is None else plan.num_packs)


def current_compile_cache() -> Optional[compile_cache_lib.CacheState]:
    """What the compile cache of this process is (`prepare_compile_cache`'s last answer), or None."""
    return _COMPILE_CACHE.get("state")


def prepare_compile_cache(compile_cache="auto", request: str = "", topology: Optional[Topology] = None,
                          max_bytes: int = compile_cache_lib.DEFAULT_MAX_BYTES) -> compile_cache_lib.CacheState:
    """Point TensorFlow's persistent XLA cache at this context's folder (`plan.compile_cache.prepare_process`;
    `request` is `compile_cache.request_text` of the strategy's arguments). `strategy()` calls it before TensorFlow
    lists its devices (TensorFlow reads `TF_XLA_FLAGS` then, once); a program that must touch TensorFlow's devices
    first (tests splitting the CPU into logical devices) calls `compile_cache.prepare_process` itself before that,
    with the same arguments. When TensorFlow has listed its devices already and read the link absl's `app.run`
    start named (`plan.compile_cache_link`), the link is pointed at this context's folder; when it read anything
    else, the answer says which folder it read (or that it read none) instead."""
    before = os.environ.get("TF_XLA_FLAGS", "")
    listed = tf_runtime.tensorflow_devices_listed()
    state = compile_cache_lib.prepare_process(compile_cache, request, topology, max_bytes=max_bytes,
                                              tensorflow_started=listed)
    read = compile_cache_lib.flag_value(before, compile_cache_lib.FLAG_DIR)
    if listed and read is not None and read == compile_cache_link.current_link():
        # TensorFlow read the link absl's app.run start named (plan/compile_cache_link.py): it follows the link
        # at each entry it reads or writes, so pointing it at this strategy's folder (a read-only one's private
        # folder of links included) is enough.
        compile_cache_link.point_link(state.folder if state.active and not state.users else None)
    elif listed and read != state.folder:
        # TensorFlow read TF_XLA_FLAGS before this call: its programs go where `before` said, if anywhere.
        state = compile_cache_lib.what_tensorflow_read(state, read)
        compile_cache_lib.warn_once(state.note)
    _COMPILE_CACHE["state"] = state
    return state


def canonical_device_name(name: str) -> str:
    """The one spelling of a device name of this process: case, `/device:` and the local
    `/job:localhost/replica:0/task:0` prefix do not change which device a name means. A name TensorFlow cannot
    parse comes back stripped (`check_devices` then refuses it).

    Example:
        >>> canonical_device_name("cpu:1"), canonical_device_name("/job:localhost/replica:0/task:0/device:CPU:1")
        ('/job:localhost/replica:0/task:0/device:CPU:1', '/job:localhost/replica:0/task:0/device:CPU:1')
    """
    try:
        spec = tf.DeviceSpec.from_string(name.strip())
    except ValueError:
        return name.strip()
    return (f"/job:{spec.job or 'localhost'}/replica:{spec.replica or 0}/task:{spec.task or 0}"
            f"/device:{(spec.device_type or '').upper()}:{spec.device_index or 0}")


def _request_key(gpus, cross_device_ops, num_packs, devices, xla_allreduce, asked_options=step_options.DEFAULT_REQUEST):
    gpus_key = gpus.strip().lower() if isinstance(gpus, str) else tuple(gpus) if isinstance(gpus, (list, tuple)) \
        else gpus
    ops_key = cross_device_ops if isinstance(cross_device_ops, str) else ("instance", id(cross_device_ops))
    if isinstance(devices, (list, tuple)) and all(isinstance(name, str) for name in devices):
        devices_key = tuple(canonical_device_name(name) for name in devices) or None
    else:
        devices_key = tuple(devices) if isinstance(devices, (list, tuple)) else devices  # refused by _build
    return (gpus_key, ops_key, num_packs, devices_key, xla_allreduce, asked_options)


def strategy(gpus="all", cross_device_ops="auto", num_packs: Optional[int] = None, *,
             devices: Optional[Sequence[str]] = None, topology: Optional[Topology] = None,
             xla_allreduce: str = "auto", cluster_resolver=None,
             peer_timeout_s: Optional[float] = None, xla_flags="auto", allreduce_dtype: str = "float32",
             input_buffer: Optional[int] = None, compiled_execution: bool = True,
             autotune_choice: Optional[facts_lib.AutotuneChoice] = None,
             compile_cache="auto", optimizer_states: str = "replicated",
             fused_attention: str = "auto") -> tf.distribute.MirroredStrategy:
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
            CPU-only ones) is chosen from this host's topology; see `tf_nvlink.distribute.multi_worker`. Call it first in
            the program, before any TensorFlow op.
        peer_timeout_s: how long a worker waits for the other workers to be reachable (default 60 s).
        xla_flags: "auto" (on 2+ GPUs in fused XLA mode, add the latency-hiding scheduler to `XLA_FLAGS`), "none",
            or a list of "--name=value" flags among `step_options.KNOWN_XLA_FLAGS`. A flag the user already set in
            `XLA_FLAGS` is never overridden (`plan.xla_flags_kept` lists those). XLA reads `XLA_FLAGS` once, at its
            first compile in the process: build the strategy before running any jit-compiled function, or the
            flags have no effect (tf_nvlink cannot tell whether XLA has already started).
        allreduce_dtype: "float32" (default) or "bfloat16": float32 gradients are cast to bfloat16 for the
            all-reduce and back after it (half the bytes on the link; the sum is rounded to bfloat16's 8-bit
            mantissa). Applies to Keras optimizers in `fit` (fused, split and without XLA).
        input_buffer: batches `experimental_distribute_dataset` (Keras `fit`) prefetches to each replica's
            device when no `InputOptions` are given (None: 1 on GPUs, TensorFlow's own depth; TensorFlow's
            default options on CPUs).
        compiled_execution: True (default): a model compiled with jit_compile=True and steps_per_execution=N > 1
            runs each execution of N steps as ONE XLA program per replica, where the whole step is in XLA (one
            GPU, or fused mode); False: one program per step, as Keras does (for comparison, or as a way out).
            `tf_nvlink.training.compiled_execution` says how; the plan's summary says which path applies.
        compile_cache: "auto" (default): XLA programs are kept on disk and read back by later processes of the
            same model, shapes, TensorFlow, XLA flags and GPUs, in the user's cache folder
            (`$TF_NVLINK_CACHE_DIR/xla`, else `$XDG_CACHE_HOME/tf_nvlink/xla`, else `~/.cache/tf_nvlink/xla`;
            `$TF_NVLINK_COMPILE_CACHE` may say "off" or another folder); a folder path; or "off" (None).
            Applies when the strategy is built before TensorFlow starts (as `xla_flags`). docs/compile_cache.md.
        autotune_choice: what measures the candidates for cross_device_ops="autotune" (`tf_nvlink.strategy()`
            passes `tf_nvlink.tools.tune.autotune_choice`); without it, "autotune" raises ValueError.
        optimizer_states: "replicated" (default: every replica holds every optimizer state) or "sharded" (each
            replica holds and updates the states of its share of the variables, whole variables balanced by size,
            and sends the updated weights to the others; one replica: the replicated path). Single host only.
            docs/sharded_optimizer_states.md.
        fused_attention: "auto" (default): Keras' attention (`MultiHeadAttention`, `GroupedQueryAttention`,
            `keras.ops.dot_product_attention`) runs as cuDNN's flash attention, one fused kernel forward and one
            backward, where it applies: inside a replica's XLA program (jit_compile=True) on NVIDIA GPUs of compute
            capability 8.0+, bfloat16 or float16, head size a multiple of 8 up to 128 (256 from compute capability
            9.0), no mask, a causal one, grouped-query heads or padding masks made from the inputs' Keras masks; no
            attention_mask tensor, bias, dropout or returned scores. Elsewhere Keras' attention runs and one INFO
            line says why. "off": Keras' own attention everywhere.

    This builds the strategy only; `tf_nvlink.strategy()` also installs the training hooks (per-replica XLA,
    BatchNorm statistics in sync), and is what programs call.

    Only one strategy can exist per process (TensorFlow's collectives clash otherwise): calling again with the
    same request returns the same strategy; a different request raises RuntimeError.

    Example:
        >>> s = strategy(gpus="0,1", cross_device_ops="auto")
        >>> s.num_replicas_in_sync, s.plan.cross_device_ops
        (2, 'nccl')
    """
    _check_topology_and_timeout(topology, peer_timeout_s)
    # Checked before anything is built or recorded: a bad value costs nothing.
    asked_options = step_options.validate_request(xla_flags, allreduce_dtype, input_buffer, compiled_execution)
    if cross_device_ops == "autotune" and autotune_choice is None:
        raise ValueError("cross_device_ops='autotune' measures the candidates through tf_nvlink.strategy(); "
                         "call that, or pass autotune_choice=tf_nvlink.tools.tune.autotune_choice. Valid without "
                         f"it: {[name for name in policy.OPS_CHOICES if name != 'autotune']}")
    cache_setting = compile_cache_lib.validate_setting(compile_cache)
    optimizer_states = optimizer_sharding.validate_optimizer_states(optimizer_states)
    fused_attention = attention_plan.validate_fused_attention(fused_attention)
    if optimizer_states != "replicated" and (
            cluster_resolver is not None or cluster_lib.parse_tf_config(os.environ.get("TF_CONFIG")) is not None):
        raise ValueError("optimizer_states='sharded' is built and tested on a single host only; with several workers "
                         "(TF_CONFIG or cluster_resolver) leave optimizer_states='replicated'. Valid choices there: "
                         f"['replicated']. Received: optimizer_states={optimizer_states!r}")
    key = _request_key(gpus, cross_device_ops, num_packs, devices, xla_allreduce, asked_options) + (
        None if cluster_resolver is None else id(cluster_resolver), cache_setting, optimizer_states, fused_attention)
    with _LOCK:
        if _CURRENT:
            return _the_strategy_already_built(key)
        cluster = None if cluster_resolver is not None else cluster_lib.parse_tf_config(os.environ.get("TF_CONFIG"))
        topology = topology if topology is not None else nvml.probe()
        prepare_compile_cache(cache_setting, compile_cache_lib.request_text(gpus, devices, xla_allreduce, xla_flags),
                              topology)
        if cluster_resolver is not None or cluster is not None:
            built, plan = _build_multi_worker(topology, cluster, cluster_resolver, peer_timeout_s, dict(
                gpus=gpus, cross_device_ops=cross_device_ops, num_packs=num_packs, devices=devices,
                xla_allreduce=xla_allreduce), asked_options, dict(xla_flags=xla_flags, allreduce_dtype=allreduce_dtype,
                                                                input_buffer=input_buffer,
                                                                compiled_execution=compiled_execution))
        else:
            built, plan = _build(gpus, cross_device_ops, num_packs, devices, topology, xla_allreduce, asked_options,
                                 autotune_choice)
        base.attach_optimizer_states(built, optimizer_states)
        base.attach_fused_attention(built, fused_attention)
        _CURRENT.update(key=key, strategy=built, plan=plan)
    log.info(plan.summary())
    log.info(attention_plan.summary(fused_attention))
    if optimizer_states == "sharded":
        log.info("tf_nvlink: optimizer states sharded over the %d local replicas (%s)",
                 len(built.extended.worker_devices), "each holds and updates its share" if base.shards_optimizer_states(built)
                 else "one replica: the replicated path")
    state = current_compile_cache()
    if state is not None and state.active and not state.users:
        log.info("tf_nvlink: %s", state.note)
    return built


def _check_topology_and_timeout(topology, peer_timeout_s) -> None:
    if topology is not None and not isinstance(topology, Topology):
        raise ValueError(f"topology should be a tf_nvlink Topology (tf_nvlink.probe() returns one) or None to probe "
                         f"NVML now. Received: topology={topology!r}")
    if peer_timeout_s is not None and (isinstance(peer_timeout_s, bool) or not isinstance(peer_timeout_s, (int, float))
                                       or not 0 < peer_timeout_s < float("inf")):
        raise ValueError(f"peer_timeout_s should be a positive number of seconds, or None for "
                         f"{rendezvous.DEFAULT_PEER_TIMEOUT_S} s. Received: peer_timeout_s={peer_timeout_s!r}")


def _the_strategy_already_built(key):
    """The strategy of an earlier call with the same request; RuntimeError for a different one."""
    if _CURRENT["key"] == key:
        return _CURRENT["strategy"]
    raise RuntimeError(
        f"tf_nvlink.strategy() was already called in this process with a different request "
        f"({_CURRENT['plan'].summary()}); TensorFlow tolerates one MirroredStrategy per process (a second "
        f"clashes on collective keys). Reuse the first strategy (tf_nvlink.strategy() with the same "
        f"arguments returns it), or run the other configuration in its own process.")


def _build_multi_worker(topology, cluster, cluster_resolver, peer_timeout_s, single_host_options: dict,
                        asked_options, options: dict):
    """The multi-worker strategy for TF_CONFIG or a cluster resolver, once the single-host-only arguments are
    checked to be at their defaults. Returns (strategy, plan)."""
    multi_worker.check_single_host_options(**single_host_options)
    if asked_options != step_options.DEFAULT_REQUEST:
        raise ValueError("xla_flags, allreduce_dtype, input_buffer and compiled_execution apply to single-host "
                         "strategies; "
                         "leave them at their defaults with several workers. Received: "
                         + ", ".join(f"{name}={value!r}" for name, value in options.items()))
    built, plan = multi_worker.build_strategy(
        topology if topology is not None else nvml.probe(), cluster, cluster_resolver=cluster_resolver,
        peer_timeout_s=rendezvous.DEFAULT_PEER_TIMEOUT_S if peer_timeout_s is None else peer_timeout_s)
    # NCCL reads these (NCCL_SOCKET_IFNAME=lo when every worker is on this host) at its first all-reduce.
    os.environ.update(plan.process_env)
    return built, plan


def _build(gpus, cross_device_ops, num_packs, devices, topology, xla_allreduce, asked_options=step_options.DEFAULT_REQUEST,
           autotune_choice: Optional[facts_lib.AutotuneChoice] = None):
    """Gather the facts, let `policy.decide` choose, build the TensorFlow objects. Returns (strategy, plan)."""
    ops_instance = None if isinstance(cross_device_ops, str) else cross_device_ops
    if ops_instance is not None and not isinstance(ops_instance, tf.distribute.CrossDeviceOps):
        raise ValueError(f"cross_device_ops should be one of {list(policy.OPS_CHOICES)} or a "
                         f"tf.distribute.CrossDeviceOps instance. Received: cross_device_ops={cross_device_ops!r}")
    if devices is not None and (isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices
                                or not all(isinstance(d, str) and d.strip() for d in devices)):
        raise ValueError(f"devices should be a non-empty list of TensorFlow device names such as "
                         f"['/gpu:0', '/gpu:1'] or ['/cpu:0', '/cpu:1'], or None. Received: devices={devices!r}")
    ops_name = "auto" if ops_instance is not None else cross_device_ops
    instance_name = type(ops_instance).__name__ if ops_instance is not None else ""
    topology = topology if topology is not None else nvml.probe()
    user_xla_flags = os.environ.get("XLA_FLAGS", "")  # read once: tf_nvlink's own flags never count as the user's
    _apply_provisional_xla_flags(topology, user_xla_flags, gpus, ops_name, num_packs, xla_allreduce, instance_name,
                                 asked_options)
    try:
        if devices:
            check_devices(devices, [d.name for d in tf.config.list_logical_devices()])
        facts = facts_lib.gather_facts(topology, autotune_choice=autotune_choice if ops_name == "autotune" else None,
                                       user_xla_flags=user_xla_flags)
        plan, warnings = policy.decide(facts, gpus, ops_name, num_packs, xla_allreduce, instance_name, asked_options)
    except Exception:
        _set_xla_flags(user_xla_flags)  # no strategy: the provisional flags are taken back
        raise
    for warning in warnings:
        log.warning("tf_nvlink: %s", warning)
    if devices:
        device_names = list(devices)
    elif plan.gpus:
        device_names = devices_lib.tf_device_for(plan.gpus, facts_lib.tensorflow_gpus(facts.topology))
    elif facts.tf_gpu_count and (not facts.topology.gpus or facts.mig):
        # GPUs NVML does not list, or MIG instances (no NVML GPU index names them): TensorFlow's own names
        device_names = [d.name for d in tf.config.list_logical_devices("GPU")]
    else:
        device_names = [d.name for d in tf.config.list_logical_devices("CPU")]
    ops = ops_instance if ops_instance is not None else build_cross_device_ops(plan, device_names)
    plan = dataclasses.replace(plan, devices=tuple(device_names))
    apply_xla_flags(plan, user_xla_flags)
    return NVLinkMirroredStrategy(device_names, cross_device_ops=ops, plan=plan), plan


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


def apply_xla_flags(plan: policy.Plan, user_xla_flags: Optional[str] = None, environ=None) -> str:
    """Set `XLA_FLAGS` in `environ` (default os.environ) to the user's value (default: the current one) followed
    by `plan.xla_flags` (which `policy.decide` already let the user's entries win over); returns the value.
    XLA parses XLA_FLAGS once, at its first use in the process, so this must run before the first XLA compile
    (the strategy does it while being built, before TensorFlow creates its devices).

    Example:
        >>> apply_xla_flags(plan, "")     # a 2-GPU fused plan
        '--xla_gpu_enable_latency_hiding_scheduler=true'
    """
    environ = os.environ if environ is None else environ
    user = environ.get("XLA_FLAGS", "") if user_xla_flags is None else user_xla_flags
    value, added, _ = step_options.merge_xla_flags(user, plan.xla_flags)
    _set_xla_flags(value, environ)
    if added:
        log.info("tf_nvlink: XLA_FLAGS=%s (applies if XLA has not compiled anything yet in this process)", value)
    return value


def _set_xla_flags(value: str, environ=None) -> None:
    environ = os.environ if environ is None else environ
    if value:
        environ["XLA_FLAGS"] = value
    else:
        environ.pop("XLA_FLAGS", None)


def _apply_provisional_xla_flags(topology, user_xla_flags, gpus, ops_name, num_packs, xla_allreduce, instance_name,
                                 asked_options):
    """The XLA flags of the plan NVML alone implies (`policy.decide` without TensorFlow's facts), set before
    `facts_lib.gather_facts` asks TensorFlow for its GPUs (in case that already reads XLA_FLAGS); the final plan sets them
    again, or takes them back."""
    facts = policy.Facts(topology=topology, visible=tuple(devices_lib.visible_nvml_indices(topology)),
                         user_xla_flags=user_xla_flags)
    try:
        early, _ = policy.decide(facts, gpus, ops_name, num_packs, xla_allreduce, instance_name, asked_options)
    except ValueError:
        return  # the final `decide` raises or falls back, and the flags are set then
    apply_xla_flags(early, user_xla_flags)
