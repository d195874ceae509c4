"""N steps, one XLA program: `steps_per_execution=N` run as ONE compiled program per replica.

Why this exists: Keras' TensorFlow trainer runs `steps_per_execution` as a `tf.while_loop` on the host that
launches one XLA program per step and takes each batch on the host in between, so the GPU waits between steps
(about a quarter of a ResNet-50 step on 1x H200, the step doctor's "GPU idle"). Here each execution of N steps
is one XLA program per replica: the N batches go in together, a loop inside XLA runs the N train steps
(forward, loss share, gradients, all-reduce in fused mode, optimizer, BatchNorm sync, metrics), and only the
last step's logs come out. While one execution runs on the GPU, the host already takes the next execution's
batches from the input pipeline (their copies to the device overlap the running program).

When it applies (`tf_nvlink.plan.execution.decide_execution`; `execution_path(model)` says which path a model takes, and why):
- `jit_compile=True`, `steps_per_execution > 1`, not `run_eagerly`;
- every replica a GPU of one process, and the whole step in XLA: one replica, or `xla_allreduce="fused"`;
  in split mode the all-reduce runs outside XLA (a merge_call), and across workers XLA's all-reduce cannot
  span processes: those keep the per-step path;
- `tf_nvlink.strategy(compiled_execution=True)`, the default (False keeps the per-step path, for comparison).

A full execution's loop runs exactly N times, a number XLA knows when it compiles (`known_trip_count`): the GPU
then runs the N steps back to back. A loop whose count is a tensor makes XLA copy the loop condition to the host
and wait for it after every step, so the GPU idles while the host launches the next step (the same gap the
compiled execution exists to remove).

Every execution, not only full ones: an execution with fewer than N batches (the epoch's end, a
`steps_per_epoch` N does not divide, a dataset of unknown length that ends) runs one more program, whose count
is a tensor (the missing batches filled with the last one and never run), so any number of steps below N runs
in it; batches of another shape (a short last batch) run as their own partial execution. Programs per replica:
one for full executions, one per batch shape of the partial ones, none per epoch. Under a tf_nvlink strategy
an epoch runs the steps it asks for (`steps_per_epoch=7` at N=5: 5 + 2; Keras runs 5 + 5), whichever path the
model takes.

Custom training loops keep one program per `strategy.run` call (`tf_nvlink.training.per_replica_steps`).
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional

import tensorflow as tf

from tf_nvlink.internals import trainer as trainer_seams
from tf_nvlink.training.exact_batches import with_metrics_across_replicas
from tf_nvlink.training.execution_mode import COMPILED, PER_STEP, execution_mode
from tf_nvlink.training.first_execution import FirstExecution
from tf_nvlink.training.fit_loop import steps_asked_for_this_call
from tf_nvlink.training.input_staging import check_staged_batches_fit, explained_oom
from tf_nvlink.training.replica_programs import (ReplicaPrograms, execution_body, next_batches, padded,
                                                 same_shape_runs, stackable, takes_ahead)

log = logging.getLogger("tf_nvlink")

__all__ = ["COMPILED", "PER_STEP", "CompiledExecution", "execution_path", "steps_asked_for"]


def execution_path(model, steps: Optional[int] = None) -> tuple[str, str]:
    """(COMPILED or PER_STEP, why) for the train/test function of `model` under a tf_nvlink strategy, at its
    `steps_per_execution` or at `steps` (what the step doctor asks before advising one).

    Example:
        >>> execution_path(model)
        ('compiled', '4 steps per execution as one XLA program per replica (fused: all-reduce inside XLA)')
    """
    mode = execution_mode(model, steps)
    return mode.path, mode.reason


class CompiledExecution:
    """Keras' train (or test) function for a model on the compiled path: `function(iterator)` runs up to
    `steps_per_execution` steps as one XLA program per replica and returns the last step's logs.

    `step` is the per-replica step (`per_replica_steps.PerReplicaXlaStep`, BatchNorm sync included);
    `one_step(data)` runs one batch on the per-step path (for batches that cannot be stacked).

    Example (what the trainer hook builds for you):
        >>> function = CompiledExecution(model, step, one_step)
        >>> logs = function(iter(strategy.experimental_distribute_dataset(dataset)))
    """

    def __init__(self, model, step, one_step: Callable, kind: str = "train"):
        self.model = model
        self.strategy = model.distribute_strategy
        self.steps = model.steps_per_execution
        self.step = step
        self.one_step = one_step
        self.programs_run = 0  # executions run as one program (tests and the doctor read it)
        self.copied_ahead = 0  # executions that copied the next one's host batches to the devices (tests read it)
        self.pinned_input = True  # the input copied from pinned host memory (see `input_staging`)
        self.input_to_device = True  # the input prefetched to the replicas' devices (see `input_staging`)
        self.reuse_staged_input = True  # a tf.data dataset staged once per model (see `input_staging`)
        self.programs = ReplicaPrograms(self.strategy, lambda replica_id, full: execution_body(
            self.step.body_for(replica_id), full))
        self._taken_ahead: list = []  # batches taken from `_ahead_of` while the last execution ran
        self._error_ahead: Optional[Exception] = None  # the input's error after `_taken_ahead`, raised in turn
        # A weak reference: once fit or evaluate drops its iterator, its input pipeline's threads stop (a kept
        # one went on prefetching beside the next fit) and the batches taken ahead from it are let go.
        self._ahead_of: Callable[[], Any] = lambda: None
        self._checked_memory = False
        self.first_execution = FirstExecution(model, kind, f"compiled execution: {self.steps} steps as one XLA "
                                                           f"program per replica")
        self._outer = tf.function(
            lambda batches, count=None: trainer_seams.reduce_step_outputs(self.programs.run(batches, count),
                                                                      self.strategy), autograph=False)
        # A full execution that also copies the next execution's host batches to the replicas' devices: the
        # copies are not inputs of the program, so they run beside it instead of before it.
        self._outer_copying_ahead = tf.function(
            lambda batches, ahead: (trainer_seams.reduce_step_outputs(self.programs.run(batches), self.strategy),
                                    self._on_replicas(ahead)), autograph=False)

    # ---- the host side: batches in, executions out -----------------------------------------------------------

    def _take(self, iterator, count: int) -> tuple[list, Optional[Exception]]:
        """Up to `count` batches, and the input's error where it raised one before `count` (the batches before it
        run first, as Keras' own loop runs the steps before a bad batch)."""
        if iterator is not self._ahead_of():
            self._taken_ahead, self._error_ahead = [], None
            self._ahead_of = _weak(iterator, self._taken_ahead.clear)  # this list's clear
        batches = self._taken_ahead[:count]
        del self._taken_ahead[:count]
        if len(batches) < count and self._error_ahead is not None:
            error, self._error_ahead = self._error_ahead, None
            return batches, error
        return next_batches(iterator, count, batches)

    def _take_ahead(self, iterator) -> None:
        """Take the next execution's batches from `iterator` before this one returns: prefetched to the devices,
        their copies run while this execution does; host batches are copied by the launch (`_copy_ahead`). An
        error of the input is kept for the execution that reaches it."""
        if self._error_ahead is None and len(self._taken_ahead) < self.steps:
            _, self._error_ahead = next_batches(iterator, self.steps, self._taken_ahead)

    def _copy_ahead(self, iterator) -> Optional[tuple]:
        """The next execution's host batches when the execution about to launch should copy them to the devices
        (host input, N batches of one shape that stack), else None."""
        if self.input_to_device or not takes_ahead(iterator):
            return None
        self._take_ahead(iterator)
        ahead = self._taken_ahead
        if len(ahead) != self.steps or len(same_shape_runs(ahead, self.strategy)) != 1 \
                or not all(stackable(batch, self.strategy) for batch in ahead):
            return None
        return tuple(ahead)

    def _on_replicas(self, batches: tuple) -> tuple:
        """`batches` (host tensors per replica) copied to each replica's device, inside the launching function."""
        return self.strategy.run(lambda *local: tf.nest.map_structure(tf.identity, local), args=batches)

    def __call__(self, iterator):
        count = steps_asked_for_this_call(self.steps)
        batches, error = self._take(iterator, count)
        with self.first_execution.reported():
            outputs = self._execute(iterator, batches, take_ahead=error is None) if batches else None
        if error is not None:
            raise error
        if outputs is None:
            raise StopIteration
        # Read after the execution, as a function of its own: the reads all-reduce, and collectives of one
        # function that are not ordered against the programs' all-reduces can wait on each other.
        return with_metrics_across_replicas(self.model, outputs)

    def _execute(self, iterator, batches: list, take_ahead: bool):
        outputs = None
        for group in same_shape_runs(batches, self.strategy):
            if not all(stackable(batch, self.strategy) for batch in group):
                for batch in group:
                    outputs = self.one_step(batch)
                continue
            self._check_memory(group[0])
            with explained_oom(self, group[0]):
                if len(group) < self.steps:  # the batches filled in are never run: the count says so
                    outputs = self._outer(padded(group, self.steps), tf.constant(len(group), tf.int32))
                elif (ahead := self._copy_ahead(iterator)) is not None:
                    outputs, staged = self._outer_copying_ahead(tuple(group), ahead)
                    self._taken_ahead[:] = staged  # strategy.run gives back the tuple of N batches, on the devices
                    self.copied_ahead += 1
                else:
                    outputs = self._outer(tuple(group))
            self.programs_run += 1
        if take_ahead and takes_ahead(iterator):
            self._take_ahead(iterator)
        return outputs

    def _check_memory(self, batch) -> None:
        if not self._checked_memory:
            self._checked_memory = True
            check_staged_batches_fit(self.model, self.steps, batch)


