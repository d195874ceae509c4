"""XLA on every replica: `model.fit(jit_compile=True)` under a tf_nvlink strategy.

Why this exists: Keras 3 puts `jit_compile` on the function that wraps `strategy.run(...)`, so one XLA cluster
spans all replicas and TensorFlow fails with "Trying to access resource .../replica_1 located in device GPU:1
from device GPU:0" (and for `jit_compile="auto"` Keras simply turns XLA off under any strategy, which costs 4.6x
on ResNet-50). The fix has two parts:

1. `PerReplicaXlaStrategyMixin.run` gives each replica its own compiled copy of any `jit_compile=True`
   tf.function passed to `strategy.run` (Keras' predict step; custom loops).
2. A hook on Keras' `TensorFlowTrainer._make_function` (train and test steps) keeps XLA off the function that
   spans the replicas and instead runs `train_step`/`test_step` through `PerReplicaXlaStep`, one compiled
   function per replica, in one of two ways (`Plan.xla_allreduce`):
   - "fused" (GPUs only): the whole train step, optimizer and gradient all-reduce included, is one XLA
     computation per replica. On all-GPU MirroredStrategies TensorFlow skips `merge_call` under XLA and
     compiles the all-reduce (CollectiveAllReduce) into the program, where XLA can combine and overlap it.
   - "split" (any device, CPUs included): forward pass, loss, metrics and gradients are compiled; the optimizer
     step stays outside XLA, because there it all-reduces the gradients through the plan's cross-device ops (a
     `merge_call`, which XLA cannot hold): the gradients are caught at `optimizer.apply` inside the compiled
     function, returned from it, and applied right after.

The hook is installed once, on the first tf_nvlink strategy, and touches only models whose strategy is a
tf_nvlink one; every other model runs Keras' code unchanged. The Keras internals relied on are checked by
`check_keras_support()` (and pinned by tests/test_xla.py); on a Keras without them, a jit-compiled fit under
a multi-replica tf_nvlink strategy raises `UnsupportedKerasError` instead of failing deep inside TensorFlow.

`jit_compile="auto"` under a tf_nvlink strategy means XLA when Keras' own rule would enable it without a
strategy (the model's layers support XLA and a GPU is present); on CPU-only machines it stays off, as in Keras.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable

import tensorflow as tf

from tf_nvlink import replicas

log = logging.getLogger("tf_nvlink")

# Keras versions whose trainer internals tests/test_xla.py pins (first, last tested minor version).
TESTED_KERAS = ((3, 12), (3, 15))

# Why the hooks could not be installed by the last `enable_per_replica_xla()` (None: installed).
_HOOK_PROBLEM: list[str | None] = [None]


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


def _is_tf_nvlink(strategy) -> bool:
    return isinstance(strategy, PerReplicaXlaStrategyMixin)


def _per_replica_wanted(model) -> bool:
    strategy = model.distribute_strategy
    return (_is_tf_nvlink(strategy) and strategy.num_replicas_in_sync > 1 and bool(model.jit_compile)
            and not model.run_eagerly)


_INSTALL_LOCK = threading.Lock()
_ORIGINALS: dict[str, Callable] = {}


def install_keras_hooks() -> str | None:
    """Install the trainer hooks once; returns None when installed, else why not (and nothing is changed)."""
    with _INSTALL_LOCK:
        if _ORIGINALS:
            return None
        problem = check_keras_support()
        if problem:
            return problem
        trainer = _keras_trainer_class()
        _ORIGINALS["_make_function"] = trainer._make_function
        _ORIGINALS["_resolve_auto_jit_compile"] = trainer._resolve_auto_jit_compile

        def _make_function(self, step_function):
            if not _is_tf_nvlink(self.distribute_strategy):
                return _ORIGINALS["_make_function"](self, step_function)
            if not _per_replica_wanted(self):  # replicas.keep_replicas_in_sync: issue 18, BatchNorm statistics
                return _ORIGINALS["_make_function"](self, replicas.keep_replicas_in_sync(self, step_function))
            kind = "train" if step_function == self.train_step else "test"
            step = replicas.keep_replicas_in_sync(self, PerReplicaXlaStep(self, step_function, kind))
            saved = self._jit_compile
            self._jit_compile = False  # the function spanning the replicas must not be one XLA cluster
            try:
                return _ORIGINALS["_make_function"](self, step)
            finally:
                self._jit_compile = saved

        def _resolve_auto_jit_compile(self):
            strategy = self._distribute_strategy
            if not _is_tf_nvlink(strategy):
                return _ORIGINALS["_resolve_auto_jit_compile"](self)
            from keras.src.trainers.trainer import model_supports_jit  # noqa: PLC0415

            if not tf.config.list_logical_devices("GPU"):
                return False  # Keras' rule: no XLA on CPU-only machines
            return model_supports_jit(self)

        trainer._make_function = _make_function
        trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
        return None


def enable_per_replica_xla() -> None:
    """Install the trainer hooks for a tf_nvlink strategy being built; on a Keras without the internals they need,
    log why, and make a jit-compiled step under that strategy raise `UnsupportedKerasError`."""
    _HOOK_PROBLEM[0] = install_keras_hooks()
    if _HOOK_PROBLEM[0]:
        log.warning("tf_nvlink: per-replica XLA unavailable: %s", _HOOK_PROBLEM[0])


def uninstall_keras_hooks() -> None:
    """Restore Keras' own trainer methods (tests use this to show what the hooks fix)."""
    with _INSTALL_LOCK:
        trainer = _keras_trainer_class()
        for name, original in _ORIGINALS.items():
            setattr(trainer, name, original)
        _ORIGINALS.clear()


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


