"""N steps, one XLA program: `steps_per_execution=N` run as ONE compiled program per replica.

Why this exists: Keras' TensorFlow trainer runs `steps_per_execution` as a `tf.while_loop` on the host that
launches one XLA program per step and takes each batch on the host in between, so the GPU waits between steps
(about a quarter of a ResNet-50 step on 1x H200, the step doctor's "GPU idle"). Here each execution of N steps
is one XLA program per replica: the N batches go in together, a loop inside XLA runs the N train steps
(forward, loss share, gradients, all-reduce in fused mode, optimizer, BatchNorm sync, metrics), and only the
last step's logs come out. While one execution runs on the GPU, the host already takes the next execution's
batches from the input pipeline (their copies to the device overlap the running program).

When it applies (`execution_path(model)` says which path a model takes, and why):
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
import threading
import weakref
from typing import Any, Callable, NamedTuple, Optional

import tensorflow as tf

from tf_nvlink import internals
from tf_nvlink.training.exact_batches import with_metrics_across_replicas

log = logging.getLogger("tf_nvlink")

COMPILED = "compiled"
PER_STEP = "per-step"


def execution_path(model, steps: Optional[int] = None) -> tuple[str, str]:
    """(COMPILED or PER_STEP, why) for the train/test function of `model` under a tf_nvlink strategy, at its
    `steps_per_execution` or at `steps` (what the step doctor asks before advising one).

    Example:
        >>> execution_path(model)
        ('compiled', '4 steps per execution as one XLA program per replica (fused: all-reduce inside XLA)')
    """
    strategy = model.distribute_strategy
    plan = getattr(strategy, "plan", None)
    steps = model.steps_per_execution if steps is None else steps
    if plan is None:
        return PER_STEP, "not under a tf_nvlink strategy: Keras' own loop"
    if steps <= 1:
        return PER_STEP, "steps_per_execution=1"
    if not getattr(plan, "compiled_execution", True):
        return PER_STEP, "compiled execution turned off: tf_nvlink.strategy(compiled_execution=False)"
    if not model.jit_compile or model.run_eagerly:
        return PER_STEP, "the model is not compiled with jit_compile=True (or runs eagerly)"
    if internals.worker_count(strategy) > 1:
        return PER_STEP, "several workers: an all-reduce inside XLA cannot span processes"
    if not internals.fused_allreduce_possible(strategy):
        return PER_STEP, ("the replicas are not all GPUs: the all-reduce runs outside XLA (split mode), "
                          "so each step is its own program")
    replicas = strategy.num_replicas_in_sync
    if replicas > 1 and strategy.xla_allreduce != "fused":
        return PER_STEP, "xla_allreduce='split': the all-reduce runs outside XLA, so each step is its own program"
    where = "one replica" if replicas == 1 else "fused: all-reduce inside XLA"
    return COMPILED, f"{steps} steps per execution as one XLA program per replica ({where})"


def input_depth(model):
    """Batches `model.fit`/`evaluate` prefetch to each device on the compiled path: N (at least the plan's
    `input_buffer`), so the copies of an execution's batches run ahead of it; None on the per-step path.

    Example:
        >>> input_depth(model)     # steps_per_execution=16, compiled
        16
    """
    if execution_path(model)[0] != COMPILED:
        return None
    return max(model.steps_per_execution, getattr(model.distribute_strategy.plan, "input_buffer", 0) or 0)


class InputStaging(NamedTuple):
    """How fit's and evaluate's input reaches the compiled execution (`internals.restage_input` applies it):
    `depth` batches prefetched per replica, `transform` run on the host dataset first, `restore(batch)` giving a
    staged batch back as the model takes it, and `to_device`: prefetched to the replicas' devices (TensorFlow's
    prefetch to the GPU) or kept in host memory, the execution's function copying them. `reuse_key` says what the
    staging depends on besides the dataset: a user's tf.data dataset staged before under the same key is not
    staged again (its tf.data functions are traced once, not at every fit and every epoch's validation)."""

    depth: int
    transform: Callable
    restore: Callable
    to_device: bool = True
    reuse_key: Optional[tuple] = None


def input_staging(model) -> Optional[InputStaging]:
    """The `InputStaging` of `model`'s fit/evaluate on the compiled path, else None: `input_depth(model)` batches
    prefetched to each device, their int32 parts carried as uint32 bits (`int32_as_bits`; `restored_ints` undoes
    it), copied from pinned host memory (`pinned_batches`). The model's compiled execution can say otherwise:
    `pinned_input = False` (pageable host memory), `input_to_device = False` (kept on the host; the benchmark
    compares both), `reuse_staged_input = False` (a tf.data dataset staged anew at every fit and evaluate).

    Example:
        >>> input_staging(model)     # steps_per_execution=16, compiled
        InputStaging(depth=16, transform=<function ...>, restore=<function restored_ints ...>, to_device=True,
                     reuse_key=(16, True, True))
    """
    depth = input_depth(model)
    if depth is None:
        return None
    function = getattr(model, "train_function", None)
    pinned = getattr(function, "pinned_input", True)
    to_device = getattr(function, "input_to_device", True)
    return InputStaging(depth, (lambda dataset: pinned_batches(int32_as_bits(dataset))) if pinned else int32_as_bits,
                        restored_ints, to_device,
                        reuse_key=(depth, bool(pinned), bool(to_device))
                        if getattr(function, "reuse_staged_input", True) else None)


class Int32Bits(NamedTuple):
    """An int32 tensor of a batch carried through the compiled execution's input as its uint32 bits.

    Why: TensorFlow keeps int32 tensors in host memory around its functions, so the distributed iterator's
    prefetch copied each int32 part of a batch (token ids, labels) to the GPU, back to the host and to the GPU
    again, each device-to-host copy waiting for every kernel queued before it (1x H200, 368M Transformer: 32
    copies of 16 KiB per execution of 8 steps). A bitcast moves no data; the replica's program bitcasts the bits
    back. The time between executions did not change measurably (docs/results.md): the prefetch still copies 8
    bytes per element from the device to the host, which waits the same way."""

    bits: Any


def int32_as_bits(dataset):
    """`dataset` with each int32 part of its elements as `Int32Bits` (uint32); unchanged when it has none or
    has parts that are not dense tensors (those batches take the per-step path).

    Example:
        >>> restored_ints(next(iter(int32_as_bits(tf.data.Dataset.from_tensors((x, labels))))))   # (x, labels)
    """
    if not _all_dense(dataset) or not any(spec.dtype == tf.int32 for spec in tf.nest.flatten(dataset.element_spec)):
        return dataset
    element = _element_from_map_args(dataset.element_spec)

    def as_bits(*parts):
        return tf.nest.map_structure(
            lambda t: Int32Bits(tf.bitcast(t, tf.uint32)) if t.dtype == tf.int32 else t, element(*parts))

    return dataset.map(as_bits, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)


def restored_ints(value):
    """`value` (a batch, or any nest holding one) with every `Int32Bits` bitcast back to its int32 tensor: what the
    replica's program does first, and what builds the model from a staged batch."""
    if isinstance(value, Int32Bits):
        return tf.bitcast(value.bits, tf.int32)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(restored_ints(part) for part in value))
    if isinstance(value, (tuple, list)):
        return type(value)(restored_ints(part) for part in value)
    if isinstance(value, dict):
        return type(value)((key, restored_ints(part)) for key, part in value.items())
    return value


