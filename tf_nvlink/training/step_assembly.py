"""How tf_nvlink builds a model's train, test and predict steps under a tf_nvlink strategy: the one place that
assembles a step from its parts.

Keras' trainer calls `make_function(model, step_function, keras_make_function)` (through the trainer seam) for
its train and test functions, and TensorFlow's `strategy.run` goes through `PerReplicaRunner` (Keras' predict
step, custom loops). `tf_nvlink.plan.execution.decide_execution` says which of these a model gets, and why:

| path, sync | the function Keras calls | one replica's step, from the inside out |
| --- | --- | --- |
| compiled, fused | `CompiledExecution`: N batches, one `strategy.run` | one XLA program: a loop over the N stacked batches of [`PerReplicaXlaStep` body: batch dimension open, loss share, replica-local step counters, `train_step` with the optimizer and its all-reduce, BatchNorm sync] |
| per-step, fused | Keras' function without XLA around `strategy.run` (spe=1), or `unrolled_steps_function` (spe>1) | one XLA program per step: the same body |
| per-step, split | Keras' function without XLA around `strategy.run` (spe=1), or `sequenced_steps_function` (spe>1; across workers `unrolled_steps_function`) | XLA: the body with `optimizer.apply` caught; outside XLA: the update, all-reduced through the plan's cross-device ops, then BatchNorm sync |
| per-step, plain | Keras' own function (XLA around it only on one CPU replica) | `train_step` weighted by examples, then BatchNorm sync |
| predict, custom loops | Keras' predict function / the user's | `PerReplicaCustomStep`: the jit function compiled per replica, fused or split |

Every per-step function runs the steps the epoch asks for (`steps_asked_for`) and reads its logs' metrics over
all replicas, as the compiled execution does. Multi-worker strategies take the per-step paths (an all-reduce inside
XLA cannot span processes).

Example:
    >>> function = make_function(model, model.train_step, keras_make_function)   # the trainer seam calls it
"""

from __future__ import annotations

import logging
from typing import Callable

import tensorflow as tf

from tf_nvlink.internals import tf_runtime, trainer as trainer_seams
from tf_nvlink.internals.registry import REGISTRY, UnsupportedKerasError
from tf_nvlink.plan.execution import COMPILED, FUSED, PLAIN, SPLIT, per_replica_xla
from tf_nvlink.training import exact_batches, replica_sync
from tf_nvlink.training.compiled_execution import CompiledExecution, steps_asked_for
from tf_nvlink.training.execution_mode import all_reduces_in_program, execution_mode, step_facts
from tf_nvlink.training.first_execution import FirstExecution
from tf_nvlink.training.per_replica_steps import PerReplicaCustomStep, PerReplicaXlaStep
from tf_nvlink.training.replica_programs import next_batches

log = logging.getLogger("tf_nvlink")


def make_function(model, step_function: Callable, keras_make_function: Callable):
    """The train/test function of a model under a tf_nvlink strategy (see the module doc).

    `keras_make_function(step, outer_jit=True)` is Keras' own `_make_function`, with XLA off the function around
    `strategy.run` when `outer_jit` is False.

    Example:
        >>> model.train_function = make_function(model, model.train_step, keras_make_function)
    """
    kind = "train" if step_function == model.train_step else "test"
    mode = execution_mode(model)
    log.info("tf_nvlink: %s function, steps_per_execution=%d: %s (%s)", kind, model.steps_per_execution, mode.path,
             mode.reason)
    if mode.sync == PLAIN:
        step = replica_sync.keep_replicas_in_sync(model, step_function)  # BatchNorm statistics
        if model.distribute_strategy.num_replicas_in_sync > 1:
            step = exact_batches.weighted_by_examples(step)  # every batch trains and evaluates as on one device
        function, outer_jit = keras_make_function(step), True
    else:
        step = replica_sync.keep_replicas_in_sync(model, PerReplicaXlaStep(model, step_function, kind))
        if mode.path == COMPILED:
            return CompiledExecution(model, step, one_step_function(model, step), kind)
        if mode.unrolled:
            # Keras' multi-step loop fails on an all-reduce without merge_call inside its tf.cond (synchronized
            # BatchNorm on one GPU too), and on the collectives of several workers ("You must feed a value for
            # placeholder tensor ... while/cond/Placeholder"); this one takes the steps the epoch asks for itself.
            function = unrolled_steps_function(model, step)
        elif model.steps_per_execution > 1:
            function = sequenced_steps_function(model, step)
        else:
            function = keras_make_function(step, outer_jit=False)  # no one XLA cluster spanning the replicas
        outer_jit = False
    one_step = one_step_function(model, step, jit_compile=outer_jit and bool(model.jit_compile))
    first = FirstExecution(model, kind, f"per-step path, {mode.sync}, steps_per_execution={model.steps_per_execution}"
                           ) if mode.sync != PLAIN or model.jit_compile else None
    return steps_asked_for(model, function, one_step, first)


