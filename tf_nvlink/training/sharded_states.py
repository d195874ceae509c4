"""Optimizer states sharded over the replicas: `tf_nvlink.strategy(optimizer_states="sharded")`.

Each trainable variable has one owning replica (`plan.optimizer_sharding.assign_owners`: whole variables, balanced
by size, over the strategy's local replicas). Its optimizer slots (momentums, velocities, ...) are created on the
owner's device only, as plain variables (`optimizer_slot`), and only the owner runs the optimizer's `update_step`
for it (`optimizer_update`); the other replicas then receive the owner's new weights:

- **merge_call path** (plain and split mode, where Keras updates in the strategy's cross-replica context, on one
  host): the owner's component of the mirrored weight is copied into the other components (a device-to-device
  copy of each weight, once per step).
- **no-merge_call path** (fused mode, inside each replica's XLA program; gradient accumulation under tf_nvlink):
  each replica sends its new value of the weights it owns and zeros for the others in one batched
  `all_reduce(SUM)` (TensorFlow has no public reduce-scatter or broadcast among replicas), and assigns the sum:
  x + 0 = x exactly, so every replica holds the owner's weights bit for bit.

The gradients are all-reduced as before (every replica needs only its owned ones, but TensorFlow's replica
context offers no reduce-scatter). Gradient accumulators stay replicated (each replica accumulates the
all-reduced gradients), as do the optimizer's step counters and the weight decay of AdamW (applied to every
replica's copy of the weight, the same on each). What is refused, and why: `check_shardable`.

Example:
    >>> strategy = tf_nvlink.strategy(optimizer_states="sharded")
    >>> with strategy.scope():
    ...     model.compile(optimizer="adam", loss="mse")
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import optimizer as optimizer_seams
from tf_nvlink.plan import optimizer_sharding
from tf_nvlink.training import thread_state

log = logging.getLogger("tf_nvlink")
SHARDABLE = optimizer_sharding.SHARDABLE
_OWNERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SLOT_BYTES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # optimizer -> {variable index: slot bytes}
_LOGGED: "weakref.WeakSet" = weakref.WeakSet()  # sharded optimizers whose memory line was logged
_LOGGED_LOCK = threading.Lock()
_NOT_CHECKED = ("its update with each replica updating only the variables it owns is not checked against one "
                "device (a subclass of a Keras optimizer may read state of other variables too)")
_NOT_SHARDABLE = {
    "Adafactor": "its factored second moments are variables of its own (`add_variable`), not slots of a reference "
                 "variable: they would stay mirrored with only the owner's copy updated, and a checkpoint, which "
                 "reads replica 0's copy, could save a stale one",
    "Muon": "it updates some variables with AdamW and others by orthogonalising whole matrices; not checked exact",
    "ScheduleFreeAdamW": "its update keeps and swaps extra copies of the weights; not checked exact",
}


def shards(optimizer) -> bool:
    """Whether `optimizer`'s states are sharded (a tf_nvlink strategy asked for it, with 2+ local replicas).

    Example:
        >>> shards(model.optimizer)
        True
    """
    return base.shards_optimizer_states(optimizer_seams.optimizer_strategy(optimizer))


def check_shardable(optimizer) -> None:
    """ValueError unless sharded states keep `optimizer`'s update one device's: a Keras optimizer of SHARDABLE
    (the class itself, not a subclass, whose update may read other state), without `use_ema`.

    Example:
        >>> check_shardable(keras.optimizers.Adam())
    """
    import keras  # noqa: PLC0415

    name = type(optimizer).__name__
    if getattr(keras.optimizers, name, None) is not type(optimizer) or name not in SHARDABLE:
        raise ValueError(
            f"optimizer_states='sharded' does not support the optimizer {name}: "
            f"{_NOT_SHARDABLE.get(name, _NOT_CHECKED)}. Use one of {list(SHARDABLE)}, or "
            f"tf_nvlink.strategy(optimizer_states='replicated').")
    if getattr(optimizer, "use_ema", False):
        raise ValueError(
            f"optimizer_states='sharded' does not support use_ema=True ({name}): Keras overwrites every replica's "
            f"weights with the moving averages on every replica, which would need the averages replicated. Use "
            f"use_ema=False, or tf_nvlink.strategy(optimizer_states='replicated').")


def owners(optimizer) -> tuple:
    """The owning replica of each of the optimizer's trainable variables (in its order), computed once per list.

    Example:
        >>> owners(model.optimizer)
        (0, 1, 1, 0)
    """
    variables = optimizer_seams.optimizer_trainable_variables(optimizer)
    key = tuple(id(v) for v in variables)
    cached = _OWNERS.get(optimizer)
    if cached is None or cached[0] != key:
        sizes = [_variable_bytes(v) for v in variables]
        replicas = len(optimizer_seams.optimizer_strategy(optimizer).extended.worker_devices)
        cached = (key, optimizer_sharding.assign_owners(sizes, replicas))
        _OWNERS[optimizer] = cached
    return cached[1]


def owner_of(optimizer, variable) -> int:
    """The replica that owns `variable` (a trainable variable of the optimizer, or a component of one)."""
    return owners(optimizer)[optimizer_seams.variable_index(optimizer, variable)]


def _variable_bytes(variable) -> int:
    return int(tf.TensorShape(variable.shape).num_elements()) * tf.as_dtype(variable.dtype).size


def optimizer_slot(optimizer, reference, name, initializer, keras_add: Callable):
    """The rule for every slot Keras creates (`add_variable_from_reference`): under sharded states, on the owner's
    device alone; gradient accumulators stay replicated (each replica adds the all-reduced gradients). Under any
    tf_nvlink strategy the slot's bytes are recorded for `memory_table`."""
    sharded = shards(optimizer) and name != "gradient_accumulator"
    if sharded:
        check_shardable(optimizer)
    if base.is_tf_nvlink_strategy(optimizer_seams.optimizer_strategy(optimizer)) and name not in (
            "gradient_accumulator", "average"):  # EMA averages are made before the variables are indexed
        recorded = _SLOT_BYTES.setdefault(optimizer, {})
        index = optimizer_seams.variable_index(optimizer, reference)
        recorded[index] = recorded.get(index, 0) + _variable_bytes(reference)
    if not sharded:
        return keras_add()
    device = optimizer_seams.optimizer_strategy(optimizer).extended.worker_devices[owner_of(optimizer, reference)]
    return optimizer_seams.add_variable_on_one_device(optimizer, reference, name, initializer, device)


