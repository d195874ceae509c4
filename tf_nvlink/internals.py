"""Every Keras/TensorFlow private-API touch of tf_nvlink's per-replica XLA, each with its reason, and the one
object holding what was changed (`_STATE`, a `HookState`; `reset_hooks_for_tests()` puts Keras back).
The trainer hooks that use these live in `tf_nvlink.training.install` (the package), the per-replica steps in `steps.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Callable

import tensorflow as tf

log = logging.getLogger("tf_nvlink")


# Keras versions whose trainer internals tests/training/test_install.py pins (first, last tested minor version).
TESTED_KERAS = ((3, 12), (3, 15))


@dataclasses.dataclass
class HookState:
    """Everything this module changes in Keras, in one place (the module's only state).

    originals: Keras' own functions, by "method" (TensorFlowTrainer's) or "Class.method" (an optimizer's), while
        the hooks are installed; empty when they are not.
    problem: why the last `enable_per_replica_xla()` could not install them (None: installed, or never tried).
    Tests put Keras back with `reset_hooks_for_tests()`.
    """

    originals: dict[str, Callable] = dataclasses.field(default_factory=dict)
    problem: str | None = None
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_STATE = HookState()


def reset_hooks_for_tests() -> None:
    """Restore Keras' own methods and forget any install problem, as in a fresh process."""
    uninstall_keras_hooks()
    _STATE.problem = None


class UnsupportedKerasError(RuntimeError):
    """The installed Keras lacks the trainer internals per-replica XLA relies on."""


def _keras_trainer_class():
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer  # noqa: PLC0415

    return TensorFlowTrainer


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
        return f"Keras {keras.__version__} has no TensorFlowTrainer.{', '.join(missing)}"
    if version[:1] != (3,):
        return f"Keras {keras.__version__} is not Keras 3"
    return None


def uninstall_keras_hooks() -> None:
    """Restore Keras' own trainer methods (tests use this to show what the hooks fix)."""
    with _STATE.lock:
        trainer = _keras_trainer_class()
        for name, original in _STATE.originals.items():
            owner, _, attribute = name.rpartition(".")
            setattr(_OPTIMIZER_CLASSES[owner]() if owner else trainer, attribute, original)
        _STATE.originals.clear()


def fully_built(model) -> bool:
    """True when `model`'s layers, compiled loss and metrics and optimizer are all built: then Keras'
    `_symbolic_build` would build nothing (the attributes it checks, read the same way)."""
    compiled = [getattr(model, "_compile_metrics", None), getattr(model, "_compile_loss", None),
                getattr(model, "optimizer", None)]
    return all(layer.built for layer in model._flatten_layers()) and all(
        part is None or part.built for part in compiled)


def fused_allreduce_possible(strategy) -> bool:
    """True when every replica is a GPU: there MirroredStrategy all-reduces inside XLA (CollectiveAllReduce
    compiled to an XLA all-reduce over NCCL) and applies updates per replica without merge_call."""
    devices = getattr(strategy.extended, "worker_devices", ())
    return bool(devices) and all("GPU" in d.upper() for d in devices)


def _only_first_replica_variables(optimizer) -> list:
    """The optimizer's step counters (aggregation ONLY_FIRST_REPLICA: `iterations`, loss-scale counters)."""
    if optimizer is None:
        return []
    return [v for v in optimizer.variables if str(getattr(v, "aggregation", "")) == "only_first_replica"]


@contextlib.contextmanager
def _replica_local(variables):
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


def _replica_id() -> int:
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
                with _replica_local(_only_first_replica_variables(self)), _agreed_finite_check(self):
                    return _original(self, dense_gradients_in_xla(grads), trainable_variables)
            finally:
                _TRACING.depth = 0

        cls.apply = apply


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
def _optimizer_calls(mode: str):
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
    if not _in_xla_context():
        return grads
    return [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads]


def _under_tf_nvlink(optimizer) -> bool:
    return hasattr(getattr(optimizer, "_distribution_strategy", None), "_tf_nvlink_plan")


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


def unrolled_steps_function(model, step_function):
    """Keras' train/test function for steps_per_execution=N > 1 without its tf.while_loop and tf.cond.

    Why: with no merge_call (MirroredStrategy on all-GPU replicas under XLA, i.e. fused mode), `strategy.run`
    inside a tf.cond or tf.while_loop branch fails ("You must feed a value for placeholder tensor ... cond");
    reproduced on CPU with a stock MirroredStrategy and `_use_merge_call` off, while N unrolled calls work. So the
    N batches are taken eagerly from the distributed iterator and one tf.function runs the N steps unrolled; the
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
        batches = []
        for _ in range(model.steps_per_execution):
            try:
                batches.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                break
        if not batches:
            raise StopIteration
        return steps_on_batches(tuple(batches))

    return function


def _in_xla_context() -> bool:
    from tensorflow.python.ops import control_flow_util  # noqa: PLC0415

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


class CrossReplicaCallInXlaError(ValueError):
    """A split-mode step (XLA per replica, all-reduce outside) asked for a cross-replica merge inside XLA."""


@contextlib.contextmanager
def _merge_call_explained():
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


# ==== Other Keras/TensorFlow private-API touches, kept here so this module holds every one =================
# (moved from multi_worker.py and callbacks.py; each says why it is needed)


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


def xplane_protobuf_module():
    """The protobuf module of the TensorFlow profiler's trace format (`XSpace`, `XPlane`, `XLine`, `XEvent`).

    Why: `tf.profiler.experimental.stop()` writes `<logdir>/plugins/profile/<run>/<host>.xplane.pb`; the parser for
    it lives in TensorBoard's profile plugin, which training machines rarely have. The message classes ship with
    TensorFlow itself at `tensorflow.tsl.profiler.protobuf.xplane_pb2` (checked on TensorFlow 2.21), outside the
    public `tf.*` API, so the step doctor reads the file as a plain protobuf through this one import.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: PLC0415

    return xplane_pb2


def read_profiler_trace(path: str):
    """The `XSpace` protobuf of one TensorFlow profiler trace file (`*.xplane.pb`); see `xplane_protobuf_module`."""
    space = xplane_protobuf_module().XSpace()
    with open(path, "rb") as trace:
        space.ParseFromString(trace.read())
    return space
