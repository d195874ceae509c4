"""tf_nvlink.strategy() on logical CPU devices: real TensorFlow training, one strategy per process.

The strategy here mirrors over conftest's N_LOGICAL_CPUS logical CPU devices (a GPU-less machine mirrors over
its CPU devices); the tests that need another layout or another strategy run cases of a scenario process of 2
logical CPUs (tests/scenarios.py).
"""

import json

import numpy as np
import pytest

import fake_nvml
import scenarios
from conftest import N_LOGICAL_CPUS


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 20)).astype("float32")
    w = rng.normal(size=(20, 3)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def _build(keras):
    keras.utils.set_random_seed(7)
    return keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def _compile(model, keras, jit=False):
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  jit_compile=jit)


@pytest.fixture(scope="module")
def trained(tf, tmp_path_factory):
    """One strategy for the whole module (one per process): train, evaluate, predict, save."""
    import keras

    import tf_nvlink

    strategy = tf_nvlink.strategy()
    x, y = _data()
    with strategy.scope():
        model = _build(keras)
        _compile(model, keras)
    history = model.fit(x, y, batch_size=64, epochs=4, shuffle=False, verbose=0)
    path = tmp_path_factory.mktemp("saved") / "model.keras"
    model.save(path)
    return {"strategy": strategy, "model": model, "history": history.history, "x": x, "y": y, "path": path}


def test_strategy_is_a_real_mirrored_strategy_over_cpu_devices(trained, tf):
    import tf_nvlink

    strategy = trained["strategy"]
    assert isinstance(strategy, tf.distribute.MirroredStrategy)
    assert strategy.num_replicas_in_sync == N_LOGICAL_CPUS
    plan = tf_nvlink.current_plan()
    assert plan is strategy.plan and plan.on_cpu and plan.cross_device_ops == "reduce_to_one"
    assert len(plan.devices) == N_LOGICAL_CPUS and all("CPU" in d for d in plan.devices)
    assert "NCCL does not run on CPU" in plan.reason and plan.summary().startswith("tf_nvlink plan: CPU")
    json.dumps(plan.to_dict())


def test_same_request_returns_same_strategy_and_different_one_raises(trained):
    import tf_nvlink

    assert tf_nvlink.strategy() is trained["strategy"]
    with pytest.raises(RuntimeError, match="one MirroredStrategy per process.*own process"):
        tf_nvlink.strategy(cross_device_ops="collective")


def test_one_device_spelled_differently_is_one_request(tf):
    """Keras' own tests ask for ["CPU:0", "CPU:1"] in one module and ["cpu:0", "cpu:1"] in another: one request."""
    from tf_nvlink.distribute import single_host

    def key(devices):
        return single_host._request_key("all", "auto", None, devices, "auto")

    spellings = [["CPU:0", "CPU:1"], ["cpu:0", "cpu:1"], ["/cpu:0", "/CPU:1"], ["/device:CPU:0", "/device:cpu:1"],
                 ["/job:localhost/replica:0/task:0/device:CPU:0", "/job:localhost/replica:0/task:0/cpu:1"],
                 [" CPU:0 ", "cpu:1"]]
    assert len({key(devices) for devices in spellings}) == 1
    assert key(["CPU:1", "CPU:0"]) != key(["CPU:0", "CPU:1"])  # another replica order
    assert key(["GPU:0", "GPU:1"]) != key(["CPU:0", "CPU:1"])
    assert key(["/job:worker/task:1/device:CPU:0"]) != key(["CPU:0"])
    assert key(["not a device"]) == ("all", "auto", None, ("not a device",), "auto", key(None)[-1])


def test_training_lowers_loss_and_keeps_replicas_identical(trained):
    losses = trained["history"]["loss"]
    assert losses[-1] < losses[0] * 0.8
    for variable in trained["model"].trainable_variables:
        replicas = variable.value.values
        assert len(replicas) == N_LOGICAL_CPUS
        for replica in replicas[1:]:
            np.testing.assert_array_equal(replicas[0].numpy(), replica.numpy())


def test_evaluate_predict_save_and_load(trained):
    import keras

    model = trained["model"]
    loss, accuracy = model.evaluate(trained["x"], trained["y"], batch_size=64, verbose=0)
    assert loss == pytest.approx(trained["history"]["loss"][-1], rel=0.3) and accuracy > 0.5
    predictions = model.predict(trained["x"][:37], batch_size=8, verbose=0)  # 37: a ragged last batch
    assert predictions.shape == (37, 3)
    reloaded = keras.models.load_model(trained["path"])
    np.testing.assert_allclose(reloaded.predict(trained["x"][:37], verbose=0), predictions, rtol=1e-5, atol=1e-6)


