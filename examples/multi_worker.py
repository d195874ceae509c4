r"""Train the 784-256-128-10 MLP on several workers (hosts) with MultiWorkerMirroredStrategy, the all-reduce of each
worker chosen from its own GPUs and links by tf_nvlink.

Every worker runs this same program; TF_CONFIG tells each one the cluster and which task it is. Two workers on
one host (two shells; only the task index differs):

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 0}}' python examples/multi_worker.py --dataset digits
    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 1}}' python examples/multi_worker.py --dataset digits

Each worker waits up to --peer_timeout seconds for the others to start, then they train in lockstep. Without
TF_CONFIG (or with a single worker in it) the program trains on this host alone.

--batch_size is the GLOBAL batch: each step, each of the N workers x G GPUs replicas gets batch_size / (N x G)
examples (every worker reads its own shard of the data). The chief (task "chief", or worker 0 without one)
writes <model_dir>/model.keras; the other workers save to a temporary directory they delete afterwards (every
worker must take part in saving, since saving may all-reduce variables). Every worker prints a checksum of its
final weights: they are equal when the workers trained in sync.

Resuming: after every epoch the chief writes a backup to <model_dir>/backup (atomically: a kill at any instant
leaves the last finished epoch). If the run dies, start every worker again with the same command: all of them
load the chief's backup and continue after the last finished epoch. Every worker must therefore reach the chief's
<model_dir> (shared storage on several hosts); workers that would resume from different epochs stop with an error
naming each one's epoch instead of hanging. The backup is deleted once model.keras is saved.
"""

import hashlib
import math
import os
import shutil
import sys
import tempfile

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

try:
    import tf_nvlink
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tf_nvlink
from tf_nvlink.util import atomic_files
from tf_nvlink.util.replica_split import replica_split
from tf_nvlink.training import callbacks as safe_callbacks
from tf_nvlink.tools import digits_data
from tf_nvlink.tools import bench_models
from tf_nvlink.distribute import multi_worker, rendezvous
from tf_nvlink.machine import cluster_config

DEFAULT_MODEL_DIR = "/tmp/tf_nvlink_multi_worker"

_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 256, "GLOBAL batch size over all workers and their GPUs (any size: each replica "
    "trains by its share of the examples).", lower_bound=1)
_STEPS_PER_EPOCH = flags.DEFINE_integer(
    "steps_per_epoch", None, "Global batches per epoch (unset: one pass over the training data).", lower_bound=1)
_MODEL_DIR = flags.DEFINE_string(
    "model_dir", "", f"Where the chief writes model.keras (empty: {DEFAULT_MODEL_DIR}). Use a directory every host "
    "can reach, or the chief's local disk.")
_DATASET = flags.DEFINE_enum(
    "dataset", "auto", digits_data.CHOICES,
    "'mnist' (Keras cache or download), 'digits' (offline UCI digits shipped with tf_nvlink), or 'auto' "
    "(MNIST if cached or downloadable within a few seconds, else digits). Every worker must load the same one.")
_PEER_TIMEOUT = flags.DEFINE_float(
    "peer_timeout", rendezvous.DEFAULT_PEER_TIMEOUT_S,
    "Seconds to wait for every other worker in TF_CONFIG to accept connections before giving up.", lower_bound=0.1)
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weight initialisation and shuffling (the same on every worker).")
_JIT_COMPILE = flags.DEFINE_bool(
    "jit_compile", False, "Compile the train step with XLA (Keras compile(jit_compile=...)); its programs are kept "
    "in the compile cache, so a rerun of the same command reads them instead of compiling.")


def make_strategy(peer_timeout_s):
    """The strategy, built before any other TensorFlow op (MultiWorkerMirroredStrategy must be); prints its plan."""
    try:
        strategy = tf_nvlink.strategy(peer_timeout_s=peer_timeout_s)  # reads TF_CONFIG
    except cluster_config.TfConfigError as error:
        raise app.UsageError(str(error)) from error
    except rendezvous.PeerUnreachableError as error:
        sys.exit(f"multi_worker.py: {error}")
    print(strategy.plan.summary(), flush=True)
    return strategy