def pinned_batches(dataset):
    """`dataset` with each dense batch copied into pinned (page-locked) host memory, which the GPU copies from at
    the link's speed and concurrently with its kernels; a copy from pageable memory ran at 6 GB/s on 1x H200 and
    did not overlap the compiled execution's program. TensorFlow allocates the output of tf.data's fused
    map-and-batch in pinned memory on a machine with GPUs (its "GPU compatible" host allocator): each batch goes
    through one as a batch of one, and the extra dimension is dropped again (a reshape, no copy). Batches with
    sparse or ragged parts are left as they are.

    Example:
        >>> distributed = strategy.experimental_distribute_dataset(pinned_batches(dataset))
    """
    if not _all_dense(dataset):
        return dataset
    staged = dataset.apply(tf.data.experimental.map_and_batch(_element_from_map_args(dataset.element_spec), 1))
    staged_element = _element_from_map_args(staged.element_spec)
    return staged.map(lambda *parts: tf.nest.map_structure(lambda t: tf.squeeze(t, 0), staged_element(*parts)))


def _all_dense(dataset) -> bool:
    return all(isinstance(spec, tf.TensorSpec) for spec in tf.nest.flatten(dataset.element_spec))


def _element_from_map_args(spec) -> Callable:
    """The element a `Dataset.map` function receives, rebuilt in the structure `spec` gives it: tf.data hands a
    plain tuple over as separate arguments and any other element (a tensor, a dict, a namedtuple such as
    `Int32Bits`) as one."""
    return lambda *parts: tf.nest.pack_sequence_as(spec, tf.nest.flatten(parts))


