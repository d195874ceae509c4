"""Pins of the Keras callback internals tf_nvlink.internals.callbacks relies on (Keras 3.12 to 3.16.dev)."""

import inspect


def test_batch_end_dispatch_of_callback_list():
    """Keras' async dispatch of CallbackList, off on TensorFlow by its backend check alone."""
    from keras.src.callbacks.callback_list import CallbackList

    from tf_nvlink.internals.registry import REGISTRY

    configure = inspect.getsource(CallbackList._configure_async_dispatch)
    for line in ("if not backend.IS_THREAD_SAFE:", 'getattr(cbk, "async_safe", False)',
                 "self._async_train = async_train", "self._async_test = async_test",
                 "self._async_predict = async_predict", "utils.is_default(cbk.on_train_batch_end)"):
        assert line in configure, line
    assert "if self._async_train:" in inspect.getsource(CallbackList.on_train_batch_end)
    assert "and self._executor is None" in inspect.getsource(CallbackList._on_begin)
    assert "self._executor.submit(fn, *args)" in inspect.getsource(CallbackList._async_dispatch)
    assert "self._flush_futures()" in inspect.getsource(CallbackList.on_epoch_end)
    assert "model=None" in inspect.getsource(REGISTRY.original(CallbackList, "__init__", CallbackList.__init__))


def test_backup_and_restore_steps():
    """AtomicBackupAndRestore overrides Keras' save and load steps and reads its epoch and metadata path."""
    import keras

    source = inspect.getsource(keras.callbacks.BackupAndRestore)
    for name in ("def _load_model(self):", "def _save_model(self):", "self._current_epoch",
                 "self._training_metadata_path"):
        assert name in source, name