_EQUIVALENCE_DATA_AND_FIT = r"""
import numpy as np
import keras


def equivalence_fit(jit):  # trains under the current strategy scope; returns the losses and the weights
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8, 8, 1)).astype("float32"); y = rng.integers(0, 4, 256).astype("int32")
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                              keras.layers.Flatten(), keras.layers.Dense(4)])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
    h = model.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    return {"loss": h.history["loss"], "weights": [w.ravel().tolist() for w in model.get_weights()],
            "jit": bool(model.jit_compile)}
"""

# Both modes under one tf_nvlink strategy of 2 logical CPUs, in a scenario process of the slow tier.
TWO_REPLICAS = scenarios.Scenario("single_host: two replicas", r"""
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import tf_nvlink
""" + _EQUIVALENCE_DATA_AND_FIT, {"two replicas": """
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
result = {}
for jit in (False, True):
    with strategy.scope():
        result["xla" if jit else "no_xla"] = equivalence_fit(jit)
"""}, slow=True)


def _single_device_run(tf, jit):
    """The reference, in this process: the default strategy (no mirroring) on one device."""
    namespace = {}
    exec(_EQUIVALENCE_DATA_AND_FIT, namespace)
    with tf.device("/cpu:0"):
        return namespace["equivalence_fit"](jit)