def make_datasets(data, global_batch, seed=0):
    """Training data repeated without end (every worker runs the same number of steps) and the test data, batched
    with the GLOBAL batch and sharded by element: the strategy gives each worker its part of each batch."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    train = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
    train = train.shuffle(len(data.x_train), seed=seed, reshuffle_each_iteration=True).repeat()
    train = train.batch(global_batch, drop_remainder=True).with_options(options).prefetch(tf.data.AUTOTUNE)
    test = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test)).batch(global_batch)
    return train, test.with_options(options)


def weights_checksum(model):
    """sha256 (first 16 hex digits) of the model's weights, and their number: equal on workers in sync."""
    digest = hashlib.sha256()
    count = 0
    for weights in model.get_weights():
        digest.update(np.ascontiguousarray(weights, dtype=np.float32).tobytes())
        count += weights.size
    return digest.hexdigest()[:16], count


def save_model(model, strategy, model_dir):
    """The standard MultiWorkerMirroredStrategy save: every worker saves, only the chief's copy is kept."""
    if strategy.extended.should_checkpoint:
        os.makedirs(model_dir, exist_ok=True)
        path = os.path.join(model_dir, "model.keras")
        with atomic_files.atomic_path(path, suffix=".keras") as partial:  # a kill mid-save leaves the old model.keras
            model.save(partial)
        return path
    scratch = tempfile.mkdtemp(prefix="tf_nvlink_worker_")
    try:
        with atomic_files.atomic_path(os.path.join(scratch, "model.keras"), suffix=".keras") as partial:
            model.save(partial)  # the same collective save as the chief's, into a folder deleted below
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return None


def read_shared_backup(strategy, backup_dir):
    """The chief's backup this run resumes from (None: start over), the same on every worker or an error."""
    try:
        backup = safe_callbacks.read_backup(backup_dir)
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    if isinstance(getattr(strategy, "plan", None), multi_worker.MultiWorkerPlan):
        multi_worker.check_same_everywhere(
            strategy, "resume_epoch", backup.epochs_done if backup else 0, timeout_s=_PEER_TIMEOUT.value,
            hint=f"Every worker resumes from the chief's backup in {backup_dir}: put --model_dir on storage every "
                 f"worker reaches, or delete the backup on every worker to start over.")
    return backup


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    strategy = make_strategy(_PEER_TIMEOUT.value)  # first: before any other TensorFlow op
    keras.utils.set_random_seed(_SEED.value)
    replicas, global_batch = strategy.num_replicas_in_sync, _BATCH_SIZE.value
    data = digits_data.load_mnist_or_fallback(_DATASET.value)
    steps = _STEPS_PER_EPOCH.value or math.ceil(len(data.x_train) / global_batch)
    print(f"dataset: {data.description}", flush=True)
    print(f"replicas: {replicas}, global batch {global_batch} = {replica_split(global_batch, replicas)}, "
          f"{steps} steps per epoch", flush=True)

    model_dir = _MODEL_DIR.value or DEFAULT_MODEL_DIR
    backup_dir = os.path.join(model_dir, "backup")
    backup = read_shared_backup(strategy, backup_dir)
    if backup is not None:
        print(f"found {backup_dir}: resuming at epoch {min(backup.epochs_done + 1, _EPOCHS.value)}/{_EPOCHS.value} "
              f"({backup.epochs_done} finished before the run stopped)", flush=True)

    train, test = make_datasets(data, global_batch, seed=_SEED.value)
    with strategy.scope():
        model = bench_models.compiled_mnist_mlp(jit_compile=_JIT_COMPILE.value)
    chief = strategy.extended.should_checkpoint
    resume = safe_callbacks.AtomicBackupAndRestore(backup_dir, write=chief)  # the chief writes, everyone restores
    history = model.fit(train, epochs=_EPOCHS.value, steps_per_epoch=steps, shuffle=False,
                        verbose=2 if chief else 0, callbacks=[resume])
    losses = history.history.get("loss", [])
    print(f"loss per epoch: {' '.join(f'{loss:.4f}' for loss in losses)}", flush=True)
    _, accuracy = model.evaluate(test, verbose=0)
    print(f"test accuracy: {accuracy:.4f}", flush=True)
    checksum, count = weights_checksum(model)
    print(f"final weights: sha256 {checksum} ({count:,} parameters)", flush=True)
    path = save_model(model, strategy, model_dir)
    print(f"saved {path}" if path else "not the chief: saved to a temporary directory, deleted", flush=True)
    if chief:
        safe_callbacks.delete_backup(backup_dir)  # only now: until model.keras exists, a rerun resumes


if __name__ == "__main__":
    app.run(main)