class StagedBatchesTooLarge(ValueError):
    """The batches of one execution do not fit on the device: `steps_per_execution` is too large."""


def execution_body(step_body: Callable, full: bool) -> Callable:
    """The Python function one replica compiles for an execution: its batches stacked, and a loop inside the
    program running `step_body` on each, carrying the last step's outputs (logs). `body(batches)` for a full
    execution (the loop runs `len(batches)` times, a count XLA knows), `body(batches, count)` for a partial one.

    Example:
        >>> program = tf.function(execution_body(step.body_for(0), full=True), jit_compile=True)
        >>> logs = program(batches)          # inside the replica's strategy.run
    """
    def execution(batches, count):
        stacked = tf.nest.map_structure(lambda *leaves: tf.stack(leaves), *batches)
        def body(index, _):
            return index + 1, step_body(tf.nest.map_structure(lambda leaf: leaf[index], stacked))

        return _loop(count, body, lambda: _carried_start(step_body, stacked), len(batches))

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
        self._programs: dict[tuple[int, bool], Any] = {}  # (replica, full) -> its tf.function
        self._lock = threading.Lock()

    def program_for(self, replica_id: int, full: bool):
        """The replica's tf.function for a full (True) or a partial execution, made on first use."""
        with self._lock:
            if (replica_id, full) not in self._programs:
                body = self.make_body(replica_id, full)
                self._programs[(replica_id, full)] = tf.function(
                    lambda batches, *count: body(tuple(restored_ints(batch) for batch in batches), *count),
                    jit_compile=internals.per_replica_jit_compile(), autograph=False)
            return self._programs[(replica_id, full)]

    def run(self, batches, count=None):
        """Each replica's program on its share of `batches`: a full execution when `count` is None."""
        if count is None:
            return self.strategy.run(lambda b: self.program_for(internals.replica_id(), True)(b), args=(batches,))
        return self.strategy.run(lambda b, c: self.program_for(internals.replica_id(), False)(b, c),
                                 args=(batches, count))

    def traced(self) -> dict[str, list[int]]:
        """How many programs each replica traced, for full executions and for partial ones (one per batch shape).

        Example:
            >>> model.train_function.programs.traced()     # 2 replicas, a short last batch
            {'full': [1, 1], 'partial': [1, 1]}
        """
        with self._lock:
            programs = dict(self._programs)
        replicas = sorted({replica for replica, _ in programs})
        return {kind: [programs[(r, full)].experimental_get_tracing_count() if (r, full) in programs else 0
                       for r in replicas]
                for kind, full in (("full", True), ("partial", False))}