@pytest.mark.slow  # test_exact_batches.py: 2 CPU replicas train as one device, plain and split, in the default run
@pytest.mark.parametrize("jit", [False, True], ids=["no_xla", "xla"])
def test_two_replicas_match_single_device_training_with_the_same_global_batch(tf, jit):
    """Both modes under one tf_nvlink strategy of 2 logical CPUs (the scenario process's), against one device here."""
    assert not tf.distribute.has_strategy()
    single, plugin = _single_device_run(tf, jit), TWO_REPLICAS.result("two replicas")["xla" if jit else "no_xla"]
    assert plugin["jit"] == jit
    assert plugin["loss"][-1] < plugin["loss"][0]
    np.testing.assert_allclose(plugin["loss"], single["loss"], rtol=1e-4)
    for a, b in zip(single["weights"], plugin["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_without_nccl_kernels_the_plan_falls_back_and_says_so(tf):
    from fake_nvml import FakeNvml, h200_x2

    from tf_nvlink.machine import nvml


    from tf_nvlink.plan import policy

    from tf_nvlink.internals import tf_runtime as internals
    assert internals.nccl_kernels_registered() is True  # PyPI's TensorFlow is a CUDA build: NCCL's GPU kernel is there
    plan = policy.make_plan(nvml.probe(FakeNvml(h200_x2())))
    assert (plan.cross_device_ops, plan.xla_allreduce) == ("nccl", "fused")
    degraded, warning = policy.without_nccl(plan)
    assert (degraded.cross_device_ops, degraded.num_packs, degraded.xla_allreduce) == ("reduce_to_one", None, "split")
    assert "no NCCL GPU kernels" in warning and "reduce_to_one instead of nccl" in warning
    assert degraded.reason.startswith("NCCL kernels missing") and degraded.gpus == plan.gpus


# ---------------------------------------------------------------- what the strategy does on faked machines
# single_host._build (and strategy()) on this GPU-less machine with a fake NVML topology and faked TensorFlow device
# lists, each case in the scenario process of 2 logical CPUs (below). Each case: the fake machine and its failing
# NVML calls, what TensorFlow is made to see (tf_gpus, descs, no_cuda_build, no_nccl), the environment, the request.
_TWO_CPUS_PRELUDE = r"""
import json, logging, os
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import pynvml, fake_nvml
from tensorflow.python.framework import kernels
from tf_nvlink.internals import tf_runtime as internals
from tf_nvlink.machine import nvml
from tf_nvlink.distribute import single_host

records = []
class Collect(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            records.append(record.getMessage())
logging.getLogger("tf_nvlink").addHandler(Collect())

def faked_machine(case):  # one faked machine: the plan, or the error, and the warnings
    records.clear()
    for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TF_CONFIG"):
        os.environ.pop(key, None)
    os.environ.update(case.get("env", {}))
    machine = fake_nvml.mixed_t4_a100() if case["machine"] == "mixed" else fake_nvml.MACHINES[case["machine"]]()
    machine.failing_calls = {call: getattr(pynvml, code) for call, code in case.get("failing", {}).items()}
    topology = nvml.probe(fake_nvml.FakeNvml(machine))
    tf_gpus = case.get("tf_gpus", 0)
    real = (tf.config.list_physical_devices, tf.config.list_logical_devices, internals.tf_gpu_descs,
            tf.test.is_built_with_cuda, kernels.get_registered_kernels_for_op)
    tf.config.list_physical_devices = lambda kind=None: (
        [tf.config.PhysicalDevice(f"/physical_device:GPU:{i}", "GPU") for i in range(tf_gpus)]
        if kind == "GPU" else real[0](kind))
    tf.config.list_logical_devices = lambda kind=None: real[1]("CPU")[:tf_gpus] if kind == "GPU" else real[1](kind)
    if "descs" in case:
        internals.tf_gpu_descs = lambda: [tuple(d) for d in case["descs"]]
    if case.get("no_cuda_build"):
        tf.test.is_built_with_cuda = lambda: False
    if case.get("no_nccl"):
        kernels.get_registered_kernels_for_op = lambda op: type("K", (), {"kernel": []})()
    try:
        if case.get("call") == "strategy":
            kwargs = dict(case["kwargs"])
            if kwargs.get("topology") == "FAKE":
                kwargs["topology"] = topology
            single_host.strategy(**kwargs)
            result = {"error": None}
        else:
            built, plan = single_host._build(case.get("gpus", "all"), case.get("ops", "auto"), None,
                                             case.get("devices"), topology, case.get("xla", "auto"))
            result = {"plan": plan.to_dict(), "summary": plan.summary(), "replicas": built.num_replicas_in_sync}
    except Exception as error:
        result = {"error": type(error).__name__ + ": " + str(error)}
    finally:
        (tf.config.list_physical_devices, tf.config.list_logical_devices, internals.tf_gpu_descs,
         tf.test.is_built_with_cuda, kernels.get_registered_kernels_for_op) = real
        for key in case.get("env", {}):
            os.environ.pop(key, None)
    result["warnings"] = list(records)
    return result
"""
# The degradations: one warning naming the cause and the fallback.
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
MIG = "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"
REQUEST_CASES = {  # the strategy's requests, honoured or refused
    "mixed, CUDA_VISIBLE_DEVICES=0, gpus=all": dict(
        machine="mixed", env={"CUDA_VISIBLE_DEVICES": "0"}, tf_gpus=1, descs=[fake_nvml.A100_AS_CUDA_0],
        devices=["/cpu:0"]),
    "mixed, CUDA_VISIBLE_DEVICES=0, gpus=[1]": dict(
        machine="mixed", env={"CUDA_VISIBLE_DEVICES": "0"}, tf_gpus=1, descs=[fake_nvml.A100_AS_CUDA_0],
        devices=["/cpu:0"], gpus=[1]),
    "mixed, CUDA_VISIBLE_DEVICES=0, gpus=[0]": dict(
        machine="mixed", env={"CUDA_VISIBLE_DEVICES": "0"}, tf_gpus=1, descs=[fake_nvml.A100_AS_CUDA_0],
        devices=["/cpu:0"], gpus=[0]),
    "MIG, gpus=all": dict(machine="h200_x2", env={"CUDA_VISIBLE_DEVICES": MIG}, tf_gpus=1),
    "MIG, gpus=0": dict(machine="h200_x2", env={"CUDA_VISIBLE_DEVICES": MIG}, tf_gpus=1, gpus="0"),
    "gpus=0, TensorFlow sees no GPU": dict(machine="h200_x2", gpus="0"),
    "gpus=[0], no driver": dict(machine="no_driver", gpus=[0]),
    "gpus=all, TensorFlow sees no GPU": dict(machine="h200_x2"),
    "devices=[/gpu:9]": dict(machine="no_driver", devices=["/gpu:9"]),
    "duplicate devices": dict(machine="no_driver", devices=["/cpu:0", "/device:CPU:0"]),
    "topology='x'": dict(machine="no_driver", call="strategy", kwargs={"topology": "x"}),
    "peer_timeout_s=-5": dict(machine="no_driver", call="strategy",
                                    kwargs={"topology": "FAKE", "peer_timeout_s": -5}),
    "optimizer_states='zero'": dict(machine="no_driver", call="strategy",
                                    kwargs={"topology": "FAKE", "optimizer_states": "zero"}),
    "optimizer_states='sharded', 2 workers": dict(
        machine="no_driver", call="strategy", kwargs={"topology": "FAKE", "optimizer_states": "sharded"},
        env={"TF_CONFIG": '{"cluster": {"worker": ["localhost:12345", "localhost:12346"]}, '
                          '"task": {"type": "worker", "index": 0}}'}),
}

FAKED_MACHINE_CASES = {**DEGRADE_CASES, **REQUEST_CASES}


# The one case that builds a strategy (one per process), so it runs last: the same devices spelled as Keras' tests
# and TensorFlow's device listing spell them.
SPELLINGS_CASE = """
first = single_host.strategy(devices=["CPU:0", "CPU:1"], topology=nvml.probe(fake_nvml.FakeNvml(fake_nvml.no_driver())))
again = [single_host.strategy(devices=devices) is first for devices in (
    ["cpu:0", "cpu:1"], ["/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"])]
try:
    single_host.strategy(devices=["CPU:1", "CPU:0"])
    other_order = None
except RuntimeError as error:
    other_order = str(error)
result = {"again": again, "other_order": other_order}
"""

# Every faked machine in one scenario process of 2 logical CPUs.
TWO_CPUS_SCENARIO = scenarios.Scenario("single_host: faked machines on 2 CPUs", _TWO_CPUS_PRELUDE, {
    **{name: f"result = faked_machine(json.loads({json.dumps(case)!r}))" for name, case in FAKED_MACHINE_CASES.items()},
    "one device list, several spellings": SPELLINGS_CASE})


def test_the_same_devices_spelled_otherwise_return_the_same_strategy():
    result = TWO_CPUS_SCENARIO.result("one device list, several spellings")
    assert result["again"] == [True, True]
    assert result["other_order"] and "different request" in result["other_order"]


@pytest.fixture(scope="module")
def faked_machines():
    return {name: TWO_CPUS_SCENARIO.result(name) for name in FAKED_MACHINE_CASES}


def _one_warning(result, *needles):
    assert len(result["warnings"]) == 1, result["warnings"]
    for needle in needles:
        assert needle in result["warnings"][0], (needle, result["warnings"][0])
    return result["warnings"][0]


def test_nvml_sees_gpus_tensorflow_none_falls_back_to_the_cpu(faked_machines):
    result = faked_machines["nvml sees GPUs, TensorFlow none"]
    line = _one_warning(result, "NVML sees 2 GPU(s) but TensorFlow sees none", "falling back to the CPU")
    assert result["plan"]["gpus"] == [] and result["plan"]["devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert "CUDA_VISIBLE_DEVICES" not in line and "could not initialise CUDA" in line, line


def test_cuda_visible_devices_hiding_every_gpu_is_named(faked_machines):
    result = faked_machines["CUDA_VISIBLE_DEVICES hides every GPU"]
    _one_warning(result, "TensorFlow sees none", "CUDA_VISIBLE_DEVICES", "falling back to the CPU")
    assert result["plan"]["gpus"] == []


def test_tensorflow_without_cuda_is_named(faked_machines):
    result = faked_machines["TensorFlow built without CUDA"]
    _one_warning(result, "built without CUDA", "tensorflow[and-cuda]", "falling back to the CPU")


def test_no_nvml_and_no_gpu_warns_once(faked_machines):
    result = faked_machines["no NVML, no GPU"]
    assert result["plan"]["gpus"] == [] and result["plan"]["cross_device_ops"] == "reduce_to_one"
    _one_warning(result, "no NVIDIA driver / NVML", "Driver Not Loaded", "falls back to the CPU")


def test_tensorflow_sees_gpus_nvml_none_uses_tensorflows_default(faked_machines):
    result = faked_machines["TensorFlow sees GPUs, NVML none"]
    _one_warning(result, "TensorFlow sees 2 GPU(s) but NVML does not", "no NVIDIA driver / NVML",
                 "TensorFlow's default all-reduce")
    assert result["plan"]["cross_device_ops"] == "collective" and result["replicas"] == 2


def test_nvml_unknown_errors_are_one_warning_line(faked_machines):
    result = faked_machines["NVML Unknown on every link"]
    assert result["plan"]["gpus"] == [0, 1] and result["replicas"] == 2  # planned with what NVML did answer
    _one_warning(result, "NVLink 0 version failed: Unknown Error", "and 35 more NVML warnings", "tf-nvlink report")


def test_nvml_not_supported_is_silent(faked_machines):
    result = faked_machines["NVML NotSupported on P2P"]
    assert result["warnings"] == [] and result["plan"]["cross_device_ops"] == "nccl"


def test_nccl_kernels_missing_falls_back_to_a_non_nccl_choice(faked_machines):
    for name in ("no NCCL kernels, auto", "no NCCL kernels, nccl asked"):
        result = faked_machines[name]
        _one_warning(result, "no NCCL GPU kernels", "reduce_to_one instead of nccl", "split")
        plan = result["plan"]
        assert (plan["cross_device_ops"], plan["num_packs"], plan["xla_allreduce"]) == ("reduce_to_one", None, "split")
        assert plan["reason"].startswith("NCCL kernels missing") and result["replicas"] == 2
    present = faked_machines["NCCL present"]
    assert present["warnings"] == [] and present["plan"]["cross_device_ops"] == "nccl"


def test_nccl_kernels_missing_is_not_mentioned_where_nccl_is_not_used(faked_machines):
    result = faked_machines["no NCCL kernels, one GPU"]
    assert result["plan"]["cross_device_ops"] == "reduce_to_one" and result["plan"]["xla_allreduce"] == "split"
    assert result["warnings"] == []


@pytest.mark.parametrize("name", ["devices as one string", "devices empty", "devices not names"])
def test_bad_devices_argument(faked_machines, name):
    error = faked_machines[name].get("error", "")
    devices = FAKED_MACHINE_CASES[name]["devices"]
    assert error.startswith("ValueError: ") and f"devices={devices!r}" in error and "['/gpu:0', '/gpu:1']" in error


def test_strategy_maps_mixed_gpu_models_by_pci(faked_machines):
    assert faked_machines["mixed, CUDA_VISIBLE_DEVICES=0, gpus=all"]["plan"]["gpus"] == [1]
    assert faked_machines["mixed, CUDA_VISIBLE_DEVICES=0, gpus=[1]"]["plan"]["gpus"] == [1]
    error = faked_machines["mixed, CUDA_VISIBLE_DEVICES=0, gpus=[0]"]["error"]
    assert error.startswith("ValueError") and "valid GPU indices are [1]" in error, error


def test_strategy_uses_a_mig_instance_and_says_so(faked_machines):
    result = faked_machines["MIG, gpus=all"]
    assert result["replicas"] == 1 and result["plan"]["devices"] == ["/device:CPU:0"]  # the faked MIG device
    assert "MIG" in result["plan"]["reason"] and "no NVLink plan" in result["summary"], result["summary"]
    assert len(result["warnings"]) == 1 and MIG in result["warnings"][0] and "no NVLink" in result["warnings"][0]
    error = faked_machines["MIG, gpus=0"]["error"]
    assert error.startswith("ValueError") and "MIG" in error and "gpus='all'" in error, error


def test_strategy_explicit_gpus_raise_all_falls_back_to_the_cpu(faked_machines):
    error = faked_machines["gpus=0, TensorFlow sees no GPU"]["error"]
    assert error.startswith("ValueError") and "TensorFlow sees none" in error and "gpus='0'" in error, error
    error = faked_machines["gpus=[0], no driver"]["error"]
    assert error.startswith("ValueError") and "Driver Not Loaded" in error, error
    fallback = faked_machines["gpus=all, TensorFlow sees no GPU"]
    assert fallback["plan"]["gpus"] == [] and len(fallback["warnings"]) == 1
    assert "falling back to the CPU" in fallback["warnings"][0]


@pytest.mark.parametrize("name, needles", [
    ("devices=[/gpu:9]", ["'/gpu:9'", "does not have", "Received: devices=['/gpu:9']"]),
    ("duplicate devices", ["twice", "Received: devices="]),
    ("topology='x'", ["Topology", "Received: topology='x'"]),
    ("peer_timeout_s=-5", ["positive number", "Received: peer_timeout_s=-5"]),
    ("optimizer_states='zero'", ["['replicated', 'sharded']", "Received: optimizer_states='zero'"]),
    ("optimizer_states='sharded', 2 workers", ["single host only", "['replicated']",
                                               "Received: optimizer_states='sharded'"]),
])
def test_strategy_arguments_validated_up_front(faked_machines, name, needles):
    error = faked_machines[name]["error"]
    assert error and error.startswith("ValueError: "), error
    for needle in needles:
        assert needle in error, (needle, error)
