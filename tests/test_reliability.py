"""Reliability, one section per promise of the issue:

1. bad input is refused with a message naming the bad value and the valid choices (one table per input);
2. missing or failing pieces degrade with ONE warning line that names the cause and the fallback;
3. no lost training: mnist_mlp.py is SIGKILLed mid-training and resumes at the right epoch; the backup, the
   checkpoints, the model and the autotune cache are written atomically;
4. security basics: no shell, no string-built commands, user-only cache files, strict JSON.

TensorFlow runs only in subprocesses (conftest.run_python or Popen), one subprocess per TensorFlow table,
so the whole file takes about 30 s on a 2-core machine. A renamed or missing name fails (AttributeError), never
skips.
"""

import ast
import json
import os
import queue
import re
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from pathlib import Path

import pynvml
import pytest

import fake_nvml
from conftest import ROOT, run_python
from fake_nvml import FakeNvml
from tf_nvlink.util import atomic_files
from tf_nvlink.machine import cluster_config
from tf_nvlink.tools import digits_data
from tf_nvlink.machine import nvml
from tf_nvlink.plan import policy
from tf_nvlink.plan import tune_cache
from tf_nvlink.util.text import strict_loads
from tf_nvlink.machine.topology import Topology

MNIST_MLP = str(ROOT / "examples" / "mnist_mlp.py")
EXAMPLES = str(ROOT / "examples")
# Library and example code this file audits (tests write scratch files freely).
SOURCES = sorted([*(ROOT / "tf_nvlink").rglob("*.py"), *(ROOT / "examples").glob("*.py")])


def machine_of(name, **changes):
    machine = fake_nvml.MACHINES[name]()
    for key, value in changes.items():
        setattr(machine, key, value)
    return machine


def topo_of(name, **changes):
    return nvml.probe(FakeNvml(machine_of(name, **changes)))


def _raises_naming(fn, *needles, error=ValueError):
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert "\n" not in message.strip(), message
    return message


# ================================================================== 1. every input validated, clearly
H200 = "h200_x2"
GPUS_CASES = [  # (gpus, what the message must contain besides the value: the valid choices)
    ("0,0", "[0, 1]"), ("7", "[0, 1]"), ("-1", "[0, 1]"), (-1, "[0, 1]"), ("abc", "[0, 1]"), ("", "'all', 'auto'"),
    ([], "[0, 1]"), ([0, "x"], "[0, 1]"), ("0,,1", "[0, 1]"), ([0, 1.0], "[0, 1]"), (None, "'all', 'auto'"),
    (1.5, "'all', 'auto'"), (True, "'all', 'auto'"),
]


@pytest.mark.parametrize("gpus, choices", GPUS_CASES, ids=[repr(c[0]) for c in GPUS_CASES])
def test_bad_gpus_on_a_two_gpu_machine(gpus, choices):
    _raises_naming(lambda: policy.make_plan(topo_of(H200), gpus), f"gpus={gpus!r}", choices)


@pytest.mark.parametrize("gpus", ["0,0", "-1", "abc", "", [], [0, "x"], None, 1.5],
                         ids=lambda v: repr(v))
def test_bad_gpus_without_any_gpu_are_still_refused(gpus):
    """A malformed request fails on a laptop too, not first on the GPU machine (well-formed ones name the reason)."""
    _raises_naming(lambda: policy.make_plan(topo_of("no_driver"), gpus), f"gpus={gpus!r}")
    assert policy.make_plan(topo_of("no_driver"), "all").gpus == ()  # "all" falls back to the CPU
    # (well-formed indices raise since issue 15 item 5: tests/test_reliability_round2.py)


OPS_CASES = ["NCCL", "ring", "", None, "hierarchical_copy", 42]


@pytest.mark.parametrize("ops", OPS_CASES, ids=repr)
def test_unknown_cross_device_ops(ops):
    message = _raises_naming(lambda: policy.make_plan(topo_of(H200), "all", ops), f"cross_device_ops={ops!r}")
    assert all(repr(choice) in message for choice in policy.OPS_CHOICES), message


@pytest.mark.parametrize("num_packs", [-1, -100, 1.5, "2", True, [1]], ids=repr)
def test_bad_num_packs(num_packs):
    _raises_naming(lambda: policy.make_plan(topo_of(H200), "all", "nccl", num_packs=num_packs),
                   f"num_packs={num_packs!r}", "non-negative integer", "None")


OTHER_INPUTS = [  # (id, call, needles)
    ("num_packs with unpacked ops", lambda: policy.make_plan(topo_of(H200), "all", "collective", num_packs=2),
     ("num_packs=2", "['nccl', 'hierarchical']")),
    ("hierarchical on 3 GPUs", lambda: policy.make_plan(topo_of("h100_hgx_x8"), "0,1,2", "hierarchical"),
     ("'hierarchical' with 3 GPUs", "'nccl'")),
    ("nccl without GPUs", lambda: policy.make_plan(topo_of("no_driver"), "all", "nccl"),
     ("cross_device_ops='nccl'", "'reduce_to_one'")),
    ("xla_allreduce", lambda: policy.make_plan(topo_of(H200), "all", "auto", xla_allreduce="fast"),
     ("xla_allreduce='fast'", "['auto', 'fused', 'split']")),
    ("fused without GPUs", lambda: policy.make_plan(topo_of("no_driver"), "all", "auto", xla_allreduce="fused"),
     ("xla_allreduce='fused'", "'split'")),
    ("hidden GPU", lambda: policy.make_plan(topo_of(H200), "0", visible=[1]),
     ("GPU 0", "CUDA_VISIBLE_DEVICES", "[1]")),
    ("dataset name", lambda: digits_data.load_mnist_or_fallback("cifar10"),
     ("name='cifar10'", "['auto', 'mnist', 'digits']")),
    ("dataset timeout", lambda: digits_data.load_mnist_or_fallback("auto", timeout=-1),
     ("timeout=-1", "positive number")),
    ("test fraction", lambda: digits_data.load_digits(test_fraction=1.5), ("test_fraction=1.5", "between 0 and 1")),
    ("tune gpus", lambda: tune_cache.gpus_key("0,x"), ("'0,x'", "'cpu:N'")),
]


