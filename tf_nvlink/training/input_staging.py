"""How fit's and evaluate's input reaches the compiled execution: staged N batches deep on each replica's device
from pinned host memory, int32 parts carried as bits, a user's tf.data dataset staged once per model, the model
built from the input's element spec, and a check that the staged batches fit on the device.

The trainer seam (`tf_nvlink.internals.trainer`) calls `symbolic_build` where Keras would build the model from
a batch; that is where the epoch's input is staged (`restage_input`) before any of its iterators exists.

Example:
    >>> input_staging(model)     # steps_per_execution=16, compiled
    InputStaging(depth=16, transform=<function ...>, restore=<function restored_ints ...>, to_device=True,
                 reuse_key=(16, True, True))
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, NamedTuple, Optional

import tensorflow as tf

from tf_nvlink.internals import tf_runtime, trainer as trainer_seams
from tf_nvlink.training.execution_mode import COMPILED, execution_mode


def input_depth(model):
    """Batches `model.fit`/`evaluate` prefetch to each device on the compiled path: N (at least the plan's
    `input_buffer`), so the copies of an execution's batches run ahead of it; None on the per-step path.

    Example:
        >>> input_depth(model)     # steps_per_execution=16, compiled
        16
    """
    if execution_mode(model).path != COMPILED:
        return None
    return max(model.steps_per_execution, getattr(model.distribute_strategy.plan, "input_buffer", 0) or 0)


class InputStaging(NamedTuple):
    """How fit's and evaluate's input reaches the compiled execution (`restage_input` applies it):
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




# The compiled execution's restaged input, per model (weakly keyed): a user's own tf.data dataset is distributed
# again once, and later fits and evaluates of the same dataset object (and every epoch's validation of one fit)
# take the same distributed dataset. At most `_RESTAGED_PER_MODEL` are kept per model (fit's input, its validation
# data and evaluate's test data); each keeps its source dataset alive until the model goes or a newer one replaces it.
_RESTAGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RESTAGED_PER_MODEL = 3


def restage_input(model, epoch_iterator, depth, transform=None, to_device=True,
                  reuse_key: Optional[Hashable] = None) -> bool:
    """Distribute the input of Keras' epoch iterator again, `depth` batches prefetched to each replica's device
    (before any of its iterators exists); returns whether it did. Why: the compiled execution takes N batches at
    once, and with TensorFlow's one batch prefetched the copies of the other N - 1 wait behind the running program
    (ResNet-50, 1x H200: 5100 img/s with 1, 5343 with 16). `transform(dataset)`, when given, runs on the host
    dataset first (the compiled execution's pinned host batches). `to_device=False` keeps the batches in host
    memory (prefetched `depth` deep there), and the function that takes them copies them to the replicas' devices.
    A dataset the user distributed is left alone. With a `reuse_key` (what the staging depends on besides the
    dataset), a user's tf.data dataset restaged before under the same key takes the distributed dataset built
    then: building it traces tf.data map functions, host time the GPU waits for at the start of every fit (and of
    every epoch's validation). Other input (numpy arrays, generators: Keras builds a new dataset for every call) is
    restaged each time and not kept.

    Example:
        >>> restage_input(model, epoch_iterator, depth=16, transform=pinned_batches)
        True
    """
    if not depth or not trainer_seams.has_distributed_input(epoch_iterator):
        return False
    source = epoch_iterator.data_adapter.get_tf_dataset()
    if isinstance(source, tf.distribute.DistributedDataset):
        return False
    reusable = reuse_key is not None and trainer_seams.is_user_tf_dataset(epoch_iterator)
    kept = _RESTAGED.setdefault(model, {}) if reusable else None
    key = (id(source), reuse_key)  # each entry holds its source, so no other dataset can have that id meanwhile
    if kept is not None and key in kept:
        kept[key] = kept.pop(key)  # the most recently used last
        trainer_seams.set_distributed_input(epoch_iterator, kept[key][1])
        return True
    dataset = source if transform is None else transform(source)
    if not to_device:
        dataset = dataset.prefetch(int(depth))
    options = tf.distribute.InputOptions(experimental_fetch_to_device=bool(to_device),
                                         experimental_per_replica_buffer_size=int(depth))
    distributed = model.distribute_strategy.experimental_distribute_dataset(dataset, options=options)
    trainer_seams.set_distributed_input(epoch_iterator, distributed)
    if kept is not None:
        kept[key] = (source, distributed)
        while len(kept) > _RESTAGED_PER_MODEL:
            del kept[next(iter(kept))]
    return True


def symbolic_build(model, epoch_iterator=None, data_batch=None) -> None:
    """The rule where Keras' `_maybe_symbolic_build` would build the model (the trainer seam calls it at every fit
    and evaluate): first the epoch's input is staged when the model's compiled execution stages it
    (`input_staging`); then a fully built model is left as it is (Keras makes a distributed iterator and
    all-reduces a batch to build nothing, about 100 ms per call on a CPU); else it is built from the input's
    shapes (`build_from_input`), a staged batch restored first.

    Example:
        >>> symbolic_build(model, epoch_iterator)      # what fit does under a tf_nvlink strategy
    """
    staging = input_staging(model) if epoch_iterator is not None else None
    if staging:
        restage_input(model, epoch_iterator, staging.depth, staging.transform, staging.to_device, staging.reuse_key)
    if trainer_seams.fully_built(model):
        return
    build_from_input(model, epoch_iterator, data_batch, restore=staging.restore if staging else None)


