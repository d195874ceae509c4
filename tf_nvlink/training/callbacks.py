"""Keras callbacks that survive SIGKILL: per-epoch checkpoints and a resumable backup, both written atomically.

Example:
    >>> from tf_nvlink.training import callbacks
    >>> model.fit(data, epochs=10, callbacks=[callbacks.EpochCheckpoint("run/checkpoints"),
    ...                                        callbacks.AtomicBackupAndRestore("run/backup")])
    >>> # killed at any instant? Rerun the same command: training resumes after the last finished epoch.
"""

import json
import os
import re
import shutil
from typing import NamedTuple, Optional

import keras

from tf_nvlink.internals import callbacks as callback_seams, trainer as trainer_seams
from tf_nvlink.util import atomic_files
from tf_nvlink.util.strict_json import strict_loads


def save_atomically(model, path):
    """model.save(path), written under a temporary name beside it and renamed: a kill leaves the old file or none."""
    with atomic_files.atomic_path(path, suffix=".keras") as partial:
        model.save(partial)


def _remove_partials(directory):
    """Temporary files a killed save left behind (atomic_files.atomic_path names them ".<name>.<random>.tmp<suffix>")."""
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(".") and ".tmp" in name:
                os.remove(os.path.join(directory, name))


class EpochCheckpoint(keras.callbacks.Callback):
    """<directory>/epoch_NNN.keras after every epoch, like keras.callbacks.ModelCheckpoint, but written atomically."""

    def __init__(self, directory):
        super().__init__()
        self.directory = directory

    def on_train_begin(self, logs=None):
        _remove_partials(self.directory)

    def on_epoch_end(self, epoch, logs=None):
        os.makedirs(self.directory, exist_ok=True)
        save_atomically(self.model, os.path.join(self.directory, f"epoch_{epoch + 1:03d}.keras"))


class Backup(NamedTuple):
    """What backup/training_metadata.json says: epochs finished, and the weights file holding their result."""

    epochs_done: int
    weights: str


_BACKUP_WEIGHTS = re.compile(r"epoch_\d+\.weights\.h5|latest\.weights\.h5")


def read_backup(directory) -> Optional[Backup]:
    """The backup in `directory`, None when there is none; ValueError naming the file when it cannot be used.

    The metadata is parsed strictly (no NaN, no duplicate keys, every field checked). Backups written by Keras'
    own BackupAndRestore ({"epoch": N, "batch": 0} beside latest.weights.h5) are read too.
    """
    path = os.path.join(directory, "training_metadata.json")
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(1 << 16)
    except FileNotFoundError:
        return None
    try:
        data = strict_loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"it holds a JSON {type(data).__name__}, not an object")
        epochs_done, weights = data.get("epoch"), data.get("weights", "latest.weights.h5")
        if isinstance(epochs_done, bool) or not isinstance(epochs_done, int) or epochs_done < 0:
            raise ValueError(f"'epoch' should be a non-negative integer. Received: {epochs_done!r}")
        if not isinstance(weights, str) or not _BACKUP_WEIGHTS.fullmatch(weights):
            raise ValueError(f"'weights' should name a weights file of this backup. Received: {weights!r}")
        if not os.path.isfile(os.path.join(directory, weights)):
            raise ValueError(f"the weights file it names, {weights}, is missing")
    except ValueError as error:
        raise ValueError(f"{path} cannot be resumed from: {error}. Delete {directory} to start training over."
                         ) from None
    return Backup(epochs_done, weights)


class AtomicBackupAndRestore(callback_seams.backup_and_restore_base()):
    """keras.callbacks.BackupAndRestore whose backup is usable whenever the process dies, even by SIGKILL.

    Keras rewrites backup/latest.weights.h5 and then training_metadata.json in place: a kill during either write
    leaves a truncated file, and the next run fails to start (json.JSONDecodeError, or OSError from HDF5); a kill
    between the two pairs one epoch's weights with the previous epoch's count. Here each epoch's weights go to
    their own file, written under a temporary name and renamed; training_metadata.json, replaced atomically last,
    names the weights it belongs to; older weights are deleted after. Whenever the process dies, the backup is the
    last finished epoch. The backup stays after training (main deletes it once model.keras is saved), so a kill
    between the last epoch and the final save loses nothing either.
    """

    # Its batch end does nothing at save_freq="epoch" (Keras' BackupAndRestore saves there only at an int
    # save_freq), so fit's batch ends may leave the training thread with it in the list (Keras' rule).
    async_safe = True

    def __init__(self, directory, write=True):
        super().__init__(backup_dir=directory, save_freq="epoch", delete_checkpoint=False)
        self.write = write  # False on the non-chief workers of a multi-worker run: they resume, the chief writes

    def load_backup(self):
        backup = read_backup(self.backup_dir)
        if backup is None:
            return
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)  # so the optimizer's state loads too
        self.model.load_weights(os.path.join(self.backup_dir, backup.weights))
        trainer_seams.set_initial_epoch(self.model, backup.epochs_done)  # what keras.callbacks.BackupAndRestore does

    def save_backup(self, epoch: int, metadata_path: str):
        if not self.write:
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        weights = f"epoch_{epoch:04d}.weights.h5"
        with atomic_files.atomic_path(os.path.join(self.backup_dir, weights), suffix=".weights.h5") as partial:
            self.model.save_weights(partial)
        metadata = {"epoch": epoch, "batch": 0, "weights": weights}
        atomic_files.write_atomic(metadata_path, json.dumps(metadata) + "\n", mode=None)
        for name in os.listdir(self.backup_dir):  # only now: until the rename above, the old pair is the backup
            if name != weights and (_BACKUP_WEIGHTS.fullmatch(name) or (name.startswith(".") and ".tmp" in name)):
                os.remove(os.path.join(self.backup_dir, name))


def delete_backup(directory):
    """Remove the backup folder after the final save: the metadata first, so a kill mid-way never leaves a
    broken backup."""
    try:
        os.remove(os.path.join(directory, "training_metadata.json"))
    except FileNotFoundError:
        pass
    shutil.rmtree(directory, ignore_errors=True)