@pytest.mark.parametrize("call, needles", [c[1:] for c in OTHER_INPUTS], ids=[c[0] for c in OTHER_INPUTS])
def test_other_bad_inputs(call, needles):
    _raises_naming(call, *needles)


def _tf_config(task=None, cluster=None, **extra):
    data = {"cluster": {"worker": ["a:1", "b:1"]} if cluster is None else cluster,
            "task": {"type": "worker", "index": 0} if task is None else task, **extra}
    return json.dumps(data)


TF_CONFIG_CASES = [  # (id, TF_CONFIG text, needles: the bad value, and the valid choices or form)
    ("not JSON", "not json", ("TF_CONFIG='not json'", "It should look like")),
    ("not an object", "[1, 2]", ("TF_CONFIG='[1, 2]'", "should be a JSON object")),
    ("NaN", _tf_config().replace('"index": 0', '"index": NaN'), ("NaN", "not JSON")),
    ("duplicate key", _tf_config()[:-1] + ', "task": {"type": "worker", "index": 1}}', ("'task' twice",)),
    ("huge number", _tf_config().replace('"index": 0', '"index": 1e999'), ("index=inf", "0 to 1")),
    ("no cluster", json.dumps({"task": {"type": "worker", "index": 0}}), ('no "cluster"', "['task']")),
    ("ps job", _tf_config(cluster={"ps": ["a:1"], "worker": ["b:1"]}), ('"ps"', "['chief', 'worker', 'evaluator']")),
    ("unknown job", _tf_config(cluster={"trainer": ["a:1"]}, task={"type": "trainer", "index": 0}),
     ("'trainer'", "['chief', 'worker', 'evaluator']")),
    ("same address", _tf_config(cluster={"worker": ["localhost:2222", "127.0.0.1:2222"]}),
     ("'127.0.0.1:2222'", "its own host:port")),
    ("no port", _tf_config(cluster={"worker": ["hostonly", "b:1"]}), ("'hostonly'", '"host:port"')),
    ("bad port", _tf_config(cluster={"worker": ["a:99999", "b:1"]}), ("'a:99999'", "1 to 65535")),
    ("task type not in cluster", _tf_config(task={"type": "chief", "index": 0}), ("'chief'", "['worker']")),
    ("index out of range", _tf_config(task={"type": "worker", "index": 2}), ("'index': 2", "0 to 1")),
    ("index as string", _tf_config(task={"type": "worker", "index": "0"}), ("index='0'", "0 to 1")),
    ("index as bool", _tf_config(task={"type": "worker", "index": True}), ("index=True", "0 to 1")),
    ("no task", json.dumps({"cluster": {"worker": ["a:1", "b:1"]}}), ('no "task"', '"type": "worker"')),
    ("rpc_layer", _tf_config(rpc_layer=5), ("rpc_layer=5", '"grpc"')),
]


@pytest.mark.parametrize("text, needles", [c[1:] for c in TF_CONFIG_CASES], ids=[c[0] for c in TF_CONFIG_CASES])
def test_bad_tf_config(text, needles):
    _raises_naming(lambda: cluster_config.parse_tf_config(text), *needles, error=cluster_config.TfConfigError)


