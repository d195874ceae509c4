"""A custom training loop against `model.fit`: the same ResNet-50 step under `tf_nvlink.strategy()`, in ONE process.

- `fit`: `model.compile(jit_compile=True)`, then the wall time of a whole `model.fit(steps_per_epoch=S)` call;
- `loop`: TensorFlow's custom-training guide shape: a `tf.function(jit_compile=True)` step that calls
  `optimizer.apply_gradients`, passed to `strategy.run` inside a plain `tf.function`, called once per batch from a
  Python loop over the distributed dataset; timed over S steps up to the loss of the last one on the host.

Both read the same synthetic batch (uint8 images from host memory through tf.data, cast on the GPU), with the
`mixed_bfloat16` policy and SGD(0.1, momentum 0.9). Rounds interleave; the table gives each one's median round
and the spread (max - min) / median. On several GPUs the strategy runs fused mode: the loop's step is compiled per
replica with the all-reduce inside XLA, as fit's is.

    python benchmarks/custom_loop_vs_fit.py --rounds 3 --steps 60 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch_per_gpu", type=int, default=128)
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "tiny"), help="tiny: a CPU smoke run")
    parser.add_argument("--json", default="")
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    import tf_nvlink

    strategy = tf_nvlink.strategy()
    plan = tf_nvlink.current_plan()
    print(plan.summary(), flush=True)
    import keras

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    n = strategy.num_replicas_in_sync
    global_batch = args.batch_per_gpu * n
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(global_batch, args.image, args.image, 3), dtype=np.uint8)
    y = rng.integers(0, 1000, size=(global_batch,)).astype("int32")
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(8)

    def build():
        inputs = keras.Input(shape=(args.image, args.image, 3), dtype="uint8")
        h = keras.layers.Rescaling(1.0 / 255)(inputs)
        if args.model == "resnet50":
            outputs = keras.applications.ResNet50(weights=None, input_shape=(args.image, args.image, 3))(h)
        else:
            h = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(8, 3, activation="relu")(h))
            outputs = keras.layers.Dense(1000, activation="softmax", dtype="float32")(h)
        return keras.Model(inputs, outputs)

    with strategy.scope():
        fit_model = build()
        fit_model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                          loss=keras.losses.SparseCategoricalCrossentropy(), jit_compile=True)
        loop_model = build()
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        loss_object = keras.losses.SparseCategoricalCrossentropy(reduction="none")

    @tf.function(jit_compile=True)
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            per_example = loss_object(labels, loop_model(images, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, loop_model.trainable_variables)
        optimizer.apply_gradients(zip(grads, loop_model.trainable_variables))
        return loss

    @tf.function
    def distributed_train_step(batch):
        losses = strategy.run(train_step, args=batch)
        return strategy.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    loop_iterator = iter(strategy.experimental_distribute_dataset(dataset))

    def run_loop(steps):
        loss = None
        for _ in range(steps):
            loss = distributed_train_step(next(loop_iterator))
        return float(loss)  # the host waits for the last step, as fit's final logs do

    def run_fit(steps):
        return fit_model.fit(dataset, steps_per_epoch=steps, epochs=1, verbose=0).history["loss"][-1]

    setups = {"fit": run_fit, "loop": run_loop}
    for name, run in setups.items():
        started = time.perf_counter()
        run(args.warmup)
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)
    rates = {name: [] for name in setups}
    for r in range(args.rounds):
        for name, run in setups.items():
            started = time.perf_counter()
            loss = run(args.steps)
            rates[name].append(global_batch * args.steps / (time.perf_counter() - started))
            print(f"round {r + 1} {name}: {rates[name][-1]:.0f} images/s (loss {loss:.3f})", flush=True)

    fit_median = statistics.median(rates["fit"])
    rows = []
    print(f"\n{'setup':<8}{'images/s':>10}{'spread':>9}{'vs fit':>8}")
    for name, values in rates.items():
        med = statistics.median(values)
        spread = (max(values) - min(values)) / med
        rows.append({"setup": name, "images_per_s": med, "rounds": values, "spread": spread,
                     "vs_fit": med / fit_median})
        print(f"{name:<8}{med:>10.0f}{100 * spread:>8.1f}%{med / fit_median:>8.2f}")
    print(f"# {n} replica(s), xla_allreduce={plan.xla_allreduce}; {args.rounds} interleaved rounds of {args.steps} "
          f"steps after a {args.warmup}-step warm-up; median round, spread = (max-min)/median")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": plan.to_dict(), "rows": rows, "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