class PerReplicaXlaStep:
    """Stands in for `model.train_step`/`test_step` inside `strategy.run`: XLA per replica, optimizer outside.

    Example (what the Keras hook does for you):
        >>> step = PerReplicaXlaStep(model, model.train_step, "train")
        >>> strategy.run(step, args=(batch,))
    """

    def __init__(self, model, step_function: Callable, kind: str):
        self.model = model
        self.step_function = step_function
        self.kind = kind
        self._compiled: dict[int, Any] = {}
        self._applied_variables: dict[int, list] = {}
        self._lock = threading.Lock()

    @property
    def fused(self) -> bool:
        """Whole train step in XLA, all-reduce included (GPUs only: TensorFlow skips merge_call under XLA there)."""
        strategy = self.model.distribute_strategy
        return self.kind != "train" or fused_allreduce_possible(strategy) and strategy.xla_allreduce == "fused"

    def _fused_body(self) -> Callable:
        optimizer = self.model.optimizer
        step_function = self.step_function

        def body(data):
            with _replica_local(_only_first_replica_variables(optimizer)):
                return step_function(data)

        return body

    def _compiled_for(self, replica_id: int):
        with self._lock:
            if replica_id not in self._compiled:
                if self.kind != "train":
                    body = self.step_function
                else:
                    body = self._fused_body() if self.fused else self._train_body(replica_id)
                self._compiled[replica_id] = tf.function(body, jit_compile=True, reduce_retracing=True,
                                                         autograph=False)
            return self._compiled[replica_id]

    def _train_body(self, replica_id: int) -> Callable:
        optimizer = self.model.optimizer

        def body(data):
            caught: dict[str, list] = {}

            def catch_apply(grads, trainable_variables=None):
                caught["grads"] = list(grads)
                caught["variables"] = list(trainable_variables if trainable_variables is not None
                                           else optimizer._trainable_variables)

            optimizer.apply = catch_apply  # instance attribute shadows the method while tracing
            try:
                logs = self.step_function(data)
            finally:
                del optimizer.apply
            if "grads" not in caught:
                raise UnsupportedKerasError(
                    "tf_nvlink's per-replica XLA needs train_step to update weights through "
                    "self.optimizer.apply_gradients() or self.optimizer.apply(); this train_step does neither. "
                    "Compile with jit_compile=False, or call the optimizer in train_step.")
            pairs = [(i, g) for i, g in enumerate(caught["grads"]) if g is not None]
            self._applied_variables[replica_id] = [(i, caught["variables"][i]) for i, _ in pairs]
            return logs, [g for _, g in pairs]

        return body

    def __call__(self, data):
        replica_id = _replica_id()
        compiled = self._compiled_for(replica_id)
        if self.fused:
            return compiled(data)
        logs, grads = compiled(data)
        variables = [v for _, v in self._applied_variables[replica_id]]
        if variables:
            # Outside XLA: all-reduce through the strategy's cross-device ops, then the update.
            self.model.optimizer.apply(grads, variables)
        return logs