# The example's flags: absl's own checks (bounds, enums) and main()'s (gpus, num_packs, model_dir, batch split).
# One subprocess imports the example once and tries every case; main() is stopped before it trains.
FLAG_CASES = {  # id: (argv, needles)
    "epochs -1": (["--epochs=-1"], ["--epochs=-1", "positive integer"]),
    "epochs 0": (["--epochs=0"], ["--epochs=0", "positive integer"]),
    "epochs x": (["--epochs", "x"], ["--epochs=x", "int()"]),
    "batch 0": (["--batch_size=0"], ["--batch_size=0", "positive integer"]),
    "batch -8": (["--batch_size=-8"], ["--batch_size=-8", "positive integer"]),
    "steps 0": (["--steps_per_epoch=0"], ["--steps_per_epoch=0", "positive integer"]),
    "num_packs -1": (["--num_packs=-1"], ["--num_packs=-1", "non-negative integer"]),
    "num_packs two": (["--num_packs=two"], ["--num_packs=two"]),
    "cross_device_ops": (["--cross_device_ops=ring"], ["--cross_device_ops=ring", "<auto|autotune|nccl|"]),
    "dataset": (["--dataset=cifar"], ["--dataset=cifar", "<auto|mnist|digits>"]),
    "num_packs with collective": (["--cross_device_ops=collective", "--num_packs=2"],
                                  ["num_packs=2", "['nccl', 'hierarchical']"]),
    "gpus abc": (["--gpus=abc"], ["gpus='abc'", "'all' / 'auto'"]),
    "gpus 0,0": (["--gpus=0,0"], ["gpus='0,0'", "twice"]),
    "model_dir is a file": (["--model_dir={file}"], ["--model_dir='{file}'", "directory"]),
    "positional": (["extra"], ["Unexpected arguments", "extra"]),
}
FLAGS_SCRIPT = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {examples!r})
    import mnist_mlp
    from absl import app, flags
    from tf_nvlink.distribute import single_host

    class ReachedTraining(Exception):
        pass

    def stop(*args, **kwargs):
        raise ReachedTraining()

    mnist_mlp.digits_data.load_mnist_or_fallback = stop  # main() loads the data right before training
    out = {{}}
    for name, argv in json.loads({cases!r}).items():
        single_host._CURRENT.clear()  # a case that got as far as building a strategy must not block the next
        flags.FLAGS.unparse_flags()
        try:
            rest = flags.FLAGS(["mnist_mlp.py", "--dataset=digits", "--model_dir={model_dir}"] + argv)
            mnist_mlp.main(rest)
            out[name] = "accepted (main() finished?!)"
        except ReachedTraining:
            out[name] = "accepted: reached training"
        except (flags.Error, app.UsageError) as error:
            out[name] = type(error).__name__ + ": " + str(error)
    try:
        mnist_mlp.replica_batch(7, 2)
    except app.UsageError as error:
        out["replica_batch 7 over 2"] = "UsageError: " + str(error)
    print("FLAGS " + json.dumps(out))
    """)


@pytest.fixture(scope="module")
def flag_results(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("flags")
    not_a_dir = scratch / "a_file"
    not_a_dir.write_text("not a directory")
    cases = {name: [arg.format(file=not_a_dir) for arg in argv] for name, (argv, _) in FLAG_CASES.items()}
    code = FLAGS_SCRIPT.format(examples=EXAMPLES, cases=json.dumps(cases), model_dir=scratch / "model")
    result = run_python(code, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("FLAGS ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr[-3000:]
    return json.loads(lines[-1][len("FLAGS "):]), not_a_dir


@pytest.mark.parametrize("name", sorted(FLAG_CASES))
def test_bad_example_flags(flag_results, name):
    results, not_a_dir = flag_results
    message = results[name]
    assert message.startswith(("IllegalFlagValueError", "UsageError")), message
    for needle in FLAG_CASES[name][1]:
        assert needle.format(file=not_a_dir) in message, (needle, message)


def test_global_batch_not_divisible_by_replicas_is_a_clear_error(flag_results):
    message = flag_results[0]["replica_batch 7 over 2"]
    assert "--batch_size=7 (the global batch) is not divisible by the 2 replicas" in message, message
    assert "e.g. 6 or 8" in message, message


# ================================================================== 2. degradation: one warning, a stated fallback
NVML_CALLS = {  # every call the probe makes -> the words its warning uses
    "nvmlInit": "nvmlInit failed", "nvmlSystemGetDriverVersion": "driver version",
    "nvmlSystemGetNVMLVersion": "NVML version", "nvmlDeviceGetCount": "device count",
    "nvmlDeviceGetHandleByIndex": "handle", "nvmlDeviceGetPciInfo": "PCI info", "nvmlDeviceGetName": "name",
    "nvmlDeviceGetUUID": "UUID", "nvmlDeviceGetCudaComputeCapability": "compute capability",
    "nvmlDeviceGetMemoryInfo": "memory", "nvmlDeviceGetNvLinkState": "state",
    "nvmlDeviceGetNvLinkVersion": "version", "nvmlDeviceGetNvLinkRemoteDeviceType": "remote type",
    "nvmlDeviceGetNvLinkRemotePciInfo": "remote PCI", "nvmlDeviceGetP2PStatus": "P2P status",
    "nvmlDeviceGetTopologyCommonAncestor": "PCIe topology", "nvmlShutdown": None,
}
# Calls without which a GPU (or all of them) cannot be used: even NotSupported must be said.
LOSES_GPUS = {"nvmlInit", "nvmlDeviceGetCount", "nvmlDeviceGetHandleByIndex", "nvmlDeviceGetPciInfo"}
ERRORS = {"NotSupported": pynvml.NVML_ERROR_NOT_SUPPORTED, "Unknown": pynvml.NVML_ERROR_UNKNOWN,
          "GpuIsLost": pynvml.NVML_ERROR_GPU_IS_LOST, "NoPermission": pynvml.NVML_ERROR_NO_PERMISSION}


# NVLink traffic calls (issue 17), not the probe's: nvml.NvLinkCounterReader's (its failures are tested in
# test_monitor.py) and the old utilization counter it does not use. The fake answers them; the table above is the
# probe's.
COUNTER_CALLS = {"nvmlDeviceGetMigMode", "nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkUtilizationCounter"}


def test_nvml_call_table_is_complete():
    assert set(NVML_CALLS) | {"nvmlDeviceGetNvLinkCapability"} == {
        name for name in dir(FakeNvml) if name.startswith("nvml")} - COUNTER_CALLS
    assert not COUNTER_CALLS & set(NVML_CALLS)


@pytest.mark.parametrize("machine", ["h200_x2", "dgx1_v100_x8", "pcie_x4"])
@pytest.mark.parametrize("error", sorted(ERRORS))
@pytest.mark.parametrize("call", sorted(NVML_CALLS))
def test_any_nvml_call_failing_never_breaks_the_probe(machine, call, error):
    fake = FakeNvml(machine_of(machine, failing_calls={call: ERRORS[error]}))
    topo = nvml.probe(fake)  # never raises
    assert fake.init_calls == (0 if call == "nvmlInit" else 1)
    assert fake.shutdown_calls == (0 if call in ("nvmlInit", "nvmlShutdown") else 1)  # paired whenever possible
    said = " ".join((topo.error or "",) + topo.warnings)
    if call in LOSES_GPUS:  # every GPU is lost this way: said, with the fallback
        assert topo.gpus == () and NVML_CALLS[call] in said, said
        assert "left out" in said or "no GPU listed" in said or "falls back to the CPU" in said, said
    elif error != "NotSupported" and NVML_CALLS[call] and call in fake.calls:
        assert NVML_CALLS[call] in said, said  # a real failure is reported, naming the call
        assert len(topo.gpus) == len(fake.machine.gpus)  # and costs only that fact
    if topo.warnings:
        line = nvml.warnings_line(topo.warnings)
        assert "\n" not in line and line.startswith(topo.warnings[0])
        if len(topo.warnings) > 1:
            assert f"and {len(topo.warnings) - 1} more NVML warning" in line


def test_nvml_init_raising_oserror_is_a_plain_error():
    fake = FakeNvml(fake_nvml.h200_x2())

    def broken():
        raise OSError("libnvidia-ml.so.1: cannot open shared object file")

    fake.nvmlInit = broken
    topo = nvml.probe(fake)
    assert topo.gpus == () and "cannot load NVML" in topo.error and "falls back to the CPU" in topo.error


def test_pynvml_not_installed_is_a_plain_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    topo = nvml.probe()
    assert topo.gpus == () and "pip install nvidia-ml-py" in topo.error and "falls back to the CPU" in topo.error


def test_real_nvml_library_missing_on_this_machine():
    topo = nvml.probe()
    if topo.gpus:
        pytest.skip(f"this machine has {len(topo.gpus)} NVIDIA GPU(s)")
    assert topo.error.startswith("no NVIDIA driver / NVML: ") and "falls back to the CPU" in topo.error
    assert "\n" not in topo.error


# The strategy's own degradations, through tf_nvlink.distribute.single_host._build on this GPU-less machine, one subprocess.
# Each case: topology (fake machine name and failing calls), what TensorFlow is made to see, the request.
DEGRADE_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys
    sys.path.insert(0, {tests!r})
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import pynvml, fake_nvml
    from tensorflow.python.framework import kernels
    from tf_nvlink.machine import nvml

    from tf_nvlink.distribute import single_host
    records = []
    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())
    logging.getLogger("tf_nvlink").addHandler(Collect())

    real_list_physical, real_list_logical = tf.config.list_physical_devices, tf.config.list_logical_devices
    real_kernels, real_cuda = kernels.get_registered_kernels_for_op, tf.test.is_built_with_cuda
    cases = json.loads({cases!r})
    out = {{}}
    for name, case in cases.items():
        records.clear()
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        os.environ.update(case.get("env", {{}}))
        machine = fake_nvml.MACHINES[case["machine"]]()
        machine.failing_calls = {{call: getattr(pynvml, code) for call, code in case.get("failing", {{}}).items()}}
        topology = nvml.probe(fake_nvml.FakeNvml(machine))
        tf_gpus = case.get("tf_gpus", 0)
        tf.config.list_physical_devices = lambda kind=None: (
            [tf.config.PhysicalDevice(f"/physical_device:GPU:{{i}}", "GPU") for i in range(tf_gpus)]
            if kind == "GPU" else real_list_physical(kind))
        tf.config.list_logical_devices = lambda kind=None: (
            real_list_logical("CPU") if kind == "GPU" and tf_gpus else real_list_logical(kind))
        tf.test.is_built_with_cuda = (lambda: False) if case.get("no_cuda_build") else real_cuda
        kernels.get_registered_kernels_for_op = (
            (lambda op: type("K", (), {{"kernel": []}})()) if case.get("no_nccl") else real_kernels)
        try:
            built, plan = single_host._build(case.get("gpus", "all"), case.get("ops", "auto"), None,
                                            case.get("devices"), topology, case.get("xla", "auto"))
            result = {{"plan": plan.to_dict(), "replicas": built.num_replicas_in_sync}}
        except Exception as error:
            result = {{"error": type(error).__name__ + ": " + str(error)}}
        result["warnings"] = list(records)
        out[name] = result
    print("DEGRADE " + json.dumps(out))
    """)
