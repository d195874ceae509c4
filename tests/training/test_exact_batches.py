"""Every batch trains as on one device (tf_nvlink.training.exact_batches): uneven last batches, global batches
that are not a multiple of the replica count, gradient accumulation and the rest of fit's surface, in plain,
split and fused mode (fused through the CPU emulation), in custom loops, and with 2 workers.

TensorFlow allows one strategy per process: one subprocess per device layout and mode runs many scenarios
(`tf_nvlink.tools.exact_batches_check`, single-device reference in the same process) and prints them as JSON.
"""

import json
import subprocess
import sys

import pytest

import scenarios
from conftest import FUSED_CPU_EMULATION, ROOT
from tf_nvlink.util import json_workers

TARGET = 1e-5
CORE = ["last_batch_1", "last_batch_3", "last_batch_33", "batch_size_5", "accumulate_2"]
# Models that stock MirroredStrategy trains differently from one device (tests/training/test_clipping.py,
# test_sample_weight_reduction.py and test_empty_replica.py show it, in the slow tier).
EVERY_MODEL = ["clipnorm", "global_clipnorm", "clipvalue", "global_clipnorm_accumulate_2", "mean_with_sample_weight",
               "batchnorm_1_plus_0"]
MORE = ["even_66", "accumulate_4", "sample_weight", "validation_split", "steps_per_execution_3", "lr_schedule",
        "lr_callback", "class_weight", "save_and_load"]

DRIVER = r'''
import json, sys
import tensorflow as tf
replicas, fused, modes, names, custom = json.loads(sys.argv[1])
tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * replicas)
import tf_nvlink
from tf_nvlink.tools import exact_batches_check as check
devices = [f"/cpu:{i}" for i in range(replicas)]
strategy = fused_strategy_emulated_on_cpu(devices) if fused else tf_nvlink.strategy(devices=devices)
out = {}
for mode in modes:
    jit = mode != "plain"
    out[mode] = check.run_scenarios(strategy, jit_compile=jit, names=names)
    if custom:
        out[mode]["custom_loop"] = check.run_custom_loop(strategy, jit, global_batch_size_known=mode == "split")
        if mode == "split":
            out[mode]["custom_loop_count_in_xla"] = check.run_custom_loop(strategy, True, examples=20, batch_size=8)
print("RESULT " + json.dumps(out))
'''


_DRIVER_CODE, _DRIVER_ENV = FUSED_CPU_EMULATION + DRIVER, {"CUDA_VISIBLE_DEVICES": ""}


def _driver_argv(replicas, fused, modes, names, custom=False):
    return [json.dumps([replicas, fused, modes, names, custom])]


def start(replicas, fused, modes, names, custom=False):
    """The driver in a process of its own (TensorFlow preloaded: tests/scenarios.py), started at once."""
    return scenarios.start_preloaded(_DRIVER_CODE, env=_DRIVER_ENV, argv=_driver_argv(replicas, fused, modes, names,
                                                                                      custom))


def result_of(process):
    done = process.wait()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_single_device(cases):
    failed = {name: case for name, case in cases.items()
              if "error" in case or max(v for k, v in case.items() if k != "error") > TARGET}
    assert not failed, json.dumps(failed, indent=1)


def _background(name, replicas, fused, modes, names, expected_s):
    """The driver as a process started in the background when the tests are collected (tests/scenarios.py)."""
    return scenarios.Background(name, _DRIVER_CODE, argv=_driver_argv(replicas, fused, modes, names), env=_DRIVER_ENV,
                                preload=True, expected_s=expected_s)


TWO_MERGE_CALL = _background("exact batches: plain and split on 2 CPUs", 2, False, ["plain", "split"], CORE, 14)
TWO_FUSED = _background("exact batches: fused (emulated) on 2 CPUs", 2, True, ["fused"], CORE + EVERY_MODEL, 14)


@pytest.fixture(scope="module")
def two_replicas():
    """The core targets on 2 CPU replicas: plain and split in one process, fused (emulated) in another, at once;
    fused mode also trains the EVERY_MODEL cases."""
    processes = {"merge_call": TWO_MERGE_CALL, "fused": TWO_FUSED}
    try:
        results = {name: result_of(process) for name, process in processes.items()}
    finally:
        for process in processes.values():
            process.kill()  # those still running (a failure in another)
    return {**results["merge_call"], **results["fused"]}


@pytest.mark.parametrize("mode", ["plain", "split", "fused"])
def test_uneven_batches_and_accumulation_match_one_device(two_replicas, mode):
    """1 + 0, 2 + 1 and 17 + 16 last batches, batch_size=5, gradient_accumulation_steps=2: weights, logged loss
    and metrics within 1e-5 of one device (before: 7.6e-2 and 1.9e-2 away, an AddN crash, a Cond.call() error)."""
    cases = {name: case for name, case in two_replicas[mode].items() if name in CORE}
    assert sorted(cases) == sorted(CORE)
    assert_single_device(cases)