class CompiledExecution:
    """Keras' train (or test) function for a model on the compiled path: `function(iterator)` runs up to
    `steps_per_execution` steps as one XLA program per replica and returns the last step's logs.

    `step` is the per-replica step (`per_replica_steps.PerReplicaXlaStep`, BatchNorm sync included);
    `one_step(data)` runs one batch on the per-step path (for batches that cannot be stacked).

    Example (what the trainer hook builds for you):
        >>> function = CompiledExecution(model, step, one_step)
        >>> logs = function(iter(strategy.experimental_distribute_dataset(dataset)))
    """

    def __init__(self, model, step, one_step: Callable):
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
        self._outer = tf.function(
            lambda batches, count=None: internals.reduce_step_outputs(self.programs.run(batches, count),
                                                                      self.strategy), autograph=False)
        # A full execution that also copies the next execution's host batches to the replicas' devices: the
        # copies are not inputs of the program, so they run beside it instead of before it.
        self._outer_copying_ahead = tf.function(
            lambda batches, ahead: (internals.reduce_step_outputs(self.programs.run(batches), self.strategy),
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
        if self.input_to_device or not _takes_ahead(iterator):
            return None
        self._take_ahead(iterator)
        ahead = self._taken_ahead
        if len(ahead) != self.steps or len(_same_shape_runs(ahead, self.strategy)) != 1 \
                or not all(_stackable(batch, self.strategy) for batch in ahead):
            return None
        return tuple(ahead)

    def _on_replicas(self, batches: tuple) -> tuple:
        """`batches` (host tensors per replica) copied to each replica's device, inside the launching function."""
        return self.strategy.run(lambda *local: tf.nest.map_structure(tf.identity, local), args=batches)

    def __call__(self, iterator):
        count = internals.steps_asked_for_this_call(self.steps)
        batches, error = self._take(iterator, count)
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
        for group in _same_shape_runs(batches, self.strategy):
            if not all(_stackable(batch, self.strategy) for batch in group):
                for batch in group:
                    outputs = self.one_step(batch)
                continue
            self._check_memory(group[0])
            with _explained_oom(self, group[0]):
                if len(group) < self.steps:  # never run: the count says so
                    padded = tuple(group) + (group[-1],) * (self.steps - len(group))
                    outputs = self._outer(padded, tf.constant(len(group), tf.int32))
                elif (ahead := self._copy_ahead(iterator)) is not None:
                    outputs, staged = self._outer_copying_ahead(tuple(group), ahead)
                    self._taken_ahead[:] = staged  # strategy.run gives back the tuple of N batches, on the devices
                    self.copied_ahead += 1
                else:
                    outputs = self._outer(tuple(group))
            self.programs_run += 1
        if take_ahead and _takes_ahead(iterator):
            self._take_ahead(iterator)
        return outputs

    def staged_bytes(self, batch) -> int:
        """Device bytes the input stages per replica: the execution's N batches and their stacked copy, the next
        execution's N taken ahead, and the batches prefetched (`input_depth`, N unless `input_buffer` is more)."""
        depth = input_depth(self.model) or self.steps
        return (3 * self.steps + depth) * batch_bytes_per_replica(batch, self.strategy)

    def _check_memory(self, batch) -> None:
        if self._checked_memory:
            return
        self._checked_memory = True
        needed = self.staged_bytes(batch)
        for device in self.strategy.extended.worker_devices:
            free = internals.device_bytes_free(device)
            if free is not None and needed > free:
                raise StagedBatchesTooLarge(_too_large_text(self.steps, needed, device, free))


def _too_large_text(steps: int, needed: int, device: str, free: Optional[int]) -> str:
    where = f"{device} has {_size_text(free)} free" if free is not None else f"{device} ran out of memory"
    return (f"steps_per_execution={steps} stages {steps} batches on each replica's device at once, "
            f"{_size_text(needed)} per replica with their stacked copy and the next executions' batches, and "
            f"{where}. "
            f"Compile with a smaller steps_per_execution (e.g. {max(1, steps // 2)}), a smaller batch, or "
            f"tf_nvlink.strategy(compiled_execution=False) to run the steps one program each.")


def _size_text(size: int) -> str:
    return f"{size / 2**20:.1f} MiB ({size} bytes)"


class _explained_oom:
    def __init__(self, execution: CompiledExecution, batch):
        self.execution, self.batch = execution, batch

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None and issubclass(kind, tf.errors.ResourceExhaustedError) \
                and self.execution.programs_run == 0:
            raise StagedBatchesTooLarge(_too_large_text(
                self.execution.steps, self.execution.staged_bytes(self.batch), "the device", None)
                + f" TensorFlow said: {str(error).splitlines()[0]}") from error
        return False


def batch_bytes_per_replica(batch, strategy) -> int:
    """The largest replica's bytes of one distributed batch.

    Example:
        >>> batch_bytes_per_replica(next(iter(strategy.experimental_distribute_dataset(dataset))), strategy)
        12845056
    """
    per_replica = [0] * strategy.num_replicas_in_sync
    for leaf in tf.nest.flatten(batch):
        for replica, tensor in enumerate(strategy.experimental_local_results(leaf)):
            per_replica[replica] += int(tf.size(tensor)) * tensor.dtype.size
    return max(per_replica)


def _carried_start(step_fn: Callable, stacked) -> tuple:
    """(zeros, shapes) of the outputs `step_fn` gives for one of the `stacked` batches, from a trace that is never
    run: what a loop carries from step to step starts as those zeros."""
    first = tf.nest.map_structure(lambda leaf: tf.TensorSpec(leaf.shape[1:], leaf.dtype), stacked)
    spec = tf.function(step_fn, autograph=False).get_concrete_function(first).structured_outputs
    return tf.nest.map_structure(_zeros_like_spec, spec), tf.nest.map_structure(lambda leaf: leaf.shape, spec)


def _loop(count, body: Callable, carried_start: Callable[[], tuple], most: int):
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
    if internals.per_replica_jit_compile():
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


def _weak(value, on_release: Callable[[], None]) -> Callable[[], Any]:
    """A weak reference to `value` (`on_release()` once it is gone), or a strong one where Python cannot make a
    weak one."""
    try:
        return weakref.ref(value, lambda _: on_release())
    except TypeError:
        return lambda: value


def _takes_ahead(iterator) -> bool:
    """Only a tf.data or distributed iterator is read ahead (a Python iterator of the user's may have effects)."""
    return isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator))


