"""Tests on real NVIDIA GPUs: `pytest -m gpu` (skipped without GPUs; the default run deselects them).

What they pin down on a machine like the lent 2x H200:
- the NVML probe agrees with the driver (`nvidia-smi topo -m` / `nvidia-smi nvlink -s` facts),
- TensorFlow's GPUs map to NVML's by PCI bus id,
- `tf_nvlink.strategy()` builds on real GPUs, and a 2-GPU fit matches single-GPU training (XLA, fused mode),
- all-reduce sums are exact for every candidate.
Each TensorFlow check runs in its own process (one strategy per process).
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import run_python

pytestmark = pytest.mark.gpu


def _nvml_gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - any NVML failure means "no GPU here"
        return 0


GPU_COUNT = _nvml_gpu_count()
needs_gpu = pytest.mark.skipif(GPU_COUNT < 1, reason="needs an NVIDIA GPU and driver")
needs_2_gpus = pytest.mark.skipif(GPU_COUNT < 2, reason="needs 2 or more NVIDIA GPUs")


@needs_gpu
def test_probe_matches_nvidia_smi():
    from tf_nvlink.machine import nvml

    topo = nvml.probe()
    assert topo.error is None and len(topo.gpus) == GPU_COUNT
    smi = shutil.which("nvidia-smi")
    if smi:
        matrix = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, check=True).stdout
        rows = {line.split()[0]: line.split()[1:1 + GPU_COUNT] for line in matrix.splitlines()
                if line.startswith("GPU")}
        for a in range(GPU_COUNT):
            for b in range(GPU_COUNT):
                assert topo.label(a, b) == rows[f"GPU{a}"][b], (a, b)
    for gpu in topo.gpus:
        for link in gpu.active_links:
            assert link.version is not None and link.gbps > 0


@needs_gpu
def test_h200_facts_when_on_h200():
    from tf_nvlink.machine import nvml

    topo = nvml.probe()
    if not all(g.name == "NVIDIA H200" for g in topo.gpus):
        pytest.skip("not an H200 machine")
    if not any(gpu.active_links for gpu in topo.gpus):  # the lab's 1x H200 reports no NVLink (seen 2026-12-01)
        assert topo.shape() in ("single", "pcie"), topo.shape()
        pytest.skip("an H200 without active NVLink links (PCIe or a link-less slice): the NVLink facts do not apply")
    for gpu in topo.gpus:
        assert len(gpu.active_links) == 18 and gpu.nvlink_version == "4.0"
        assert gpu.nvlink_gbps == pytest.approx(478.1, abs=0.1)
    if GPU_COUNT > 1:
        assert topo.shape() == "nvswitch" and topo.label(0, 1) == "NV18"


@needs_gpu
def test_tf_gpus_map_to_nvml_by_pci():
    proc = run_python(
        "import json; from tf_nvlink.internals import tf_runtime as internals; from tf_nvlink.machine import nvml, tf_devices\n"
        "topo = nvml.probe(); m = tf_devices.map_tf_gpus(topo, internals.tf_gpu_descs())\n"
        "print(json.dumps([[d.tf_index, d.nvml_index, str(d.pci_bus_id), str(topo.gpu(d.nvml_index).pci_bus_id)]"
        " for d in m]))", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    mapped = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(mapped) == GPU_COUNT
    for _, nvml_index, tf_pci, nvml_pci in mapped:
        assert nvml_index is not None and tf_pci == nvml_pci


_FIT_SCRIPT = r"""
import json, sys
import numpy as np, tensorflow as tf, keras
import tf_nvlink
mode, cpus = sys.argv[1], int(sys.argv[2])
if cpus:  # the CPU rehearsal of this test (tests/tools/test_allreduce_bench.py): that many logical CPUs, no GPU
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * cpus)
if mode != "single":
    strategy = tf_nvlink.strategy(gpus="all", xla_allreduce=mode)
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
else:
    strategy = tf.distribute.get_strategy()
