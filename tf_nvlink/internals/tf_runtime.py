"""Seams in TensorFlow's runtime: XLA contexts, MirroredStrategy's merge_call switch, worker counts, device memory
and kernels, the eager context (multi-worker start, coordination service, run metadata), a tf.function's jit
flag, the profiler's trace format and its step markers, XLA's HLO format.

Checked against TensorFlow 2.21 (setup.cfg's floor, what CI tests); pinned in tests/internals/test_tf_runtime_seams.py.

Example:
    >>> from tf_nvlink.internals import tf_runtime
    >>> tf_runtime.worker_count(tf.distribute.MirroredStrategy())
    1
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tf_nvlink.internals.registry import REGISTRY


def in_xla_context() -> bool:
    """Whether the code being traced now is inside an XLA cluster (`control_flow_util`, TensorFlow's own test)."""
    from tensorflow.python.ops import control_flow_util  # noqa: PLC0415

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def uses_merge_call(strategy) -> bool:
    """Whether `strategy` merges across replicas with merge_call here: the private `MirroredExtended._use_merge_call()`,
    which TensorFlow answers False for all-GPU replicas under XLA (fused mode)."""
    return strategy.extended._use_merge_call()  # noqa: SLF001


def _mirrored_extended_class():
    from tensorflow.python.distribute import mirrored_strategy  # noqa: PLC0415

    return mirrored_strategy.MirroredExtended


def emulate_fused_mode_on_cpu() -> None:
    """Tests only: make CPU replicas take the path TensorFlow takes under XLA on all-GPU replicas (no merge_call:
    `MirroredExtended._use_merge_call` answers False), so fused mode's code runs on a CPU-only machine (its
    per-replica steps then compile without XLA, `fused_mode_emulated()`). Call once per process, before building
    the strategy."""
    REGISTRY.patch(_mirrored_extended_class(), "_use_merge_call", lambda original: lambda self: False)


def fused_mode_emulated() -> bool:
    """Whether `emulate_fused_mode_on_cpu` is on in this process."""
    return REGISTRY.patched(_mirrored_extended_class(), "_use_merge_call")


def worker_count(strategy) -> int:
    """The number of worker processes of a strategy (1 for MirroredStrategy): the private `extended._num_workers`
    of MultiWorkerMirroredStrategy; no public accessor."""
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


_MEMORY_LIMITS: dict[str, int] = {}


def device_bytes_free(device: str):
    """Bytes the TensorFlow allocator of GPU `device` can still hand out (its limit less what it holds now), or
    None for a CPU or when unknown. Reads `device_lib.list_local_devices` (the allocator's `memory_limit`, no public
    accessor) once per device; `tf.config.experimental.get_memory_info` gives the bytes in use."""
    name = device.split("device:")[-1].upper()
    if not name.startswith("GPU:"):
        return None
    if name not in _MEMORY_LIMITS:
        from tensorflow.python.client import device_lib  # noqa: PLC0415

        for local in device_lib.list_local_devices():
            _MEMORY_LIMITS[local.name.split("device:")[-1].upper()] = int(local.memory_limit)
    limit = _MEMORY_LIMITS.get(name)
    if not limit:
        return None
    try:
        in_use = int(tf.config.experimental.get_memory_info(name)["current"])
    except (ValueError, RuntimeError):
        return None
    return limit - in_use


def tf_gpu_descs() -> list[tuple[str, str]]:
    """(name, physical_device_desc) of every GPU TensorFlow sees (initialises the GPUs), from
    `tensorflow.python.client.device_lib.list_local_devices`: the public `tf.config` API gives no PCI bus id, which
    maps TensorFlow's GPUs to NVML's."""
    from tensorflow.python.client import device_lib  # noqa: PLC0415

    return [(d.name, d.physical_device_desc) for d in device_lib.list_local_devices() if d.device_type == "GPU"]


def nccl_kernels_registered() -> bool:
    """True when this TensorFlow build has NCCL's GPU kernels (CUDA builds do; CPU-only and ROCm ones may not), from
    `tensorflow.python.framework.kernels.get_registered_kernels_for_op`: no public API lists kernels."""
    from tensorflow.python.framework import kernels  # noqa: PLC0415

    try:
        return any(k.device_type == "GPU" for k in kernels.get_registered_kernels_for_op("NcclAllReduce").kernel)
    except Exception:  # noqa: BLE001 - an op TensorFlow does not know at all: no NCCL
        return False


def tensorflow_runtime_started() -> bool:
    """True once TensorFlow's runtime is initialised in this process (`context.context()._initialized`):
    MultiWorkerMirroredStrategy can start its server only before that."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return bool(getattr(context.context(), "_initialized", False))


def tensorflow_devices_listed() -> bool:
    """True once TensorFlow has listed its physical devices in this process (`context.context()._physical_devices`
    is set then; the runtime need not have started): TensorFlow has read `TF_XLA_FLAGS` by then."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    handle = context.context()
    return getattr(handle, "_physical_devices", None) is not None or bool(getattr(handle, "_initialized", False))


def coordination_set(key: str, value: str) -> None:
    """Publish `value` under `key` in the coordination service's key-value store (multi-worker; the eager
    context's `set_config_key_value`, only in `tensorflow.python.eager.context`)."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    context.context().set_config_key_value(key, value)


def coordination_get(key: str, timeout_ms: int) -> str:
    """The value another worker published under `key`, waiting up to `timeout_ms` (`get_config_key_value`)."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return context.context().get_config_key_value(key, timeout_ms)


@contextlib.contextmanager
def recorded_run_metadata():
    """Record TensorFlow's run metadata (function graphs after Grappler) while the block runs; yields a list
    that holds the `RunMetadata` afterwards. Run metadata exists only in `tensorflow.python.eager.context`."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    recorded: list = []
    context.enable_run_metadata()
    try:
        yield recorded
        recorded.append(context.export_run_metadata())
    finally:
        context.disable_run_metadata()


def jit_tf_function(fn):
    """(tf.function, python function, autograph flag) when `fn` is a `tf.function(jit_compile=True)`, or Keras'
    `_autoconvert_optionals` wrapper of one (reached through `__wrapped__`); else None. Reads `tf.function`'s
    private `_jit_compile` and `_autograph` (no public accessor)."""
    target = fn if hasattr(fn, "python_function") else getattr(fn, "__wrapped__", fn)
    if not (getattr(target, "_jit_compile", False) and hasattr(target, "python_function")):
        return None
    return target, target.python_function, getattr(target, "_autograph", True)


def xplane_protobuf_module():
    """The protobuf module of the TensorFlow profiler's trace format (`XSpace`, `XPlane`, `XLine`, `XEvent`):
    `tensorflow.tsl.profiler.protobuf.xplane_pb2`, outside the public `tf.*` API. `tf.profiler.experimental.stop()`
    writes `<logdir>/plugins/profile/<run>/<host>.xplane.pb`; the parser for it lives in TensorBoard's profile
    plugin, which training machines rarely have."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    return xplane_pb2


def hlo_protobuf_module():
    """The protobuf module of XLA's HLO (`HloProto`, `HloModuleProto`, `HloInstructionProto`):
    `tensorflow.compiler.xla.service.hlo_pb2`, outside the public `tf.*` API. The profiler's trace holds each
    compiled program's optimized HLO as an `HloProto` (the stat "Hlo Proto" of the `/host:metadata` plane's event
    metadata, one per program id): its instructions' `metadata.op_name` (the TensorFlow op and name scope each came
    from) and each computation's schedule."""
    from tensorflow.compiler.xla.service import hlo_pb2  # noqa: PLC0415

    return hlo_pb2


def step_trace(step: int):
    """A profiler trace event that marks one training step, as tf_keras' TensorBoard callback marks the steps of
    `profile_batch`: `tf.profiler.experimental.Trace("train", step_num=step, _r=1)`. `_r=1` (undocumented) makes
    it a root event, which TensorBoard's profile plugin groups the step's device work under (the overview page's
    step-time graph). Enter it when the step begins and exit it when it ends."""
    return tf.profiler.experimental.Trace("train", step_num=int(step), _r=1)