def build_from_input(model, epoch_iterator=None, data_batch=None, restore: Optional[Callable] = None) -> None:
    """Build `model` as Keras' `_maybe_symbolic_build` does, from the shapes of the epoch's input instead of a
    batch taken from a fresh iterator over it, and from the first replica's share of a given `data_batch` instead
    of the MEAN of all replicas' shares.

    Why: Keras takes one batch from a new iterator over the user's input only to read its shapes, and that
    iterator advances the user's input: a seeded `shuffle(reshuffle_each_iteration=True)` then yields another
    order every epoch than on one device, and a `from_generator` generator runs once more per fit. Without a
    strategy Keras builds the model when the step is traced, taking nothing. The input's element spec (the batch
    dimension left open) has the structure, feature shapes and dtypes the build needs. A dataset the user
    distributed has per-replica specs: its first batch is taken as before. Keras reduces per-replica batches with
    `strategy.reduce("MEAN")` only to get one batch whose shapes build the model, and that AddN fails when the
    shares differ in size (`batch_size=5` on 2 replicas); one replica's share has the same structure and feature
    shapes. `restore(batch)`, when given, turns a staged batch back into what the model takes.

    Example:
        >>> build_from_input(model, epoch_iterator)
    """
    if not trainer_seams.has_own_strategy(model):  # as Keras: build when the step is traced
        return
    strategy = model.distribute_strategy
    if epoch_iterator is not None:
        data_batch = _open_batch_specs(epoch_iterator.data_adapter.get_tf_dataset())
        if data_batch is None:  # the user's own distributed dataset
            for _, _, batches in epoch_iterator:
                data_batch = next(batches)
                break
    data_batch = tf.nest.map_structure(
        lambda value: strategy.experimental_local_results(value)[0]
        if isinstance(value, tf.distribute.DistributedValues) else value, data_batch)
    if restore is not None:
        data_batch = restore(data_batch)
    trainer_seams.symbolic_build(model, data_batch)


def _open_batch_specs(dataset):
    """The element spec of a host `dataset`, each part's batch dimension open (None for a distributed dataset)."""
    if isinstance(dataset, tf.distribute.DistributedDataset):
        return None

    def opened(spec):
        shape = spec.shape
        if shape.rank:
            shape = tf.TensorShape([None]).concatenate(shape[1:])
        return tf.TensorSpec(shape, spec.dtype) if isinstance(spec, tf.TensorSpec) else spec

    return tf.nest.map_structure(opened, dataset.element_spec)


# ---- the memory check: the staged batches must fit on the device -------------------------------------------

class StagedBatchesTooLarge(ValueError):
    """The batches of one execution do not fit on the device: `steps_per_execution` is too large."""


def _too_large_text(steps: int, needed: int, device: str, free: Optional[int]) -> str:
    where = f"{device} has {_size_text(free)} free" if free is not None else f"{device} ran out of memory"
    return (f"steps_per_execution={steps} stages {steps} batches on each replica's device at once, "
            f"{_size_text(needed)} per replica with their stacked copy and the next executions' batches, and "
            f"{where}. "
            f"Compile with a smaller steps_per_execution (e.g. {max(1, steps // 2)}), a smaller batch, or "
            f"tf_nvlink.strategy(compiled_execution=False) to run the steps one program each.")


def _size_text(size: int) -> str:
    return f"{size / 2**20:.1f} MiB ({size} bytes)"


class explained_oom:
    """Around an execution: TensorFlow's out-of-memory error of the FIRST program said as `StagedBatchesTooLarge`."""

    def __init__(self, execution, batch):
        self.execution, self.batch = execution, batch

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        if kind is not None and issubclass(kind, tf.errors.ResourceExhaustedError) \
                and self.execution.programs_run == 0:
            raise StagedBatchesTooLarge(_too_large_text(
                self.execution.steps, staged_bytes(self.execution.model, self.execution.steps, self.batch), "the device", None)
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


def staged_bytes(model, steps: int, batch) -> int:
    """Device bytes the input stages per replica at `steps` per execution: the execution's N batches and their
    stacked copy, the next execution's N taken ahead, and the batches prefetched (`input_depth`, N unless
    `input_buffer` is more).

    Example:
        >>> staged_bytes(model, 16, batch)
        822083584
    """
    depth = input_depth(model) or steps
    return (3 * steps + depth) * batch_bytes_per_replica(batch, model.distribute_strategy)


def check_staged_batches_fit(model, steps: int, batch) -> None:
    """Raise `StagedBatchesTooLarge` when the batches staged per replica do not fit on a replica's device.

    Example:
        >>> check_staged_batches_fit(model, model.steps_per_execution, first_batch)
    """
    needed = staged_bytes(model, steps, batch)
    for device in model.distribute_strategy.extended.worker_devices:
        free = tf_runtime.device_bytes_free(device)
        if free is not None and needed > free:
            raise StagedBatchesTooLarge(_too_large_text(steps, needed, device, free))