def one_step_function(model, step_function: Callable, jit_compile: bool = False):
    """One batch through `strategy.run(step_function)`, its logs reduced as Keras reduces them: Keras'
    `one_step_on_data` as a tf.function, optional inputs converted as Keras does. The paths that run fewer steps
    than `steps_per_execution` (an epoch's last execution) need the single step Keras builds but does not expose.

    Example:
        >>> one_step = one_step_function(model, step)
        >>> logs = one_step(next(iterator))
    """
    return trainer_seams.with_optionals_converted(model, _step_on_data(model, step_function, jit_compile))


def _step_on_data(model, step_function: Callable, jit_compile: bool = False):
    return tf.function(_reduced_step(model, step_function), reduce_retracing=True, jit_compile=jit_compile)


def _reduced_step(model, step_function: Callable) -> Callable:
    """Keras' `one_step_on_data`: one batch through `strategy.run(step_function)`, its outputs reduced."""
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        return trainer_seams.reduce_step_outputs(strategy.run(step_function, args=(data,)), strategy)

    return one_step_on_data


def unrolled_steps_function(model, step_function: Callable):
    """Keras' train/test function for steps_per_execution=N > 1 without its tf.while_loop and tf.cond.

    Why: with no merge_call (MirroredStrategy on all-GPU replicas under XLA, i.e. fused mode), `strategy.run`
    inside a tf.cond or tf.while_loop branch fails ("You must feed a value for placeholder tensor ... cond");
    reproduced on CPU with a stock MirroredStrategy and `_use_merge_call` off, while N unrolled calls work. So the
    N batches are taken eagerly from the distributed iterator (the input's error raised after the batches before
    it ran) and one tf.function runs the N steps unrolled; the last execution of an epoch may hold fewer (its own
    trace).

    Example:
        >>> train_function = unrolled_steps_function(model, step)
        >>> logs = train_function(iterator)
    """
    one_step_on_data = trainer_seams.with_optionals_converted(model, _reduced_step(model, step_function))

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


def sequenced_steps_function(model, step_function: Callable):
    """Keras' train/test function for steps_per_execution=N > 1 (N steps in one tf.while_loop over the iterator),
    with each batch taken only after the step before it has applied its updates.

    Why: Keras' loop takes batch k+1 while step k runs, so an input error in batch k+1 aborts step k part-way:
    the optimizer's step counter advanced and some weights not updated (split mode on 2 CPU replicas, one fit in
    two). Here the next batch waits for the step's function call (a control edge from a call waits for all of the
    function's side effects), so an input error comes after the steps before it, as on one device. The step is
    traced once, for the loop's body; its outputs' structure comes from that trace.

    Example:
        >>> train_function = sequenced_steps_function(model, step)
        >>> logs = train_function(iterator)
    """
    on_data = _step_on_data(model, step_function)
    one_step = trainer_seams.with_optionals_converted(model, on_data)
    traced_step = trainer_seams.with_optionals_converted(model, on_data.get_concrete_function)
    steps = model.steps_per_execution

    def after(outputs, take):
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            return take()

    @tf.autograph.experimental.do_not_convert
    def steps_on_iterator(iterator):
        next_inputs = iterator.get_next_as_optional()
        outputs_spec = tf.nest.map_structure(tf.type_spec_from_value,
                                             traced_step(next_inputs.get_value()).structured_outputs)

        def more(step, outputs, next_inputs):
            return tf.logical_and(step < steps, next_inputs.has_value())

        def body(step, outputs, next_inputs):
            stepped = one_step(next_inputs.get_value())
            next_inputs = tf.cond(step + 1 < steps, lambda: after(stepped, iterator.get_next_as_optional),
                                  lambda: next_inputs)
            return step + 1, tf.experimental.Optional.from_value(stepped), next_inputs

        _, outputs, _ = tf.while_loop(more, body, (tf.constant(0), tf.experimental.Optional.empty(outputs_spec),
                                                   next_inputs))
        return outputs

    steps_on_iterator = tf.function(steps_on_iterator, reduce_retracing=True)

    def function(iterator):
        if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
            outputs = None  # `*_on_batch`: Keras passes a Python generator of one batch
            for _, data in zip(range(steps), iterator):
                outputs = one_step(data)
            return outputs
        outputs = steps_on_iterator(iterator)
        if not outputs.has_value():
            raise StopIteration
        return outputs.get_value()

    return function


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
        return FUSED if all_reduces_in_program(self.strategy) else SPLIT

    def _copies_needed(self) -> bool:
        # Several replicas; or one GPU, where TensorFlow's no-merge_call path under XLA still fails on the
        # optimizer's step counter ("merge_call called while defining a new graph", seen on 1x H200).
        return per_replica_xla(step_facts(self.strategy))

    def __call__(self, strategy_run: Callable, fn, args=(), kwargs=None, options=None):
        replicas = self.strategy.num_replicas_in_sync
        if replicas > 1 and tf_runtime.in_xla_context():
            problem = REGISTRY.problem
            if problem:
                first, last = trainer_seams.TESTED_KERAS
                raise UnsupportedKerasError(
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
        jit_function = tf_runtime.jit_tf_function(fn) if self._copies_needed() else None
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
