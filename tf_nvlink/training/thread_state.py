"""What the step being traced (or the execution being run) in this thread has set for the Keras seams: tf_nvlink's
one thread-local.

Why a thread-local: Keras calls the functions tf_nvlink patches with their own arguments only (a loss value to
scale, an optimizer's `apply(grads)`, a metric's `update_state(values)`, a train function's `(iterator)`), so
the state of the step cannot be passed along with them, and MirroredStrategy traces each replica's copy of a
step in a thread of its own, at the same time. Each field says who sets it; everything is set for the length of
a `with setting(...)` block and put back after it.

Example:
    >>> with setting(loss_share=share):
    ...     logs = model.train_step(data)        # Keras' scale_loss_for_distribution reads current().loss_share
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Optional


@dataclasses.dataclass
class ThreadState:
    """The fields the rules read; None (or empty) when no step of tf_nvlink's is traced in this thread."""

    # exact_batches.loss_share_while_tracing: this replica's share of the step's examples (a float32 scalar
    # tensor), of its sample weights, and whether the weights had no single share (one tensor per output).
    loss_share: Any = None
    weight_share: Any = None
    weight_share_unknown: bool = False
    # exact_batches: the CompileLoss whose call runs now (its per-output loss metrics count by the share).
    compile_loss: Any = None
    # optimizer_rules.optimizer_calls: what `optimizer.apply` does while one replica's custom step is traced
    # ("catch": record the call; "replica_local": run it with the step counters per replica), the calls caught,
    # and whether an `apply` of ours runs already (an optimizer's apply calling another's runs as Keras' own).
    optimizer_mode: Optional[str] = None
    caught_updates: Optional[list] = None
    inside_apply: bool = False
    # optimizer_rules: gradients already all-reduced before Keras' apply (accumulation under merge_call); the
    # clip of the all-reduced gradients running now; the clip deferred until the accumulated mean is applied.
    gradients_reduced: bool = False
    clipping_reduced: bool = False
    clip_later: bool = False
    # sharded optimizer states, accumulation under merge_call: the owner's weights sent after Keras' cond
    send_weights_later: bool = False
    # replica_sync: the Keras variables the step wrote (id -> variable), while recording.
    written: Optional[dict] = None
    # fit_loop: the steps the epoch asks of the train/test function called now in this (the training) thread.
    steps_asked: Optional[int] = None
    # exact_batches.batch_opened: the batch size of the replica step traced now, which `open_batch_dimension`
    # hides from the trace (fused_attention needs it: XLA's custom calls take fully known shapes).
    static_batch: Optional[int] = None


_THREAD = threading.local()


def current() -> ThreadState:
    """This thread's state (a fresh one the first time a thread asks)."""
    state = getattr(_THREAD, "state", None)
    if state is None:
        state = _THREAD.state = ThreadState()
    return state


@contextlib.contextmanager
def setting(**fields):
    """Set `fields` of this thread's state while the block runs; the earlier values come back after it.

    Example:
        >>> with setting(optimizer_mode="catch", caught_updates=[]):
        ...     step(data)
    """
    state = current()
    saved = {name: getattr(state, name) for name in fields}
    for name, value in fields.items():
        setattr(state, name, value)
    try:
        yield state
    finally:
        for name, value in saved.items():
            setattr(state, name, value)
