"""What the compiled execution (fit) and `CompiledSteps` (custom loops) share: one tf.function per replica, N
batches taken from a distributed iterator, stacked and run by a loop inside each replica's XLA program.

Example:
    >>> programs = ReplicaPrograms(strategy, lambda replica_id, full: execution_body(step, full))
    >>> batches, error = next_batches(iterator, 8)
    >>> per_replica_outputs = programs.run(tuple(batches))       # inside a tf.function
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Hashable, Optional

import tensorflow as tf

from tf_nvlink.training.execution_mode import per_replica_jit_compile
from tf_nvlink.training.input_staging import restored_ints


def replica_id() -> int:
    """The replica the calling code runs for (0 outside a replica context).

    Example:
        >>> strategy.run(lambda: replica_id())      # 0 and 1 on two replicas
    """
    context = tf.distribute.get_replica_context()
    replica = tf.get_static_value(context.replica_id_in_sync_group) if context is not None else 0
    return int(replica or 0)


class PerReplicaFunctions:
    """One tf.function per key (a replica, or a replica and a kind of program), made on first use from
    `make_python(key)`, compiled with XLA unless the tests emulate fused mode on CPU.

    Example:
        >>> functions = PerReplicaFunctions(lambda replica: step.body_for(replica), reduce_retracing=True)
        >>> functions(replica_id())(data)
    """

    def __init__(self, make_python: Callable[[Hashable], Callable], **options):
        self.make_python, self.options = make_python, options
        self._functions: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable):
        with self._lock:
            if key not in self._functions:
                self._functions[key] = tf.function(self.make_python(key), jit_compile=per_replica_jit_compile(),
                                                   **self.options)
            return self._functions[key]

    def forget(self, key: Hashable) -> None:
        """Drop the function of `key`: the next call makes it again (traced anew)."""
        with self._lock:
            self._functions.pop(key, None)

    def made(self) -> dict:
        """The functions made so far, by key."""
        with self._lock:
            return dict(self._functions)


def execution_body(step_body: Callable, full: bool) -> Callable:
    """The Python function one replica compiles for an execution: its batches stacked, and a loop inside the
    program running `step_body` on each, carrying the last step's outputs (logs). `body(batches)` for a full
    execution (the loop runs `len(batches)` times, a count XLA knows), `body(batches, count)` for a partial one.

    Example:
        >>> program = tf.function(execution_body(step.body_for(0), full=True), jit_compile=True)
        >>> logs = program(batches)          # inside the replica's strategy.run
    """
    def execution(batches, count):
        stacked = stack(batches)
        step = traced_once(step_body, stacked)

        def body(index, _):
            return index + 1, step(tf.nest.map_structure(lambda leaf: leaf[index], stacked))

        return steps_loop(count, body, lambda: carried_start(step, stacked), len(batches))

    if full:
        return lambda batches: execution(batches, len(batches))
    return execution


class ReplicaPrograms:
    """One compiled program per replica and kind of execution, run by `strategy.run`: `make_body(replica_id,
    full)` gives the Python function a replica compiles, called as `body(batches)` for a full execution (its
    loop count, `len(batches)`, known to XLA) and `body(batches, count)` for a partial one (a tensor count).
    The batches' `Int32Bits` parts reach the body as int32 (`restored_ints`).

    Example:
        >>> programs = ReplicaPrograms(strategy, lambda replica_id, full: execution_body)
        >>> per_replica_outputs = programs.run(batches)            # a full execution, inside a tf.function
    """

    def __init__(self, strategy, make_body: Callable[[int, bool], Callable]):
        self.strategy, self.make_body = strategy, make_body
        self._programs = PerReplicaFunctions(self._program_body, autograph=False)  # (replica, full) -> tf.function

    def _program_body(self, key: tuple[int, bool]) -> Callable:
        body = self.make_body(*key)
        return lambda batches, *count: body(tuple(restored_ints(batch) for batch in batches), *count)

    def program_for(self, replica_id: int, full: bool):
        """The replica's tf.function for a full (True) or a partial execution, made on first use."""
        return self._programs((replica_id, full))

    def run(self, batches, count=None):
        """Each replica's program on its share of `batches`: a full execution when `count` is None."""
        if count is None:
            return self.strategy.run(lambda b: self.program_for(replica_id(), True)(b), args=(batches,))
        return self.strategy.run(lambda b, c: self.program_for(replica_id(), False)(b, c),
                                 args=(batches, count))

    def traced(self) -> dict[str, list[int]]:
        """How many programs each replica traced, for full executions and for partial ones (one per batch shape).

        Example:
            >>> model.train_function.programs.traced()     # 2 replicas, a short last batch
            {'full': [1, 1], 'partial': [1, 1]}
        """
        programs = self._programs.made()
        replicas = sorted({replica for replica, _ in programs})
        return {kind: [programs[(r, full)].experimental_get_tracing_count() if (r, full) in programs else 0
                       for r in replicas]
                for kind, full in (("full", True), ("partial", False))}


def traced_once(step_fn: Callable, stacked) -> Callable:
    """`step_fn` for one of the `stacked` batches, traced once where XLA runs the loop (a concrete function: the
    loop's start value and its body both use this one trace, so a fresh process traces the model's step once per
    program instead of twice); `step_fn` itself in the tests' CPU emulation of fused mode, whose unrolled loop
    traces each step anew (TensorFlow's own collectives hang when one function launches the same one again).

    Example:
        >>> step = traced_once(step_body, stacked)
        >>> logs = step(tf.nest.map_structure(lambda leaf: leaf[0], stacked))
    """
    return _traced(step_fn, stacked) if per_replica_jit_compile() else step_fn


