"""XLA on every replica: `model.fit(jit_compile=True)` under a tf_nvlink strategy.

Why this exists: Keras 3 puts `jit_compile` on the function that wraps `strategy.run(...)`, so one XLA cluster
spans all replicas and TensorFlow fails with "Trying to access resource .../replica_1 located in device GPU:1
from device GPU:0" (and for `jit_compile="auto"` Keras simply turns XLA off under any strategy, which costs 4.6x
on ResNet-50). The fix has two parts:

1. `PerReplicaRunner` (attached to the strategy's `run`) gives each replica its own compiled copy (`PerReplicaCustomStep`) of any
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
`check_keras_support()` (and pinned by tests/training/test_install.py); on a Keras without them, a jit-compiled fit under
a multi-replica tf_nvlink strategy raises `UnsupportedKerasError` instead of failing deep inside TensorFlow.

Split mode cannot hold anything else that merges across replicas inside the step (SyncBatchNorm,
`replica_context.all_reduce`): that raises `CrossReplicaCallInXlaError`, which names the ways out.

The Keras/TensorFlow internals these hooks replace or read are all in `tf_nvlink.internals`, each with its reason
(trainer methods, the optimizers' `apply`, `TFOptimizer._all_reduce_sum_gradients`, a tf.function's jit flag).

`install_training_hooks(strategy)` is what `tf_nvlink.strategy()` calls on every strategy it builds.

`jit_compile="auto"` under a tf_nvlink strategy means XLA when Keras' own rule would enable it without a
strategy (the model's layers support XLA and a GPU is present); on CPU-only machines it stays off, as in Keras.
"""

from __future__ import annotations

from typing import Callable

import tensorflow as tf

from tf_nvlink import internals
from tf_nvlink.distribute import base
from tf_nvlink.training import compiled_execution, exact_batches, gradient_allreduce, replica_sync
from tf_nvlink.training.per_replica_steps import PerReplicaCustomStep, PerReplicaXlaStep, all_reduces_in_program

log = internals.log


def install_training_hooks(strategy) -> None:
    """Everything tf_nvlink changes in Keras for `strategy` (a tf_nvlink strategy just built): the gradient
    all-reduce, the trainer hooks (per-replica XLA, BatchNorm statistics kept in sync) and the per-replica
    `strategy.run`. Calling it again for the same strategy changes nothing.

    Example:
        >>> built = single_host.strategy(devices=["/cpu:0", "/cpu:1"])
        >>> install_training_hooks(built)     # tf_nvlink.strategy() does both
    """
    gradient_allreduce.install_gradient_allreduce_hook()  # one replica: no all-reduce; bfloat16: cast around it
    enable_per_replica_xla()
    if base.runner_of(strategy) is None:
        base.attach_runner(strategy, PerReplicaRunner(strategy))


def _per_replica_wanted(model) -> bool:
    """XLA per replica (PerReplicaXlaStep): several replicas, or one GPU, where Keras' jit function around
    `strategy.run` fails once the optimizer's step counter is updated in a `tf.cond` (a LossScaleOptimizer,
    gradient accumulation): TensorFlow broadcasts it with a `merge_call` ("merge_call called while defining a
    new graph", seen on 1x H200), which the fused step avoids (`internals.replica_local`)."""
    strategy = model.distribute_strategy
    several_or_gpu = strategy.num_replicas_in_sync > 1 or internals.fused_allreduce_possible(strategy)
    return several_or_gpu and bool(model.jit_compile) and not model.run_eagerly


def _make_function(model, step_function: Callable, keras_make_function: Callable):
    """The train/test function of a model under a tf_nvlink strategy (see the module doc): the compiled
    execution where it applies, else a per-step path that runs the steps the epoch asks for."""
    kind = "train" if step_function == model.train_step else "test"
    path, reason = compiled_execution.execution_path(model)
    log.info("tf_nvlink: %s function, steps_per_execution=%d: %s (%s)", kind, model.steps_per_execution, path,
             reason)
    if path == compiled_execution.COMPILED:
        step = replica_sync.keep_replicas_in_sync(model, PerReplicaXlaStep(model, step_function, kind))
        return compiled_execution.CompiledExecution(model, step, internals.one_step_function(model, step))
    function, step, outer_jit = _per_step_function(model, step_function, kind, keras_make_function)
    one_step = internals.one_step_function(model, step, jit_compile=outer_jit and bool(model.jit_compile))
    return compiled_execution.steps_asked_for(model, function, one_step)


def _per_step_function(model, step_function: Callable, kind: str, keras_make_function: Callable):
    """(function, the step it runs per replica, whether XLA spans the function around strategy.run)."""
    if not _per_replica_wanted(model):  # replica_sync.keep_replicas_in_sync: BatchNorm statistics
        step = replica_sync.keep_replicas_in_sync(model, step_function)
        if model.distribute_strategy.num_replicas_in_sync > 1:
            step = exact_batches.weighted_by_examples(step)  # every batch trains and evaluates as on one device
        return keras_make_function(step), step, True
    strategy = model.distribute_strategy
    step = replica_sync.keep_replicas_in_sync(model, PerReplicaXlaStep(model, step_function, kind))
    if model.steps_per_execution > 1 and (all_reduces_in_program(strategy) or internals.worker_count(strategy) > 1):
        # Keras' multi-step loop fails on an all-reduce without merge_call inside its tf.cond (synchronized
        # BatchNorm on one GPU too), and on the collectives of several workers ("You must feed a value for
        # placeholder tensor ... while/cond/Placeholder"); this one takes the steps the epoch asks for itself.
        return internals.unrolled_steps_function(model, step, compiled_execution.next_batches), step, False
    return keras_make_function(step, outer_jit=False), step, False  # no one XLA cluster spanning the replicas