keras.utils.set_random_seed(3)
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16, 16, 3)).astype("float32"); y = rng.integers(0, 10, 512)
with strategy.scope():
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
history = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
kernel = model.trainable_variables[0].value
copies = list(getattr(kernel, "values", [kernel]))  # a mirrored variable's per-replica copies
same = all(np.array_equal(copies[0].numpy(), v.numpy()) for v in copies)
print(json.dumps({"loss": history.history["loss"], "weights": [w.tolist() for w in model.get_weights()],
                  "replicas": strategy.num_replicas_in_sync, "replicas_identical": bool(same)}))
"""


def check_fit_matches_single_device(mode, replicas, cpus=0):
    """Fit the same model on one device and under `tf_nvlink.strategy(xla_allreduce=mode)`; the weights agree."""
    results = {}
    for run in ("single", mode):
        proc = run_python(["-c", _FIT_SCRIPT, run, str(cpus)], timeout=600,
                          env={"CUDA_VISIBLE_DEVICES": ""} if cpus else None)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[run] = json.loads(proc.stdout.strip().splitlines()[-1])
    single, multi = results["single"], results[mode]
    assert multi["replicas"] == replicas and multi["replicas_identical"]
    assert multi["loss"][-1] < multi["loss"][0]
    assert len(single["weights"]) == len(multi["weights"])
    for a, b in zip(single["weights"], multi["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=2e-3, atol=2e-4)


@needs_2_gpus
@pytest.mark.parametrize("mode", ["fused", "split"])
def test_two_gpu_xla_fit_matches_single_gpu(mode):
    check_fit_matches_single_device(mode, GPU_COUNT)


# Every default candidate of `tf-nvlink bench`, by the label its records carry ("nccl" runs as "nccl:1").
EXPECTED_GPU_CANDIDATES = {"collective", "nccl:1", "nccl:4", "hierarchical:1", "reduce_to_one", "auto", "xla"}


def check_allreduce_records(records, sizes):
    """What the exact-sum test demands of `tf-nvlink bench --json` records from an even number of GPUs; tests/
    tests/tools/test_allreduce_bench.py runs it on the recorded 2x H200 JSON, so a wrong expectation shows up without a GPU."""
    ok = [r for r in records if r["status"] == "ok"]
    assert not [r for r in records if r["status"] in ("failed", "wrong")]
    assert {r["candidate"] for r in ok} >= EXPECTED_GPU_CANDIDATES
    for candidate in EXPECTED_GPU_CANDIDATES:
        assert {r["size_bytes"] for r in ok if r["candidate"] == candidate and not r["variant"]} >= set(sizes)
    assert all(r["wrong"] == 0 and r["busbw"] > 0 for r in ok)


@needs_2_gpus
def test_allreduce_sums_exact_for_every_candidate():
    proc = run_python(["-m", "tf_nvlink", "bench", "--sizes", "1M,16M", "--iters", "3", "--json"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_allreduce_records(json.loads(proc.stdout[proc.stdout.index("["):]), [2**20, 2**24])


_CUSTOM_LOOP_SCRIPT = r"""
import json, sys
import numpy as np, tensorflow as tf, keras
import tf_nvlink
mode, precision = sys.argv[1], sys.argv[2]
if mode == "single":
    strategy = tf.distribute.get_strategy()
elif mode == "one_gpu":
    strategy = tf_nvlink.strategy(gpus=[0])
else:
    strategy = tf_nvlink.strategy(gpus="all", xla_allreduce=mode)
keras.mixed_precision.set_global_policy("mixed_float16" if precision == "mixed" else "float32")
GLOBAL = 64
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16, 16, 3)).astype("float32"); y = rng.integers(0, 10, 512).astype("int32")
with strategy.scope():
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
    optimizer = keras.optimizers.SGD(0.1)
    if precision == "mixed":  # a huge first scale: the first steps overflow and are skipped
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=2.0 ** 20)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