def _next_or_none(iterator):
    try:
        return next(iterator)
    except (StopIteration, tf.errors.OutOfRangeError):
        return None


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


def _signature(batch, strategy) -> tuple:
    return tuple((tuple(tensor.shape), tensor.dtype.name) if hasattr(tensor, "shape") else (type(tensor).__name__,)
                 for leaf in tf.nest.flatten(batch) for tensor in strategy.experimental_local_results(leaf))


def _same_shape_runs(batches: list, strategy) -> list[list]:
    """Consecutive batches of one shape signature together (a short last batch starts its own run)."""
    runs: list[list] = []
    previous = None
    for batch in batches:
        signature = _signature(batch, strategy)
        if runs and signature == previous:
            runs[-1].append(batch)
        else:
            runs.append([batch])
        previous = signature
    return runs


def _stackable(batch, strategy) -> bool:
    """Dense tensors only: sparse, ragged and optional values take the per-step path."""
    return all(isinstance(tensor, tf.Tensor)  # a SparseTensor, RaggedTensor or Optional is no tf.Tensor
               for leaf in tf.nest.flatten(batch) for tensor in strategy.experimental_local_results(leaf))


def steps_asked_for(model, function: Callable, one_step: Callable) -> Callable:
    """A per-step path's train function that runs the steps the epoch asks for: `function(iterator)` runs
    `model.steps_per_execution` batches; when the epoch asks for fewer (its last execution), `one_step` runs them
    one by one. Its logs read the model's metrics over all replicas (`with_metrics_across_replicas`).

    Example:
        >>> train_function = steps_asked_for(model, keras_function, one_step)
    """
    steps = model.steps_per_execution

    def limited(iterator):
        return with_metrics_across_replicas(model, _steps(iterator))

    def _steps(iterator):
        count = internals.steps_asked_for_this_call(steps)
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