def memory_table(optimizer, replicas: int | None = None, device_bytes: int | None = None) -> dict:
    """Bytes on the fullest replica of a built optimizer's weights, gradients and optimizer states, replicated and
    sharded over `replicas` (default: its strategy's local replicas), as `optimizer_sharding.memory_rows` gives
    them: the slots by owner, everything else the optimizer keeps (step counters, accumulators) whole; with
    `device_bytes` (one GPU's memory), whether each fits. `optimizer_sharding.format_memory_table` prints it.
    Built under a tf_nvlink strategy (the slots are recorded as they are created).

    Example:
        >>> print(optimizer_sharding.format_memory_table(memory_table(model.optimizer), 2))
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    variables = optimizer_seams.optimizer_trainable_variables(inner)
    replicas = replicas or len(optimizer_seams.optimizer_strategy(inner).extended.worker_devices)
    slots = _SLOT_BYTES.get(inner, {})
    states = [slots.get(index, 0) for index in range(len(variables))]
    others = sum(_variable_bytes(v) for v in optimizer.variables) - sum(states)
    return optimizer_sharding.memory_rows([_variable_bytes(v) for v in variables], states, replicas,
                                          other_state_bytes=others, device_bytes=device_bytes)


def _log_memory_once(optimizer) -> None:
    """One INFO line per sharded optimizer, at its first update (its slots are all made by then): its optimizer
    states per replica, replicated and sharded (`optimizer_sharding.summary_line`)."""
    with _LOGGED_LOCK:  # fused mode traces every replica's update in its own thread
        if optimizer in _LOGGED:
            return
        _LOGGED.add(optimizer)
    log.info("%s", optimizer_sharding.summary_line(memory_table(optimizer)))


def optimizer_update(optimizer, distribution, grads_and_vars, learning_rate, keras_update: Callable):
    """The rule for Keras' per-variable update loop: under sharded states, `update_step` on the owner's component
    only, then every replica gets the owner's new weights (the module doc says how on each path)."""
    if not shards(optimizer):
        return keras_update()
    check_shardable(optimizer)
    _log_memory_once(optimizer)
    pairs = [(g, v) for g, v in grads_and_vars if g is not None]
    if tf.distribute.get_replica_context() is None:
        _update_in_cross_replica_context(optimizer, distribution, pairs, learning_rate)
    else:
        _update_in_each_replica(optimizer, distribution, pairs, learning_rate)
    return None


def _update_in_cross_replica_context(optimizer, distribution, pairs, learning_rate) -> None:
    for grad, var in pairs:
        owner_part = distribution.experimental_local_results(var)[owner_of(optimizer, var)]

        def step(part, g, lr, owner_part=owner_part):
            if part is owner_part:
                optimizer.update_step(g, part, lr)

        distribution.extended.update(var, step, args=(grad, learning_rate), group=False)
        _copy_from_owner(optimizer, distribution, var)


def _copy_from_owner(optimizer, distribution, var) -> None:
    """In the cross-replica context: the owner's component of `var` copied into the others (through
    `extended.update`, each copy on its component's device; direct assigns failed in Keras' multi-step loop)."""
    owner_part = distribution.experimental_local_results(var)[owner_of(optimizer, var)]

    def copy(part):
        if part is not owner_part:
            part.assign(owner_part.read_value())

    distribution.extended.update(var, copy, group=False)


def send_owned_weights(optimizer, variables) -> None:
    """From each replica of a step, outside Keras' accumulation cond (merge_call allowed): the owners' weights
    copied to every replica. Gradient accumulation under merge_call updates inside Keras' cond on the no-merge_call
    path, where an all-reduce fails in Keras' multi-step loop; the update there sends nothing
    (`thread_state.send_weights_later`), and this sends every step (an unchanged weight copies itself: exact).

    Example:
        >>> send_owned_weights(optimizer, trainable_variables)
    """
    owner = getattr(optimizer, "inner_optimizer", optimizer)  # a LossScaleOptimizer's slots are its inner one's

    def copy_all(distribution):
        for var in variables:
            _copy_from_owner(owner, distribution, getattr(var, "value", var))

    tf.distribute.get_replica_context().merge_call(copy_all)


def _update_in_each_replica(optimizer, distribution, pairs, learning_rate) -> None:
    local = []  # (this replica's component, whether it owns it)
    for grad, var in pairs:
        owner_part = distribution.experimental_local_results(var)[owner_of(optimizer, var)]

        def step(part, g, lr, owner_part=owner_part):
            local.append((part, part is owner_part))
            if part is owner_part:
                optimizer.update_step(g, part, lr)

        distribution.extended.update(var, step, args=(grad, learning_rate), group=False)
    if not local or thread_state.current().send_weights_later:
        return
    sent = [part.read_value() if mine else tf.zeros(part.shape, part.dtype) for part, mine in local]
    received = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, sent)
    for (part, _), value in zip(local, received):
        part.assign(value)
