"""The one gatherer of what `policy.decide` needs to know about this process, used by `tf_nvlink.strategy()` and by
`tf-nvlink report` alike, so the report shows the plan the strategy would build.

Without TensorFlow (the report's `--no-tf`), TensorFlow is assumed to see the GPUs NVML and `CUDA_VISIBLE_DEVICES`
leave, in that order (the prediction). With TensorFlow, its own GPU count, and on mixed machines (where CUDA's
numbering is not NVML's) the GPUs it sees by their PCI bus ids; whether it has NCCL's kernels; why it sees no GPU.

Example:
    >>> from tf_nvlink.distribute import facts
    >>> facts.gather_facts(nvml.probe(), tensorflow=False).visible     # CUDA_VISIBLE_DEVICES=1 on 2 GPUs
    (1,)
"""

from __future__ import annotations

import os
from typing import Callable, Mapping, Optional, Sequence

from tf_nvlink.machine import tf_devices as devices_lib
from tf_nvlink.machine.topology import Topology
from tf_nvlink.plan import policy, tune_cache

# What measures the all-reduce candidates for `cross_device_ops="autotune"`: (topology, NVML indices) ->
# `tune_cache` choice (or None). `tf_nvlink.strategy()` passes `tf_nvlink.tools.tune.autotune_choice`.
AutotuneChoice = Callable[[Topology, Sequence[int]], object]


def tensorflow_gpus(topology: Topology) -> list[devices_lib.TfGpu]:
    """TensorFlow's GPUs, each with its NVML index (imports TensorFlow and initialises the GPUs).

    Example:
        >>> [(g.tf_name, g.nvml_index) for g in tensorflow_gpus(nvml.probe())]
        [('/device:GPU:0', 0), ('/device:GPU:1', 1)]
    """
    from tf_nvlink.internals import tf_runtime  # noqa: PLC0415 - TensorFlow only when asked

    return devices_lib.map_tf_gpus(topology, tf_runtime.tf_gpu_descs())


def gather_facts(topology: Topology, *, tensorflow: bool = True,
                 tf_gpus: Optional[Sequence[devices_lib.TfGpu]] = None,
                 autotune_choice: Optional[AutotuneChoice] = None, user_xla_flags: Optional[str] = None,
                 no_gpu_cause: Optional[str] = None, environ: Optional[Mapping[str, str]] = None) -> policy.Facts:
    """The facts `policy.decide` plans from.

    Args:
        topology: NVML's view (`nvml.probe()`).
        tensorflow: False: "no TensorFlow", nothing is imported and the visible GPUs are the
            CUDA_VISIBLE_DEVICES prediction; True: TensorFlow is asked (see the module doc).
        tf_gpus: TensorFlow's GPUs already mapped by the caller (the report); None: asked when needed.
        autotune_choice: measures a missing tune winner (minutes, in worker processes that need the GPUs'
            memory: `policy.decide` asks before TensorFlow initialises them here); None: the stored winner only.
        user_xla_flags: the user's `XLA_FLAGS` (default: `environ`'s).
        no_gpu_cause: why TensorFlow sees no GPU, when the caller knows (default: found out here).
        environ: where CUDA_VISIBLE_DEVICES and XLA_FLAGS are read (default `os.environ`).

    Example:
        >>> gather_facts(topology, tensorflow=False, environ={"CUDA_VISIBLE_DEVICES": "1"}).visible
        (1,)
    """
    environ = os.environ if environ is None else environ
    visible = tuple(devices_lib.visible_nvml_indices(topology, environ))
    tf_gpu_count = nccl = None
    cause = no_gpu_cause or ""
    if tensorflow:
        tf_gpu_count = len(tf_gpus) if tf_gpus is not None else _tensorflow_gpu_count()
        if topology.gpus and not tf_gpu_count and no_gpu_cause is None:
            cause = _why_tensorflow_sees_no_gpu(visible, environ)
        if tf_gpu_count and topology.gpus and devices_lib.visible_needs_tensorflow(topology, environ):
            # Mixed GPU models, CUDA_DEVICE_ORDER unset: CUDA's indices are not NVML's, TensorFlow's PCI ids say
            # which GPUs it sees (this initialises them before an autotune, which only a mixed machine pays).
            mapped = tf_gpus if tf_gpus is not None else tensorflow_gpus(topology)
            visible = tuple(devices_lib.visible_from_tensorflow(mapped))
        nccl = _nccl_available() if tf_gpu_count else None

    def tune_choice(gpus):
        if autotune_choice is not None:
            return autotune_choice(topology, gpus)
        return tune_cache.stored_choice(topology, gpus)

    return policy.Facts(topology=topology, visible=visible, tf_gpu_count=tf_gpu_count, no_gpu_cause=cause,
                        nccl_available=nccl, tune_choice=tune_choice, mig=tuple(devices_lib.mig_entries(environ)),
                        user_xla_flags=environ.get("XLA_FLAGS", "") if user_xla_flags is None else user_xla_flags)


def _tensorflow_gpu_count() -> int:
    import tensorflow as tf  # noqa: PLC0415

    return len(tf.config.list_physical_devices("GPU"))


def _nccl_available() -> Optional[bool]:
    try:
        from tf_nvlink.internals import tf_runtime  # noqa: PLC0415

        return tf_runtime.nccl_kernels_registered()
    except ImportError:  # TensorFlow's internals missing: unknown, as without TensorFlow
        return None


def _why_tensorflow_sees_no_gpu(visible: Sequence[int], environ: Mapping[str, str]) -> str:
    import tensorflow as tf  # noqa: PLC0415

    if not tf.test.is_built_with_cuda():
        return "this TensorFlow is built without CUDA: pip install 'tensorflow[and-cuda]'"
    hidden_by = environ.get("CUDA_VISIBLE_DEVICES")
    if hidden_by is not None and not visible:
        return f"CUDA_VISIBLE_DEVICES={hidden_by!r} hides them"
    return ("TensorFlow could not initialise CUDA; its log above says why: with pip, 'tensorflow[and-cuda]' "
            "installs the CUDA libraries, and the NVIDIA driver must be new enough for them")
