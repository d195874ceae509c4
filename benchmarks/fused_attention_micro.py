"""Attention alone on one GPU: Keras' attention against cuDNN's fused attention (tf_nvlink.training.fused_attention),
forward and backward, at the benchmark Transformers' shapes, in interleaved rounds; and their largest difference.

Each setup is one `tf.function(jit_compile=True)` under `tf_nvlink.strategy()` computing causal attention of
bfloat16 [B, T, N, H] queries, keys and values and the gradients of a weighted sum of the output, run `--calls`
times back to back and timed as a whole (the result read once at the end).

    python benchmarks/fused_attention_micro.py --rounds 3 --json attention_micro.json
"""

import json
import time

from absl import app, flags

import tf_nvlink  # noqa: F401 - before app.run: the compile cache's link (tf_nvlink.util.absl_start)

_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.", lower_bound=1)
_CALLS = flags.DEFINE_integer("calls", 50, "Calls timed per round and setup.", lower_bound=1)
_JSON = flags.DEFINE_string("json", "", "Write the measurements to this JSON file.")
SHAPES = {"512": (8, 512, 16, 64), "2048": (2, 2048, 16, 64)}  # the transformer and transformer_2048 batches


def main(argv):
    del argv
    import numpy as np
    import tensorflow as tf

    strategy = tf_nvlink.strategy(gpus=[0])
    import keras

    from tf_nvlink.distribute import base
    from tf_nvlink.tools import bench_stats

    record = {"gpu": tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0]),
              "shapes": {}}
    for label, (batch, seq, heads, head_dim) in SHAPES.items():
        rng = np.random.default_rng(0)
        tensors = [tf.constant(rng.normal(size=(batch, seq, heads, head_dim)), tf.bfloat16) for _ in range(4)]
        functions, outputs = {}, {}
        for setting in ("auto", "off"):
            base.attach_fused_attention(strategy, setting)

            @tf.function(jit_compile=True)
            def step(query, key, value, weights):
                with tf.GradientTape() as tape:
                    tape.watch([query, key, value])
                    out = keras.ops.dot_product_attention(query, key, value, is_causal=True)
                    loss = tf.reduce_sum(tf.cast(out * weights, tf.float32))
                return [out] + tape.gradient(loss, [query, key, value])

            functions[setting] = step
            outputs[setting] = [strategy.experimental_local_results(t)[0].numpy().astype("float32")
                                for t in strategy.run(step, args=tensors)]
        difference = [float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12))
                      for a, b in zip(outputs["auto"], outputs["off"])]
        seconds = {setting: [] for setting in functions}
        for round_index in range(_ROUNDS.value):
            for setting in (("auto", "off") if round_index % 2 == 0 else ("off", "auto")):
                started = time.perf_counter()
                for _ in range(_CALLS.value):
                    results = strategy.run(functions[setting], args=tensors)
                strategy.experimental_local_results(results[0])[0].numpy()
                seconds[setting].append((time.perf_counter() - started) / _CALLS.value)
        rows = {setting: {"ms": [s * 1e3 for s in values], "median_ms": bench_stats.summarize(values).median * 1e3,
                          "spread": bench_stats.summarize(values).spread} for setting, values in seconds.items()}
        record["shapes"][label] = {"batch_tokens_heads_head": [batch, seq, heads, head_dim], "rows": rows,
                                   "relative_difference": difference,
                                   "speedup": rows["off"]["median_ms"] / rows["auto"]["median_ms"]}
        print(f"{label} tokens ({batch}x{seq}, {heads} heads of {head_dim}): forward+backward fused "
              f"{rows['auto']['median_ms']:.3f} ms ({rows['auto']['spread']:.1%}), Keras "
              f"{rows['off']['median_ms']:.3f} ms ({rows['off']['spread']:.1%}), "
              f"{record['shapes'][label]['speedup']:.2f}x; largest relative difference (output, dQ, dK, dV) "
              f"{', '.join(f'{d:.3g}' for d in difference)}", flush=True)
    if _JSON.value:
        with open(_JSON.value, "w") as handle:
            json.dump(record, handle, indent=1, default=str)


if __name__ == "__main__":
    app.run(main)