def _weak(value, on_release: Callable[[], None]) -> Callable[[], Any]:
    """A weak reference to `value` (`on_release()` once it is gone), or a strong one where Python cannot make a
    weak one."""
    try:
        return weakref.ref(value, lambda _: on_release())
    except TypeError:
        return lambda: value


def steps_asked_for(model, function: Callable, one_step: Callable,
                    first_execution: Optional[FirstExecution] = None) -> Callable:
    """A per-step path's train function that runs the steps the epoch asks for: `function(iterator)` runs
    `model.steps_per_execution` batches; when the epoch asks for fewer (its last execution), `one_step` runs them
    one by one. Its logs read the model's metrics over all replicas (`with_metrics_across_replicas`).
    `first_execution` reports the first call (what compiles, how long it took).

    Example:
        >>> train_function = steps_asked_for(model, keras_function, one_step)
    """
    steps = model.steps_per_execution

    def limited(iterator):
        if first_execution is None:
            return with_metrics_across_replicas(model, _steps(iterator))
        with first_execution.reported():
            outputs = _steps(iterator)
        return with_metrics_across_replicas(model, outputs)

    def _steps(iterator):
        count = steps_asked_for_this_call(steps)
        if count >= steps:
            return function(iterator)
        batches, error = next_batches(iterator, count)
        outputs = None
        for batch in batches:
            outputs = one_step(batch)
        if error is not None:
            raise error
        if outputs is None:
            raise StopIteration
        return outputs

    return limited