TWO_CPUS = ["/cpu:0", "/cpu:1"]
DEGRADE_CASES = {
    # NVML lists 2 H200s, TensorFlow (no driver here) lists none: this machine with a fake topology.
    "nvml sees GPUs, TensorFlow none": dict(machine="h200_x2"),
    "CUDA_VISIBLE_DEVICES hides every GPU": dict(machine="h200_x2", env={"CUDA_VISIBLE_DEVICES": ""}),
    "TensorFlow built without CUDA": dict(machine="h200_x2", no_cuda_build=True),
    "no NVML, no GPU": dict(machine="no_driver"),
    "TensorFlow sees GPUs, NVML none": dict(machine="no_driver", tf_gpus=2),
    "NVML Unknown on every link": dict(machine="h200_x2", tf_gpus=2, devices=TWO_CPUS,
                                       failing={"nvmlDeviceGetNvLinkVersion": "NVML_ERROR_UNKNOWN"}),
    "NVML NotSupported on P2P": dict(machine="h200_x2", tf_gpus=2, devices=TWO_CPUS,
                                     failing={"nvmlDeviceGetP2PStatus": "NVML_ERROR_NOT_SUPPORTED"}),
    "no NCCL kernels, auto": dict(machine="h200_x2", tf_gpus=2, devices=TWO_CPUS, no_nccl=True),
    "no NCCL kernels, nccl asked": dict(machine="h200_x2", tf_gpus=2, devices=TWO_CPUS, no_nccl=True, ops="nccl"),
    "no NCCL kernels, one GPU": dict(machine="h200_x2", tf_gpus=2, devices=["/cpu:0"], no_nccl=True, gpus="0"),
    "NCCL present": dict(machine="h200_x2", tf_gpus=2, devices=TWO_CPUS),
    "devices as one string": dict(machine="no_driver", devices="/cpu:0"),
    "devices empty": dict(machine="no_driver", devices=[]),
    "devices not names": dict(machine="no_driver", devices=["/cpu:0", 1]),
}