def test_clipping_sample_weight_reduction_and_an_empty_batchnorm_replica_match_one_device(two_replicas):
    """Fused mode: clipnorm, global_clipnorm (with gradient accumulation too) and clipvalue act on the all-reduced
    gradients; mean_with_sample_weight is divided by the step's weights; a BatchNorm model whose every step splits
    1 + 0 keeps finite weights and one device's moving statistics (plain and split: test_clipping.py,
    test_sample_weight_reduction.py, test_empty_replica.py and the 2-worker test, slow tier)."""
    cases = {name: case for name, case in two_replicas["fused"].items() if name in EVERY_MODEL}
    assert sorted(cases) == sorted(EVERY_MODEL)
    assert_single_device(cases)


@pytest.mark.slow
def test_four_replicas_and_the_rest_of_fit_and_custom_loops_match_one_device():
    """batch_size=7 on 4 replicas; accumulation 4, sample_weight, validation_split, steps_per_execution=3 with a
    partial execution, a learning-rate schedule and callback, class_weight, save and load, and custom loops with tf_nvlink.average_loss on 2 replicas."""
    processes = [start(4, False, ["plain", "split"], ["batch_size_7", "last_batch_1"]),
                 start(4, True, ["fused"], ["batch_size_7", "last_batch_1"]),
                 start(2, False, ["plain", "split"], MORE, custom=True),
                 start(2, True, ["fused"], MORE, custom=True)]
    try:
        results = [result_of(process) for process in processes]
    finally:
        for process in processes:
            process.kill()  # those still running (a failure in another)
    for result in results:
        for mode, cases in result.items():
            count_in_xla = cases.pop("custom_loop_count_in_xla", None)
            assert_single_device(cases)
            if count_in_xla is not None:  # split mode: the count's all-reduce cannot sit inside XLA
                assert "average_loss(per_example_loss, global_batch_size=n)" in count_in_xla["error"], count_in_xla
    assert {mode for result in results for mode in result} == {"plain", "split", "fused"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "split"])
def test_two_workers_match_one_device(mode):
    """2 CPU worker processes (MultiWorkerMirroredStrategy, 1 replica each): every scenario within 1e-5, a worker
    without examples in a BatchNorm model, clipping after the all-reduce and mean_with_sample_weight included."""
    ports = json_workers.free_ports(2, host="127.0.0.1")
    cluster = {"worker": [f"localhost:{port}" for port in ports]}
    script = str(ROOT / "benchmarks" / "exact_batches_gpu.py")
    names = ",".join(CORE + ["accumulate_4", "sample_weight", "validation_split", "batchnorm_1_plus_0", "clipnorm",
                             "global_clipnorm", "clipvalue", "mean_with_sample_weight"])
    commands = [[sys.executable, script, "--devices", "tf_config", "--mode", mode, "--scenarios", names]] * 2
    envs = [json_workers.package_env({"CUDA_VISIBLE_DEVICES": "", "TF_CONFIG": json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}})}) for index in range(2)]
    for record, error in json_workers.run_json_workers(commands, envs, timeout=500,
                                                       accept=lambda record: "cases" in record):
        assert record is not None, error
        assert record["replicas"] == 2
        assert_single_device(record["cases"])


def test_average_loss_refuses_a_scalar_and_integers():
    import tf_nvlink
    from tf_nvlink.training.exact_batches import average_loss

    with pytest.raises(ValueError, match=r"one loss per example \(rank >= 1\)"):
        average_loss(1.0)
    with pytest.raises(ValueError, match=r"floating-point tensor .* Received dtype int32"):
        average_loss([1, 2])
    assert float(tf_nvlink.average_loss([1.0, 3.0])) == 2.0
    assert float(average_loss([1.0, 3.0], global_batch_size=4)) == 1.0
    assert float(average_loss([[1.0, 3.0]], sample_weight=[2.0])) == 4.0


def test_benchmark_refuses_fused_mode_on_cpu_and_bad_devices():
    script = str(ROOT / "benchmarks" / "exact_batches_gpu.py")
    env = json_workers.package_env({"CUDA_VISIBLE_DEVICES": ""})
    fused = subprocess.run([sys.executable, script, "--devices", "cpu:2"], env=env, capture_output=True, text=True)
    assert fused.returncode != 0 and "--mode fused needs GPU replicas" in fused.stderr, fused.stderr[-2000:]
    bad = subprocess.run([sys.executable, script, "--devices", "tpu:2"], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "--devices should be" in bad.stderr, bad.stderr[-2000:]
