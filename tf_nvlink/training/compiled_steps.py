"""N steps of a custom training loop as one XLA program per replica: `CompiledSteps`.

`model.fit` gets this by itself (`tf_nvlink.training.compiled_execution`); a custom loop that passes a
`tf.function(jit_compile=True)` step to `strategy.run` pays the host's launch and batch hand-over once per step.
`CompiledSteps(strategy, step, steps=N)` takes up to N batches from a distributed iterator and runs them as one
program per replica: the N batches stacked on the replica's device and a loop inside XLA calling the step, its
`optimizer.apply_gradients` and gradient all-reduce included (fused mode). Each call returns the step's outputs
summed over the steps it ran, per replica (for `strategy.reduce`), and how many it ran.

Where one program cannot hold the step (split mode: CPUs, or `xla_allreduce="split"`, where the all-reduce runs
outside XLA) the same call runs the N steps one `strategy.run` each, with the same results. A batch of another
shape (a short last batch) ends the call before it; the next call starts with it (one more program).

Example:
    >>> @tf.function(jit_compile=True)
    ... def step(x, y):
    ...     ...  # loss, gradients, optimizer.apply_gradients
    ...     return loss
    >>> train = CompiledSteps(strategy, step, steps=8)
    >>> iterator = iter(strategy.experimental_distribute_dataset(dataset))
    >>> loss_sum, ran = train(iterator)       # ran == 0 once the iterator is exhausted
"""

from __future__ import annotations

from typing import Any, Callable

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import tf_runtime
from tf_nvlink.training.optimizer_rules import optimizer_calls
from tf_nvlink.training.replica_programs import (ReplicaPrograms, carried_start, next_batches, padded, signature,
                                                 stack, stackable, steps_loop, traced_once)


class CompiledSteps:
    """`steps` batches of a distributed iterator per call, as one XLA program per replica (see the module doc).

    Args:
        strategy: a tf_nvlink strategy (`tf_nvlink.strategy()`).
        step: the replica step, called as `step(*batch)` for a tuple batch, else `step(batch)`: a
            `tf.function(jit_compile=True)` or a plain Python function; it returns a nest of numeric tensors.
        steps: batches per call (N >= 1).
    """

    def __init__(self, strategy, step: Callable, steps: int):
        if not base.is_tf_nvlink_strategy(strategy):
            raise TypeError("CompiledSteps needs a tf_nvlink strategy (tf_nvlink.strategy() builds one), whose "
                            f"strategy.run compiles a program per replica. Received: {type(strategy).__name__}")
        runner = base.runner_of(strategy)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps should be a positive integer (batches per call). Received: steps={steps!r}")
        self.strategy, self.step, self.steps = strategy, step, steps
        jit = tf_runtime.jit_tf_function(step)
        self.python_function = jit[1] if jit else step
        self.autograph = jit[2] if jit else True
        self.mode = runner.custom_loop_mode  # "fused": one program; "split": one strategy.run per step
        self.programs_run = 0
        self.programs = ReplicaPrograms(strategy, lambda replica_id, full: (
            (lambda batches: self._program(batches, len(batches))) if full else self._program))
        self._held: list = []  # a batch of another shape, kept for the next call
        self._one_at_a_time = tf.function(self._run_one_by_one, autograph=False)
        self._outer = tf.function(self.programs.run, autograph=False)

    def __call__(self, iterator) -> tuple[Any, int]:
        """(the step's outputs summed over the steps run, per replica; steps run): up to `steps` batches, fewer
        at the end of the iterator or before a batch of another shape; (None, 0) when none is left."""
        batches = self._take(iterator)
        if not batches:
            return None, 0
        if self.mode != "fused" or not all(stackable(batch, self.strategy) for batch in batches):
            return self._one_at_a_time(tuple(batches)), len(batches)
        try:
            if len(batches) == self.steps:  # the loop's trip count is known to XLA
                outputs = self._outer(tuple(batches))
            else:
                outputs = self._outer(padded(batches, self.steps),  # the batches filled in never run
                                      tf.constant(len(batches), tf.int32))
        except Exception as error:  # AutoGraph may re-raise a copy of tf_nvlink's error: matched by its text
            if "is not built yet" not in str(error):
                raise
            raise ValueError(f"{error}: CompiledSteps runs the optimizer inside the replicas' programs, where it "
                             "cannot create its variables. Build it first, under the strategy's scope: "
                             "optimizer.build(model.trainable_variables).") from error
        self.programs_run += 1
        return outputs, len(batches)

    def _take(self, iterator) -> list:
        batches, self._held = self._held, []
        while len(batches) < self.steps:
            taken, error = next_batches(iterator, 1)
            if error is not None:
                raise error
            if not taken:
                break
            batch = taken[0]
            if batches and signature(batch, self.strategy) != signature(batches[0], self.strategy):
                self._held = [batch]
                break
            batches.append(batch)
        return batches

    def _call_step(self, function: Callable, batch):
        return function(*batch) if isinstance(batch, tuple) else function(batch)

    # ---- split mode (or unstackable batches): one strategy.run per step, summed per replica ------------------

    def _run_one_by_one(self, batches):
        total = None
        for batch in batches:
            # the step itself, so a jit step gets tf_nvlink's per-replica copy (split mode's update outside XLA)
            outputs = self.strategy.run(self.step, args=batch if isinstance(batch, tuple) else (batch,))
            total = outputs if total is None else self.strategy.run(
                lambda a, b: tf.nest.map_structure(tf.add, a, b), args=(total, outputs))
        return total

    # ---- fused mode: one program per replica ---------------------------------------------------------------

    def _program(self, batches, count):
        """The replica's program: `count` (a Python int for a full call, else a tensor) steps over `batches`."""
        step = tf.autograph.to_graph(self.python_function) if self.autograph else self.python_function
        stacked = stack(batches)

        def one(batch):
            with optimizer_calls("replica_local"):  # the step counters per replica, as fit's fused step
                return self._call_step(step, batch)

        one_step = traced_once(one, stacked)

        def body(index, total):  # the loop carries the outputs' sum (None before the first step, unrolled)
            outputs = one_step(tf.nest.map_structure(lambda leaf: leaf[index], stacked))
            return index + 1, outputs if total is None else tf.nest.map_structure(tf.add, total, outputs)

        return steps_loop(count, body, lambda: carried_start(one_step, stacked), len(batches))
