"""Keras' fit loop under a tf_nvlink strategy: an epoch runs the steps it asks for, and batch ends are dispatched
as Keras dispatches them on JAX.

The seams (`tf_nvlink.internals.trainer`, `tf_nvlink.internals.callbacks`) call `epoch_executions` for every
epoch and `batch_end_dispatch` for every `CallbackList` of a model under a tf_nvlink strategy.

Example:
    >>> count = steps_asked_for_this_call(model.steps_per_execution)    # inside a train function
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

from tf_nvlink.distribute import base, single_host
from tf_nvlink.internals import callbacks as callback_seams, trainer as trainer_seams
from tf_nvlink.plan import compile_cache
from tf_nvlink.training import thread_state

log = logging.getLogger("tf_nvlink")


def epoch_executions(epoch_iterator, keras_executions: Callable[[], Iterator]) -> Iterator:
    """The (first step, last step, iterator) of each execution of an epoch. With `steps_per_execution=N` Keras hands
    out executions of N steps whatever `steps_per_epoch` says (`steps_per_epoch=7` at N=5 runs 10 steps an epoch;
    the progress bar and callbacks say 5 and 10). Under a tf_nvlink strategy the last execution of an epoch is cut
    to the steps the epoch asks for: its last step is clamped, Keras' count of steps taken is corrected, and the
    function called for it reads the count (`steps_asked_for_this_call`). Other strategies run Keras' code."""
    steps = epoch_iterator.steps_per_execution
    if steps <= 1 or not base.is_tf_nvlink_strategy(trainer_seams.epoch_strategy(epoch_iterator)):
        yield from keras_executions()
        return
    limit = trainer_seams.epoch_step_limit(epoch_iterator)  # as Keras reads it when the epoch starts
    for begin, end, iterator in keras_executions():
        if 0 < limit <= end:
            end = limit - 1
            trainer_seams.uncount_epoch_steps(epoch_iterator, steps - (end - begin + 1))
        with thread_state.setting(steps_asked=end - begin + 1):
            yield begin, end, iterator


# What TensorFlow's iterators say at the end of their data (`errors::OutOfRange("End of sequence")` in tf.data's
# iterator ops, for datasets, generators and distributed iterators alike).
INPUT_END_MESSAGE = "End of sequence"


def input_end_or_raise(error) -> None:
    """The rule for an OutOfRangeError that Keras would take for the end of an epoch's input: returns when it is the
    input's end; otherwise raises, so that the epoch never ends as if the data had run out. TensorFlow returns
    OutOfRangeError for a compile-cache entry it cannot read ("Read less bytes than requested"), and on such an
    error the step did not run: `compile_cache.CompileCacheError` names the folder, the entries that look damaged
    and what to do (in tf_nvlink's own writable folder they are deleted, so the next run compiles them again).

    Example:
        >>> input_end_or_raise(tf.errors.OutOfRangeError(None, None, "End of sequence"))    # the input's end
    """
    message = getattr(error, "message", None) or str(error)
    if INPUT_END_MESSAGE in message:
        return
    raise compile_cache.read_failure(single_host.current_compile_cache(), message) from error


def steps_asked_for_this_call(default: int) -> int:
    """The steps the epoch asks of the train/test function being called now (`default` outside a hooked epoch):
    `steps_per_execution`, or fewer for the epoch's last execution.

    Example:
        >>> steps_asked_for_this_call(8)    # the last execution of steps_per_epoch=20 at N=8
        4
    """
    return thread_state.current().steps_asked or default


_BATCH_END_METHODS = {"train": ("on_batch_end", "on_train_batch_end"), "test": ("on_test_batch_end",),
                      "predict": ("on_predict_batch_end",)}


def callbacks_needing_batch_ends(callbacks, kind: str = "train") -> list[str]:
    """The class names of the user `callbacks` that keep the batch ends of `kind` ("train": fit, "test":
    evaluate, "predict") on the training thread by Keras' rule: not `async_safe`, and with their own method.

    Example:
        >>> callbacks_needing_batch_ends([keras.callbacks.ModelCheckpoint("m.keras")])
        []
    """
    return [type(callback).__name__ for callback in (callbacks if isinstance(callbacks, (list, tuple)) else ())
            if not getattr(callback, "async_safe", False)
            and any(callback_seams.overrides_batch_end(callback, method) for method in _BATCH_END_METHODS[kind])]


def batch_ends_dispatch_asynchronously(callbacks) -> tuple[bool, bool, bool]:
    """(train, test, predict): whether Keras' rule lets batch ends of fit, evaluate and predict run off the
    training thread with these user `callbacks`: each one is `async_safe` or leaves that batch-end method as
    Keras' default (`CallbackList._configure_async_dispatch`, without its backend check).

    Example:
        >>> batch_ends_dispatch_asynchronously([])
        (True, True, True)
    """
    return tuple(not callbacks_needing_batch_ends(callbacks, kind) for kind in ("train", "test", "predict"))


_NAMED_BLOCKING_CALLBACKS: set = set()  # the callback classes already named in this process (logged once each)


def batch_end_dispatch(callbacks) -> tuple[bool, bool, bool]:
    """The rule for a `CallbackList` of a model under a tf_nvlink strategy. Keras converts each call's logs to
    Python floats before the batch-end callbacks run, on the training thread unless the backend is marked
    thread-safe (JAX is; TensorFlow is not). On TensorFlow the host then waits for the GPU to finish every call
    before it launches the next, so the GPU idles while the host takes the next batches and launches the next
    program (between the compiled execution's programs, 1x H200: about 10 ms per call). Under a tf_nvlink strategy
    batch ends follow Keras' JAX rule (`batch_ends_dispatch_asynchronously`); callbacks that keep them on the
    training thread are named once."""
    new = sorted(set(callbacks_needing_batch_ends(callbacks, "train")) - _NAMED_BLOCKING_CALLBACKS)
    if new:
        _NAMED_BLOCKING_CALLBACKS.update(new)
        log.info("tf_nvlink: fit's batch ends run on the training thread because %s define(s) on_train_batch_end or "
                 "on_batch_end without async_safe = True: the host waits for the GPU to finish every call before "
                 "it launches the next. Set async_safe = True on a callback whose batch ends may run on another "
                 "thread (in order), or leave batch ends out of it.", ", ".join(new))
    return batch_ends_dispatch_asynchronously(callbacks)
