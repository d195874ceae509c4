"""Seams in Keras' callbacks: how a `CallbackList` dispatches batch ends, `BackupAndRestore`'s save and load
steps, and the TensorBoard callback beside one of ours.

Checked against Keras 3.12 to 3.15.1 and keras-nightly 3.16.0.dev2026102704, TensorFlow 2.21; pinned in
tests/internals/test_callbacks_seams.py.

Example:
    >>> from tf_nvlink.internals import callbacks
    >>> callbacks.overrides_batch_end(keras.callbacks.History(), "on_train_batch_end")
    False
"""

from __future__ import annotations

import concurrent.futures
import sys

from tf_nvlink.internals.registry import REGISTRY


def _keras_callback_list_class():
    from keras.src.callbacks.callback_list import CallbackList  # noqa: PLC0415

    return CallbackList


def install_batch_end_dispatch_seam(rules) -> None:
    """Patch `CallbackList.__init__` once: for a model under a tf_nvlink strategy (`rules.is_ours`),
    `rules.batch_end_dispatch(callbacks)` gives (train, test, predict): whether the batch ends of fit, evaluate and
    predict run off the training thread, set in the private `_async_train`, `_async_test`, `_async_predict` that
    Keras' `_configure_async_dispatch` sets (on TensorFlow always False, by its backend check alone). Where any is
    true they run on one callback thread, in order (`_executor`, the pool Keras' `_on_begin` makes when none is
    there, has several)."""
    def patch(original):
        def __init__(self, callbacks=None, *args, model=None, **kwargs):
            original(self, callbacks, *args, model=model, **kwargs)
            if model is not None and rules.is_ours(getattr(model, "_distribute_strategy", None)):
                self._async_train, self._async_test, self._async_predict = rules.batch_end_dispatch(callbacks)
                if (self._async_train or self._async_test or self._async_predict) and self._executor is None:
                    self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                           thread_name_prefix="tf_nvlink_batch_ends")

        return __init__

    REGISTRY.patch(_keras_callback_list_class(), "__init__", patch)


def overrides_batch_end(callback, method: str) -> bool:
    """Whether `callback` defines the batch-end `method` itself rather than keeping Keras' default
    (`keras.src.utils.python_utils.is_default`, Keras' own test in `_configure_async_dispatch`)."""
    from keras.src.utils.python_utils import is_default  # noqa: PLC0415

    return not is_default(getattr(callback, method))


_BACKUP_BASE: list = []


def backup_and_restore_base():
    """`keras.callbacks.BackupAndRestore` with its private save/load steps as overridable public methods.

    Touches `_load_model` (at train begin), `_save_model` (at each epoch's end), `_current_epoch` and
    `_training_metadata_path`: tf_nvlink's `AtomicBackupAndRestore` keeps Keras' schedule and file names but writes
    every file atomically; Keras has no public seam for the writes. Subclasses define `load_backup()` and
    `save_backup(epoch, metadata_path)`. The class is made on first use (Keras is imported then).
    """
    if not _BACKUP_BASE:
        import keras  # noqa: PLC0415

        class BackupAndRestoreSeams(keras.callbacks.BackupAndRestore):
            def _load_model(self):
                self.load_backup()

            def _save_model(self):
                self.save_backup(self._current_epoch, self._training_metadata_path)

            def load_backup(self):
                raise NotImplementedError

            def save_backup(self, epoch: int, metadata_path: str):
                raise NotImplementedError

        _BACKUP_BASE.append(BackupAndRestoreSeams)
    return _BACKUP_BASE[0]


def tensorboard_log_dir_beside(callback) -> str | None:
    """The log_dir of a keras.callbacks.TensorBoard in the CallbackList calling `callback` now, or None.

    Keras gives a callback no view of its siblings; the CallbackList whose hook calls ours has them, so this
    walks up a few frames (the private `sys._getframe`) to the caller whose `self.callbacks` holds `callback`."""
    import keras  # noqa: PLC0415

    frame = sys._getframe(1)  # noqa: SLF001 - the callback hook that asks
    for _ in range(6):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        siblings = getattr(owner, "callbacks", None)
        if isinstance(siblings, list) and any(c is callback for c in siblings):
            for sibling in siblings:
                if isinstance(sibling, keras.callbacks.TensorBoard):
                    return sibling.log_dir
            return None
        frame = frame.f_back
    return None
