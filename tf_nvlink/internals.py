"""Every private Keras/TensorFlow touch of tf_nvlink (`keras.src`, `tensorflow.python`, private attributes), in
this one module, each with what it touches, the versions checked and why it exists.

Versions checked: Keras 3.12 to 3.15.1 (`TESTED_KERAS`, setup.cfg's range) and TensorFlow 2.21 (setup.cfg's floor, what CI tests), unless a
note says otherwise; tests/training/test_install.py and test_replica_sync.py pin the Keras source these rely on.
Keras 3.16 moved two of them (`_keras_trainer_class`, `keras_variable_class` find either place); the pins pass on
keras-nightly 3.16.0.dev2026102704, outside the declared range until a 3.16 release candidate passes.
Nothing else in tf_nvlink/ may touch a private name (tests/test_private_api.py checks it). The callers pass
their own logic in (the trainer hooks' step builder, the "is this a tf_nvlink strategy" check), so this module
imports nothing of tf_nvlink's above it. What was changed in Keras is held in `_STATE`, a `HookState`
(`reset_hooks_for_tests()` puts Keras back).

Example:
    >>> from tf_nvlink import internals
    >>> internals.check_keras_support() is None      # this Keras has the trainer internals tf_nvlink hooks
    True
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib
import logging
import threading
import weakref
from typing import Callable, Hashable

import tensorflow as tf

log = logging.getLogger("tf_nvlink")


# ==== Keras' trainer and optimizers under per-replica XLA (tf_nvlink.training.per_replica_steps) =============

# Keras versions whose trainer internals tests/training/test_install.py pins (first, last tested minor version).
TESTED_KERAS = ((3, 12), (3, 15))


@dataclasses.dataclass
class HookState:
    """Everything this module changes in Keras, in one place (the module's only state).

    originals: Keras' own functions, by "method" (TensorFlowTrainer's) or "Class.method" (an optimizer's, the
        TensorFlow optimizer's gradient all-reduce, the Variable write), while replaced; empty when none is.
    problem: why the last `enable_per_replica_xla()` could not install them (None: installed, or never tried).
    Tests put Keras back with `reset_hooks_for_tests()`.
    """

    originals: dict[str, Callable] = dataclasses.field(default_factory=dict)
    problem: str | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    # The caller's "is this a tf_nvlink strategy" check (distribute.base.is_tf_nvlink_strategy), given at install.
    is_ours: Callable[[object], bool] = lambda strategy: False
    # Tests only (`emulate_fused_mode_on_cpu`): per-replica steps compile without XLA, fused mode on CPU replicas.
    fused_emulated_on_cpu: bool = False
    # Whether the per-output sample weights warning (`loss_share_while_tracing`) was logged in this process.
    warned_per_output_weights: bool = False
    # The callback classes already named for keeping fit's batch ends on the training thread (logged once each).
    named_blocking_callbacks: set = dataclasses.field(default_factory=set)


_STATE = HookState()


def reset_hooks_for_tests() -> None:
    """Restore Keras' own methods and forget any install problem, as in a fresh process."""
    uninstall_keras_hooks()
    _STATE.problem = None
    _STATE.warned_per_output_weights = False
    _STATE.named_blocking_callbacks.clear()


def keras_hook_problem() -> str | None:
    """Why the trainer hooks could not be installed (None: installed, or never tried)."""
    return _STATE.problem


class UnsupportedKerasError(RuntimeError):
    """The installed Keras lacks the trainer internals per-replica XLA relies on."""


def _keras_epoch_iterator_class():
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    return EpochIterator


def _keras_callback_list_class():
    from keras.src.callbacks.callback_list import CallbackList  # noqa: PLC0415

    return CallbackList


def _keras_trainer_class():
    """Keras' TensorFlow trainer, the class `keras.Model` inherits fit's machinery from: `TensorFlowTrainer` in
    `keras.src.backend.tensorflow.trainer` (Keras 3.12 to 3.15.1), renamed `Trainer` in the same module by Keras
    3.16 (keras-nightly 3.16.0.dev2026102704 checked; no alias; its base became `BaseTrainer`)."""
    from keras.src.backend.tensorflow import trainer as module  # noqa: PLC0415

    for name in ("TensorFlowTrainer", "Trainer"):
        trainer = getattr(module, name, None)
        if isinstance(trainer, type):
            return trainer
    raise ImportError(f"no TensorFlowTrainer (or Trainer) in {module.__name__}")


def check_keras_support() -> str | None:
    """None when this Keras can run per-replica XLA, else the reason it cannot."""
    try:
        import keras  # noqa: PLC0415

        trainer = _keras_trainer_class()
    except Exception as exc:  # noqa: BLE001 - any import problem means "not supported"
        return f"cannot import Keras' TensorFlow trainer ({exc})"
    version = tuple(int(p) for p in keras.__version__.split(".")[:2] if p.isdigit())
    missing = [name for name in ("_make_function", "_resolve_auto_jit_compile", "train_step", "test_step")
               if not hasattr(trainer, name)]
    if missing:
        return f"Keras {keras.__version__} has no {trainer.__name__}.{', '.join(missing)}"
    if version[:1] != (3,):
        return f"Keras {keras.__version__} is not Keras 3"
    return None


def uninstall_keras_hooks() -> None:
    """Restore Keras' own trainer methods (tests use this to show what the hooks fix)."""
    with _STATE.lock:
        trainer = _keras_trainer_class()
        for name, original in list(_STATE.originals.items()):
            owner, _, attribute = name.rpartition(".")
            owners = {**_OPTIMIZER_CLASSES, "loss_module": _keras_loss_module,
                      "EpochIterator": _keras_epoch_iterator_class, "BatchNormalization": _keras_batch_norm_class,
                      "CompileLoss": _keras_compile_loss_class, "Mean": _keras_mean_metric_class,
                      "CallbackList": _keras_callback_list_class}
            if owner and owner not in owners:
                continue  # the gradient all-reduce and the write recorder have their own restore
            setattr(owners[owner]() if owner else trainer, attribute, original)
            del _STATE.originals[name]


# The compiled execution's restaged input, per model (weakly keyed): a user's own tf.data dataset is distributed
# again once, and later fits and evaluates of the same dataset object (and every epoch's validation of one fit)
# take the same distributed dataset. At most `_RESTAGED_PER_MODEL` are kept per model (fit's input, its validation
# data and evaluate's test data); each keeps its source dataset alive until the model goes or a newer one replaces it.
_RESTAGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RESTAGED_PER_MODEL = 3


def restage_input(model, epoch_iterator, depth, transform=None, to_device=True,
                  reuse_key: Hashable | None = None) -> bool:
    """Distribute the input of Keras' `TFEpochIterator` again, `depth` batches prefetched to each replica's device
    (before any of its iterators exists); returns whether it did. Touches `TFEpochIterator._distributed_dataset`
    (Keras 3.12 to 3.15), set in its `__init__` from the strategy's `experimental_distribute_dataset` with no
    options, and reads whether its data adapter is Keras' `TFDatasetAdapter` (the user's own tf.data dataset).
    Why: the compiled execution takes N batches at once, and with TensorFlow's one batch prefetched the
    copies of the other N - 1 wait behind the running program (ResNet-50, 1x H200: 5100 img/s with 1, 5343 with
    16). `transform(dataset)`, when given, runs on the host dataset first (the compiled execution's pinned host
    batches). `to_device=False` keeps the batches in host memory (prefetched `depth` deep there), and the function
    that takes them copies them to the replicas' devices. A dataset the user distributed is left alone.
    With a `reuse_key` (what the staging depends on besides the dataset), a user's tf.data dataset restaged before
    under the same key takes the distributed dataset built then: building it traces tf.data map functions, host
    time the GPU waits for at the start of every fit (and of every epoch's validation). Other input (numpy arrays,
    generators: Keras builds a new dataset for every call) is restaged each time and not kept."""
    if not depth or not hasattr(epoch_iterator, "_distributed_dataset"):
        return False
    source = epoch_iterator.data_adapter.get_tf_dataset()
    if isinstance(source, tf.distribute.DistributedDataset):
        return False
    reusable = reuse_key is not None and _is_user_tf_dataset(epoch_iterator)
    kept = _RESTAGED.setdefault(model, {}) if reusable else None
    key = (id(source), reuse_key)  # each entry holds its source, so no other dataset can have that id meanwhile
    if kept is not None and key in kept:
        kept[key] = kept.pop(key)  # the most recently used last
        epoch_iterator._distributed_dataset = kept[key][1]  # noqa: SLF001
        return True
    dataset = source if transform is None else transform(source)
    if not to_device:
        dataset = dataset.prefetch(int(depth))
    options = tf.distribute.InputOptions(experimental_fetch_to_device=bool(to_device),
                                         experimental_per_replica_buffer_size=int(depth))
    distributed = model.distribute_strategy.experimental_distribute_dataset(dataset, options=options)
    epoch_iterator._distributed_dataset = distributed  # noqa: SLF001
    if kept is not None:
        kept[key] = (source, distributed)
        while len(kept) > _RESTAGED_PER_MODEL:
            del kept[next(iter(kept))]
    return True


def _is_user_tf_dataset(epoch_iterator) -> bool:
    """Whether the epoch's input is a tf.data dataset the user passed (Keras' `TFDatasetAdapter`, Keras 3.12 to
    3.15): the same object again in a later call means the same input."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import TFDatasetAdapter  # noqa: PLC0415

    return isinstance(getattr(epoch_iterator, "data_adapter", None), TFDatasetAdapter)


def nested_layers(model) -> list:
    """Every layer inside `model`, nested ones included, not the model itself (Keras' `Layer._flatten_layers`,
    Keras 3.12 to 3.16.dev; no public accessor walks nested layers), or its `layers` where it has no such method."""
    walk = getattr(model, "_flatten_layers", None)
    return list(walk(include_self=False, recursive=True)) if walk else list(getattr(model, "layers", []))


def fully_built(model) -> bool:
    """True when `model`'s layers, compiled loss and metrics and optimizer are all built: then Keras'
    `_symbolic_build` would build nothing (the attributes it checks, read the same way)."""
    compiled = [getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None),
                getattr(model, "optimizer", None)]
    return all(layer.built for layer in model._flatten_layers()) and all(
        part is None or part.built for part in compiled)


def symbolic_build_from_one_replica(model, iterator=None, data_batch=None, restore=None) -> None:
    """Keras' `TensorFlowTrainer._maybe_symbolic_build` (3.12 to 3.15), building from the shapes of the epoch's
    input instead of a batch taken from a fresh iterator over it, and from the first replica's share of a given
    `data_batch` instead of the MEAN of all replicas' shares.

    Why: Keras takes one batch from a new iterator over the user's input (`iterator`, its `EpochIterator`) only
    to read its shapes, and that iterator advances the user's input: a seeded
    `shuffle(reshuffle_each_iteration=True)` then yields another order every epoch than on one device, and a
    `from_generator` generator runs once more per fit (an extra pass over data that may stream from a database).
    Without a strategy Keras builds the model when the step is traced, taking nothing. The input's element spec
    (`data_adapter.get_tf_dataset().element_spec`, the batch dimension left open) has the structure, feature shapes
    and dtypes the build needs. A dataset the user distributed has per-replica specs: its first batch is taken as
    before. Keras reduces per-replica batches with `strategy.reduce("MEAN")` only to get one batch whose shapes
    build the model, and that AddN fails when the shares differ in size (`batch_size=5` on 2 replicas: "Inputs
    to operation AddN ... must have the same size and shape. Input 0: [3,8] != input 1: [2,8]"); one replica's
    share has the same structure and feature shapes. `restore(batch)`, when given, turns a staged batch back into
    what the model takes (the compiled execution's int32 parts). Private Keras touched: `model._symbolic_build`,
    the `EpochIterator`'s `data_adapter`."""
    if model._distribute_strategy is None:  # noqa: SLF001 - as Keras: build when the step is traced
        return
    strategy = model.distribute_strategy
    if iterator is not None:
        data_batch = _open_batch_specs(iterator.data_adapter.get_tf_dataset())
        if data_batch is None:  # the user's own distributed dataset
            for _, _, batches in iterator:
                data_batch = next(batches)
                break
    data_batch = tf.nest.map_structure(
        lambda value: strategy.experimental_local_results(value)[0]
        if isinstance(value, tf.distribute.DistributedValues) else value, data_batch)
    if restore is not None:
        data_batch = restore(data_batch)
    with strategy.scope():
        model._symbolic_build(data_batch=data_batch)  # noqa: SLF001


def _open_batch_specs(dataset):
    """The element spec of a host `dataset`, each part's batch dimension open (None for a distributed dataset)."""
    if isinstance(dataset, tf.distribute.DistributedDataset):
        return None

    def opened(spec):
        shape = spec.shape
        if shape.rank:
            shape = tf.TensorShape([None]).concatenate(shape[1:])
        return tf.TensorSpec(shape, spec.dtype) if isinstance(spec, tf.TensorSpec) else spec

    return tf.nest.map_structure(opened, dataset.element_spec)


def fused_allreduce_possible(strategy) -> bool:
    """True when every replica is a GPU: there MirroredStrategy all-reduces inside XLA (CollectiveAllReduce
    compiled to an XLA all-reduce over NCCL) and applies updates per replica without merge_call.
    (True on any device while `emulate_fused_mode_on_cpu` is on.)"""
    if _STATE.fused_emulated_on_cpu:
        return True
    devices = getattr(strategy.extended, "worker_devices", ())
    return bool(devices) and all("GPU" in d.upper() for d in devices)


def only_first_replica_variables(optimizer) -> list:
    """The optimizer's step counters (aggregation ONLY_FIRST_REPLICA: `iterations`, loss-scale counters)."""
    if optimizer is None:
        return []
    return [v for v in optimizer.variables if str(getattr(v, "aggregation", "")) == "only_first_replica"]


@contextlib.contextmanager
def replica_local(variables):
    """While tracing one replica's fused step, point ONLY_FIRST_REPLICA variables at that replica's own copy.

    TensorFlow broadcasts replica 0's value for such variables with a `merge_call`, even in its no-merge-call
    XLA mode, and a `merge_call` cannot live inside XLA. Every replica computes the same value for these counters
    (iterations + 1), so updating each replica's own copy keeps them identical without the broadcast.
    """
    swapped = []
    try:
        for variable in variables:
            mirrored = getattr(variable, "_value", None)
            local = getattr(mirrored, "_get_on_device_or_primary", None)
            if local is not None:
                swapped.append((variable, mirrored))
                variable._value = local()
        yield
    finally:
        for variable, mirrored in swapped:
            variable._value = mirrored


def replica_id() -> int:
    """The replica the calling code runs for (0 outside a replica context)."""
    context = tf.distribute.get_replica_context()
    replica_id = tf.get_static_value(context.replica_id_in_sync_group) if context is not None else 0
    return int(replica_id or 0)


# Custom loops: what `optimizer.apply` does while one replica's copy of a jit step is traced (thread-local:
# MirroredStrategy traces each replica in its own thread). Keras' optimizers that define `apply` are hooked.
_OPTIMIZER_CLASSES: dict[str, Callable[[], type]] = {
    "BaseOptimizer": lambda: __import__("keras.src.optimizers.base_optimizer",
                                        fromlist=["BaseOptimizer"]).BaseOptimizer,
    "LossScaleOptimizer": lambda: __import__("keras.src.optimizers.loss_scale_optimizer",
                                             fromlist=["LossScaleOptimizer"]).LossScaleOptimizer,
}


_TRACING = threading.local()


def _install_optimizer_hooks() -> None:
    """Hook `apply` of Keras' optimizers (called with _STATE.lock held, after the trainer hooks)."""
    for owner, load in _OPTIMIZER_CLASSES.items():
        cls = load()
        original = cls.__dict__["apply"]
        _STATE.originals[f"{owner}.apply"] = original

        def apply(self, grads, trainable_variables=None, _original=original):
            mode = getattr(_TRACING, "mode", None)
            if getattr(_TRACING, "depth", 0):
                return _original(self, grads, trainable_variables)
            if mode is None:  # any update under a tf_nvlink strategy: fit with or without XLA, split updates
                if not _under_tf_nvlink(self):
                    return _original(self, grads, trainable_variables)
                if getattr(self, "gradient_accumulation_steps", None) and _merge_call_in_use(self):
                    return _accumulate_without_merge_call(self, _original, grads, trainable_variables)
                with _agreed_finite_check(self):
                    return _original(self, dense_gradients_in_xla(grads), trainable_variables)
            if not self.built and trainable_variables is not None:
                error = OptimizerNotBuiltWhileTracing(f"optimizer {self.name!r} is not built yet")
                error.optimizer, error.variables = self, list(trainable_variables)
                raise error
            if mode == "catch":
                _TRACING.caught.append((self, list(grads), trainable_variables))
                return None
            _TRACING.depth = 1
            try:
                with replica_local(only_first_replica_variables(self)), _agreed_finite_check(self):
                    return _original(self, dense_gradients_in_xla(grads), trainable_variables)
            finally:
                _TRACING.depth = 0

        cls.apply = apply


_NO_MERGE_CALL = threading.local()


def gradients_already_reduced() -> bool:
    """True while `_accumulate_without_merge_call` applies gradients it has all-reduced already (this thread)."""
    return getattr(_NO_MERGE_CALL, "active", False)


def _merge_call_in_use(optimizer) -> bool:
    context = tf.distribute.get_replica_context()
    strategy = getattr(optimizer, "_distribution_strategy", None)
    return (context is not None and context.num_replicas_in_sync > 1 and not tf.executing_eagerly()
            and strategy is not None and strategy.extended._use_merge_call())  # noqa: SLF001


def _accumulate_without_merge_call(optimizer, original_apply, grads, trainable_variables):
    """`gradient_accumulation_steps` under a merge_call MirroredStrategy (plain mode, split mode's update).

    Why: Keras 3 (3.12 to 3.15 checked) decides between "accumulate" and "accumulate and update" in a `tf.cond`
    inside `BaseOptimizer._backend_apply_gradients`, and both branches reach `merge_call` (the gradient
    all-reduce, `maybe_merge_call` around the variable updates): "RuntimeError: Exception encountered when calling
    Cond.call(). `merge_call` called while defining a new graph". Stock MirroredStrategy fails the same way.
    Here the gradients are all-reduced first, outside the cond (every replica then holds the same global-batch
    gradients), and Keras' `apply` runs on them with this replica thread on MirroredStrategy's no-merge_call path
    (the private `MirroredExtended._use_merge_call`, which TensorFlow itself turns off under XLA on GPUs, and
    which the fused mode relies on): each replica updates its own copy of every accumulator and variable with
    the same values, so the copies stay identical, and the optimizer's step counters are kept per replica
    (`_replica_local`). The optimizer's `_all_reduce_sum_gradients` (an instance attribute set here) passes
    these gradients through rather than all-reducing them again."""
    pairs = [(g, v) for g, v in zip(grads, trainable_variables if trainable_variables is not None
                                     else optimizer._trainable_variables)]
    with _clipping_later():  # Keras clips the accumulated mean below, once these are the global gradients
        reduced = optimizer._all_reduce_sum_gradients(pairs)  # noqa: SLF001 - tf_nvlink's hook, bfloat16 included
    if "_all_reduce_sum_gradients" not in optimizer.__dict__:  # Keras' update step must not all-reduce them again
        reduce_sum = optimizer._all_reduce_sum_gradients  # noqa: SLF001
        optimizer._all_reduce_sum_gradients = lambda grads_and_vars: (
            list(grads_and_vars) if gradients_already_reduced() else reduce_sum(grads_and_vars))
    extended = optimizer._distribution_strategy.extended  # noqa: SLF001
    if "_use_merge_call" not in extended.__dict__:
        merge_call_default = extended._use_merge_call  # noqa: SLF001
        extended._use_merge_call = lambda: (not gradients_already_reduced()) and merge_call_default()
    _NO_MERGE_CALL.active = True
    try:
        with replica_local(only_first_replica_variables(optimizer)):
            return original_apply(optimizer, [g for g, _ in reduced],
                                  None if trainable_variables is None else [v for _, v in reduced])
    finally:
        _NO_MERGE_CALL.active = False


_CLIP = threading.local()  # this replica thread's clipping state (see _install_clip_hook)


def _install_clip_hook() -> None:
    """Replace `BaseOptimizer._clip_gradients` (Keras 3.12 to 3.15; called with _STATE.lock held).

    Why: Keras clips (`clipnorm`, `global_clipnorm`, `clipvalue`) in `_backend_apply_gradients`, before its
    TensorFlow optimizer all-reduces the gradients in `_backend_update_step`, so under a MirroredStrategy each
    replica clips its own share and the update differs from one device's (stock MirroredStrategy does the same).
    Under a multi-replica tf_nvlink strategy the clip there is deferred, and `clip_reduced_gradients` applies
    Keras' own clip to the all-reduced gradients (tf_nvlink.training.gradient_allreduce): one device's update.
    Gradients that are already all-reduced (`gradients_already_reduced`, gradient accumulation under
    merge_call) are clipped where Keras clips them."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer  # noqa: PLC0415

    original = _STATE.originals["BaseOptimizer._clip_gradients"] = BaseOptimizer.__dict__["_clip_gradients"]

    def _clip_gradients(self, grads):
        if getattr(_CLIP, "now", False) or gradients_already_reduced() or not _clip_after_allreduce(self):
            return original(self, grads)
        return list(grads)  # clipped once all-reduced

    BaseOptimizer._clip_gradients = _clip_gradients


def _clip_after_allreduce(optimizer) -> bool:
    context = tf.distribute.get_replica_context()
    return context is not None and context.num_replicas_in_sync > 1 and _under_tf_nvlink(optimizer)


def _clipping_later():
    return _thread_setting(_CLIP, "skip", True)


@contextlib.contextmanager
def _thread_setting(local: threading.local, name: str, value):
    """`local.name = value` while the block runs in this thread, the earlier value (or None) back after it."""
    saved = getattr(local, name, None)
    setattr(local, name, value)
    try:
        yield
    finally:
        setattr(local, name, saved)


def clip_reduced_gradients(optimizer, grads: list) -> list:
    """Keras' clipping of `optimizer` (its `_clip_gradients`: clipnorm, global_clipnorm, clipvalue) applied to
    all-reduced gradients; unchanged while gradient accumulation reduces them before Keras clips the mean."""
    if getattr(_CLIP, "skip", False) or not _clip_after_allreduce(optimizer):
        return grads
    _CLIP.now = True
    try:
        return optimizer._clip_gradients(grads)  # noqa: SLF001
    finally:
        _CLIP.now = False


class OptimizerNotBuiltWhileTracing(Exception):  # noqa: N818 - a signal to the step, not an error for users
    """An optimizer without variables was reached while one replica's copy of a custom-loop step was traced.

    Keras builds an optimizer in its first `apply`, so the step would create its variables: in split mode the
    trace would hold constants for them (LossScaleOptimizer's `initial_scale` in place of `dynamic_scale`, so the
    scale never changed), in fused mode TensorFlow's variable-initialisation cond ("You must feed a value for
    placeholder tensor ... cond/Placeholder"). `PerReplicaCustomStep` stops that trace, builds the optimizer
    outside it (`build_optimizer(error.optimizer, error.variables)`) and traces again. No own __init__: AutoGraph
    re-raises such exceptions as the same type (others become a StagingError), though as a new object."""

    optimizer = None
    variables: list = []


def build_optimizer(optimizer, variables: list) -> None:
    """From one replica of a step (not inside XLA): build `optimizer` on `variables` as Keras' `apply` does when
    first called, but eagerly in the strategy's cross-replica context, as `model.fit` does. Every replica must
    call it (a merge_call): they all stop at the same unbuilt optimizer. Variables created while a function is
    traced would make TensorFlow initialise them in a cond, which fails on MirroredStrategy's no-merge_call path."""
    import keras  # noqa: PLC0415

    def build(strategy):
        if not optimizer.built:
            with tf.init_scope(), strategy.scope(), keras.name_scope(optimizer.name, caller=optimizer):
                optimizer.build(variables)
            optimizer.built = True

    tf.distribute.get_replica_context().merge_call(build)


@contextlib.contextmanager
def optimizer_calls(mode: str):
    """While tracing one replica's copy of a custom-loop step: "catch" records every outermost
    `optimizer.apply(grads, variables)` instead of running it (split mode, the update runs after XLA);
    "replica_local" runs it with the optimizer's step counters kept per replica (fused mode)."""
    saved = (getattr(_TRACING, "mode", None), getattr(_TRACING, "caught", None), getattr(_TRACING, "depth", 0))
    _TRACING.mode, _TRACING.caught, _TRACING.depth = mode, [], 0
    try:
        yield _TRACING.caught
    finally:
        _TRACING.mode, _TRACING.caught, _TRACING.depth = saved


def dense_gradients_in_xla(grads):
    """Inside XLA, sparse gradients (tf.IndexedSlices, from Embedding layers) made dense; elsewhere unchanged.

    An all-reduce of IndexedSlices is an all-gather (CollectiveGatherV2), which XLA cannot compile: on 1x H200 a
    Transformer LM's jit-compiled fit under a one-GPU tf_nvlink strategy failed with "No registered
    'CollectiveGatherV2' OpKernel for XLA_GPU_JIT". A dense all-reduce is what XLA compiles (and combines)."""
    if not in_xla_context():
        return grads
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def optimizer_strategy(optimizer):
    """The distribution strategy a Keras optimizer was created under (None: none recorded).

    Touches `optimizer._distribution_strategy`, which Keras' TensorFlow optimizer sets in `__init__`; no public
    accessor exists."""
    return getattr(optimizer, "_distribution_strategy", None)


def optimizer_trainable_variables(optimizer) -> list:
    """The variables a built Keras optimizer updates when `apply(grads)` gets none (`optimizer._trainable_variables`,
    set by `BaseOptimizer.build`; no public accessor exists)."""
    return list(optimizer._trainable_variables)


def _under_tf_nvlink(optimizer) -> bool:
    return _STATE.is_ours(optimizer_strategy(optimizer))


@contextlib.contextmanager
def _agreed_finite_check(optimizer):
    """LossScaleOptimizer: every replica skips or applies the step together, on all replicas' gradients.

    Keras checks the gradients for inf/NaN before they are all-reduced: with merge_call (split mode) it keeps
    replica 0's verdict for all ("Each replica computed the same `finite` value, since `grads` is all-reduced",
    which it is not), so an overflow on another replica reaches the all-reduced update (NaN weights: seen in
    fit without XLA and in split mode, on 2 CPU replicas; stock MirroredStrategy does the same); without
    merge_call (fused mode) each replica decides alone, and one that skips leaves the others' all-reduce waiting.
    The check is all-reduced instead: the step is applied only when every replica's gradients are finite, which
    is when the all-reduced gradients are. Replica threads take turns while tracing, so the override reads the
    replica context when it is called and the class's own check."""
    context = tf.distribute.get_replica_context()
    if not hasattr(optimizer, "inner_optimizer") or not hasattr(type(optimizer), "check_finite") \
            or context is None or context.num_replicas_in_sync < 2:
        yield
        return
    check_finite = type(optimizer).check_finite

    def agreed(grads):
        not_finite = tf.cast(tf.logical_not(check_finite(optimizer, grads)), tf.float32)
        replica = tf.distribute.get_replica_context()  # split mode: a replica of Keras' merge_call
        return tf.equal(replica.all_reduce(tf.distribute.ReduceOp.SUM, not_finite), 0.0)

    optimizer.check_finite = agreed
    try:
        yield
    finally:
        optimizer.__dict__.pop("check_finite", None)


def unrolled_steps_function(model, step_function, next_batches: Callable):
    """Keras' train/test function for steps_per_execution=N > 1 without its tf.while_loop and tf.cond.

    Why: with no merge_call (MirroredStrategy on all-GPU replicas under XLA, i.e. fused mode), `strategy.run`
    inside a tf.cond or tf.while_loop branch fails ("You must feed a value for placeholder tensor ... cond");
    reproduced on CPU with a stock MirroredStrategy and `_use_merge_call` off, while N unrolled calls work. So the
    N batches are taken eagerly from the distributed iterator (`next_batches(iterator, N)`: the batches and the
    input's error, raised after the batches before it ran) and one tf.function runs the N steps unrolled; the
    last execution of an epoch may hold fewer (its own trace). Private Keras touched: `reduce_per_replica` and
    `TensorFlowTrainer._autoconvert_optionals`, as in Keras' `_make_function`.
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica  # noqa: PLC0415

    strategy = model.distribute_strategy

    def one_step_on_data(data):
        return reduce_per_replica(strategy.run(step_function, args=(data,)), strategy, reduction="auto")

    one_step_on_data = model._autoconvert_optionals(one_step_on_data)

    @tf.autograph.experimental.do_not_convert
    def steps_on_batches(batches):
        outputs = None
        for data in batches:
            outputs = one_step_on_data(data)
        return outputs

    steps_on_batches = tf.function(steps_on_batches, reduce_retracing=True)

    def function(iterator):
        batches, error = next_batches(iterator, model.steps_per_execution)
        outputs = steps_on_batches(tuple(batches)) if batches else None
        if error is not None:
            raise error  # after the steps before it, as Keras' own loop
        if outputs is None:
            raise StopIteration
        return outputs

    return function


def reduce_step_outputs(outputs, strategy):
    """A step's per-replica outputs (logs) reduced as Keras' train function reduces them
    (`keras.src.backend.tensorflow.trainer.reduce_per_replica`, reduction "auto"; Keras 3.12 to 3.15). Why: the
    compiled execution returns the same logs as Keras' own function, and Keras has no public name for it."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica  # noqa: PLC0415

    return reduce_per_replica(outputs, strategy, reduction="auto")


def one_step_function(model, step_function, jit_compile: bool = False):
    """One batch through `strategy.run(step_function)`, its logs reduced: Keras' `one_step_on_data` (3.12 to
    3.15) as a tf.function, optional inputs converted as Keras does (`TensorFlowTrainer._autoconvert_optionals`).
    Why: the paths that run fewer steps than `steps_per_execution` (an epoch's last execution) need the single
    step Keras builds inside `_make_function` but does not expose."""
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        return reduce_step_outputs(strategy.run(step_function, args=(data,)), strategy)

    return model._autoconvert_optionals(  # noqa: SLF001
        tf.function(one_step_on_data, reduce_retracing=True, jit_compile=jit_compile))


def worker_count(strategy) -> int:
    """The number of worker processes of a strategy (1 for MirroredStrategy). Touches the private
    `extended._num_workers` of MultiWorkerMirroredStrategy (TensorFlow 2.21); no public accessor."""
    return int(getattr(strategy.extended, "_num_workers", 1) or 1)


def device_bytes_free(device: str):
    """Bytes the TensorFlow allocator of GPU `device` can still hand out (its limit less what it holds now), or
    None for a CPU or when unknown. Touches `device_lib.list_local_devices` (the allocator's `memory_limit`, no
    public accessor; TensorFlow 2.21) once per device; `tf.config.experimental.get_memory_info` gives the
    bytes in use. Why: the compiled execution checks that the N staged batches fit before training starts."""
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


_MEMORY_LIMITS: dict[str, int] = {}
_EXECUTION = threading.local()  # the steps Keras' fit/evaluate loop asks of the function it calls now


def steps_asked_for_this_call(default: int) -> int:
    """The steps the epoch asks of the train/test function being called now (`default` outside a hooked epoch):
    `steps_per_execution`, or fewer for the epoch's last execution (see `_install_epoch_iterator_hook`)."""
    return getattr(_EXECUTION, "steps", None) or default


def _install_epoch_iterator_hook() -> None:
    """Replace `EpochIterator._enumerate_iterator` (Keras 3.12 to 3.15; called with _STATE.lock held).

    Why: with `steps_per_execution=N` Keras hands out executions of N steps whatever `steps_per_epoch` says
    (`steps_per_epoch=7` at N=5 runs 10 steps an epoch; the progress bar and callbacks say 5 and 10). Under a
    tf_nvlink strategy the last execution of an epoch is cut to the steps the epoch asks for: `end_step` is
    clamped, Keras' count of steps taken (`_steps_seen`) is corrected, and the function called for it reads the
    count (`steps_asked_for_this_call`). Other strategies run Keras' code."""
    from keras.src.trainers.epoch_iterator import EpochIterator  # noqa: PLC0415

    original = _STATE.originals["EpochIterator._enumerate_iterator"] = EpochIterator.__dict__["_enumerate_iterator"]

    def _enumerate_iterator(self):
        steps = self.steps_per_execution
        if steps <= 1 or not _STATE.is_ours(getattr(self, "_distribute_strategy", None)):
            yield from original(self)
            return
        limit = self.steps_per_epoch or self._num_batches or -1  # as Keras reads it when the epoch starts
        for begin, end, iterator in original(self):
            if 0 < limit <= end:
                end = limit - 1
                self._steps_seen -= steps - (end - begin + 1)
            _EXECUTION.steps = end - begin + 1
            try:
                yield begin, end, iterator
            finally:
                _EXECUTION.steps = None

    EpochIterator._enumerate_iterator = _enumerate_iterator


_BATCH_END_METHODS = {"train": ("on_batch_end", "on_train_batch_end"), "test": ("on_test_batch_end",),
                      "predict": ("on_predict_batch_end",)}


def batch_ends_dispatch_asynchronously(callbacks) -> tuple[bool, bool, bool]:
    """(train, test, predict): whether Keras' rule lets batch ends of fit, evaluate and predict run off the
    training thread with these user `callbacks`: each one is `async_safe` or leaves that batch-end method as
    Keras' default (`CallbackList._configure_async_dispatch`, Keras 3.12 to 3.15, without its backend check)."""
    return tuple(not callbacks_needing_batch_ends(callbacks, kind) for kind in ("train", "test", "predict"))


def callbacks_needing_batch_ends(callbacks, kind: str = "train") -> list[str]:
    """The class names of the user `callbacks` that keep the batch ends of `kind` ("train": fit, "test":
    evaluate, "predict") on the training thread by Keras' rule: not `async_safe`, and with their own method."""
    from keras.src.utils.python_utils import is_default  # noqa: PLC0415

    return [type(callback).__name__ for callback in (callbacks if isinstance(callbacks, (list, tuple)) else ())
            if not getattr(callback, "async_safe", False)
            and not all(is_default(getattr(callback, method)) for method in _BATCH_END_METHODS[kind])]


def _install_batch_end_dispatch_hook() -> None:
    """Replace `CallbackList.__init__` (Keras 3.12 to 3.15; called with _STATE.lock held).

    Why: Keras converts each call's logs to Python floats before the batch-end callbacks run, on the training
    thread unless the backend is marked thread-safe (JAX is; TensorFlow is not). On TensorFlow the host then
    waits for the GPU to finish every call before it launches the next, so the GPU idles while the host takes
    the next batches and launches the next program (between the compiled execution's programs, 1x H200: about
    10 ms per call). Under a tf_nvlink strategy batch ends follow Keras' JAX rule: when every callback the user
    passed is `async_safe` or leaves batch ends alone (the progress bar and History are Keras' own and take part),
    they run off the training thread, each with its own call's logs, on one callback thread so that they keep
    their order (Keras' pool has several); the epoch's end waits for them. Touches the private `_async_train`,
    `_async_test` and `_async_predict` that `_configure_async_dispatch` sets, and `_executor`, the pool
    `_on_begin` makes when none is there."""
    callback_list = _keras_callback_list_class()
    original = _STATE.originals["CallbackList.__init__"] = callback_list.__dict__["__init__"]

    def __init__(self, callbacks=None, *args, model=None, **kwargs):
        original(self, callbacks, *args, model=model, **kwargs)
        if model is not None and _STATE.is_ours(getattr(model, "_distribute_strategy", None)):
            self._async_train, self._async_test, self._async_predict = batch_ends_dispatch_asynchronously(callbacks)
            _name_blocking_callbacks(callbacks_needing_batch_ends(callbacks, "train"))
            if (self._async_train or self._async_test or self._async_predict) and self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix="tf_nvlink_batch_ends")

    callback_list.__init__ = __init__


def _name_blocking_callbacks(names: list[str]) -> None:
    new = sorted(set(names) - _STATE.named_blocking_callbacks)
    if new:
        _STATE.named_blocking_callbacks.update(new)
        log.info("tf_nvlink: fit's batch ends run on the training thread because %s define(s) on_train_batch_end or "
                 "on_batch_end without async_safe = True: the host waits for the GPU to finish every call before "
                 "it launches the next. Set async_safe = True on a callback whose batch ends may run on another "
                 "thread (in order), or leave batch ends out of it.", ", ".join(new))


def in_xla_context() -> bool:
    from tensorflow.python.ops import control_flow_util  # noqa: PLC0415

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def cross_replica_sum_impossible_here() -> bool:
    """True inside a jit-compiled step of a strategy that merges across replicas with merge_call (split mode):
    there a replica-context all-reduce cannot be compiled into the replica's XLA program.

    Why: whether the strategy uses merge_call is only the private `MirroredExtended._use_merge_call()`
    (TensorFlow 2.21 checked); TensorFlow answers False for all-GPU replicas under XLA (fused mode).
    """
    return in_xla_context() and tf.distribute.get_strategy().extended._use_merge_call()  # noqa: SLF001


class CrossReplicaCallInXlaError(ValueError):
    """A split-mode step (XLA per replica, all-reduce outside) asked for a cross-replica merge inside XLA."""


@contextlib.contextmanager
def merge_call_explained():
    """TensorFlow's "merge_call called while defining a new graph" in a split-mode step, said in tf_nvlink's terms."""
    try:
        yield
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        raise CrossReplicaCallInXlaError(
            "A jit_compile=True step running in tf_nvlink's split mode (CPU replicas, or xla_allreduce='split') "
            "asked for a cross-replica merge inside XLA, which split mode cannot hold: "
            "keras.layers.BatchNormalization(synchronized=True), tf.distribute.get_replica_context().all_reduce() "
            "or merge_call() in the step. Use synchronized=False (or move the all-reduce out of the jit step), "
            "fused mode (all-GPU replicas: tf_nvlink.strategy(xla_allreduce='fused')), or jit_compile=False. "
            f"TensorFlow said: {error}") from error


# ==== Keras 3 on MultiWorkerMirroredStrategy, and a resumed fit's first epoch ===================================


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


def set_initial_epoch(model, epoch: int) -> None:
    """Make the next `model.fit()` start at `epoch`.

    Why: Keras keeps the epoch a resumed fit starts from in the private `model._initial_epoch`, which its own
    `keras.callbacks.BackupAndRestore` sets; tf_nvlink's backup callback restores the same way.
    """
    model._initial_epoch = epoch  # noqa: SLF001


# ==== Keras' TensorFlowTrainer (the trainer hooks of tf_nvlink.training.install) ===============================


def install_trainer_hooks(is_ours: Callable[[object], bool], make_function: Callable,
                          input_staging: Callable[[object], tuple | None] = lambda model: None,
                          split_batch: Callable | None = None) -> str | None:
    """Replace Keras' trainer methods once; returns None when installed (or already), else why not (and nothing
    is changed). Models whose strategy `is_ours` rejects run Keras' own code.

    Touches (TensorFlowTrainer's, replaced on the class; the originals are kept in `_STATE.originals`):
    - `_make_function`: calls `make_function(model, step_function, keras_make_function)`, where
      `keras_make_function(step, outer_jit=True)` is Keras' own, with the model's `_jit_compile` off around it
      when `outer_jit` is False (the function spanning the replicas must not be one XLA cluster).
    - `_resolve_auto_jit_compile`: Keras turns "auto" XLA off under any strategy ("Disable XLA with
      tf.distribute"); under ours it is Keras' rule without a strategy (`model_supports_jit`, with a GPU).
    - `_maybe_symbolic_build` (where it exists): skipped once the model is fully built (`fully_built`): Keras
      makes a distributed iterator at every fit/evaluate only to build nothing (about 100 ms per call on a CPU).
      Before that, the build takes the first replica's share of the first batch
      (`symbolic_build_from_one_replica`): Keras' MEAN of the shares fails when they differ in size. First of
      all, where `input_staging(model)` names a staging (a depth, a host transform, a batch restore, on the devices
      or not), the epoch's input is distributed again with that many batches prefetched, transformed first
      (`restage_input`), and the build takes its batch restored.
    - `BaseOptimizer.apply`, `LossScaleOptimizer.apply` (`_install_optimizer_hooks`).
    - `keras.src.losses.loss.scale_loss_for_distribution` / `unscale_loss_for_distribution`
      (`_install_loss_share_hooks`, the exact-batch rule).
    - `EpochIterator._enumerate_iterator` (`_install_epoch_iterator_hook`: an epoch runs the steps it asks for).
    - `BatchNormalization._moments` (`_install_empty_replica_hooks`: no NaN from a replica without examples).
    - `CompileLoss.call`, `Mean.update_state` (`_install_output_loss_metric_hooks`: a multi-output model's
      per-output loss metrics count each step once, a replica without examples not at all).
    - `BaseOptimizer._clip_gradients` (`_install_clip_hook`: clipping acts on the all-reduced gradients).
    - `CallbackList.__init__` (`_install_batch_end_dispatch_hook`: batch ends dispatched as Keras does on JAX).
    - `train_on_batch`, `test_on_batch`, `predict_on_batch` (`_install_on_batch_hooks`, with `split_batch`: the
      batch split over the replicas).
    """
    with _STATE.lock:
        if "_make_function" in _STATE.originals:
            return None
        problem = check_keras_support()
        if problem:
            return problem
        _STATE.is_ours = is_ours
        trainer = _keras_trainer_class()
        keras_make = _STATE.originals["_make_function"] = trainer._make_function
        keras_resolve = _STATE.originals["_resolve_auto_jit_compile"] = trainer._resolve_auto_jit_compile

        def _make_function(self, step_function):
            if not is_ours(self.distribute_strategy):
                return keras_make(self, step_function)

            def keras_make_function(step, outer_jit=True):
                if outer_jit:
                    return keras_make(self, step)
                saved = self._jit_compile
                self._jit_compile = False
                try:
                    return keras_make(self, step)
                finally:
                    self._jit_compile = saved

            return make_function(self, step_function, keras_make_function)

        def _resolve_auto_jit_compile(self):
            if not is_ours(self._distribute_strategy):
                return keras_resolve(self)
            from keras.src.trainers.trainer import model_supports_jit  # noqa: PLC0415

            if not tf.config.list_logical_devices("GPU"):
                return False  # Keras' rule: no XLA on CPU-only machines
            return model_supports_jit(self)

        trainer._make_function = _make_function
        trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
        if hasattr(trainer, "_maybe_symbolic_build"):
            keras_build = _STATE.originals["_maybe_symbolic_build"] = trainer._maybe_symbolic_build

            def _maybe_symbolic_build(self, iterator=None, data_batch=None):
                if not is_ours(self.distribute_strategy):
                    return keras_build(self, iterator=iterator, data_batch=data_batch)
                staging = input_staging(self) if iterator is not None else None
                if staging:
                    restage_input(self, iterator, staging.depth, staging.transform, staging.to_device,
                                  staging.reuse_key)
                if fully_built(self):
                    return None  # Keras would make a distributed iterator and all-reduce a batch to build nothing
                return symbolic_build_from_one_replica(self, iterator=iterator, data_batch=data_batch,
                                                       restore=staging.restore if staging else None)

            trainer._maybe_symbolic_build = _maybe_symbolic_build
        _install_optimizer_hooks()
        _install_loss_share_hooks()
        _install_output_loss_metric_hooks()
        _install_epoch_iterator_hook()
        _install_empty_replica_hooks()
        _install_clip_hook()
        _install_batch_end_dispatch_hook()
        if split_batch is not None:
            _install_on_batch_hooks(trainer, is_ours, split_batch)
        return None


_ON_BATCH_ARGUMENTS = {"train_on_batch": ("x", "y", "sample_weight", "class_weight"),
                       "test_on_batch": ("x", "y", "sample_weight"), "predict_on_batch": ("x",)}


def _install_on_batch_hooks(trainer, is_ours: Callable[[object], bool], split_batch: Callable) -> None:
    """Replace `TensorFlowTrainer.train_on_batch`, `test_on_batch` and `predict_on_batch` (Keras 3.12 to 3.15;
    called with _STATE.lock held).

    Why: Keras hands the batch of these calls to `strategy.run` as it is, so every replica gets the whole batch:
    `predict_on_batch` on 5 rows returns 10 rows on 2 replicas (stock MirroredStrategy too), and the others
    compute every example once per replica. Under a multi-replica tf_nvlink strategy the batch (x, y,
    sample_weight; `class_weight` turned into sample weights first, as Keras does,
    `data_adapter_utils.class_weight_to_sample_weights`) is split over the replicas by `split_batch(strategy,
    batch)` (None: it cannot be split, Keras' call runs as it is), as fit splits a global batch."""
    from keras.src.trainers.data_adapters import data_adapter_utils  # noqa: PLC0415

    for name, arguments in _ON_BATCH_ARGUMENTS.items():
        original = _STATE.originals[name] = trainer.__dict__[name]

        def on_batch(self, *args, _original=original, _arguments=arguments, **kwargs):
            strategy = self.distribute_strategy
            if not is_ours(strategy) or strategy.num_replicas_in_sync < 2:
                return _original(self, *args, **kwargs)
            given = dict(zip(_arguments, args), **kwargs)
            if given.get("class_weight") is not None and given.get("sample_weight") is None:
                given["sample_weight"] = data_adapter_utils.class_weight_to_sample_weights(
                    given["y"], given.pop("class_weight"))
            names = [key for key in ("x", "y", "sample_weight") if given.get(key) is not None]
            split = split_batch(strategy, tuple(given[key] for key in names))
            if split is not None:
                given.update(zip(names, split))
            return _original(self, **given)

        setattr(trainer, name, on_batch)


def enable_trainer_hooks(is_ours: Callable[[object], bool], make_function: Callable,
                         input_staging: Callable[[object], tuple | None] = lambda model: None,
                         split_batch: Callable | None = None) -> str | None:
    """`install_trainer_hooks`, remembering why it failed (`keras_hook_problem()`); returns that reason or None."""
    _STATE.problem = install_trainer_hooks(is_ours, make_function, input_staging, split_batch)
    return _STATE.problem


def jit_tf_function(fn):
    """(tf.function, python function, autograph flag) when `fn` is a `tf.function(jit_compile=True)`, or Keras'
    `_autoconvert_optionals` wrapper of one (reached through `__wrapped__`); else None.

    Touches `tf.function`'s private `_jit_compile` and `_autograph` (TensorFlow 2.21; no public accessor):
    tf_nvlink recompiles such a function once per replica, with the user's autograph setting."""
    target = fn if hasattr(fn, "python_function") else getattr(fn, "__wrapped__", fn)
    if not (getattr(target, "_jit_compile", False) and hasattr(target, "python_function")):
        return None
    return target, target.python_function, getattr(target, "_autograph", True)


# ==== Keras' BatchNormalization on a replica without examples (tf_nvlink.training.replica_sync) ================


def _keras_batch_norm_class():
    from keras.src.layers.normalization.batch_normalization import BatchNormalization  # noqa: PLC0415

    return BatchNormalization


def _install_empty_replica_hooks() -> None:
    """Replace `BatchNormalization._moments` (Keras 3.12 to 3.15; called with _STATE.lock held).

    Why: a step whose global batch leaves a replica without examples (65 examples at batch_size=32 on 2 replicas:
    1 + 0) has that replica compute its batch mean and variance over nothing, 0 / 0 = NaN (`tf.nn.moments`); the NaN
    reaches the moving statistics and, through the replica sync, every replica, and the model predicts NaN from then
    on (stock MirroredStrategy does the same). Under a multi-replica tf_nvlink strategy an empty batch's moments
    are 0 instead, selected with `tf.where` (a batch with examples gets Keras' own values, bit for bit); its
    moving-statistics update then counts for nothing in the sync, which weights replicas by their examples.
    `synchronized=True` and masked inputs already divide by a count that cannot be 0."""
    cls = _keras_batch_norm_class()
    original = _STATE.originals["BatchNormalization._moments"] = cls.__dict__["_moments"]

    def _moments(self, inputs, mask):
        mean, variance = original(self, inputs, mask)
        context = tf.distribute.get_replica_context()
        if mask is not None or self.synchronized or context is None or context.num_replicas_in_sync < 2 \
                or not _STATE.is_ours(tf.distribute.get_strategy()):
            return mean, variance
        has_examples = tf.size(inputs) > 0
        return (tf.where(has_examples, mean, tf.zeros_like(mean)),
                tf.where(has_examples, variance, tf.zeros_like(variance)))

    cls._moments = _moments


# ==== Keras' TensorFlow optimizer: its gradient all-reduce (tf_nvlink.training.gradient_allreduce) =============


def replace_gradient_allreduce(replacement: Callable) -> bool:
    """Replace `TFOptimizer._all_reduce_sum_gradients` (Keras' TensorFlow optimizer's gradient all-reduce, in fit
    with and without XLA and in custom loops) by `replacement(optimizer, grads_and_vars, keras_all_reduce)`;
    returns False when it already is. Why: tf_nvlink skips the all-reduce of one replica and casts around it
    for bfloat16 (training/gradient_allreduce.py says why); Keras has no public hook there."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer  # noqa: PLC0415

    with _STATE.lock:
        if "TFOptimizer._all_reduce_sum_gradients" in _STATE.originals:
            return False
        original = _STATE.originals["TFOptimizer._all_reduce_sum_gradients"] = TFOptimizer._all_reduce_sum_gradients

        def _all_reduce_sum_gradients(self, grads_and_vars):
            return replacement(self, grads_and_vars, lambda pairs: original(self, pairs))

        TFOptimizer._all_reduce_sum_gradients = _all_reduce_sum_gradients
        return True


def restore_gradient_allreduce() -> None:
    """Put Keras' own `TFOptimizer._all_reduce_sum_gradients` back (tests show what the replacement changes)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer  # noqa: PLC0415

    with _STATE.lock:
        original = _STATE.originals.pop("TFOptimizer._all_reduce_sum_gradients", None)
        if original is not None:
            TFOptimizer._all_reduce_sum_gradients = original


def check_gradients_present(grads_and_vars) -> None:
    """Keras' own check of (gradient, variable) pairs: all None raises, some None warns
    (`keras.src.backend.tensorflow.optimizer.filter_empty_gradients`, no public name)."""
    from keras.src.backend.tensorflow.optimizer import filter_empty_gradients  # noqa: PLC0415

    filter_empty_gradients(grads_and_vars)


# ==== Keras' TensorFlow Variable: which variables a step writes (tf_nvlink.training.replica_sync) ==============


def keras_variable_class():
    """Keras' TensorFlow-backend Variable class: `keras.src.backend.tensorflow.core.Variable` (Keras 3.12 to 3.15.1),
    `keras.src.backend.tensorflow.ops.core.Variable` in Keras 3.16 (keras-nightly 3.16.0.dev2026102704 checked)."""
    for module in ("keras.src.backend.tensorflow.core", "keras.src.backend.tensorflow.ops.core"):
        try:
            return importlib.import_module(module).Variable
        except ImportError:
            continue
    raise ImportError("no Variable in keras.src.backend.tensorflow.core or keras.src.backend.tensorflow.ops.core")


def report_variable_writes(on_write: Callable[[object], None]) -> bool:
    """Call `on_write(variable)` before every write of a Keras variable's value; returns False when installed
    already. Touches `Variable._direct_assign`, which every `assign`/`assign_add`/`assign_sub` of Keras' TensorFlow
    backend reaches (BatchNormalization's moving statistics included); Keras has no public write hook."""
    variable_class = keras_variable_class()
    with _STATE.lock:
        if "Variable._direct_assign" in _STATE.originals:
            return False
        original = _STATE.originals["Variable._direct_assign"] = variable_class._direct_assign

        def _direct_assign(self, value):
            on_write(self)
            return original(self, value)

        variable_class._direct_assign = _direct_assign
        return True


def keras_variable_write_original() -> Callable | None:
    """Keras' own `Variable._direct_assign` while `report_variable_writes` is installed (tests read its source)."""
    return _STATE.originals.get("Variable._direct_assign")


# ==== Keras callbacks =========================================================================================


_BACKUP_BASE: list = []


def backup_and_restore_base():
    """`keras.callbacks.BackupAndRestore` with its private save/load steps as overridable public methods.

    Touches (Keras 3.12-3.15.1): `_load_model` (at train begin), `_save_model` (at each epoch's end),
    `_current_epoch` and `_training_metadata_path`. Why: tf_nvlink's `AtomicBackupAndRestore` keeps Keras'
    schedule and file names but writes every file atomically; Keras has no public seam for the writes.
    Subclasses define `load_backup()` and `save_backup(epoch, metadata_path)`. The class is made on first use
    (Keras is imported then).
    """
    if not _BACKUP_BASE:
        import keras  # noqa: PLC0415

        class BackupAndRestoreSeams(keras.callbacks.BackupAndRestore):
            def _load_model(self):
                self.load_backup()

            def _save_model(self):
                self.save_backup(self._current_epoch, self._training_metadata_path)

            def load_backup(self):
                raise NotImplementedError

            def save_backup(self, epoch: int, metadata_path: str):
                raise NotImplementedError

        _BACKUP_BASE.append(BackupAndRestoreSeams)
    return _BACKUP_BASE[0]


def tensorboard_log_dir_beside(callback) -> str | None:
    """The log_dir of a keras.callbacks.TensorBoard in the CallbackList calling `callback` now, or None.

    Keras gives a callback no view of its siblings; the CallbackList whose hook calls ours has them, so this
    walks up a few frames (`sys._getframe`) to the caller whose `self.callbacks` holds `callback` (Keras'
    CallbackList, 3.12-3.15.1)."""
    import sys  # noqa: PLC0415

    import keras  # noqa: PLC0415

    frame = sys._getframe(1)  # the callback hook that asks
    for _ in range(6):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        siblings = getattr(owner, "callbacks", None)
        if isinstance(siblings, list) and any(c is callback for c in siblings):
            for sibling in siblings:
                if isinstance(sibling, keras.callbacks.TensorBoard):
                    return sibling.log_dir
            return None
        frame = frame.f_back
    return None


# ==== TensorFlow's eager context (multi-worker start, coordination service, run metadata) ======================


def tensorflow_runtime_started() -> bool:
    """True once TensorFlow's runtime is initialised in this process (`context.context()._initialized`,
    `tensorflow.python.eager.context`). Why: MultiWorkerMirroredStrategy can start its server only before that;
    tf_nvlink says so instead of TensorFlow's later, obscure failure."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    return bool(getattr(context.context(), "_initialized", False))


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
    that holds the `RunMetadata` afterwards. Why: the all-reduce bench inspects the optimised graphs; run
    metadata exists only in `tensorflow.python.eager.context` (TensorFlow 2.21)."""
    from tensorflow.python.eager import context  # noqa: PLC0415

    recorded: list = []
    context.enable_run_metadata()
    try:
        yield recorded
        recorded.append(context.export_run_metadata())
    finally:
        context.disable_run_metadata()


# ==== TensorFlow's devices and kernels (facts for tf_nvlink.machine.tf_devices' pure mapping) ==================


def tf_gpu_descs() -> list[tuple[str, str]]:
    """(name, physical_device_desc) of every GPU TensorFlow sees (initialises the GPUs).

    Touches `tensorflow.python.client.device_lib.list_local_devices`: the public `tf.config` API gives no PCI
    bus id, which maps TensorFlow's GPUs to NVML's."""
    from tensorflow.python.client import device_lib  # noqa: PLC0415

    return [(d.name, d.physical_device_desc) for d in device_lib.list_local_devices() if d.device_type == "GPU"]


def nccl_kernels_registered() -> bool:
    """True when this TensorFlow build has NCCL's GPU kernels (CUDA builds do; CPU-only and ROCm ones may not).

    Touches `tensorflow.python.framework.kernels.get_registered_kernels_for_op`: no public API lists kernels."""
    from tensorflow.python.framework import kernels  # noqa: PLC0415

    try:
        return any(k.device_type == "GPU" for k in kernels.get_registered_kernels_for_op("NcclAllReduce").kernel)
    except Exception:  # noqa: BLE001 - an op TensorFlow does not know at all: no NCCL
        return False


# ==== Tests only: fused XLA mode on CPU replicas ==============================================================


def emulate_fused_mode_on_cpu() -> None:
    """Tests only: make CPU replicas take the path TensorFlow takes under XLA on all-GPU replicas (no merge_call),
    and compile per-replica steps without XLA (XLA on CPU cannot compile collectives), so fused mode's code runs
    on a CPU-only machine. Touches `MirroredExtended._use_merge_call` (`tensorflow.python.distribute`). Call once
    per process, before building the strategy."""
    from tensorflow.python.distribute import mirrored_strategy  # noqa: PLC0415

    mirrored_strategy.MirroredExtended._use_merge_call = lambda self: False
    _STATE.fused_emulated_on_cpu = True


def per_replica_jit_compile() -> bool:
    """Whether per-replica steps compile with XLA (always, except under `emulate_fused_mode_on_cpu`)."""
    return not _STATE.fused_emulated_on_cpu


# ==== Keras' per-replica loss scale (the exact-batch rule of tf_nvlink.training.exact_batches) ==============

_LOSS_SHARE = threading.local()  # each replica traces its step in its own thread


def _keras_loss_module():
    from keras.src.losses import loss as loss_module  # noqa: PLC0415

    return loss_module




@contextlib.contextmanager
def loss_share_while_tracing(share, weight_share=None):
    """While one replica's train step is traced: Keras scales that replica's mean loss by `share` (a float32
    scalar tensor, the replica's examples over the global batch's) instead of 1/num_replicas, and a
    `reduction="mean_with_sample_weight"` loss (divided by the replica's sum of sample weights) by `weight_share`
    (the replica's sample weights over the step's; default `share`).

    Why: Keras 3 (3.12 to 3.15 checked) scales every replica's mean loss by 1/num_replicas in the module functions
    `keras.src.losses.loss.scale_loss_for_distribution` (the compiled loss, the regularisation losses) and undoes
    it for the logged loss with `unscale_loss_for_distribution`; with a last batch split 1 + 0 the step's
    gradient is then half the single-device one. The hooks (`_install_loss_share_hooks`) read this thread-local
    share; with none set they run Keras' own functions. `reduce_values` (the weighted reductions) is hooked too:
    for "mean_with_sample_weight" with weights it scales by the weight share. `weight_share=None` means the step's
    weights have no single share (one tensor per output): such a loss takes `share` and a warning is logged."""
    with _thread_setting(_LOSS_SHARE, "value", share), \
            _thread_setting(_LOSS_SHARE, "weight", share if weight_share is None else weight_share), \
            _thread_setting(_LOSS_SHARE, "weight_unknown", weight_share is None):
        yield


def _install_loss_share_hooks() -> None:
    """Replace Keras' scale/unscale_loss_for_distribution (called with _STATE.lock held)."""
    module = _keras_loss_module()
    scale, unscale = module.scale_loss_for_distribution, module.unscale_loss_for_distribution
    _STATE.originals["loss_module.scale_loss_for_distribution"] = scale
    _STATE.originals["loss_module.unscale_loss_for_distribution"] = unscale

    def scale_loss_for_distribution(value):
        share = getattr(_LOSS_SHARE, "value", None)
        if share is None:
            return scale(value)
        return value * tf.cast(share, value.dtype)

    def unscale_loss_for_distribution(value):
        share = getattr(_LOSS_SHARE, "value", None)
        if share is None:
            return unscale(value)
        return tf.math.divide_no_nan(value, tf.cast(share, value.dtype))  # a replica with 0 examples logs 0

    reduce_values = _STATE.originals["loss_module.reduce_values"] = module.reduce_values

    def reduce_values_weighted(values, sample_weight=None, reduction="sum_over_batch_size"):
        if getattr(_LOSS_SHARE, "value", None) is not None and reduction not in (None, "none") \
                and tuple(values.shape) == (0,):
            return tf.reduce_sum(values)  # 0, and a gradient (of zeros): Keras returns the empty array itself
        weight_share = getattr(_LOSS_SHARE, "weight", None)
        if weight_share is None or reduction != "mean_with_sample_weight" or sample_weight is None:
            return reduce_values(values, sample_weight, reduction)
        if getattr(_LOSS_SHARE, "weight_unknown", False) and not _STATE.warned_per_output_weights:
            _STATE.warned_per_output_weights = True
            log.warning("tf_nvlink: a reduction='mean_with_sample_weight' loss of a model with several outputs, "
                        "given sample weights: each replica's loss is scaled by its share of the examples, not "
                        "of the weights, so steps whose weights are uneven across the replicas differ from one "
                        "device. Use the default reduction (sum_over_batch_size) to train exactly as on one "
                        "device.")
        with _thread_setting(_LOSS_SHARE, "value", weight_share):  # its divisor is the replica's weights
            return reduce_values(values, sample_weight, reduction)

    module.scale_loss_for_distribution = scale_loss_for_distribution
    module.unscale_loss_for_distribution = unscale_loss_for_distribution
    module.reduce_values = reduce_values_weighted


def _keras_compile_loss_class():
    from keras.src.trainers.compile_utils import CompileLoss  # noqa: PLC0415

    return CompileLoss


def _keras_mean_metric_class():
    from keras.src.metrics.reduction_metrics import Mean  # noqa: PLC0415

    return Mean


_OUTPUT_LOSS_METRICS = threading.local()  # the CompileLoss whose call runs in this replica thread


def _install_output_loss_metric_hooks() -> None:
    """Replace `CompileLoss.call` and `Mean.update_state` (Keras 3.12 to 3.15; called with _STATE.lock held).

    Why: for a model with several outputs Keras keeps one `Mean` per output loss (`<output>_loss` in the logs) and
    updates it in `CompileLoss.call` with `sample_weight=tree.flatten(y_p)[0].shape[0]`, the STATIC batch size,
    which is None in fit's step when batches vary in size (a partial last batch): the metric then counts every step
    once, with its mean loss. Under a MirroredStrategy every replica counts the step once, the replica without examples too (its
    loss is 0), so a 1 + 0 step enters `<output>_loss` at half its value (and an uneven split weights the replicas'
    means alike). While a train step under a tf_nvlink strategy is traced (`loss_share_while_tracing`), such an
    update is weighted by the replica's share of the step's examples instead: the replicas add up to one count
    per step, the step's mean loss (one device's value), and a replica without examples adds nothing. Updates
    with a known batch size (Keras weights them by it), other `Mean`s, and every update outside those steps run
    Keras' own code."""
    compile_loss, mean = _keras_compile_loss_class(), _keras_mean_metric_class()
    call = _STATE.originals["CompileLoss.call"] = compile_loss.__dict__["call"]
    update_state = _STATE.originals["Mean.update_state"] = mean.__dict__["update_state"]

    def call_counting_shares(self, y_true, y_pred, sample_weight=None):
        if getattr(_LOSS_SHARE, "value", None) is None:
            return call(self, y_true, y_pred, sample_weight)
        with _thread_setting(_OUTPUT_LOSS_METRICS, "owner", self):  # its metrics exist once it is built
            return call(self, y_true, y_pred, sample_weight)

    def update_state_by_share(self, values, sample_weight=None):
        share, owner = getattr(_LOSS_SHARE, "value", None), getattr(_OUTPUT_LOSS_METRICS, "owner", None)
        if sample_weight is None and share is not None and owner is not None \
                and any(metric is self for metric in owner.metrics):
            sample_weight = tf.cast(share, self.dtype)  # replicas' shares add up to 1: the step counts once
        return update_state(self, values, sample_weight)

    compile_loss.call = call_counting_shares
    mean.update_state = update_state_by_share


# ==== TensorFlow profiler traces (the step doctor) ===========================================================


def xplane_protobuf_module():
    """The protobuf module of the TensorFlow profiler's trace format (`XSpace`, `XPlane`, `XLine`, `XEvent`).

    Why: `tf.profiler.experimental.stop()` writes `<logdir>/plugins/profile/<run>/<host>.xplane.pb`; the parser for
    it lives in TensorBoard's profile plugin, which training machines rarely have. The message classes ship with
    TensorFlow itself at `tensorflow.tsl.profiler.protobuf.xplane_pb2` (checked on TensorFlow 2.21), outside the
    public `tf.*` API, so the step doctor reads the file as a plain protobuf through this one import.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    return xplane_pb2
