"""XLA on every replica: `model.fit(jit_compile=True)` under a tf_nvlink strategy.

Why this exists: Keras 3 puts `jit_compile` on the function that wraps `strategy.run(...)`, so one XLA cluster
spans all replicas and TensorFlow fails with "Trying to access resource .../replica_1 located in device GPU:1
from device GPU:0" (and for `jit_compile="auto"` Keras simply turns XLA off under any strategy, which costs 4.6x
on ResNet-50). The fix has two parts:

1. `PerReplicaXlaStrategyMixin.run` gives each replica its own compiled copy (`PerReplicaCustomStep`) of any
   `jit_compile=True` tf.function passed to `strategy.run`: Keras' predict step, and custom training loops in
   the shape of TensorFlow's guide (a jit step calling `optimizer.apply_gradients`, passed to `strategy.run`
   inside a plain tf.function or eagerly), fused or split like fit below. A `tf.function(jit_compile=True)`
   around `strategy.run` itself cannot work (one XLA program would span the replicas): it raises a ValueError
   naming the supported shape.
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

Split mode cannot hold anything else that merges across replicas inside the step (SyncBatchNorm,
`replica_context.all_reduce`): that raises `CrossReplicaCallInXlaError`, which names the ways out.

Private Keras/TensorFlow touches, and why (all state in `_STATE`, a `HookState`; `reset_hooks_for_tests()`):
- `TensorFlowTrainer._make_function` (replaced): keep XLA off the function spanning the replicas, run the step
  per replica.
- `TensorFlowTrainer._resolve_auto_jit_compile` (replaced): Keras turns "auto" XLA off under any strategy.
- `BaseOptimizer.apply`, `LossScaleOptimizer.apply` (replaced; pass-through unless a per-replica step is being
  traced in this thread): catch the update (split) or keep step counters per replica (fused) in custom loops.
- `optimizer.apply` / `optimizer.check_finite` (instance attributes, only while one replica's step is traced):
  fit's split catch; LossScaleOptimizer's finite check all-reduced in fused mode.
- `optimizer._trainable_variables`, a mirrored variable's `_value` and `_get_on_device_or_primary()`
  (`_replica_local`): the replica's own copy of an ONLY_FIRST_REPLICA counter.
- `tf.function`'s `python_function`, `_jit_compile`, `_autograph`: recompile a user's jit function per replica.
- `control_flow_util.GraphOrParentsInXlaContext`: detect `strategy.run` inside a jit function.

`jit_compile="auto"` under a tf_nvlink strategy means XLA when Keras' own rule would enable it without a
strategy (the model's layers support XLA and a GPU is present); on CPU-only machines it stays off, as in Keras.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable

import tensorflow as tf

log = logging.getLogger("tf_nvlink")

# Keras versions whose trainer internals tests/test_xla.py pins (first, last tested minor version).
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


def _is_tf_nvlink(strategy) -> bool:
    return isinstance(strategy, PerReplicaXlaStrategyMixin)


def _per_replica_wanted(model) -> bool:
    strategy = model.distribute_strategy
    return (_is_tf_nvlink(strategy) and strategy.num_replicas_in_sync > 1 and bool(model.jit_compile)
            and not model.run_eagerly)




def install_keras_hooks() -> str | None:
    """Install the trainer hooks once; returns None when installed, else why not (and nothing is changed)."""
    with _STATE.lock:
        if _STATE.originals:
            return None
        problem = check_keras_support()
        if problem:
            return problem
        trainer = _keras_trainer_class()
        _STATE.originals["_make_function"] = trainer._make_function
        _STATE.originals["_resolve_auto_jit_compile"] = trainer._resolve_auto_jit_compile

        def _make_function(self, step_function):
            if not _per_replica_wanted(self):
                return _STATE.originals["_make_function"](self, step_function)
            kind = "train" if step_function == self.train_step else "test"
            step = PerReplicaXlaStep(self, step_function, kind)
            saved = self._jit_compile
            self._jit_compile = False  # the function spanning the replicas must not be one XLA cluster
            try:
                return _STATE.originals["_make_function"](self, step)
            finally:
                self._jit_compile = saved

        def _resolve_auto_jit_compile(self):
            strategy = self._distribute_strategy
            if not _is_tf_nvlink(strategy):
                return _STATE.originals["_resolve_auto_jit_compile"](self)
            from keras.src.trainers.trainer import model_supports_jit  # noqa: PLC0415

            if not tf.config.list_logical_devices("GPU"):
                return False  # Keras' rule: no XLA on CPU-only machines
            return model_supports_jit(self)

        trainer._make_function = _make_function
        trainer._resolve_auto_jit_compile = _resolve_auto_jit_compile
        _install_optimizer_hooks()
        return None


def enable_per_replica_xla() -> None:
    """Install the trainer hooks for a tf_nvlink strategy being built; on a Keras without the internals they need,
    log why, and make a jit-compiled step under that strategy raise `UnsupportedKerasError`."""
    _STATE.problem = install_keras_hooks()
    if _STATE.problem:
        log.warning("tf_nvlink: per-replica XLA unavailable: %s", _STATE.problem)


def uninstall_keras_hooks() -> None:
    """Restore Keras' own trainer methods (tests use this to show what the hooks fix)."""
    with _STATE.lock:
        trainer = _keras_trainer_class()
        for name, original in _STATE.originals.items():
            owner, _, attribute = name.rpartition(".")
            setattr(_OPTIMIZER_CLASSES[owner]() if owner else trainer, attribute, original)
        _STATE.originals.clear()


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
            with _replica_local(_only_first_replica_variables(optimizer)), _agreed_finite_check(optimizer):
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
        with _merge_call_explained():
            logs, grads = compiled(data)
        variables = [v for _, v in self._applied_variables[replica_id]]
        if variables:
            # Outside XLA: all-reduce through the strategy's cross-device ops, then the update.
            self.model.optimizer.apply(grads, variables)
        return logs


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
            if mode is None or getattr(_TRACING, "depth", 0):
                return _original(self, grads, trainable_variables)
            if mode == "catch":
                _TRACING.caught.append((self, list(grads), trainable_variables))
                return None
            _TRACING.depth = 1
            try:
                with _replica_local(_only_first_replica_variables(self)), _agreed_finite_check(self):
                    return _original(self, grads, trainable_variables)
            finally:
                _TRACING.depth = 0

        cls.apply = apply


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


