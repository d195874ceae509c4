"""Where does the 2-GPU step lose time? 1 GPU against tf_nvlink on N GPUs, trained the way users train, in ONE process.

One process holds both setups, so their rounds interleave without restarting TensorFlow:
- `1gpu`: plain Keras, no strategy, `jit_compile=True`, on GPU:0 (the best single-GPU setup);
- `auto`: `tf_nvlink.strategy()` over every GPU, `jit_compile=True`;
- input variants of `auto`: `host` (the default: a uint8 host batch through tf.data, as decoded JPEGs arrive,
  cast on the GPU by the model's first layer), `buffer4` (the same with 4 batches prefetched to each GPU instead of
  TensorFlow's 1), `device` (the batch already on each GPU: no host input at all).
Each measurement is the wall time of a whole `model.fit(steps_per_epoch=S)` call after a warm-up fit; the rounds
run interleaved and the table gives each setup's median round and the spread (max - min) / median.
With `--profile DIR` it also traces a few steps of `1gpu` and `auto` with TensorFlow's profiler and prints, per GPU,
where the step time goes (compute kernels, NCCL, memory copies, idle) from the trace itself.
With NVML present it records the NVLink bytes (fields 138/139: data TX/RX, KiB per link) each setup moved per step.

XLA_FLAGS is read once per process, so compare XLA settings by running this script once per setting, e.g.

    python benchmarks/scaling_probe.py --rounds 3 --steps 100 --json out.json
    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true python benchmarks/scaling_probe.py ...
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---------------------------------------------------------------- NVLink counters (NVML field values) ----------
def nvlink_kib(indices):
    """{gpu: (tx_kib, rx_kib)} summed over active links, or None without NVML/counters."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None
    out = {}
    try:
        for i in indices:
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            links = []
            for link in range(36):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link):
                        links.append(link)
                except pynvml.NVMLError:
                    break
            if not links:
                return None
            values = pynvml.nvmlDeviceGetFieldValues(h, [(138, l) for l in links] + [(139, l) for l in links])
            tx = sum(v.value.ullVal for v in values[:len(links)] if v.nvmlReturn == 0)
            rx = sum(v.value.ullVal for v in values[len(links):] if v.nvmlReturn == 0)
            out[i] = (tx, rx)
    finally:
        pynvml.nvmlShutdown()
    return out


# ---------------------------------------------------------------- trace summary --------------------------------
def _union(intervals):
    total, end = 0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total


def _merge(intervals):
    merged = []
    for s, e in sorted(intervals):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return merged


def _overlap(a, b):
    """Length of the intersection of two merged interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize_trace(logdir, steps):
    """Per GPU plane: window, busy, compute, NCCL (exposed = not overlapped by compute), copies, idle; in ms/step.
    Host: the busiest TensorFlow op names (ms/step, summed over threads)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb")))
    if not paths:
        return {"error": f"no .xplane.pb under {logdir}"}
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as f:
        space.ParseFromString(f.read())
    result = {"trace": paths[-1], "gpus": {}, "host_top": []}
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        if plane.name.startswith("/device:GPU:"):
            kinds = collections.defaultdict(list)
            kernel_names = collections.Counter()
            for line in plane.lines:
                if not line.name.startswith("Stream"):
                    continue
                base = line.timestamp_ns * 1000
                for ev in line.events:
                    s = base + ev.offset_ps
                    e = s + ev.duration_ps
                    name = names.get(ev.metadata_id, "")
                    low = name.lower()  # the stream's own name lists every kind it carries ("MemcpyD2D,...")
                    if "nccl" in low:
                        kind = "nccl"
                    elif "memcpyh2d" in low or "htod" in low:
                        kind = "h2d"
                    elif "memcpyd2h" in low or "dtoh" in low:
                        kind = "d2h"
                    elif "memcpy" in low or "memset" in low:
                        kind = "d2d"
                    else:
                        kind = "compute"
                    kinds[kind].append((s, e))
                    kernel_names[(kind, name[:60])] += ev.duration_ps
            everything = [iv for ivs in kinds.values() for iv in ivs]
            if not everything:
                continue
            lo = min(s for s, _ in everything)
            hi = max(e for _, e in everything)
            ps_per_ms = 1e9
            compute = _merge(kinds["compute"])
            nccl = _merge(kinds["nccl"])
            busy = _union(everything)
            summary = {
                "window_ms_per_step": (hi - lo) / ps_per_ms / steps,
                "busy_ms_per_step": busy / ps_per_ms / steps,
                "idle_ms_per_step": (hi - lo - busy) / ps_per_ms / steps,
                "compute_ms_per_step": _union(kinds["compute"]) / ps_per_ms / steps,
                "nccl_ms_per_step": _union(kinds["nccl"]) / ps_per_ms / steps,
                "nccl_exposed_ms_per_step": (_union(kinds["nccl"]) - _overlap(compute, nccl)) / ps_per_ms / steps,
                "h2d_ms_per_step": _union(kinds["h2d"]) / ps_per_ms / steps,
                "d2h_ms_per_step": _union(kinds["d2h"]) / ps_per_ms / steps,
                "d2d_ms_per_step": _union(kinds["d2d"]) / ps_per_ms / steps,
                "top_kernels": [(k, n, round(d / ps_per_ms / steps, 3)) for (k, n), d in
                                kernel_names.most_common(15)],
                "events_per_step": round(len(everything) / steps, 1),
            }
            result["gpus"][plane.name] = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items()}
        elif plane.name.startswith("/host:CPU"):
            totals = collections.Counter()
            for line in plane.lines:
                for ev in line.events:
                    totals[names.get(ev.metadata_id, "")[:80]] += ev.duration_ps
            result["host_top"] = [(n, round(d / 1e9 / steps, 3)) for n, d in totals.most_common(25)]
    return result