def carried_start(step_fn: Callable, stacked) -> tuple:
    """(zeros, shapes) of the outputs `step_fn` gives for one of the `stacked` batches (from its trace, made here
    unless `step_fn` is one already): what a loop carries from step to step starts as those zeros."""
    if not isinstance(step_fn, tf.types.experimental.ConcreteFunction):
        step_fn = _traced(step_fn, stacked)
    spec = step_fn.structured_outputs
    return tf.nest.map_structure(_zeros_like_spec, spec), tf.nest.map_structure(lambda leaf: leaf.shape, spec)


def _traced(step_fn: Callable, stacked):
    """`step_fn`'s concrete function for one of the `stacked` batches."""
    one_batch = tf.nest.map_structure(lambda leaf: tf.TensorSpec(leaf.shape[1:], leaf.dtype), stacked)
    return tf.function(step_fn, autograph=False).get_concrete_function(one_batch)


def steps_loop(count, body: Callable, carried_start: Callable[[], tuple], most: int):
    """`body` run `count` times inside the replica's program: an XLA while loop.

    `body(index, carried)` returns (index + 1, the new carried outputs); `carried_start()` gives (the first
    carried outputs, their shapes), called only where a loop needs them (the unrolled full loop of the CPU
    emulation starts from None instead).

    `count` is a Python int for a full execution: the loop's bound is then a constant, XLA knows the trip count
    and its GPU runtime launches the iterations back to back. A tensor `count` (at most `most`, a partial
    execution) is read by the loop condition, which XLA evaluates on the device and copies to the host after
    every iteration, waiting for the GPU each time.

    Without XLA (tests' CPU emulation of fused mode) the loop is unrolled (`most` conds for a tensor count):
    TensorFlow's own collectives (the CPU stand-in for the all-reduce XLA compiles) hang when one replica's while
    loop launches the same collective again (seen with 2 CPU replicas), while XLA runs its all-reduce in a loop
    natively."""
    known = isinstance(count, int)
    if per_replica_jit_compile():
        start, invariants = carried_start()
        return tf.while_loop(lambda index, _: index < count, body, (tf.constant(0), start),
                             shape_invariants=(tf.TensorShape([]), invariants),
                             maximum_iterations=None if known else most)[1]
    outputs = None if known else carried_start()[0]
    for index in range(count if known else most):
        if known:
            outputs = body(tf.constant(index), outputs)[1]
        else:
            outputs = tf.cond(index < count, lambda index=index: body(tf.constant(index), outputs)[1],
                              lambda: outputs)
    return outputs


def _zeros_like_spec(spec):
    return tf.zeros([0 if dim is None else dim for dim in spec.shape.as_list()], spec.dtype) \
        if spec.shape.rank is not None else tf.zeros([], spec.dtype)


def takes_ahead(iterator) -> bool:
    """Only a tf.data or distributed iterator is read ahead (a Python iterator of the user's may have effects)."""
    return isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))


def next_batches(iterator, count: int, batches: Optional[list] = None) -> tuple[list, Optional[Exception]]:
    """(`batches` extended from `iterator` to `count`, or to the input's end; the error the input raised, if it
    raised one first). The caller runs the batches taken before the error, then raises it: Keras' own loop runs
    the steps before a bad batch.

    Example:
        >>> batches, error = next_batches(iterator, model.steps_per_execution)
    """
    batches = [] if batches is None else batches
    while len(batches) < count:
        try:
            batches.append(next(iterator))
        except (StopIteration, tf.errors.OutOfRangeError):
            break
        except Exception as error:  # noqa: BLE001 - the input's own error, raised by the caller in turn
            return batches, error
    return batches, None


def signature(batch, strategy) -> tuple:
    return tuple((tuple(tensor.shape), tensor.dtype.name) if hasattr(tensor, "shape") else (type(tensor).__name__,)
                 for leaf in tf.nest.flatten(batch) for tensor in strategy.experimental_local_results(leaf))


def same_shape_runs(batches: list, strategy) -> list[list]:
    """Consecutive batches of one shape signature together (a short last batch starts its own run)."""
    runs: list[list] = []
    previous = None
    for batch in batches:
        batch_signature = signature(batch, strategy)
        if runs and batch_signature == previous:
            runs[-1].append(batch)
        else:
            runs.append([batch])
        previous = batch_signature
    return runs


def stackable(batch, strategy) -> bool:
    """Dense tensors only: sparse, ragged and optional values take the per-step path."""
    return all(isinstance(tensor, tf.Tensor)  # a SparseTensor, RaggedTensor or Optional is no tf.Tensor
               for leaf in tf.nest.flatten(batch) for tensor in strategy.experimental_local_results(leaf))


def stack(batches) -> object:
    """The batches (each a nest of tensors of one structure and shape) stacked along a new first dimension, the
    loop's input inside a replica's program.

    Example:
        >>> stack([(x0, y0), (x1, y1)])      # (x of shape [2, ...], y of shape [2, ...])
    """
    return tf.nest.map_structure(lambda *leaves: tf.stack(leaves), *batches)


def padded(batches: list, steps: int) -> tuple:
    """`batches` filled up to `steps` with the last one, for a partial execution whose count says how many run.

    Example:
        >>> len(padded([a, b], 8))
        8
    """
    return tuple(batches) + (batches[-1],) * (steps - len(batches))