@contextlib.contextmanager
def _agreed_finite_check(optimizer):
    """Fused mode, LossScaleOptimizer: every replica skips or applies the step together.

    Without merge_call each replica checks its own (not yet all-reduced) gradients for inf/NaN; the replicas
    could disagree, and a replica that skips would leave the others' all-reduce waiting. The check is
    all-reduced instead: the step is applied only when every replica's gradients are finite."""
    check_finite = getattr(optimizer, "check_finite", None)
    context = tf.distribute.get_replica_context()
    if check_finite is None or not hasattr(optimizer, "inner_optimizer") or context is None \
            or context.num_replicas_in_sync < 2:
        yield
        return

    def agreed(grads):
        not_finite = tf.cast(tf.logical_not(check_finite(grads)), tf.float32)
        return tf.equal(context.all_reduce(tf.distribute.ReduceOp.SUM, not_finite), 0.0)

    optimizer.check_finite = agreed
    try:
        yield
    finally:
        del optimizer.check_finite


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

    @property
    def _custom_loop_mode(self) -> str:
        return "fused" if fused_allreduce_possible(self) and self.xla_allreduce == "fused" else "split"

    def run(self, fn, args=(), kwargs=None, options=None):
        if self.num_replicas_in_sync > 1 and _in_xla_context():
            if _STATE.problem:
                raise UnsupportedKerasError(
                    f"XLA across replicas is not possible with this Keras: {_STATE.problem}. tf_nvlink supports "
                    f"Keras {'.'.join(map(str, TESTED_KERAS[0]))} to {'.'.join(map(str, TESTED_KERAS[1]))}; "
                    "compile with jit_compile=False or install a supported Keras.")
            raise ValueError(
                "strategy.run() was called inside a tf.function(jit_compile=True): one XLA program cannot span "
                f"the {self.num_replicas_in_sync} replicas (TensorFlow would fail with 'Trying to access "
                "resource ... replica_1'). Put jit_compile=True on the step function you pass to strategy.run "
                "and keep the function around strategy.run a plain tf.function:\n"
                "    @tf.function(jit_compile=True)\n    def step(x, y): ...\n"
                "    @tf.function\n    def train(x, y): return strategy.run(step, args=(x, y))\n"
                "tf_nvlink compiles one copy of `step` per replica.")
        target = fn if hasattr(fn, "python_function") else getattr(fn, "__wrapped__", fn)  # Keras wraps its own
        if self.num_replicas_in_sync > 1 and getattr(target, "_jit_compile", False) and hasattr(
                target, "python_function"):
            fn = self._per_replica_copy(fn, target)
            if tf.executing_eagerly():  # as MirroredStrategy does for a tf.function: run the replicas in a graph
                return self._eager_runner(target, fn, options)(*args, **(kwargs or {}))
        return super().run(fn, args=args, kwargs=kwargs, options=options)

    def _eager_runner(self, target, per_replica, options):
        key = ("eager", id(target), id(options))
        if key not in self._per_replica_functions:
            run = super().run

            def run_replicas(*call_args, **call_kwargs):
                return run(per_replica, args=call_args, kwargs=call_kwargs, options=options)

            self._per_replica_functions[key] = (target, tf.function(run_replicas, autograph=False))
        return self._per_replica_functions[key][1]

    def _per_replica_copy(self, fn, target):
        if not hasattr(self, "_per_replica_functions"):
            self._per_replica_functions = {}
        key = id(target)
        if key not in self._per_replica_functions:
            unwrap_optionals = fn is not target  # Keras' _autoconvert_optionals wrapper
            step = PerReplicaCustomStep(target.python_function, self._custom_loop_mode,
                                        autograph=getattr(target, "_autograph", True))

            def per_replica(*call_args, **call_kwargs):
                if unwrap_optionals:
                    call_args = tf.nest.map_structure(
                        lambda x: None if isinstance(x, tf.experimental.Optional) else x, call_args)
                return step(*call_args, **call_kwargs)

            per_replica.step = step
            self._per_replica_functions[key] = (target, per_replica)  # keep target alive: ids are reused
        return self._per_replica_functions[key][1]