def _in_xla_context() -> bool:
    from tensorflow.python.ops import control_flow_util  # noqa: PLC0415

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


class PerReplicaXlaStrategyMixin:
    """Gives each replica its own compiled copy of a `jit_compile=True` tf.function passed to `run`.

    The strategy's `_tf_nvlink_plan` (set by its builder) says how XLA models all-reduce (`xla_allreduce`).
    """

    _per_replica_functions: dict
    _tf_nvlink_plan = None

    @property
    def xla_allreduce(self) -> str:
        """"fused" or "split": how jit_compile=True models all-reduce (see the module doc)."""
        return self._tf_nvlink_plan.xla_allreduce if self._tf_nvlink_plan else "split"

    def run(self, fn, args=(), kwargs=None, options=None):
        if self.num_replicas_in_sync > 1 and _HOOK_PROBLEM[0] and _in_xla_context():
            raise UnsupportedKerasError(
                f"XLA across replicas is not possible with this Keras: {_HOOK_PROBLEM[0]}. tf_nvlink supports "
                f"Keras {'.'.join(map(str, TESTED_KERAS[0]))} to {'.'.join(map(str, TESTED_KERAS[1]))}; "
                "compile with jit_compile=False or install a supported Keras.")
        target = getattr(fn, "__wrapped__", fn)
        if self.num_replicas_in_sync > 1 and getattr(target, "_jit_compile", False) and hasattr(
                target, "python_function"):
            fn = self._per_replica_copy(fn, target)
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _per_replica_copy(self, fn, target):
        if not hasattr(self, "_per_replica_functions"):
            self._per_replica_functions = {}
        key = id(target)
        if key not in self._per_replica_functions:
            copies: dict[int, Any] = {}
            lock = threading.Lock()
            python_function = target.python_function
            unwrap_optionals = fn is not target  # Keras' _autoconvert_optionals wrapper

            def per_replica(*call_args, **call_kwargs):
                replica_id = _replica_id()
                with lock:
                    if replica_id not in copies:
                        copies[replica_id] = tf.function(python_function, jit_compile=True,
                                                         reduce_retracing=True)
                if unwrap_optionals:
                    call_args = tf.nest.map_structure(
                        lambda x: None if isinstance(x, tf.experimental.Optional) else x, call_args)
                return copies[replica_id](*call_args, **call_kwargs)

            self._per_replica_functions[key] = (target, per_replica)  # keep target alive: ids are reused
        return self._per_replica_functions[key][1]


# ==== Other Keras/TensorFlow private-API touches, kept here so this module holds every one ========================
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
    reduced as int64.
    """

    def reduce(self, reduce_op, value, axis):
        if isinstance(value, (tuple, list, dict)):
            return tf.nest.map_structure(lambda leaf: self.reduce(reduce_op, leaf, axis), value)
        shape = getattr(value, "shape", None)
        if axis is not None and shape is not None and shape.rank == 0:
            axis = None  # one number per replica: the reduction is across replicas
        local = self.experimental_local_results(value)
        if local and getattr(local[0], "dtype", None) == tf.int32:
            wide = self.run(lambda v: tf.cast(v, tf.int64), args=(value,))
            return tf.cast(super().reduce(reduce_op, wide, axis), tf.int32)
        return super().reduce(reduce_op, value, axis)


def set_initial_epoch(model, epoch: int) -> None:
    """Make the next `model.fit()` start at `epoch`.

    Why: Keras keeps the epoch a resumed fit starts from in the private `model._initial_epoch`, which its own
    `keras.callbacks.BackupAndRestore` sets; tf_nvlink's backup callback restores the same way.
    """
    model._initial_epoch = epoch  # noqa: SLF001
