r"""A custom training loop with XLA under tf_nvlink: the seed 784-256-128-10 MLP on MNIST (or offline digits).

    python examples/custom_loop.py                                  # every GPU, XLA step, plan from the topology
    python examples/custom_loop.py --xla_allreduce split --epochs 2 --model_dir /tmp/loop
    python examples/custom_loop.py --dataset digits --epochs 2      # offline
    python examples/custom_loop.py --steps_per_execution 8          # 8 steps per XLA program per replica

The shape of TensorFlow's guide "Custom training with tf.distribute.Strategy": a `tf.function(jit_compile=True)`
step that computes the loss, its gradients and `optimizer.apply_gradients`, passed to `strategy.run` inside a
plain `tf.function` over one epoch. tf_nvlink compiles one copy of the step per replica: in "fused" mode (2+ GPUs)
the gradient all-reduce runs inside each replica's XLA program; in "split" mode (CPUs, or --xla_allreduce split)
XLA computes the gradients and the plan's cross-device ops all-reduce them outside XLA.

--steps_per_execution N > 1 runs N steps per call through `tf_nvlink.compiled_steps`: in fused mode (GPUs) the
N batches go to each replica together and one XLA program per replica loops over them, so the host launches one
program per N steps; in split mode the N steps run one `strategy.run` each. Both train as the per-step loop does.

--batch_size is the GLOBAL batch; the loss is averaged over it (`tf.nn.compute_average_loss`), so the summed
gradients equal one device's. <model_dir>/ckpt holds a tf.train.Checkpoint (model, optimizer, finished epochs)
after every epoch: rerun the same command and training resumes after the last finished epoch.
"""

import math
import os
import sys
import time

from absl import app
from absl import flags
import keras
import tensorflow as tf

try:
    import tf_nvlink
except ImportError:  # run from a source checkout without `pip install -e .`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tf_nvlink
from tf_nvlink.tools import digits_data
from tf_nvlink.tools import bench_models
from tf_nvlink.plan import policy
from tf_nvlink.util.replica_split import replica_split

DEFAULT_MODEL_DIR = "/tmp/tf_nvlink_custom_loop"
MIN_STEPS_PER_EPOCH = 10  # a small training set is repeated within an epoch to fill at least this many batches

_GPUS = flags.DEFINE_string(
    "gpus", "all", "GPUs to mirror over: 'all', 'auto' (the largest NVLink-connected group), or nvidia-smi "
    "indices such as '0,1'. Without GPUs the model is mirrored over the CPU.")
_CROSS_DEVICE_OPS = flags.DEFINE_enum(
    "cross_device_ops", "auto", policy.OPS_CHOICES,
    "How gradients are all-reduced outside XLA: 'auto' lets tf_nvlink choose from the NVLink/PCIe topology.")
_XLA_ALLREDUCE = flags.DEFINE_enum(
    "xla_allreduce", "auto", ["auto", "fused", "split"],
    "'fused': the whole step, gradient all-reduce included, is one XLA program per replica (GPUs only); "
    "'split': XLA computes the gradients, the cross-device ops all-reduce them; 'auto': fused on 2+ GPUs.")
_JIT_COMPILE = flags.DEFINE_bool("jit_compile", True, "Compile the train step with XLA.")
_STEPS_PER_EXECUTION = flags.DEFINE_integer(
    "steps_per_execution", 1, "Train steps per call: N > 1 runs N steps as one XLA program per replica "
    "(tf_nvlink.compiled_steps; fused mode), else one strategy.run per step.", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 1024, "GLOBAL batch size, split across the replicas (any size: the loss counts each replica's share).",
    lower_bound=1)
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Epochs to reach (a resumed run trains only the missing ones).",
                               lower_bound=1)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Adam's learning rate.", lower_bound=0.0)
_MODEL_DIR = flags.DEFINE_string("model_dir", "", f"Checkpoint directory. Empty: {DEFAULT_MODEL_DIR}.")
_DATASET = flags.DEFINE_enum(
    "dataset", "auto", digits_data.CHOICES,
    "'mnist' (Keras cache or download), 'digits' (offline UCI digits shipped with tf_nvlink), or 'auto'.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for weight initialisation and shuffling.")


def make_strategy(gpus, cross_device_ops, xla_allreduce):
    """tf_nvlink.strategy(); a bad flag combination is a usage error. Prints the plan (once)."""
    try:
        strategy = tf_nvlink.strategy(gpus, cross_device_ops, xla_allreduce=xla_allreduce)
    except ValueError as error:
        raise app.UsageError(str(error)) from error
    print(tf_nvlink.current_plan().summary(), flush=True)
    return strategy


def steps_per_epoch(num_examples, global_batch, min_steps=MIN_STEPS_PER_EPOCH):
    """(passes over the training set per epoch, global batches per epoch): one pass, or enough for min_steps."""
    repeats = max(1, math.ceil(min_steps * global_batch / num_examples))
    return repeats, repeats * num_examples // global_batch


