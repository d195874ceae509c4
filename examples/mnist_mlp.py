r"""Train a 784-256-128-10 MLP on MNIST with the strategy tf_nvlink picks for this machine's GPUs.

    python examples/mnist_mlp.py                          # every GPU, all-reduce chosen from the topology
    python examples/mnist_mlp.py --gpus 0,1 --cross_device_ops nccl --num_packs 2
    python examples/mnist_mlp.py --dataset digits --epochs 2 --model_dir /tmp/quick

Without internet (and no cached ~/.keras/datasets/mnist.npz), --dataset auto falls back to the UCI handwritten
digits shipped with tf_nvlink; the start-up lines say which data set was used and why.

--batch_size is the GLOBAL batch: each of the N replicas gets batch_size / N examples per step. The digits set
is small (1,437 training images, 1.4 global batches of 1024), so it is repeated within each epoch until an epoch
has at least 10 steps (measured: 2 steps per epoch reach only 90-92% test accuracy in 10 epochs, 10 steps 96%);
the start-up lines say so.

<model_dir> gets checkpoints/ (the model after each epoch), backup/ (BackupAndRestore: rerun the same command
after a crash or kill, even SIGKILL, and training resumes after the last finished epoch; the backup is deleted
once model.keras is saved), model.keras (the final model), and logs/ for TensorBoard if the tensorboard package
is installed (TensorFlow 2.21 no longer installs it). Every file is written under a temporary name and renamed
into place, so a kill at any instant leaves the previous version, never a truncated file.
"""

import importlib.util
import logging
import math
import os
import sys
import time
from typing import NamedTuple

from absl import app
from absl import flags
import numpy as np

try:
    import tf_nvlink
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tf_nvlink
from tf_nvlink.tools import digits_data
from tf_nvlink.plan import policy
from tf_nvlink.util.replica_split import replica_split

# TensorFlow and Keras are imported by import_tensorflow(), when main() starts: --help and --helpfull stay fast.
keras = tf = safe_callbacks = bench_models = None


def import_tensorflow():
    """Import TensorFlow, Keras and the tf_nvlink modules that need them (once)."""
    global keras, tf, safe_callbacks, bench_models
    import keras  # noqa: PLC0415
    import tensorflow as tf  # noqa: PLC0415
    from tf_nvlink.training import callbacks as safe_callbacks  # noqa: PLC0415
    from tf_nvlink.tools import bench_models  # noqa: PLC0415


DEFAULT_MODEL_DIR = "/tmp/tf_nvlink_mnist"
MIN_STEPS_PER_EPOCH = 10  # a small training set is repeated within an epoch to fill at least this many batches

_GPUS = flags.DEFINE_string(
    "gpus", "all", "GPUs to mirror over: 'all' (every GPU TensorFlow sees), 'auto' (the largest NVLink-connected "
    "group), or nvidia-smi indices such as '0,1'. Without GPUs the model is mirrored over the CPU.")
_CROSS_DEVICE_OPS = flags.DEFINE_enum(
    "cross_device_ops", "auto", policy.OPS_CHOICES,
    "How gradients are all-reduced across replicas: 'auto' lets tf_nvlink choose from the NVLink/PCIe topology; "
    "'collective' is TensorFlow's MirroredStrategy default.")
_NUM_PACKS = flags.DEFINE_integer(
    "num_packs", None, "Gradient buffers per all-reduce for 'nccl'/'hierarchical' (0: no packing); "
    "unset: tf_nvlink's choice.", lower_bound=0)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 1024, "GLOBAL batch size, split across the replicas (any size: each trains by its share).",
    lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Training epochs.", lower_bound=1)
_STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch", None, "Global batches per epoch (unset: one pass over the training data, see the module "
    "doc for small data sets). Use a small value for quick runs.", lower_bound=1)
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", "", f"Directory for checkpoints/, logs/ (TensorBoard), backup/ (resume after a kill) and "
    f"model.keras. Empty: {DEFAULT_MODEL_DIR}.")
_DATASET = flags.DEFINE_enum(
    "dataset", "auto", digits_data.CHOICES,
    "'mnist' (Keras cache or download), 'digits' (offline UCI digits shipped with tf_nvlink, upsampled to "
    "28x28), or 'auto' (MNIST if cached or downloadable within a few seconds, else digits).")
_JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False, "Compile the train step with XLA (Keras compile(jit_compile=...)).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weight initialisation and shuffling.")
_MONITOR_NVLINK = flags.DEFINE_bool(
    "monitor_nvlink", False, "Measure NVLink traffic from NVML's counters during training (tf_nvlink.NVLinkMonitor): "
    "nvlink_gbps and nvlink_bytes_per_step in each epoch's line, and one line if NVLink carried far less than the "
    "all-reduce should.")


class EpochPlan(NamedTuple):
    """How one epoch walks the training data."""

    repeats: int  # passes over the training set per epoch (1, or more for small data sets)
    steps: int  # global batches per epoch
    examples: int  # training examples per epoch
    forever: bool  # --steps_per_epoch given: the training dataset repeats without end, Keras counts steps

    @classmethod
    def make(cls, num_examples, global_batch, steps_per_epoch=None, min_steps=MIN_STEPS_PER_EPOCH):
        """One pass per epoch, or enough passes for `min_steps` global batches; --steps_per_epoch overrides."""
        if steps_per_epoch is not None:
            return cls(1, steps_per_epoch, steps_per_epoch * global_batch, True)
        repeats = max(1, math.ceil(min_steps * global_batch / num_examples))
        return cls(repeats, math.ceil(repeats * num_examples / global_batch), repeats * num_examples, False)

    def note(self):
        return f", training set repeated {self.repeats}x per epoch (small data set)" if self.repeats > 1 else ""


def make_datasets(data, global_batch, repeats=1, forever=False, seed=0):
    """tf.data pipelines batched with the GLOBAL batch: (train, test). Keras splits each batch over replicas."""
    train = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    train = train.shuffle(len(data.x_train), seed=seed, reshuffle_each_iteration=True)
    train = train.repeat() if forever else train.repeat(repeats)
    train = train.batch(global_batch).prefetch(tf.data.AUTOTUNE)
    test = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test))
    test = test.batch(global_batch).prefetch(tf.data.AUTOTUNE)
    return train, test


def make_callbacks(model_dir):
    """A .keras checkpoint per epoch, the backup to resume from (both written atomically) and, if installed,
    TensorBoard.

    The checkpoint comes before the backup: the backup is the commit point, so a kill between the two redoes that
    epoch (and rewrites its checkpoint) rather than leaving a finished epoch without its checkpoint. TensorFlow 2.21
    no longer installs TensorBoard: without the `tensorboard` package no logs are written.
    """
    callbacks = [
        safe_callbacks.EpochCheckpoint(os.path.join(model_dir, "checkpoints")),
        safe_callbacks.AtomicBackupAndRestore(backup_dir(model_dir)),
    ]
    if tensorboard_installed():
        callbacks.append(keras.callbacks.TensorBoard(log_dir=os.path.join(model_dir, "logs")))
    return callbacks


def backup_dir(model_dir):
    return os.path.join(model_dir, "backup")


def tensorboard_installed():
    return importlib.util.find_spec("tensorboard") is not None


def epoch_timer():
    """A Keras callback that records each epoch's wall time in `seconds`."""

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []
            self._start = None

        def on_epoch_begin(self, epoch, logs=None):
            self._start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self._start)

    return EpochTimer()


def throughput_line(epoch_seconds, examples_per_epoch):
    """'training: N examples/s ...' from this run's epoch times, leaving out its first epoch (tracing) if it can."""
    if not epoch_seconds:
        return "training: no epoch left to run (the backup says training had already reached --epochs)"
    steady = epoch_seconds[1:] or epoch_seconds
    rate = examples_per_epoch * len(steady) / sum(steady)
    which = (f"over {len(steady)} epoch(s) after this run's first ({epoch_seconds[0]:.1f} s, incl. tracing)"
             if len(epoch_seconds) > 1 else "1 epoch, tracing included")
    return f"training: {rate:,.0f} examples/s {which}; {sum(epoch_seconds):.1f} s in all"


