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
`check_keras_support()` (and pinned by tests/training/test_install.py); on a Keras without them, a jit-compiled fit under
a multi-replica tf_nvlink strategy raises `UnsupportedKerasError` instead of failing deep inside TensorFlow.

Split mode cannot hold anything else that merges across replicas inside the step (SyncBatchNorm,
`replica_context.all_reduce`): that raises `CrossReplicaCallInXlaError`, which names the ways out.

Private Keras/TensorFlow touches, and why (all state in `_STATE`, a `HookState`; `reset_hooks_for_tests()`):
- `TensorFlowTrainer._make_function` (replaced): keep XLA off the function spanning the replicas, run the step
  per replica.
- `TensorFlowTrainer._resolve_auto_jit_compile` (replaced): Keras turns "auto" XLA off under any strategy.
- `TensorFlowTrainer._maybe_symbolic_build` (skipped once the model, its compiled loss and metrics and its
  optimizer are built): under any strategy Keras makes a distributed iterator at every `fit`/`evaluate` call to
  take one batch and average it across replicas, and then finds nothing to build. Making that iterator
  (TensorFlow's MultiDeviceIterator traces its functions each time) took about 100 ms per call on a CPU. Before
  that, the build uses the first replica's share of the first batch (`internals.symbolic_build_from_one_replica`):
  Keras' MEAN of the shares fails when they differ in size (`batch_size=5` on 2 replicas).
- `keras.src.losses.loss.scale_loss_for_distribution` / `unscale_loss_for_distribution` (replaced): while a
  replica's train step is traced, its loss is scaled by its share of the global batch rather than by
  1/num_replicas (`exact_batches`: every batch trains as on one device, whatever the split).
- `MirroredExtended._use_merge_call` (an instance attribute on the strategy's extended, answering False only in a
  thread applying already all-reduced accumulated gradients): `gradient_accumulation_steps` in plain and split
  mode, where Keras' accumulation `tf.cond` would reach `merge_call`.
- `TFOptimizer._all_reduce_sum_gradients` (replaced, `allreduce.py`): no all-reduce for one replica; bfloat16.
- `BaseOptimizer.apply`, `LossScaleOptimizer.apply` (replaced): while a per-replica custom-loop step is traced
  in this thread, catch the update (split) or keep step counters per replica (fused); an optimizer not built
  yet stops that trace and is built outside it (`optimizer.build`, `optimizer.built`). Otherwise pass-through,
  except that a LossScaleOptimizer under a tf_nvlink strategy all-reduces its finite check (Keras keeps
  replica 0's, so another replica's overflow reached the weights as NaN).
- `optimizer.apply` / `optimizer.check_finite` (instance attributes, only while one replica's step is traced or
  its update applied): fit's split catch; the all-reduced finite check.
- `optimizer._trainable_variables`, a mirrored variable's `_value` and `_get_on_device_or_primary()`
  (`_replica_local`): the replica's own copy of an ONLY_FIRST_REPLICA counter.
- `tf.function`'s `python_function`, `_jit_compile`, `_autograph`: recompile a user's jit function per replica.
- `control_flow_util.GraphOrParentsInXlaContext`: detect `strategy.run` inside a jit function.

`jit_compile="auto"` under a tf_nvlink strategy means XLA when Keras' own rule would enable it without a
strategy (the model's layers support XLA and a GPU is present); on CPU-only machines it stays off, as in Keras.
"""

from __future__ import annotations

import tensorflow as tf

from tf_nvlink.training import exact_batches, replica_sync
from tf_nvlink import internals
from tf_nvlink.internals import (TESTED_KERAS, _STATE, CrossReplicaCallInXlaError,  # noqa: F401
                                   HookState, MultiWorkerKerasReduceMixin, UnsupportedKerasError,
                                   _in_xla_context, _install_optimizer_hooks, _keras_trainer_class,
                                   check_keras_support, fused_allreduce_possible, log,
                                   reset_hooks_for_tests,
                                   set_initial_epoch, uninstall_keras_hooks)
from tf_nvlink.training.gradient_allreduce import install_gradient_allreduce_hook
from tf_nvlink.training.per_replica_steps import PerReplicaCustomStep, PerReplicaXlaStep

__all__ = ["TESTED_KERAS", "CrossReplicaCallInXlaError", "HookState", "MultiWorkerKerasReduceMixin",
           "PerReplicaCustomStep", "PerReplicaXlaStep", "PerReplicaXlaStrategyMixin", "UnsupportedKerasError",
           "check_keras_support", "enable_per_replica_xla", "fused_allreduce_possible",
           "install_gradient_allreduce_hook", "install_keras_hooks",
           "reset_hooks_for_tests", "set_initial_epoch", "uninstall_keras_hooks"]


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
            if not _is_tf_nvlink(self.distribute_strategy):
                return _STATE.originals["_make_function"](self, step_function)
            if not _per_replica_wanted(self):  # replica_sync.keep_replicas_in_sync: issue 18, BatchNorm statistics
                step = replica_sync.keep_replicas_in_sync(self, step_function)
                if step_function == self.train_step and self.distribute_strategy.num_replicas_in_sync > 1:
                    step = exact_batches.weighted_by_examples(step)  # issue 25: uneven batches
                return _STATE.originals["_make_function"](self, step)
            kind = "train" if step_function == self.train_step else "test"
            strategy = self.distribute_strategy
            step = replica_sync.keep_replicas_in_sync(self, PerReplicaXlaStep(self, step_function, kind))
            if self.steps_per_execution > 1 and internals.fused_allreduce_possible(strategy) \
                    and strategy.xla_allreduce == "fused":
                return internals.unrolled_steps_function(self, step)  # Keras' multi-step loop fails without merge_call
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
        if hasattr(trainer, "_maybe_symbolic_build"):
            _STATE.originals["_maybe_symbolic_build"] = trainer._maybe_symbolic_build

            def _maybe_symbolic_build(self, iterator=None, data_batch=None):
                if _is_tf_nvlink(self.distribute_strategy) and internals.fully_built(self):
                    return None  # Keras would make a distributed iterator and all-reduce a batch to build nothing
                if _is_tf_nvlink(self.distribute_strategy):
                    return internals.symbolic_build_from_one_replica(self, iterator=iterator, data_batch=data_batch)
                return _STATE.originals["_maybe_symbolic_build"](self, iterator=iterator, data_batch=data_batch)

            trainer._maybe_symbolic_build = _maybe_symbolic_build
        _install_optimizer_hooks()
        internals._install_loss_share_hooks()
        return None


def enable_per_replica_xla() -> None:
    """Install the trainer hooks for a tf_nvlink strategy being built; on a Keras without the internals they need,
    log why, and make a jit-compiled step under that strategy raise `UnsupportedKerasError`."""
    _STATE.problem = install_keras_hooks()
    if _STATE.problem:
        log.warning("tf_nvlink: per-replica XLA unavailable: %s", _STATE.problem)


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
        # One GPU: fused (the whole step in XLA; its all-reduce is a no-op), whatever the plan says for fit.
        fused = self.xla_allreduce == "fused" or self.num_replicas_in_sync == 1
        return "fused" if internals.fused_allreduce_possible(self) and fused else "split"

    def _per_replica_copies_needed(self) -> bool:
        # Several replicas; or one GPU, where TensorFlow's no-merge_call path under XLA still fails on the
        # optimizer's step counter ("merge_call called while defining a new graph", seen on 1x H200).
        return self.num_replicas_in_sync > 1 or internals.fused_allreduce_possible(self)

    @tf.autograph.experimental.do_not_convert  # plain Python checks; AutoGraph would garble the error's source
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
        if self._per_replica_copies_needed() and getattr(target, "_jit_compile", False) and hasattr(
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