def install_keras_hooks() -> str | None:
    """Install the trainer hooks once; returns None when installed, else why not (and nothing is changed)."""
    return internals.install_trainer_hooks(base.is_tf_nvlink_strategy, _make_function,
                                           compiled_execution.input_staging, exact_batches.split_over_replicas)


def enable_per_replica_xla() -> None:
    """Install the trainer hooks for a tf_nvlink strategy being built; on a Keras without the internals they need,
    log why, and make a jit-compiled step under that strategy raise `UnsupportedKerasError`."""
    problem = internals.enable_trainer_hooks(base.is_tf_nvlink_strategy, _make_function,
                                             compiled_execution.input_staging, exact_batches.split_over_replicas)
    if problem:
        log.warning("tf_nvlink: per-replica XLA unavailable: %s", problem)


class PerReplicaRunner:
    """`strategy.run` of a tf_nvlink strategy: each replica gets its own compiled copy of a `jit_compile=True`
    tf.function passed to it (`PerReplicaCustomStep`); everything else runs as TensorFlow's `run`.

    Example (what `install_training_hooks` does):
        >>> base.attach_runner(strategy, PerReplicaRunner(strategy))
    """

    def __init__(self, strategy):
        self.strategy = strategy
        self.per_replica_functions: dict = {}  # id(tf.function) -> (tf.function, its per-replica copy)

    @property
    def custom_loop_mode(self) -> str:
        """"fused" or "split" for custom loops: one GPU is fused (the whole step in XLA; its all-reduce is a
        no-op), whatever the plan says for fit."""
        fused = self.strategy.xla_allreduce == "fused" or self.strategy.num_replicas_in_sync == 1
        return "fused" if internals.fused_allreduce_possible(self.strategy) and fused else "split"

    def _copies_needed(self) -> bool:
        # Several replicas; or one GPU, where TensorFlow's no-merge_call path under XLA still fails on the
        # optimizer's step counter ("merge_call called while defining a new graph", seen on 1x H200).
        return self.strategy.num_replicas_in_sync > 1 or internals.fused_allreduce_possible(self.strategy)

    def __call__(self, strategy_run: Callable, fn, args=(), kwargs=None, options=None):
        replicas = self.strategy.num_replicas_in_sync
        if replicas > 1 and internals.in_xla_context():
            problem = internals.keras_hook_problem()
            if problem:
                first, last = internals.TESTED_KERAS
                raise internals.UnsupportedKerasError(
                    f"XLA across replicas is not possible with this Keras: {problem}. tf_nvlink supports "
                    f"Keras {'.'.join(map(str, first))} to {'.'.join(map(str, last))}; "
                    "compile with jit_compile=False or install a supported Keras.")
            raise ValueError(
                "strategy.run() was called inside a tf.function(jit_compile=True): one XLA program cannot span "
                f"the {replicas} replicas (TensorFlow would fail with 'Trying to access "
                "resource ... replica_1'). Put jit_compile=True on the step function you pass to strategy.run "
                "and keep the function around strategy.run a plain tf.function:\n"
                "    @tf.function(jit_compile=True)\n    def step(x, y): ...\n"
                "    @tf.function\n    def train(x, y): return strategy.run(step, args=(x, y))\n"
                "tf_nvlink compiles one copy of `step` per replica.")
        jit_function = internals.jit_tf_function(fn) if self._copies_needed() else None
        if jit_function is not None:
            target = jit_function[0]
            fn = self._per_replica_copy(fn, *jit_function)
            if tf.executing_eagerly():  # as MirroredStrategy does for a tf.function: run the replicas in a graph
                return self._eager_runner(strategy_run, target, fn, options)(*args, **(kwargs or {}))
        return strategy_run(fn, args=args, kwargs=kwargs, options=options)

    def _eager_runner(self, strategy_run, target, per_replica, options):
        key = ("eager", id(target), id(options))
        if key not in self.per_replica_functions:
            def run_replicas(*call_args, **call_kwargs):
                return strategy_run(per_replica, args=call_args, kwargs=call_kwargs, options=options)

            self.per_replica_functions[key] = (target, tf.function(run_replicas, autograph=False))
        return self.per_replica_functions[key][1]

    def _per_replica_copy(self, fn, target, python_function, autograph):
        key = id(target)
        if key not in self.per_replica_functions:
            unwrap_optionals = fn is not target  # Keras' _autoconvert_optionals wrapper
            step = PerReplicaCustomStep(python_function, self.custom_loop_mode, autograph=autograph)

            def per_replica(*call_args, **call_kwargs):
                if unwrap_optionals:
                    call_args = tf.nest.map_structure(
                        lambda x: None if isinstance(x, tf.experimental.Optional) else x, call_args)
                return step(*call_args, **call_kwargs)

            per_replica.step = step
            self.per_replica_functions[key] = (target, per_replica)  # keep target alive: ids are reused
        return self.per_replica_functions[key][1]