@tf.function(jit_compile=True)
def step(xb, yb):
    with tf.GradientTape() as tape:
        loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=GLOBAL)
        scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

@tf.function
def train_epoch(batches):
    total = tf.constant(0.0)
    for xb, yb in batches:
        total += strategy.reduce("SUM", strategy.run(step, args=(xb, yb)), axis=None)
    return total

dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL)
losses = [float(train_epoch(dataset if mode == "single" else strategy.experimental_distribute_dataset(dataset)))
          for _ in range(3)]
kernel = model.trainable_variables[0].value
copies = list(getattr(kernel, "values", [kernel]))
same = all(np.array_equal(copies[0].numpy(), v.numpy()) for v in copies)
print(json.dumps({"loss": losses, "weights": [w.tolist() for w in model.get_weights()],
                  "iterations": int(optimizer.iterations.numpy()),
                  "replicas": strategy.num_replicas_in_sync, "replicas_identical": bool(same)}))
"""


@needs_2_gpus
@pytest.mark.parametrize("mode", ["fused", "split"])
@pytest.mark.parametrize("precision", ["float32", "mixed"])
def test_two_gpu_custom_loop_with_jit_step_matches_single_gpu(mode, precision, tmp_path):
    """TensorFlow's custom-loop guide shape (a jit step with optimizer.apply_gradients passed to strategy.run):
    stock MirroredStrategy fails with "merge_call called while defining a new graph"; under tf_nvlink it trains
    and equals one GPU (mixed: LossScaleOptimizer skipping the first, overflowing steps on every replica)."""
    results = {}
    for run in ("single", mode):
        script = tmp_path / "custom_loop_step.py"  # from a file: AutoGraph needs the loop's source
        script.write_text(_CUSTOM_LOOP_SCRIPT)
        proc = run_python([str(script), run, precision], timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[run] = json.loads(proc.stdout.strip().splitlines()[-1])
    single, multi = results["single"], results[mode]
    assert multi["replicas"] == GPU_COUNT and multi["replicas_identical"]
    assert multi["iterations"] == single["iterations"]
    assert multi["loss"][-1] < multi["loss"][0]
    tolerance = dict(rtol=2e-3, atol=2e-4) if precision == "float32" else dict(rtol=2e-2, atol=2e-3)
    for a, b in zip(single["weights"], multi["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), **tolerance)


@needs_gpu
@pytest.mark.parametrize("precision", ["float32", "mixed"])
def test_one_gpu_custom_loop_with_jit_step_matches_no_strategy(precision, tmp_path):
    """On ONE GPU the same loop failed under tf_nvlink.strategy() (1x H200: "merge_call called while defining a new
    graph" from the optimizer's step counter); the step now runs per replica in fused mode and equals plain Keras."""
    results = {}
    for run in ("single", "one_gpu"):
        script = tmp_path / "custom_loop_step.py"
        script.write_text(_CUSTOM_LOOP_SCRIPT)
        proc = run_python([str(script), run, precision], timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[run] = json.loads(proc.stdout.strip().splitlines()[-1])
    single, one = results["single"], results["one_gpu"]
    assert one["replicas"] == 1 and one["iterations"] == single["iterations"]
    tolerance = dict(rtol=1e-5, atol=1e-6) if precision == "float32" else dict(rtol=2e-3, atol=2e-4)
    np.testing.assert_allclose(one["loss"], single["loss"], **tolerance)
    for a, b in zip(single["weights"], one["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), **tolerance)


_GPU_CASES = "numpy,steps_per_epoch,unknown_length,accumulate,loss_scale,no_batchnorm,host_input"


def _compiled_execution_cases(layout, tmp_path):
    """The cases' results, and whether XLA knew the trip count of a 4-step loop (its optimized HLO, dumped)."""
    dump = tmp_path / "xla_dump"
    proc = run_python(["tests/training/compiled_execution_cases.py", layout, _GPU_CASES], timeout=900,
                      env={"XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    optimized = [path.read_text() for path in dump.glob("*after_optimizations.txt")]
    known = any('"known_trip_count":{"n":"4"}' in text for text in optimized)
    return json.loads(proc.stdout.strip().splitlines()[-1]), known


def _assert_compiled_equals_per_step(results):
    results, known_trip_count = results
    assert known_trip_count, "no full execution's loop had a trip count XLA knew"
    for case, runs in results.items():
        per_step, compiled = runs["per_step"], runs["compiled"]
        assert compiled["function"] == "CompiledExecution", case
        traced = compiled["programs_traced"]  # one program for full executions, one per partial batch shape
        assert set(traced["full"]) == {1} and max(traced["partial"]) <= 2, (case, traced)
        for a, b in zip(per_step["weights"], compiled["weights"]):
            np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6, err_msg=case)
        np.testing.assert_allclose(compiled["evaluate"], per_step["evaluate"], rtol=1e-5, atol=1e-6, err_msg=case)
        if case == "host_input":  # its second fit's full executions copied the next one's batches to the device
            assert compiled["copied_ahead"] == 2, compiled["copied_ahead"]
        if case == "steps_per_epoch":  # two fits of the same tf.data datasets (validation too), each staged once
            assert compiled["stagings"] == 2, compiled["stagings"]


@needs_gpu
def test_one_gpu_compiled_execution_equals_per_step_training(tmp_path):
    """On one GPU, steps_per_execution=4 as one XLA program (a while loop over the stacked batches) trains to the
    weights of one program per step: full and partial executions, a short last batch, steps_per_epoch=7, a dataset
    of unknown length, gradient accumulation, a LossScaleOptimizer, host-kept batches copied one execution ahead
    (float32, 1e-5; TF32 off); a full
    execution's loop has a trip count XLA knows, so the GPU runs its steps without waiting for the host."""
    _assert_compiled_equals_per_step(_compiled_execution_cases("gpu1", tmp_path))


@needs_gpu
def test_one_gpu_compiled_steps_of_a_custom_loop_equal_one_run_per_step():
    """CompiledSteps on one GPU: each call of up to 4 custom-loop steps is one XLA program (a while loop over the
    stacked batches) and trains to the weights of one strategy.run per step, partial calls and the short last
    batch included (float32, 1e-5; TF32 off)."""
    from tests.training.test_compiled_steps import assert_same_training

    proc = run_python(["tests/training/compiled_steps_cases.py", "gpu1"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_training(json.loads(proc.stdout.strip().splitlines()[-1]), "fused", programs=6)


@needs_2_gpus
def test_two_gpu_compiled_execution_equals_per_step_training(tmp_path):
    """The same on 2 GPUs in fused mode: the all-reduces inside each replica's loop, an uneven 8 + 7 split."""
    _assert_compiled_equals_per_step(_compiled_execution_cases("gpu2", tmp_path))


def _feature_matrix(layout):
    proc = run_python(["tests/training/feature_matrix_cases.py", layout], timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_feature_matrix(results):
    from tests.training.test_feature_matrix import assert_as_on_one_device

    failures = []
    for row, paths in results.items():
        for path in ("per_step", "compiled"):
            if "cannot" in paths[path]:
                continue
            try:
                assert_as_on_one_device(paths, row, path)
            except AssertionError as failure:
                failures.append(f"{row} {path}: {str(failure)[:400]}")
    assert not failures, "\n".join(failures)


@needs_gpu
def test_one_gpu_feature_matrix_as_on_one_device():
    """Every row of the Keras feature matrix (tests/training/feature_matrix_cases.py) on one GPU under XLA, per
    step and compiled, against the same Keras on the GPU without a strategy (float32: 1e-5, TF32 off)."""
    _assert_feature_matrix(_feature_matrix("gpu1"))


@needs_2_gpus
def test_two_gpu_feature_matrix_as_on_one_device():
    """The same on 2 GPUs in fused mode: empty replicas, uneven splits, the all-reduces inside XLA."""
    _assert_feature_matrix(_feature_matrix("gpu2"))


_CACHE_FIT = r"""
import json, os, sys
import tf_nvlink
strategy = tf_nvlink.strategy(gpus=[0], compile_cache=sys.argv[1])
import keras, numpy as np
keras.utils.set_random_seed(1)
with strategy.scope():
    model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile=True, steps_per_execution=4)
x = np.linspace(0, 1, 64 * 32, dtype="float32").reshape(64, 32)
loss = model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0).history["loss"][-1]
from tf_nvlink.distribute import single_host
from tf_nvlink.plan import compile_cache
from tf_nvlink.training.compiled_execution import execution_path
folder = single_host.current_compile_cache().folder
print(json.dumps({"folder": folder, "loss": loss, "path": execution_path(model)[0],
                  "entries": {os.path.basename(e.path): e.mtime for e in compile_cache.entries(folder)}}))
"""


@needs_gpu
def test_one_gpu_second_process_reads_the_compile_cache(tmp_path):
    """The compiled execution on one GPU: the first process stores its program(s), a second one reads them back
    (the same entries, none rewritten) and trains to the same loss."""
    runs = []
    for _ in range(2):
        result = run_python(["-c", _CACHE_FIT, str(tmp_path)], env={"TF_XLA_FLAGS": ""}, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["path"] == "compiled" and first["entries"]
    assert second["entries"] == first["entries"] and second["loss"] == first["loss"]


TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3}  # the largest difference over the largest value of Keras'
# A gradient that is zero in exact arithmetic (the key projection's bias: softmax ignores a constant added along the
# key axis) is rounding noise on both sides: it is bounded absolutely, by this share of the largest gradient of the
# query projection's bias (the same kind of sum, and not zero).
ZERO_GRADIENT_BOUND = 3e-2
ZERO_IN_EXACT_ARITHMETIC = ("key/bias",)


def _fused_attention_run():
    """The JSON of tests/fused_attention_gpu.py, its cases in a few processes (a case that ends its process reports
    its stderr, the other groups still run), once per session; kept in $TF_NVLINK_KEEP_DIR when that is set."""
    if "run" not in _FUSED_ATTENTION:
        merged = {"layers": {}, "fits": {}}
        for group in FUSED_ATTENTION_GROUPS:
            proc = run_python(["tests/fused_attention_gpu.py", ",".join(group)], timeout=1500)
            if proc.returncode != 0:
                error = {"error": f"the process ended with {proc.returncode}: {proc.stderr[-3000:]}"}
                merged["layers"].update({case: error for case in group if case != "fits"})
                if "fits" in group:
                    merged["fits"] = {model: error for model in ("lm", "encoder_padding", "gqa_decoder")}
                continue
            out = json.loads(proc.stdout.strip().splitlines()[-1])
            merged["compute_capability"] = out["compute_capability"]
            merged["layers"].update(out["layers"])
            merged["fits"].update(out["fits"])
        _FUSED_ATTENTION["run"] = merged
        keep = os.environ.get("TF_NVLINK_KEEP_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            (Path(keep) / "fused_attention_gpu.json").write_text(json.dumps(merged, indent=1))
    return _FUSED_ATTENTION["run"]


_FUSED_ATTENTION = {}
FUSED_ATTENTION_CASES = ["bf16_causal", "bf16_no_mask", "fp16_causal", "fp16_no_mask", "cross_96x320_causal",
                         "cross_96x320_no_mask", "cross_320x96_causal_fp16", "head_32", "head_128", "head_256",
                         "head_256_fp16_cross", "t200_b3_n5", "t200_b3_n5_fp16_no_mask", "gqa_8_on_2_causal",
                         "gqa_8_on_2_no_mask_fp16", "gqa_4_on_1_causal", "padding_right_self_causal",
                         "padding_holes_self_causal", "padding_right_self", "padding_holes_cross",
                         "padding_right_cross_fp16"]
FUSED_ATTENTION_GROUPS = [FUSED_ATTENTION_CASES[:7] + ["attention_mask_kept", "empty_batch"],
                          FUSED_ATTENTION_CASES[7:13], FUSED_ATTENTION_CASES[13:16], FUSED_ATTENTION_CASES[16:],
                          ["fits"]]


@needs_gpu
@pytest.mark.parametrize("case", FUSED_ATTENTION_CASES)
def test_one_gpu_fused_attention_agrees_with_keras_attention(case):
    """cuDNN's fused attention (fused_attention="auto") against Keras' own ("off") on one GPU, one attention layer
    (MultiHeadAttention, GroupQueryAttention, MultiHeadAttention over Masking'd inputs) in a jit-compiled step: its
    output and its gradients with respect to query, key, value and every weight, within the dtype's precision
    (zero-in-exact-arithmetic gradients absolutely); each case counted fused with "auto" and not with "off"."""
    out = _fused_attention_run()["layers"][case]
    if "skipped" in out:
        pytest.skip(out["skipped"])
    assert "error" not in out, out["error"]
    fused_decisions = [why for why in out["fused_counts"] if why.startswith("fused: ")]
    assert fused_decisions, out["fused_counts"]
    assert not any(why.startswith("fused: ") for why in out["off_counts"]), out["off_counts"]
    tolerance = TOLERANCE[out["case"]["dtype"]]
    rows = out["rows"]
    query_bias = max(row["largest"] for name, row in rows.items() if name.endswith("query/bias"))
    for name, row in rows.items():
        assert row["finite"], name
        if name.endswith(ZERO_IN_EXACT_ARITHMETIC):
            assert row["fused_largest"] <= ZERO_GRADIENT_BOUND * query_bias, (name, row, query_bias)
        elif row["largest"]:
            assert row["relative"] < tolerance, (name, row)


@needs_gpu
def test_one_gpu_attention_that_stays_keras_is_exactly_keras():
    """An attention_mask argument keeps Keras' attention (the same numbers, bit for bit), and an empty batch is
    refused with its reason rather than sent to cuDNN."""
    run = _fused_attention_run()["layers"]
    kept = run["attention_mask_kept"]
    assert "error" not in kept, kept["error"]
    assert all(row["max_abs_difference"] == 0.0 for row in kept["rows"].values()), kept["rows"]
    assert any("an attention_mask argument" in why for why in kept["fused_counts"]), kept["fused_counts"]
    empty = run["empty_batch"]
    assert "error" not in empty, empty["error"]
    assert any(why.startswith("Keras' attention: an empty attention (batch 0") for why in empty["fused_counts"])


@needs_gpu
@pytest.mark.parametrize("model", ["lm", "encoder_padding", "gqa_decoder"])
def test_one_gpu_fused_attention_trains_as_keras_attention(model):
    """200 AdamW steps of the compiled execution (its trace leaves the batch open), mixed_bfloat16: a causal LM, an
    encoder over padded sequences (Embedding(mask_zero=True), holes too) and a decoder with grouped-query attention
    train fused ("auto", counted) to Keras' attention's losses within 2%."""
    out = _fused_attention_run()["fits"][model]
    assert "error" not in out, out["error"]
    assert any(why.startswith("fused: ") for why in out["counts"]["auto"]), out["counts"]
    assert not any(why.startswith("fused: ") for why in out["counts"]["off"]), out["counts"]
    fused, plain = np.array(out["curves"]["auto"]), np.array(out["curves"]["off"])
    assert fused[-1] < fused[0] * 0.9  # it trains
    np.testing.assert_allclose(fused, plain, rtol=2e-2)