@pytest.fixture(scope="module")
def degraded(tmp_path_factory):
    code = DEGRADE_SCRIPT.format(tests=str(ROOT / "tests"), cases=json.dumps(DEGRADE_CASES))
    env = {"TF_NVLINK_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}  # no stored tune winner
    result = run_python(code, env=env, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("DEGRADE ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr[-3000:]
    return json.loads(lines[-1][len("DEGRADE "):])


def _one_warning(result, *needles):
    assert len(result["warnings"]) == 1, result["warnings"]
    for needle in needles:
        assert needle in result["warnings"][0], (needle, result["warnings"][0])
    return result["warnings"][0]


def test_nvml_sees_gpus_tensorflow_none_falls_back_to_the_cpu(degraded):
    result = degraded["nvml sees GPUs, TensorFlow none"]
    line = _one_warning(result, "NVML sees 2 GPU(s) but TensorFlow sees none", "falling back to the CPU")
    assert result["plan"]["gpus"] == [] and result["plan"]["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert "CUDA_VISIBLE_DEVICES" not in line and "could not initialise CUDA" in line, line


def test_cuda_visible_devices_hiding_every_gpu_is_named(degraded):
    result = degraded["CUDA_VISIBLE_DEVICES hides every GPU"]
    _one_warning(result, "TensorFlow sees none", "CUDA_VISIBLE_DEVICES", "falling back to the CPU")
    assert result["plan"]["gpus"] == []


def test_tensorflow_without_cuda_is_named(degraded):
    result = degraded["TensorFlow built without CUDA"]
    _one_warning(result, "built without CUDA", "tensorflow[and-cuda]", "falling back to the CPU")


def test_no_nvml_and_no_gpu_warns_once(degraded):
    result = degraded["no NVML, no GPU"]
    assert result["plan"]["gpus"] == [] and result["plan"]["cross_device_ops"] == "reduce_to_one"
    _one_warning(result, "no NVIDIA driver / NVML", "Driver Not Loaded", "falls back to the CPU")


def test_tensorflow_sees_gpus_nvml_none_uses_tensorflows_default(degraded):
    result = degraded["TensorFlow sees GPUs, NVML none"]
    _one_warning(result, "TensorFlow sees 2 GPU(s) but NVML does not", "no NVIDIA driver / NVML",
                 "TensorFlow's default all-reduce")
    assert result["plan"]["cross_device_ops"] == "collective" and result["replicas"] == 2


def test_nvml_unknown_errors_are_one_warning_line(degraded):
    result = degraded["NVML Unknown on every link"]
    assert result["plan"]["gpus"] == [0, 1] and result["replicas"] == 2  # planned with what NVML did answer
    _one_warning(result, "NVLink 0 version failed: Unknown Error", "and 35 more NVML warnings", "tf-nvlink report")


def test_nvml_not_supported_is_silent(degraded):
    result = degraded["NVML NotSupported on P2P"]
    assert result["warnings"] == [] and result["plan"]["cross_device_ops"] == "nccl"


def test_nccl_kernels_missing_falls_back_to_a_non_nccl_choice(degraded):
    for name in ("no NCCL kernels, auto", "no NCCL kernels, nccl asked"):
        result = degraded[name]
        _one_warning(result, "no NCCL GPU kernels", "reduce_to_one instead of nccl", "split")
        plan = result["plan"]
        assert (plan["cross_device_ops"], plan["num_packs"], plan["xla_allreduce"]) == ("reduce_to_one", None, "split")
        assert plan["reason"].startswith("NCCL kernels missing") and result["replicas"] == 2
    present = degraded["NCCL present"]
    assert present["warnings"] == [] and present["plan"]["cross_device_ops"] == "nccl"


def test_nccl_kernels_missing_is_not_mentioned_where_nccl_is_not_used(degraded):
    result = degraded["no NCCL kernels, one GPU"]
    assert result["plan"]["cross_device_ops"] == "reduce_to_one" and result["plan"]["xla_allreduce"] == "split"
    assert result["warnings"] == []


@pytest.mark.parametrize("name", ["devices as one string", "devices empty", "devices not names"])
def test_bad_devices_argument(degraded, name):
    error = degraded[name].get("error", "")
    devices = DEGRADE_CASES[name]["devices"]
    assert error.startswith("ValueError: ") and f"devices={devices!r}" in error and "['/gpu:0', '/gpu:1']" in error


# ================================================================== 3. no lost training
def _example_env(tmp_path):
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", TF_NVLINK_CACHE_DIR=str(tmp_path / "cache"))


def _read_lines(stream, lines):
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


def test_sigkill_mid_training_then_rerun_resumes_at_the_right_epoch(tmp_path):
    """The acceptance test: SIGKILL a real training process after epoch 2, rerun the same command."""
    model_dir = tmp_path / "model"
    command = [sys.executable, MNIST_MLP, "--dataset", "digits", "--epochs", "6", "--model_dir", str(model_dir)]
    env = _example_env(tmp_path)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    seen, lines = [], queue.Queue()
    reader = threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # "Epoch 3/6" is printed once epochs 1-2 and their checkpoints and backup are written
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail("no 'Epoch 3/6' within 120 s:\n" + "".join(seen))
            assert line is not None, "training ended before epoch 3:\n" + "".join(seen)
            seen.append(line)
            if line.startswith("Epoch 3/6"):
                break
        os.kill(process.pid, signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        reader.join(timeout=30)
        process.stdout.close()
    killed_output = "".join(seen)
    assert "Epoch 6/6" not in killed_output and "test accuracy" not in killed_output, killed_output

    metadata = json.loads((model_dir / "backup" / "training_metadata.json").read_text())
    done = metadata["epoch"]  # 2, or more if epoch 3 finished between the line and the kill
    assert 2 <= done < 6, metadata
    checkpoints = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
    assert checkpoints[:done] == [f"epoch_{e:03d}.keras" for e in range(1, done + 1)], checkpoints
    assert all(zipfile.is_zipfile(model_dir / "checkpoints" / name) for name in checkpoints if not name.startswith(
        ".")), checkpoints  # whole files, never torn ones

    resumed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    out = resumed.stdout
    assert resumed.returncode == 0, out + resumed.stderr[-3000:]
    assert f"found {model_dir}/backup: resuming the interrupted run at epoch {done + 1}/6" in out, out
    epochs = [int(e) for e in re.findall(r"^Epoch (\d)/6$", out, re.M)]
    assert epochs == list(range(done + 1, 7)) and epochs[0] != 1, out  # from where it stopped, to the end
    assert re.search(r"^Epoch 6/6$", out, re.M), out
    accuracy = float(re.search(r"^test accuracy: (\d\.\d{4})$", out, re.M).group(1))
    assert accuracy >= 0.8, out
    assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == [
        f"epoch_{e:03d}.keras" for e in range(1, 7)]
    assert (model_dir / "model.keras").is_file() and not (model_dir / "backup").exists()


def test_killed_after_the_last_epoch_before_the_save_loses_nothing(tmp_path):
    """The backup outlives fit(): a kill before model.keras is written reruns into evaluate-and-save only."""
    model_dir = tmp_path / "model"
    flags = ["--dataset", "digits", "--epochs", "2", "--steps_per_epoch", "3", "--batch_size", "64",
             "--model_dir", str(model_dir)]
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.argv = [{MNIST_MLP!r}] + {flags!r}
        sys.path.insert(0, {EXAMPLES!r})
        import mnist_mlp
        from absl import app
        mnist_mlp.evaluate_and_save = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        app.run(mnist_mlp.main)
        """)
    killed = run_python(code, env={"TF_NVLINK_CACHE_DIR": str(tmp_path / "cache")}, timeout=120)
    assert killed.returncode == -signal.SIGKILL and "Epoch 2/2" in killed.stdout, killed.stdout + killed.stderr
    assert not (model_dir / "model.keras").exists() and (model_dir / "backup").is_dir()

    rerun = run_python([MNIST_MLP, *flags], env={"TF_NVLINK_CACHE_DIR": str(tmp_path / "cache")}, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr[-3000:]
    assert "resuming: all 2 epochs had finished; evaluating and saving" in rerun.stdout, rerun.stdout
    assert not re.search(r"^Epoch ", rerun.stdout, re.M) and "test accuracy: " in rerun.stdout, rerun.stdout
    assert (model_dir / "model.keras").is_file() and not (model_dir / "backup").exists()


# The backup at every instant a kill can hit it: the interrupted save's temporary files are left behind (as a
# real kill leaves them), and a fresh process must resume from a consistent (epoch, weights) pair.
BACKUP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    sys.path.insert(0, {examples!r})
    import keras, mnist_mlp
    from tf_nvlink.training import callbacks

    from tf_nvlink.tools.training_bench import models
    from tf_nvlink.plan import tune_cache
    from tf_nvlink.util.text import strict_loads
    from tf_nvlink.plan import tune_cache
    backup = {backup!r}
    x = np.random.default_rng(0).random((64, 784)).astype("float32")
    y = np.arange(64) % 10

    def model():
        m = models.compiled_mnist_mlp()
        m.build((None, 784))
        return m

    def weights(m):
        return [w.copy() for w in m.get_weights()]

    class Killed(BaseException):
        pass

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
    out = {{}}
    for point in ["weights rename", "metadata rename", None]:  # the n-th os.replace of the save is killed
        real_replace, calls = os.replace, []
        def replace(src, dst, point=point):
            calls.append(dst)
            step = {{"weights rename": 1, "metadata rename": 2}}.get(point)
            if len(calls) == step:
                with open(src, "wb") as torn:  # a kill leaves the half-written temporary behind
                    torn.write(b"torn")
                raise Killed()
            return real_replace(src, dst)
        tune_cache.os.replace = replace
        callback = callbacks.AtomicBackupAndRestore(backup)
        callback.set_model(first)
        callback._current_epoch = 2
        unlink = os.unlink
        os.unlink = lambda path: None  # a killed process cleans nothing up
        try:
            callback._save_model()
        except Killed:
            pass
        finally:
            tune_cache.os.replace, os.unlink = real_replace, unlink
        resumed = resume()
        got = weights(resumed)
        out[str(point)] = {{
            "epoch": resumed._initial_epoch,
            "weights_of": [e for e, w in ((1, after_1), (2, after_2))
                           if all(np.array_equal(a, b) for a, b in zip(got, w))],
            "files": sorted(os.listdir(backup)),
        }}
    with open(os.path.join(backup, "training_metadata.json"), "w") as f:
        f.write('{{"epoch": 2, "batch": 0, "weig')  # what Keras' own callback leaves after a kill mid-write
    try:
        callbacks.read_backup(backup)
        out["torn"] = "read?!"
    except ValueError as error:
        out["torn"] = str(error)
    for text in ['{{"epoch": NaN, "weights": "epoch_0002.weights.h5"}}',
                 '{{"epoch": 1, "epoch": 2, "weights": "epoch_0002.weights.h5"}}',
                 '{{"epoch": 2, "weights": "../../etc/passwd"}}', '{{"epoch": -1}}', '[2]']:
        with open(os.path.join(backup, "training_metadata.json"), "w") as f:
            f.write(text)
        try:
            callbacks.read_backup(backup)
            out[text] = "read?!"
        except ValueError as error:
            out[text] = str(error)
    print("BACKUP " + json.dumps(out))
    """)


def test_backup_is_consistent_whenever_the_save_is_killed(tmp_path):
    backup = tmp_path / "backup"
    result = run_python(BACKUP_SCRIPT.format(examples=EXAMPLES, backup=str(backup)), timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BACKUP ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr[-3000:]
    out = json.loads(lines[-1][len("BACKUP "):])
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


def test_write_atomic_keeps_the_old_file_when_killed(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    atomic_files.write_atomic(str(path), '{"old": true}\n')

    class Killed(BaseException):
        pass

    def killed(*args):
        raise Killed()

    monkeypatch.setattr(tune_cache.os, "replace", killed)
    with pytest.raises(Killed):
        atomic_files.write_atomic(str(path), '{"new": true}\n')
    monkeypatch.undo()
    assert path.read_text() == '{"old": true}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # the temporary went too


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_file_modes(tmp_path, umask):
    """The cache is user-only whatever the umask; write_atomic(mode=None) honours the umask like open()."""
    old = os.umask(umask)
    try:
        key = tune_cache.store(_record(), path=str(tmp_path / "cache" / "autotune.json"))
        atomic_files.write_atomic(str(tmp_path / "shared.json"), "{}\n", mode=None)
        with atomic_files.atomic_path(str(tmp_path / "model.keras"), suffix=".keras") as partial:
            assert partial.endswith(".keras") and Path(partial).name.startswith(".model.keras.")
            Path(partial).write_bytes(b"zip")
    finally:
        os.umask(old)
    assert key in tune_cache.entries(str(tmp_path / "cache" / "autotune.json"))
    assert stat.S_IMODE((tmp_path / "cache").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "cache" / "autotune.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "cache" / "autotune.json.lock").stat().st_mode) & 0o077 == 0
    assert stat.S_IMODE((tmp_path / "shared.json").stat().st_mode) == 0o666 & ~umask
    assert stat.S_IMODE((tmp_path / "model.keras").stat().st_mode) == 0o666 & ~umask
    assert not list(tmp_path.rglob(".*"))  # no temporary left anywhere


def _record():
    return {"fingerprint": "abc123", "tf_version": "2.21.0", "gpus": [0, 1], "candidate": "nccl:1",
            "cross_device_ops": "nccl", "num_packs": 1, "score": 200.0, "sizes": [1024], "scores": {"nccl:1": 200.0},
            "n_replicas": 2, "measured_at": "2026-11-30T00:00:00+00:00"}


# ================================================================== 4. security basics (and every file write)
SHELL_CALLS = {"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput", "commands.getoutput"}
SUBPROCESS_CALLS = {"subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
                    "subprocess.check_output"}
WRITE_METHODS = {"save", "save_weights", "savefig", "write_text", "write_bytes", "tofile"}
WRITE_FUNCTIONS = {"json.dump", "np.save", "np.savez", "np.savez_compressed", "numpy.save", "pickle.dump",
                   "shutil.copy", "shutil.copyfile", "shutil.copy2"}
# Saves that are atomic by TensorFlow's own design: tf.train.CheckpointManager.save writes the shards under
# "<prefix>_temp/" and merges them into place (MergeV2Checkpoints), then rewrites the "checkpoint" state file with
# file_io.atomic_write_string_to_file; a kill leaves latest_checkpoint at the previous complete checkpoint.
ATOMIC_BY_TENSORFLOW = {("examples/custom_loop.py", "manager.save")}


def _name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


class _Audit(ast.NodeVisitor):
    """Shell use, string-built commands, and file writes not inside `with ...atomic_path(...)` (or atomic_files.py's own
    atomic helpers)."""

    def __init__(self, relative):
        self.relative, self.atomic_depth, self.function = relative, 0, ""
        self.shell, self.writes = [], []

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    def visit_With(self, node):
        atomic = any(_name(item.context_expr).endswith("atomic_path") for item in node.items)
        self.atomic_depth += atomic
        self.generic_visit(node)
        self.atomic_depth -= atomic

    def visit_Call(self, node):
        name, where = _name(node.func), f"{self.relative}:{node.lineno}"
        if name in SHELL_CALLS or name.startswith("os.exec") and name.endswith("p"):
            self.shell.append(f"{where} {name}")
        for keyword in node.keywords:
            if keyword.arg == "shell" and not (isinstance(keyword.value, ast.Constant) and not keyword.value.value):
                self.shell.append(f"{where} shell={ast.unparse(keyword.value)}")
        if name in SUBPROCESS_CALLS and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr,
                                                                                 ast.BinOp)):
            self.shell.append(f"{where} {name} with a string command {ast.unparse(node.args[0])[:60]}")
        kind = None
        if name == "open":
            mode = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "mode"), ast.Constant("r"))
            if not isinstance(mode, ast.Constant) or set(str(mode.value)) & set("wax+"):
                kind = "open"
        elif name in WRITE_FUNCTIONS:
            kind = name
        elif isinstance(node.func, ast.Attribute) and node.func.attr in WRITE_METHODS \
                and (self.relative, name) not in ATOMIC_BY_TENSORFLOW:
            kind = node.func.attr
        atomic_helper = self.relative == "tf_nvlink/util/atomic_files.py" and self.function in ("write_atomic", "atomic_path")
        if kind and not self.atomic_depth and not atomic_helper:
            self.writes.append((self.relative, kind, where))
        self.generic_visit(node)


@pytest.fixture(scope="module")
def audit():
    shell, writes = [], []
    for path in SOURCES:
        visitor = _Audit(str(path.relative_to(ROOT)))
        visitor.visit(ast.parse(path.read_text(), str(path)))
        shell += visitor.shell
        writes += visitor.writes
    return shell, writes


def test_no_shell_and_no_string_built_commands(audit):
    shell, _ = audit
    assert shell == []


def test_every_file_write_is_atomic(audit):
    _, writes = audit
    assert writes == [], "non-atomic writes; use atomic_files.write_atomic or `with atomic_files.atomic_path(...)`: " + str(
        [where for _, _, where in writes])


def test_the_audit_sees_what_it_looks_for(tmp_path):
    source = textwrap.dedent("""
        import os, subprocess, json
        def f(path, cmd, data):
            subprocess.run(f"ls {cmd}", shell=True)
            subprocess.run("ls " + cmd)
            os.system(cmd)
            subprocess.run(["ls", cmd])  # fine
            with open(path, "w") as handle:
                json.dump(data, handle)
            with atomic_files.atomic_path(path) as partial:
                model.save(partial)  # fine
            open(path)  # a read: fine
        """)
    visitor = _Audit("x.py")
    visitor.visit(ast.parse(source))
    assert [entry.split(" ", 1)[1] for entry in visitor.shell] == [
        "shell=True", "subprocess.run with a string command f'ls {cmd}'",
        "subprocess.run with a string command 'ls ' + cmd", "os.system"]
    assert [kind for _, kind, _ in visitor.writes] == ["open", "json.dump"]


STRICT_JSON = ["NaN", "[Infinity]", '{"a": -Infinity}', "1e999", '{"a": 1, "a": 2}']


@pytest.mark.parametrize("text", STRICT_JSON)
def test_cache_json_is_parsed_strictly(text):
    with pytest.raises(ValueError):
        strict_loads(text)


def test_corrupt_cache_is_ignored_with_one_warning_and_replaced(tmp_path, caplog):
    path = tmp_path / "autotune.json"
    path.write_text('{"format": 1, "entries": {"k": {"score": NaN}}}')
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        assert tune_cache.entries(str(path)) == {}
        assert tune_cache.entries(str(path)) == {}  # the same bad file warns once
    assert len([r for r in caplog.records if r.name == "tf_nvlink"]) == 1
    assert "NaN is not valid JSON" in caplog.text and str(path) in caplog.text
    tune_cache.store(_record(), path=str(path))
    assert len(tune_cache.entries(str(path))) == 1


def test_topology_error_stays_one_line():
    """The no-NVML message is used as a log line: no newline in it whatever NVML said."""
    topo = topo_of("no_driver", init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    assert isinstance(topo, Topology) and "\n" not in topo.error