# ---------------------------------------------------------------- training ------------------------------------
def build_model(keras, name, image, steps_per_execution=1):
    """ResNet-50 on uint8 images (cast on the GPU), the 368M-parameter Transformer LM, or a tiny CPU smoke model."""
    if name == "transformer":
        from tf_nvlink.tools.training_bench import models

        model = models.transformer_lm()
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        inputs = keras.Input(shape=(image, image, 3), dtype="uint8")
        x = keras.layers.Rescaling(1.0 / 255)(inputs)  # the cast runs on the GPU, inside the compiled step
        if name == "resnet50":
            outputs = keras.applications.ResNet50(weights=None, input_shape=(image, image, 3), classes=1000)(x)
        else:  # "tiny": a smoke test of this script on a CPU
            x = keras.layers.Conv2D(8, 3, activation="relu")(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.GlobalAveragePooling2D()(x)
            outputs = keras.layers.Dense(1000, activation="softmax", dtype="float32")(x)
        model = keras.Model(inputs, outputs)
        loss = keras.losses.SparseCategoricalCrossentropy()
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss=loss, jit_compile=True,
                  steps_per_execution=steps_per_execution)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch_per_gpu", type=int, default=None, help="default: 128 images, 8 sequences")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--long_steps", type=int, default=0,
                        help="also time a fit of this many steps in each round: the difference from the --steps fit "
                             "gives the marginal step time (steady state) and the fixed cost of each fit call")
    parser.add_argument("--variants", default="host,device",
                        help="of auto: host, buffer1, buffer4, device, nosync (BatchNorm statistics not averaged across "
                             "replicas), monitor (NVLinkMonitor, default), monitor1 (NVLinkMonitor reading every "
                             "batch in its thread), async (1gpu and auto with "
                             "Keras' async batch-end callbacks), spe8 (1gpu with steps_per_execution=8), onedevice "
                             "(TensorFlow's OneDeviceStrategy on GPU:0: a strategy without replicas' machinery)")
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--model", default="resnet50", choices=("resnet50", "transformer", "tiny"))
    parser.add_argument("--allreduce_dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--xla_allreduce", default="auto", choices=("auto", "fused", "split"))
    parser.add_argument("--steps_per_execution", type=int, default=1, help="Keras compile() option, both setups")
    parser.add_argument("--profile", default="", help="trace 1gpu, the first auto setup and 1gpu/onedevice into "
                                                       "this directory")
    parser.add_argument("--profile_steps", type=int, default=10)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    variants = args.variants.split(",")

    import numpy as np
    import tensorflow as tf

    import tf_nvlink

    strategy = tf_nvlink.strategy(allreduce_dtype=args.allreduce_dtype, xla_allreduce=args.xla_allreduce)
    plan = tf_nvlink.current_plan()
    print(plan.summary(), flush=True)
    import keras

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    n = strategy.num_replicas_in_sync
    per_gpu = args.batch_per_gpu or (8 if args.model == "transformer" else 128)
    unit = "tokens" if args.model == "transformer" else "images"
    per_example = 512 if args.model == "transformer" else 1  # tokens per sequence
    rng = np.random.default_rng(0)

    def batch(size):
        if args.model == "transformer":
            tokens = rng.integers(0, 32000, size=(size, 512)).astype("int32")
            return tokens, np.roll(tokens, -1, axis=1)
        x = rng.integers(0, 256, size=(size, args.image, args.image, 3), dtype=np.uint8)
        return x, rng.integers(0, 1000, size=(size,)).astype("int32")

    def host_dataset(size):  # a host batch through tf.data, as users feed model.fit
        return tf.data.Dataset.from_tensors(batch(size)).repeat().prefetch(8)

    # 1 GPU: no strategy at all; the model lives on the first GPU.
    with tf.device(plan.devices[0] if plan.devices else "/cpu:0"):
        one = build_model(keras, args.model, args.image, args.steps_per_execution)
    with strategy.scope():
        multi = build_model(keras, args.model, args.image, args.steps_per_execution)
        unsynced = None
        if "nosync" in variants:
            unsynced = build_model(keras, args.model, args.image, args.steps_per_execution)
    global_batch = per_gpu * n
    multi_host = host_dataset(global_batch)
    setups = [("1gpu", one, host_dataset(per_gpu), per_gpu, [])]
    if "host" in variants:
        setups.append(("auto/host", multi, multi_host, global_batch, []))
    if "buffer1" in variants:  # TensorFlow's default depth, instead of the plan's input_buffer
        setups.append(("auto/buffer1", multi, strategy.experimental_distribute_dataset(
            multi_host, tf.distribute.InputOptions(experimental_per_replica_buffer_size=1)), global_batch, []))
    if "buffer4" in variants:
        setups.append(("auto/buffer4", multi, strategy.experimental_distribute_dataset(
            multi_host, tf.distribute.InputOptions(experimental_per_replica_buffer_size=4)), global_batch, []))
    if "device" in variants:
        def on_device(context):
            x, y = batch(per_gpu)
            return tf.data.Dataset.from_tensors((tf.constant(x), tf.constant(y))).repeat()
        # distribute_datasets_from_function places each replica's pipeline output on its GPU; from_tensors of
        # constants made there keeps the batch in device memory (no per-step host copy).
        setups.append(("auto/device", multi, strategy.distribute_datasets_from_function(
            on_device, tf.distribute.InputOptions(experimental_fetch_to_device=True)), global_batch, []))
    if unsynced is not None:
        setups.append(("auto/nosync", unsynced, multi_host, global_batch, []))
    if "async" in variants:  # Keras' async batch-end callbacks (its JAX/torch default), off for TF in Keras
        setups.insert(1, ("1gpu/async", one, host_dataset(per_gpu), per_gpu, []))
        setups.append(("auto/async", multi, multi_host, global_batch, []))
    if "spe8" in variants:  # one GPU with steps_per_execution=8: a sync every 8 steps instead of every step
        with tf.device(plan.devices[0] if plan.devices else "/cpu:0"):
            one8 = build_model(keras, args.model, args.image, 8)
        setups.insert(1, ("1gpu/spe8", one8, host_dataset(per_gpu), per_gpu, []))
    if "onedevice" in variants:  # a strategy scope with no mirrored variables and no all-reduce
        with tf.distribute.OneDeviceStrategy(plan.devices[0] if plan.devices else "/cpu:0").scope():
            single = build_model(keras, args.model, args.image, args.steps_per_execution)
        setups.insert(1, ("1gpu/onedevice", single, host_dataset(per_gpu), per_gpu, []))
    if "monitor" in variants:  # the default: reads when training begins and at each epoch end
        setups.append(("auto/monitor", multi, multi_host, global_batch, [tf_nvlink.NVLinkMonitor()]))
    if "monitor1" in variants:  # plus a background read every batch
        setups.append(("auto/monitor1", multi, multi_host, global_batch,
                       [tf_nvlink.NVLinkMonitor(every_n_batches=1)]))

    gpus = list(plan.gpus)
    times = collections.defaultdict(list)
    nvlink = collections.defaultdict(list)
    monitored = collections.defaultdict(list)
    marginal = collections.defaultdict(list)  # (per_s from the long-short difference, fixed seconds per fit)
    import keras.src.backend as keras_backend

    thread_safe = keras_backend.IS_THREAD_SAFE

    def fit(name, model, ds, steps, callbacks=()):
        # Keras reads IS_THREAD_SAFE when fit builds its CallbackList: True lets batch-end callbacks (and the
        # float() of the logs that syncs with the GPU) run in a thread while the next step is dispatched.
        keras_backend.IS_THREAD_SAFE = thread_safe or name.endswith("/async")
        try:
            return model.fit(ds, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=list(callbacks))
        finally:
            keras_backend.IS_THREAD_SAFE = thread_safe

    for name, model, ds, _, callbacks in setups:  # compile and warm up every setup first
        started = time.perf_counter()
        if model is unsynced:  # read when Keras builds the train function, i.e. now
            os.environ["TF_NVLINK_SYNC_NON_TRAINABLE"] = "0"
        fit(name, model, ds, args.warmup)
        os.environ.pop("TF_NVLINK_SYNC_NON_TRAINABLE", None)
        print(f"warm-up {name}: {time.perf_counter() - started:.1f} s", flush=True)
    for r in range(args.rounds):
        for name, model, ds, size, callbacks in setups:
            before = nvlink_kib(gpus) if len(gpus) > 1 else None
            started = time.perf_counter()
            history = fit(name, model, ds, args.steps, callbacks)
            seconds = time.perf_counter() - started
            after = nvlink_kib(gpus) if len(gpus) > 1 else None
            times[name].append(size * per_example * args.steps / seconds)
            if before and after:
                nvlink[name].append({g: ((after[g][0] - before[g][0]) * 1024 / args.steps,
                                         (after[g][1] - before[g][1]) * 1024 / args.steps) for g in gpus})
            if "nvlink_bytes_per_step" in history.history:
                monitored[name].append(history.history["nvlink_bytes_per_step"][-1])
                mon = callbacks[0]
                print(f"  NVLinkMonitor: {len(mon.read_seconds)} reads in the training thread, "
                      f"{1000 * sum(mon.read_seconds):.1f} ms in all; {len(mon.background_read_seconds)} background "
                      f"reads (median {1000 * statistics.median(mon.background_read_seconds or [0]):.1f} ms), "
                      f"{mon.skipped_reads} skipped", flush=True)
            print(f"round {r + 1} {name}: {times[name][-1]:.0f} {unit}/s", flush=True)
            if args.long_steps:
                started = time.perf_counter()
                fit(name, model, ds, args.long_steps, callbacks)
                long_seconds = time.perf_counter() - started
                step_s = (long_seconds - seconds) / (args.long_steps - args.steps)
                marginal[name].append((size * per_example / step_s, seconds - args.steps * step_s))
                print(f"round {r + 1} {name}: {args.long_steps} steps {long_seconds:.2f} s; marginal "
                      f"{marginal[name][-1][0]:.0f} {unit}/s, fixed {1000 * marginal[name][-1][1]:.0f} ms per fit",
                      flush=True)

    one_median = statistics.median(times["1gpu"])
    rows = []
    print(f"\n{'setup':<16}{unit + '/s':>9}{'spread':>9}{'step ms':>9}{'vs 1 GPU':>10}{'scaling':>9}"
          f"{'NVLink TX MiB/step/GPU':>24}")
    for name, _, _, size, _ in setups:
        med = statistics.median(times[name])
        spread = (max(times[name]) - min(times[name])) / med
        replicas = 1 if name.startswith("1gpu") else n
        tx = ""
        if nvlink[name]:
            tx_mib = [statistics.median([s[g][0] for s in nvlink[name]]) / 2**20 for g in gpus]
            tx = "/".join(f"{v:.1f}" for v in tx_mib)
        if monitored.get(name):
            tx += f" (NVLinkMonitor {statistics.median(monitored[name]) / 2**20:.1f})"
        row = {"setup": name, "per_s": med, "unit": unit, "rounds": times[name], "spread": spread,
               "replicas": replicas, "batch": size,
               "step_ms": 1000 * size * per_example / med, "scaling": med / (replicas * one_median),
               "nvlink_tx_mib": tx, "monitor_bytes_per_step": monitored.get(name)}
        rows.append(row)
        print(f"{name:<16}{med:>9.0f}{100 * spread:>8.1f}%{row['step_ms']:>9.1f}{med / one_median:>10.2f}"
              f"{row['scaling']:>9.2f}  {tx}")
    if marginal:
        one_marginal = statistics.median(m[0] for m in marginal["1gpu"])
        print(f"\nsteady state ({args.long_steps}-step fit minus {args.steps}-step fit, same round)\n"
              f"{'setup':<16}{unit + '/s':>9}{'spread':>9}{'step ms':>9}{'scaling':>9}{'fixed ms/fit':>14}")
        for row in rows:
            per_s = [m[0] for m in marginal[row["setup"]]]
            med = statistics.median(per_s)
            row.update(marginal_per_s=med, marginal_rounds=per_s, marginal_spread=(max(per_s) - min(per_s)) / med,
                       marginal_scaling=med / (row["replicas"] * one_marginal),
                       fixed_ms_per_fit=1000 * statistics.median(m[1] for m in marginal[row["setup"]]))
            print(f"{row['setup']:<16}{med:>9.0f}{100 * row['marginal_spread']:>8.1f}%"
                  f"{1000 * row['batch'] * per_example / med:>9.1f}{row['marginal_scaling']:>9.2f}"
                  f"{row['fixed_ms_per_fit']:>14.0f}")
    for key, label in (("per_s", "whole fits"), ("marginal_per_s", "steady state")):
        ones = [row for row in rows if row["replicas"] == 1 and key in row]
        if len(ones) > 1 and n > 1:  # the best one-GPU setup, not plain Keras, is what scaling should be against
            best = max(ones, key=lambda row: row[key])
            print(f"# scaling against the best one-GPU setup ({best['setup']}, {label}): " + ", ".join(
                f"{row['setup']} {row[key] / (row['replicas'] * best[key]):.2f}" for row in rows
                if row["replicas"] > 1))
    grads = sum(int(np.prod(v.shape)) * 4 for v in multi.trainable_variables)
    print(f"# fp32 gradient bytes {grads / 2**20:.1f} MiB in {len(multi.trainable_variables)} tensors; expected "
          f"all-reduce traffic per GPU per step 2(n-1)/n x that = {2 * (n - 1) / n * grads / 2**20:.1f} MiB")
    print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; NCCL_P2P_DISABLE="
          f"{os.environ.get('NCCL_P2P_DISABLE', '')!r}; steps_per_execution={args.steps_per_execution}; "
          f"allreduce_dtype={args.allreduce_dtype}; {args.rounds} interleaved rounds of {args.steps}-step fits after "
          f"a {args.warmup}-step warm-up; median round, spread = (max-min)/median")

    profiles = {}
    if args.profile:
        first_auto = next(s for s in setups if s[0].startswith("auto"))
        for name, model, ds, _, _ in [setups[0], first_auto] + [s for s in setups if s[0] == "1gpu/onedevice"]:
            logdir = os.path.join(args.profile, name.replace("/", "_"))
            tf.profiler.experimental.start(logdir)
            model.fit(ds, steps_per_epoch=args.profile_steps, epochs=1, verbose=0)
            tf.profiler.experimental.stop()
            profiles[name] = summarize_trace(logdir, args.profile_steps)
            print(f"\n## profile {name} ({args.profile_steps} steps)")
            print(json.dumps(profiles[name], indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plan": plan.to_dict(), "rows": rows, "profiles": profiles,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "gradient_bytes": grads,
                       "args": vars(args)}, f, indent=1)


if __name__ == "__main__":
    main()