class Trainer:
    """The model, its optimizer, the jit-compiled step and the per-epoch loop under one strategy."""

    def __init__(self, strategy, global_batch, learning_rate, jit_compile, steps_per_execution=1):
        self.strategy, self.global_batch = strategy, global_batch
        with strategy.scope():
            self.model = bench_models.mnist_mlp()
            self.optimizer = keras.optimizers.Adam(learning_rate)
            self.optimizer.build(self.model.trainable_variables)  # its variables exist before the first trace
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        self.train_step = tf.function(self._train_step, jit_compile=jit_compile)
        self.test_step = tf.function(self._test_step, jit_compile=jit_compile)
        self.train_steps = (tf_nvlink.compiled_steps(strategy, self.train_step, steps_per_execution)
                            if steps_per_execution > 1 else None)

    def _train_step(self, x, y):
        with tf.GradientTape() as tape:
            logits = self.model(x, training=True)
            loss = tf.nn.compute_average_loss(self.loss(y, logits), global_batch_size=self.global_batch)
        grads = tape.gradient(loss, self.model.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))
        return loss, self._correct(y, logits)

    def _test_step(self, x, y):
        return self._correct(y, self.model(x, training=False))

    @staticmethod
    def _correct(y, logits):
        return tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32),
                                              tf.cast(y, tf.int32)), tf.float32))

    @tf.function
    def train_epoch(self, batches):
        """Sum over one epoch of the global-batch losses, and the number of correct predictions."""
        loss, correct = tf.constant(0.0), tf.constant(0.0)
        for x, y in batches:
            step_loss, step_correct = self.strategy.run(self.train_step, args=(x, y))
            loss += self.strategy.reduce("SUM", step_loss, axis=None)
            correct += self.strategy.reduce("SUM", step_correct, axis=None)
        return loss, correct

    def train_epoch_in_executions(self, batches):
        """`train_epoch` with up to steps_per_execution steps per call (one XLA program per replica in fused mode)."""
        loss, correct, iterator = 0.0, 0.0, iter(batches)
        while True:
            sums, ran = self.train_steps(iterator)  # per replica: the losses and correct counts of `ran` steps
            if not ran:
                return loss, correct
            # Summed as tensors, read once per epoch: a float() here would make the host wait for every call
            # before launching the next, and the GPU would idle in between.
            loss += self.strategy.reduce("SUM", sums[0], axis=None)
            correct += self.strategy.reduce("SUM", sums[1], axis=None)

    @tf.function
    def count_correct(self, batches):
        correct = tf.constant(0.0)
        for x, y in batches:
            correct += self.strategy.reduce("SUM", self.strategy.run(self.test_step, args=(x, y)), axis=None)
        return correct


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    model_dir, global_batch = _MODEL_DIR.value or DEFAULT_MODEL_DIR, _BATCH_SIZE.value
    keras.utils.set_random_seed(_SEED.value)
    strategy = make_strategy(_GPUS.value, _CROSS_DEVICE_OPS.value, _XLA_ALLREDUCE.value)
    replicas = strategy.num_replicas_in_sync
    data = digits_data.load_mnist_or_fallback(_DATASET.value)
    repeats, steps = steps_per_epoch(len(data.x_train), global_batch)
    mode = strategy.xla_allreduce if _JIT_COMPILE.value and replicas > 1 else "off" if not _JIT_COMPILE.value \
        else "one replica"
    print(f"dataset: {data.description}\nreplicas: {replicas}, global batch {global_batch} = "
          f"{replica_split(global_batch, replicas)}, {steps} steps per epoch; XLA: {mode}"
          + (f"; {_STEPS_PER_EXECUTION.value} steps per call" if _STEPS_PER_EXECUTION.value > 1 else ""), flush=True)

    trainer = Trainer(strategy, global_batch, _LEARNING_RATE.value, _JIT_COMPILE.value, _STEPS_PER_EXECUTION.value)
    epochs_done = tf.Variable(0, trainable=False, dtype=tf.int64)  # outside the scope: one plain variable
    checkpoint = tf.train.Checkpoint(model=trainer.model, optimizer=trainer.optimizer, epochs_done=epochs_done)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(model_dir, "ckpt"), max_to_keep=3)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
        print(f"resumed from {manager.latest_checkpoint}: {int(epochs_done.numpy())} epoch(s) done", flush=True)

    train = (tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train))
             .shuffle(len(data.x_train), seed=_SEED.value).repeat(repeats)
             .batch(global_batch, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
    test = tf.data.Dataset.from_tensor_slices((data.x_test, data.y_test)).batch(global_batch)
    for epoch in range(int(epochs_done.numpy()), _EPOCHS.value):
        start = time.perf_counter()
        batches = strategy.experimental_distribute_dataset(train)
        loss, correct = (trainer.train_epoch_in_executions(batches) if trainer.train_steps is not None
                         else trainer.train_epoch(batches))
        seconds = time.perf_counter() - start
        epochs_done.assign(epoch + 1)
        path = manager.save()
        print(f"epoch {epoch + 1}/{_EPOCHS.value}: loss {float(loss) / steps:.4f}, accuracy "
              f"{float(correct) / (steps * global_batch):.4f}, {steps * global_batch / seconds:,.0f} examples/s "
              f"({seconds:.1f} s); saved {path}", flush=True)
    correct = trainer.count_correct(strategy.experimental_distribute_dataset(test))
    print(f"test accuracy: {float(correct) / len(data.x_test):.4f}", flush=True)


if __name__ == "__main__":
    app.run(main)
