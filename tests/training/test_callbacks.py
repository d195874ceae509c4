"""tf_nvlink.training.callbacks.AtomicBackupAndRestore: the backup is consistent at every instant a kill can hit
the save, and a torn or hand-edited backup is refused naming the file (in the test process: a small model trained
on one device, no strategy)."""

import os

import numpy as np


class _Killed(BaseException):
    pass


def _kill_the_save_at_every_instant(backup):
    """The backup at every instant a kill can hit it: the interrupted save's temporary files are left behind (as a
    real kill leaves them), and a fresh model must resume from a consistent (epoch, weights) pair."""
    from tf_nvlink.plan import tune_cache
    from tf_nvlink.tools import bench_models
    from tf_nvlink.training import callbacks

    x = np.random.default_rng(0).random((64, 784)).astype("float32")
    y = np.arange(64) % 10

    def model():
        m = bench_models.compiled_mnist_mlp()
        m.build((None, 784))
        return m

    def weights(m):
        return [w.copy() for w in m.get_weights()]

    def resume():
        fresh, callback = model(), callbacks.AtomicBackupAndRestore(backup)
        callback.set_model(fresh)
        callback.on_train_begin()
        return fresh

    first = model()
    first.fit(x, y, epochs=1, verbose=0, callbacks=[callbacks.AtomicBackupAndRestore(backup)])
    after_1 = weights(first)
    first.fit(x, y, epochs=1, verbose=0)  # epoch 2's weights, not yet backed up
    after_2 = weights(first)
    out = {}
    for point in ["weights rename", "metadata rename", None]:  # the n-th os.replace of the save is killed
        real_replace, calls = os.replace, []

        def replace(src, dst, point=point):
            calls.append(dst)
            step = {"weights rename": 1, "metadata rename": 2}.get(point)
            if len(calls) == step:
                with open(src, "wb") as torn:  # a kill leaves the half-written temporary behind
                    torn.write(b"torn")
                raise _Killed()
            return real_replace(src, dst)

        tune_cache.os.replace = replace
        callback = callbacks.AtomicBackupAndRestore(backup)
        callback.set_model(first)
        callback._current_epoch = 2
        unlink = os.unlink
        os.unlink = lambda path: None  # a killed process cleans nothing up
        try:
            callback._save_model()
        except _Killed:
            pass
        finally:
            tune_cache.os.replace, os.unlink = real_replace, unlink
        resumed = resume()
        got = weights(resumed)
        out[str(point)] = {
            "epoch": resumed._initial_epoch,
            "weights_of": [e for e, w in ((1, after_1), (2, after_2))
                           if all(np.array_equal(a, b) for a, b in zip(got, w))],
            "files": sorted(os.listdir(backup)),
        }
    with open(os.path.join(backup, "training_metadata.json"), "w") as f:
        f.write('{"epoch": 2, "batch": 0, "weig')  # what Keras' own callback leaves after a kill mid-write
    try:
        callbacks.read_backup(backup)
        out["torn"] = "read?!"
    except ValueError as error:
        out["torn"] = str(error)
    for text in ['{"epoch": NaN, "weights": "epoch_0002.weights.h5"}',
                 '{"epoch": 1, "epoch": 2, "weights": "epoch_0002.weights.h5"}',
                 '{"epoch": 2, "weights": "../../etc/passwd"}', '{"epoch": -1}', '[2]']:
        with open(os.path.join(backup, "training_metadata.json"), "w") as f:
            f.write(text)
        try:
            callbacks.read_backup(backup)
            out[text] = "read?!"
        except ValueError as error:
            out[text] = str(error)
    return out


def test_backup_is_consistent_whenever_the_save_is_killed(tf, tmp_path):
    """The `tf` fixture: TensorFlow's devices are configured before this test runs a function (later tests in the
    same process count on the logical CPUs)."""
    backup = tmp_path / "backup"
    out = _kill_the_save_at_every_instant(str(backup))
    # Killed before either rename: epoch 1 and epoch 1's weights, whatever debris the kill left.
    assert out["weights rename"]["epoch"] == 1 and out["weights rename"]["weights_of"] == [1], out
    assert out["metadata rename"]["epoch"] == 1 and out["metadata rename"]["weights_of"] == [1], out
    assert "epoch_0002.weights.h5" in out["metadata rename"]["files"]  # renamed, but not yet the backup
    # The save that completes: epoch 2, its weights, and the debris of the killed saves is gone.
    assert out["None"]["epoch"] == 2 and out["None"]["weights_of"] == [2], out
    assert out["None"]["files"] == ["epoch_0002.weights.h5", "training_metadata.json"], out
    metadata = str(backup / "training_metadata.json")
    for key, message in out.items():
        if key not in ("weights rename", "metadata rename", "None"):
            assert message.startswith(f"{metadata} cannot be resumed from: ") and "Delete" in message, (key, message)


def test_backup_lets_fits_batch_ends_leave_the_training_thread_while_keras_int_frequency_keeps_them(tf, tmp_path):
    """Its batch end does nothing (epoch frequency), so it is async-safe by Keras' rule; Keras' BackupAndRestore
    with an int save_freq saves at batch ends and keeps them on the training thread."""
    import keras

    from tf_nvlink.training import fit_loop as internals
    from tf_nvlink.training import callbacks

    ours = callbacks.AtomicBackupAndRestore(str(tmp_path / "backup"))
    keras_every_10 = keras.callbacks.BackupAndRestore(str(tmp_path / "keras"), save_freq=10)
    assert internals.batch_ends_dispatch_asynchronously([ours]) == (True, True, True)
    assert internals.callbacks_needing_batch_ends([ours, keras_every_10], "train") == ["BackupAndRestore"]
    assert internals.batch_ends_dispatch_asynchronously([ours, keras_every_10])[0] is False