def evaluate_and_save(model, test, x_check, model_dir):
    """Test accuracy, then save model.keras and check that the reloaded file predicts the same on `x_check`."""
    _, accuracy = model.evaluate(test, verbose=0)
    print(f"test accuracy: {accuracy:.4f}", flush=True)
    path = os.path.join(model_dir, "model.keras")
    safe_callbacks.save_atomically(model, path)
    reloaded = keras.models.load_model(path)
    diff = float(np.max(np.abs(model.predict(x_check, verbose=0) - reloaded.predict(x_check, verbose=0))))
    if diff > 1e-4:
        raise RuntimeError(f"reloaded {path} predicts differently from the trained model (max |diff| {diff:.3g})")
    print(f"reloaded {path}: predictions on {len(x_check)} test images match (max |diff| {diff:.1e})")
    return accuracy


def make_strategy(gpus, cross_device_ops, num_packs):
    """tf_nvlink.strategy(), with a bad flag combination reported as a usage error; prints the plan."""
    # The plan is printed below; tf_nvlink's own INFO line would repeat it (its warnings still show).
    logging.getLogger("tf_nvlink").setLevel(logging.WARNING)
    try:
        strategy = tf_nvlink.strategy(gpus, cross_device_ops, num_packs)
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    print(tf_nvlink.current_plan().summary(), flush=True)
    return strategy


def check_model_dir(model_dir):
    """Create `model_dir` now, so that an unusable one is a usage error before training, not after an epoch."""
    try:
        os.makedirs(model_dir, exist_ok=True)
    except OSError as error:
        raise app.UsageError(f"--model_dir={model_dir!r} cannot be used: {error.strerror or error}. Give a "
                             f"directory this user can create or write to.") from error
    if not os.access(model_dir, os.W_OK | os.X_OK):
        raise app.UsageError(f"--model_dir={model_dir!r} is not writable by this user. Give a directory this user "
                             f"can write to.")
    try:
        return safe_callbacks.read_backup(backup_dir(model_dir))
    except ValueError as error:
        raise app.UsageError(str(error)) from error


def resume_line(model_dir, backup, epochs):
    """What a rerun after a kill says before training."""
    where = f"found {os.path.join(model_dir, 'backup')}: resuming"
    if backup.epochs_done >= epochs:
        return f"{where}: all {epochs} epochs had finished; evaluating and saving the model"
    return (f"{where} the interrupted run at epoch {backup.epochs_done + 1}/{epochs} "
            f"({backup.epochs_done} finished before it stopped)")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    model_dir, global_batch = _MODEL_DIR.value or DEFAULT_MODEL_DIR, _BATCH_SIZE.value
    strategy = make_strategy(_GPUS.value, _CROSS_DEVICE_OPS.value, _NUM_PACKS.value)
    import_tensorflow()
    backup = check_model_dir(model_dir)
    keras.utils.set_random_seed(_SEED.value)
    per_replica = replica_split(global_batch, strategy.num_replicas_in_sync)
    data = digits_data.load_mnist_or_fallback(_DATASET.value)
    print(f"dataset: {data.description}", flush=True)
    epoch = EpochPlan.make(len(data.x_train), global_batch, _STEPS_PER_EPOCH.value)
    print(f"replicas: {strategy.num_replicas_in_sync}, global batch {global_batch} = {per_replica}, "
          f"{epoch.steps} steps per epoch{epoch.note()}", flush=True)
    logs = "logs/ (TensorBoard)" if tensorboard_installed() else "no TensorBoard logs (pip install tensorboard)"
    print(f"model_dir: {model_dir}: checkpoints/, backup/, {logs}", flush=True)
    if backup is not None:
        print(resume_line(model_dir, backup, _EPOCHS.value), flush=True)

    train, test = make_datasets(data, global_batch, epoch.repeats, epoch.forever, seed=_SEED.value)
    with strategy.scope():
        model = bench_models.compiled_mnist_mlp(jit_compile=_JIT_COMPILE.value)
    timer = epoch_timer()
    model.fit(train, epochs=_EPOCHS.value, steps_per_epoch=_STEPS_PER_EPOCH.value, shuffle=False, verbose=2,
              callbacks=make_callbacks(model_dir) + [timer]
              + ([tf_nvlink.NVLinkMonitor()] if _MONITOR_NVLINK.value else []))
    print(throughput_line(timer.seconds, epoch.examples), flush=True)
    evaluate_and_save(model, test, data.x_test[:256], model_dir)
    safe_callbacks.delete_backup(backup_dir(model_dir))  # only now: until model.keras exists, a rerun resumes instead of starting over


if __name__ == "__main__":
    app.run(main)
