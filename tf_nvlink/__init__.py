"""tf_nvlink: a TensorFlow MirroredStrategy chosen from the machine's real GPU interconnect.

    import tf_nvlink
    with tf_nvlink.strategy().scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=True)
    model.fit(dataset, epochs=10)

`import tf_nvlink` is light: TensorFlow is imported only when a strategy is built or the report asks for it,
so `tf-nvlink report --no-tf` answers instantly.
"""

import sys  # noqa: E402
from tf_nvlink.util.version import __version__  # noqa: E402
from tf_nvlink.util import absl_start as _absl_start  # noqa: E402
from tf_nvlink.machine import nvml as _nvml  # light: NVML is loaded when probe() runs  # noqa: E402

__all__ = ["strategy", "current_plan", "probe", "NVLinkMonitor", "StepDoctor", "sync_non_trainable",
           "synced_step", "average_loss", "compiled_steps", "CompileCacheError", "__version__"]


def strategy(gpus="all", cross_device_ops="auto", num_packs=None, **kwargs):
    """The tf.distribute strategy for this machine, with tf_nvlink's training hooks installed (per-replica XLA,
    BatchNorm statistics in sync); see `tf_nvlink.distribute.single_host.strategy` for every argument.

    Example:
        >>> import tf_nvlink
        >>> with tf_nvlink.strategy(gpus="auto").scope():
        ...     model = build_model()
    """
    # The compile cache's TF_XLA_FLAGS before TensorFlow is imported: under absl's app.run importing TensorFlow
    # lists its devices, and TensorFlow reads TF_XLA_FLAGS then. Once TensorFlow is imported, the strategy sets
    # them, points the link _link_compile_cache named in them at its folder, or says that TensorFlow has read
    # them already.
    from tf_nvlink.plan import compile_cache  # noqa: PLC0415

    if "tensorflow" not in sys.modules:
        compile_cache.prepare_process(kwargs.get("compile_cache", "auto"), compile_cache.request_text(
            gpus, kwargs.get("devices"), kwargs.get("xla_allreduce", "auto"), kwargs.get("xla_flags", "auto")),
            kwargs.get("topology"))
    # TensorFlow is imported here, not at `import tf_nvlink`; the tune tool only if "autotune" measures.
    from tf_nvlink.training import install  # noqa: PLC0415

    return install.build_strategy(gpus=gpus, cross_device_ops=cross_device_ops, num_packs=num_packs,
                                  autotune_choice=_autotune_choice, **kwargs)


def _autotune_choice(*args, **kwargs):
    """`tf_nvlink.tools.tune.autotune_choice`, imported when `cross_device_ops="autotune"` asks for it."""
    from tf_nvlink.tools import tune  # noqa: PLC0415

    return tune.autotune_choice(*args, **kwargs)


def current_plan():
    """The `Plan` of the strategy this process built with `strategy()`, or None before the first call.

    Example:
        >>> tf_nvlink.current_plan().xla_allreduce
        'fused'
    """
    from tf_nvlink.distribute import single_host

    return single_host.current_plan()


def probe(nvml=None):
    """NVML's view of this machine's GPUs and links as a `Topology` (instant; no TensorFlow).

    Example:
        >>> tf_nvlink.probe().kind()
        'nvswitch'
    """
    return _nvml.probe(nvml)


def sync_non_trainable(model, variables=None):
    """Average the model's non-trainable state (BatchNorm moving statistics) across replicas, in a custom
    training loop's replica function; `model.fit` under a tf_nvlink strategy does it by itself.
    See `tf_nvlink.training.replica_sync.sync_non_trainable`.

    Example:
        >>> def step_fn(x, y):
        ...     ...  # forward, gradients, optimizer.apply(...)
        ...     tf_nvlink.sync_non_trainable(model)
        >>> strategy.run(step_fn, args=(x, y))
    """
    from tf_nvlink.training import replica_sync

    return replica_sync.sync_non_trainable(model, variables)


def synced_step(model, step):
    """Wrap a replica function for `strategy.run` so the non-trainable state it writes ends identical on every
    replica. See `tf_nvlink.training.replica_sync.synced_step`.

    Example:
        >>> strategy.run(tf_nvlink.synced_step(model, step_fn), args=(batch,))
    """
    from tf_nvlink.training import replica_sync

    return replica_sync.synced_step(model, step)


def average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """A custom training loop's loss in a replica step: the sum of the per-example losses over the GLOBAL batch's
    example count (all-reduced when `global_batch_size` is None), so the summed gradients are one device's for
    any split of the batch. See `tf_nvlink.training.exact_batches.average_loss`.

    Example:
        >>> def step(x, y):
        ...     with tf.GradientTape() as tape:
        ...         loss = tf_nvlink.average_loss(keras.losses.mean_squared_error(y, model(x, training=True)))
        ...     optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
        ...                                   model.trainable_variables))
        >>> strategy.run(step, args=(x, y))
    """
    from tf_nvlink.training import exact_batches

    return exact_batches.average_loss(per_example_loss, sample_weight=sample_weight,
                                      global_batch_size=global_batch_size)


def compiled_steps(strategy, step, steps):
    """A custom loop's `steps` steps per call as ONE XLA program per replica (fused mode; elsewhere one
    `strategy.run` per step, the same results). See `tf_nvlink.training.compiled_steps.CompiledSteps`.

    Example:
        >>> train = tf_nvlink.compiled_steps(strategy, jit_step, steps=8)
        >>> iterator = iter(strategy.experimental_distribute_dataset(dataset))
        >>> while True:
        ...     loss_sum, ran = train(iterator)     # the step's outputs summed over the `ran` steps, per replica
        ...     if not ran:
        ...         break
    """
    from tf_nvlink.training.compiled_steps import CompiledSteps

    return CompiledSteps(strategy, step, steps)


def __getattr__(name):
    """`tf_nvlink.NVLinkMonitor` (the Keras callback of tf_nvlink.training.nvlink_monitor) and
    `tf_nvlink.StepDoctor` (tf_nvlink.tools.doctor.callback), imported with Keras on first use;
    `tf_nvlink.CompileCacheError` (tf_nvlink.plan.compile_cache: a step failed reading the compile cache)."""
    if name == "NVLinkMonitor":
        from tf_nvlink.training import nvlink_monitor

        return nvlink_monitor.NVLinkMonitor
    if name == "StepDoctor":
        from tf_nvlink.tools.doctor import callback

        return callback.StepDoctor
    if name == "CompileCacheError":
        from tf_nvlink.plan import compile_cache

        return compile_cache.CompileCacheError
    raise AttributeError(f"module 'tf_nvlink' has no attribute {name!r}")


def _link_compile_cache() -> None:
    """Run when absl's `app.run` starts: TensorFlow's init callback lists its devices before `main` builds the
    strategy, and TensorFlow reads `TF_XLA_FLAGS` then, once. This names the process's compile-cache link in them
    (`plan.compile_cache_link`); the strategy points it at its context folder (docs/compile_cache.md)."""
    if "tensorflow" in sys.modules:
        from tf_nvlink.internals import tf_runtime

        if tf_runtime.tensorflow_devices_listed():
            return  # TensorFlow has read TF_XLA_FLAGS: the strategy says so
    from tf_nvlink.plan import compile_cache_link

    compile_cache_link.make_link()


# `import tf_nvlink` at a script's top comes before its `app.run(main)`; absl's app is imported by then when the
# script (or TensorFlow, which imports it) imported it first, as sorted imports do.
_absl_start.before_app_run(_link_compile_cache)