class PerReplicaCustomStep:
    """One replica's compiled copy of a `jit_compile=True` function passed to `strategy.run` (custom loops,
    Keras' predict step), so no XLA program spans two replicas.

    - "fused" (all-GPU replicas, plan `xla_allreduce="fused"`): the whole function, `optimizer.apply_gradients`
      and its gradient all-reduce included, is one XLA program per replica; the optimizer's step counters are
      kept per replica (as in fit's fused mode).
    - "split" (any device): the function is compiled with every `optimizer.apply`/`apply_gradients` call caught:
      the gradients leave XLA, and the calls run right after, in the same order, outside XLA, where the
      optimizer all-reduces through the plan's cross-device ops. Values the function computes after
      `apply_gradients` (rare) see the weights before that update.

    Example (what `strategy.run` does for a jit step under a tf_nvlink strategy):
        >>> step = PerReplicaCustomStep(train_step.python_function, "split")
        >>> strategy.run(step, args=(x, y))    # the mixin does this for you
    """

    def __init__(self, python_function: Callable, mode: str, autograph: bool = True):
        if mode not in ("fused", "split"):
            raise ValueError(f"mode should be 'fused' or 'split'. Received: mode={mode!r}")
        self.python_function = python_function
        self.mode = mode
        self.autograph = autograph
        self._compiled: dict[int, Any] = {}
        self._updates: dict[int, list] = {}  # replica -> [(optimizer, variables or None)] of the traced calls
        self._lock = threading.Lock()

    def _body(self, replica_id: int) -> Callable:
        python_function = self.python_function
        if self.mode == "fused":
            def fused(*args, **kwargs):
                with _optimizer_calls("replica_local"):
                    return python_function(*args, **kwargs)

            return fused

        def split(*args, **kwargs):
            with _optimizer_calls("catch") as caught:
                outputs = python_function(*args, **kwargs)
            updates, grads = [], []
            for optimizer, call_grads, variables in caught:
                variables = None if variables is None else list(variables)
                kept = [i for i, g in enumerate(call_grads) if g is not None]
                if variables is not None:
                    variables = [variables[i] for i in kept]
                elif len(kept) != len(call_grads):
                    raise ValueError("optimizer.apply(grads) without variables got None gradients; pass the "
                                     "variables too: optimizer.apply_gradients(zip(grads, variables)).")
                updates.append((optimizer, variables))
                grads.append([call_grads[i] for i in kept])
            previous = self._updates.get(replica_id)
            if previous is not None and not _same_updates(previous, updates):
                raise ValueError("A jit_compile=True step under a tf_nvlink strategy updated different optimizers "
                                 "or variables when traced again (new input shapes?); tf_nvlink's split mode needs "
                                 "the same optimizer calls on every trace. Use one step function per shape.")
            self._updates[replica_id] = updates
            return outputs, grads

        return split

    def _compiled_for(self, replica_id: int):
        with self._lock:
            if replica_id not in self._compiled:
                self._compiled[replica_id] = tf.function(self._body(replica_id), jit_compile=True,
                                                         reduce_retracing=True, autograph=self.autograph)
            return self._compiled[replica_id]

    def __call__(self, *args, **kwargs):
        replica_id = _replica_id()
        compiled = self._compiled_for(replica_id)
        if self.mode == "fused":
            return compiled(*args, **kwargs)
        with _merge_call_explained():
            outputs, grads = compiled(*args, **kwargs)
        for (optimizer, variables), call_grads in zip(self._updates.get(replica_id, ()), grads):
            # Outside XLA: the optimizer all-reduces through the strategy's cross-device ops, then updates.
            optimizer.apply(call_grads, variables)
        return outputs


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


def _same_updates(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        oa is ob and (va is None) == (vb is None) and (va is None or [id(v) for v in va] == [id(v) for v in vb])
        for (oa, va), (ob, vb) in zip(a, b))
