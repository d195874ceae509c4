"""Step options of the plan (tf_nvlink.plan.step_options.choose_step_options) and how the strategy applies them: XLA flags merged
into XLA_FLAGS (the user's win), gradients all-reduced in bfloat16, input prefetched to each replica's device."""

import dataclasses
import json
import os

import pytest

import fake_nvml
import scenarios
from conftest import run_python
from fake_nvml import FakeNvml
from tf_nvlink.plan import step_options

from tf_nvlink.machine import nvml
from tf_nvlink.plan import policy
LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
GRAPHS = "--xla_enable_command_buffers_during_profiling=true"  # every GPU plan


def plan_for(machine, gpus="all", xla_allreduce="auto"):
    return policy.make_plan(nvml.probe(FakeNvml(fake_nvml.MACHINES[machine]())), gpus,
                            xla_allreduce=xla_allreduce)


@pytest.mark.parametrize("machine, gpus, mode, expected", [
    ("h200_x2", "all", "auto", (GRAPHS, LHS)),   # 2 GPUs, fused: the all-reduce is inside XLA, overlap it
    ("h100_hgx_x8", "all", "auto", (GRAPHS, LHS)),
    ("h200_x2", "all", "split", (GRAPHS,)),      # all-reduce outside XLA: nothing for XLA's scheduler to overlap
    ("h200_x2", "0", "auto", (GRAPHS,)),         # one GPU: no collective at all
    ("no_driver", "all", "auto", ()),            # CPU
])
def test_xla_flags_chosen_for_gpus_and_fused_multi_gpu_xla(machine, gpus, mode, expected):
    plan = step_options.choose_step_options(plan_for(machine, gpus, mode))
    assert plan.xla_flags == expected and plan.xla_flags_kept == ()
    assert (LHS in plan.summary()) == (LHS in expected)
    assert plan.to_dict()["xla_flags"] == list(expected)


def test_users_xla_flags_win_and_are_recorded():
    user = "--xla_dump_to=/tmp/dump --xla_gpu_enable_latency_hiding_scheduler=false"
    plan = step_options.choose_step_options(plan_for("h200_x2"), user_xla_flags=user)
    assert plan.xla_flags == (GRAPHS,) and plan.xla_flags_kept == ("--xla_gpu_enable_latency_hiding_scheduler=false",)
    assert "user's XLA_FLAGS kept: --xla_gpu_enable_latency_hiding_scheduler=false" in plan.summary()
    value, added, kept = step_options.merge_xla_flags("--xla_dump_to=/tmp/dump", (LHS,))
    assert value == "--xla_dump_to=/tmp/dump " + LHS and added == (LHS,) and kept == ()
    assert step_options.merge_xla_flags("", ())[0] == ""


def test_xla_flags_none_and_explicit_lists():
    assert step_options.choose_step_options(plan_for("h200_x2"), xla_flags="none").xla_flags == ()
    explicit = ["--xla_gpu_all_reduce_combine_threshold_bytes=134217728", LHS]
    assert step_options.choose_step_options(plan_for("no_driver"), xla_flags=explicit).xla_flags == tuple(explicit)


@pytest.mark.parametrize("bad", ["on", "", ["--xla_made_up_flag=true"], ["xla_gpu_enable_latency_hiding_scheduler"],
                                 [LHS + " --x=1"], 3])
def test_bad_xla_flags_are_refused_naming_the_valid_choices(bad):
    with pytest.raises(ValueError, match="xla_flags") as info:
        step_options.choose_step_options(plan_for("h200_x2"), xla_flags=bad)
    assert "auto" in str(info.value) or "xla_gpu_enable_latency_hiding_scheduler" in str(info.value)


def test_allreduce_dtype_and_input_buffer():
    plan = step_options.choose_step_options(plan_for("h200_x2"), allreduce_dtype="bfloat16")
    assert plan.allreduce_dtype == "bfloat16" and "gradients all-reduced in bfloat16" in plan.summary()
    assert plan.input_buffer == step_options.GPU_INPUT_BUFFER == 1 and "1 batch deep" in plan.summary()
    assert step_options.choose_step_options(plan_for("no_driver")).input_buffer == 0  # CPU: TensorFlow's own options
    assert step_options.choose_step_options(plan_for("h200_x2"), input_buffer=1).input_buffer == 1
    with pytest.raises(ValueError, match="allreduce_dtype should be one of \\['float32', 'bfloat16'\\]"):
        step_options.choose_step_options(plan_for("h200_x2"), allreduce_dtype="float16")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="input_buffer should be a positive integer"):
            step_options.choose_step_options(plan_for("h200_x2"), input_buffer=bad)
    default = step_options.choose_step_options(plan_for("no_driver"))
    assert default.allreduce_dtype == "float32" and default.step_options_summary() == ""


def test_decide_chooses_the_step_options_for_the_final_plan():
    """policy.decide (what strategy() and the report call) picks the step options last: from the user's XLA_FLAGS in the
    facts, and after the NCCL fallback, which makes the plan split (no collective inside XLA: no flags)."""
    topo = nvml.probe(FakeNvml(fake_nvml.MACHINES["h200_x2"]()))
    plan, _ = policy.decide(policy.Facts(topo, tf_gpu_count=2), asked_options=("auto", "bfloat16", None))
    assert (plan.xla_allreduce, plan.xla_flags, plan.allreduce_dtype, plan.input_buffer) == \
        ("fused", (GRAPHS, LHS), "bfloat16", 1)
    user = "--xla_gpu_enable_latency_hiding_scheduler=false"
    plan, _ = policy.decide(policy.Facts(topo, tf_gpu_count=2, user_xla_flags=user))
    assert plan.xla_flags == (GRAPHS,) and plan.xla_flags_kept == (user,) and plan.allreduce_dtype == "float32"
    plan, warnings = policy.decide(policy.Facts(topo, tf_gpu_count=2, nccl_available=False))
    assert plan.xla_allreduce == "split" and plan.xla_flags == (GRAPHS,) and "no NCCL" in warnings[0]
    plan, _ = policy.decide(policy.Facts(topo, tf_gpu_count=0, no_gpu_cause="x"), asked_options=(
        [LHS], "float32", 3))
    assert plan.gpus == () and plan.xla_flags == (LHS,) and plan.input_buffer == 3  # explicit: as given
    assert step_options.validate_request([LHS], "bfloat16", 1) == ((LHS,), "bfloat16", 1, True)
    plan, _ = policy.decide(policy.Facts(topo, tf_gpu_count=2), asked_options=("auto", "float32", None, False))
    assert plan.compiled_execution is False and "compiled execution off" in plan.summary()


def test_compiled_execution_request_is_checked_and_said_in_the_summary():
    with pytest.raises(ValueError, match=r"compiled_execution should be True .* or False .* Received: "
                                         r"compiled_execution='yes'"):
        step_options.validate_request(compiled_execution="yes")
    fused = step_options.choose_step_options(plan_for("h200_x2"))
    assert "steps_per_execution=N runs as one XLA program per replica" in fused.summary()
    split = step_options.choose_step_options(dataclasses.replace(plan_for("h200_x2"), xla_allreduce="split"))
    assert "one program per step (split mode all-reduces outside XLA)" in split.summary()
    off = step_options.choose_step_options(plan_for("h200_x2"), compiled_execution=False)
    assert "compiled execution off" in off.summary()
    assert "compiled execution off" in step_options.report_text(off.to_dict())


def test_apply_xla_flags_merges_into_the_environment():
    from tf_nvlink.distribute import single_host

    plan = step_options.choose_step_options(plan_for("h200_x2"), user_xla_flags="--xla_dump_to=/tmp/d")
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    assert single_host.apply_xla_flags(plan, environ=environ) == f"--xla_dump_to=/tmp/d {GRAPHS} {LHS}" == \
        environ["XLA_FLAGS"]
    # again from the user's value (as the strategy does after its provisional setting): nothing added twice
    assert single_host.apply_xla_flags(plan, "--xla_dump_to=/tmp/d", environ) == environ["XLA_FLAGS"]
    # a final plan without flags takes the provisional ones back: the user's value, or no variable at all
    cpu = step_options.choose_step_options(plan_for("no_driver"))
    assert single_host.apply_xla_flags(cpu, "--xla_dump_to=/tmp/d", environ) == environ["XLA_FLAGS"] == \
        "--xla_dump_to=/tmp/d"
    assert single_host.apply_xla_flags(cpu, "", environ) == "" and "XLA_FLAGS" not in environ


def test_xla_flags_set_before_tensorflow_is_asked_and_taken_back_on_failure(tf, monkeypatch):
    """On a 2-GPU NVML machine the NVML-only plan's flags are in XLA_FLAGS when gather_facts asks TensorFlow for
    its GPUs; when building then fails, the user's value is back."""
    from tf_nvlink.distribute import facts, single_host

    topo = nvml.probe(FakeNvml(fake_nvml.MACHINES["h200_x2"]()))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    seen = []

    def failing_gather_facts(*args, **kwargs):
        seen.append((os.environ.get("XLA_FLAGS"), kwargs.get("user_xla_flags")))
        raise RuntimeError("TensorFlow failed")

    monkeypatch.setattr(facts, "gather_facts", failing_gather_facts)
    with pytest.raises(RuntimeError, match="TensorFlow failed"):
        single_host._build("all", "auto", None, None, topo, "auto")
    assert seen == [(f"--xla_dump_to=/tmp/d {GRAPHS} {LHS}", "--xla_dump_to=/tmp/d")]
    assert os.environ["XLA_FLAGS"] == "--xla_dump_to=/tmp/d"


# Real fits on a tf_nvlink strategy of 2 logical CPUs, in scenario processes (one strategy per process: each
# scenario's prelude is _TWO_CPUS_PRELUDE after its STRATEGY_KWARGS line).
_TWO_CPUS_PRELUDE = r"""
import json, os
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink


def strategy():  # this process's one strategy (the same request every time)
    return tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"], **STRATEGY_KWARGS)


def xla_flags_fit():  # a jit fit right after the strategy is built: XLA parses XLA_FLAGS at its first compile
    s = strategy()
    with s.scope():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        m.compile(optimizer="sgd", loss="mse", jit_compile=True)
    m.fit(np.ones((8, 4), "float32"), np.ones((8, 2), "float32"), batch_size=4, verbose=0)
    p = tf_nvlink.current_plan()
    return {"env": os.environ.get("XLA_FLAGS"), "flags": list(p.xla_flags), "kept": list(p.xla_flags_kept)}


reduced = []  # (dtype, shape) of every tensor all-reduced across the replicas
original = tf.distribute.ReplicaContext.all_reduce
def spy(self, op, value, options=None):
    if self.strategy.num_replicas_in_sync > 1:  # not the one-device model's no-op all-reduce
        reduced.extend((t.dtype.name, list(t.shape)) for t in tf.nest.flatten(value))
    return original(self, op, value, options)
tf.distribute.ReplicaContext.all_reduce = spy


def against_one_device(jit):  # 12 SGD steps on one device, then on the strategy's 2 replicas, same global batches
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 20)).astype("float32"); y = rng.integers(0, 3, 256).astype("int32")
    def build():
        keras.utils.set_random_seed(7)
        m = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
        m.compile(optimizer=keras.optimizers.SGD(0.1), jit_compile=jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
    one = build(); one.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)  # one device, global batch
    s = strategy()
    with s.scope():
        two = build()
    reduced.clear()
    two.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(one.get_weights(), two.get_weights()))
    return {"diff": diff, "kernel_dtypes": sorted({d for d, shape in reduced if shape == [20, 16]})}
"""


def _two_cpus(name, strategy_kwargs, cases, **options):
    return scenarios.Scenario(name, f"STRATEGY_KWARGS = {strategy_kwargs!r}\n" + _TWO_CPUS_PRELUDE, cases, **options)


# bfloat16 all-reduce with the flag list that stands in for a 2-GPU fused plan's: XLA_FLAGS first, then the
# comparison with one device. The float32 comparison and the variants of the slow tier have their own processes.
BFLOAT16 = _two_cpus("step_options: bfloat16, xla_flags", {"allreduce_dtype": "bfloat16", "xla_flags": [LHS]},
                     {"xla flags": "result = xla_flags_fit()", "nojit": "result = against_one_device(False)"})
FLOAT32 = _two_cpus("step_options: float32", {}, {"nojit": "result = against_one_device(False)"}, slow=True)
USER_FLAG = _two_cpus("step_options: the user's XLA flag", {"xla_flags": [LHS]}, {"xla flags": "result = xla_flags_fit()"},
                      env={"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}, slow=True)
SPLIT_XLA = {dtype: _two_cpus(f"step_options: {dtype}, split XLA", {"allreduce_dtype": dtype},
                              {"split_xla": "result = against_one_device(True)"}, slow=True)
             for dtype in ("float32", "bfloat16")}


@pytest.mark.parametrize("user, expected_env, expected_kept", [
    (None, LHS, []),
    pytest.param("--xla_gpu_enable_latency_hiding_scheduler=false", "--xla_gpu_enable_latency_hiding_scheduler=false",
                 ["--xla_gpu_enable_latency_hiding_scheduler=false"], marks=pytest.mark.slow),  # merge: unit-tested
], ids=["no_user_flags", "user_flag_wins"])
def test_strategy_sets_xla_flags_before_xla_compiles(user, expected_env, expected_kept):
    """On CPUs "auto" adds nothing, so the explicit list stands in for a 2-GPU fused plan; XLA (CPU) accepts the
    flag and the jit fit trains (an unknown flag name would abort the process)."""
    record = (USER_FLAG if user else BFLOAT16).result("xla flags")
    assert record["env"] == expected_env and record["kept"] == expected_kept
    assert record["flags"] == ([] if user else [LHS])


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["nojit", "split_xla"])
def test_bfloat16_allreduce_trains_close_to_float32_and_really_reduces_bfloat16(jit):
    """2 CPU replicas, 12 SGD steps against one device (float32) on the same global batches: bfloat16 (8-bit mantissa,
    ~0.4% per sum) within 2e-3 of it, and visibly not float32 (> 1e-5; the float32 all-reduce is within 1e-6, below)."""
    result = SPLIT_XLA["bfloat16"].result("split_xla") if jit else BFLOAT16.result("nojit")
    assert result["kernel_dtypes"] == ["bfloat16"]
    assert 1e-5 < result["diff"] < 2e-3


@pytest.mark.slow  # tests/training/test_exact_batches.py: float32 2-replica fits within 1e-5 of one device, default run
@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "split_xla"])
def test_float32_allreduce_is_the_default_and_trains_as_one_device(jit):
    """The same comparison with the default all-reduce: float32 tensors, equal to one device to rounding (< 1e-6)."""
    result = SPLIT_XLA["float32"].result("split_xla") if jit else FLOAT32.result("nojit")
    assert result["kernel_dtypes"] == ["float32"] and result["diff"] < 1e-6


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_fit_prefetches_to_each_replica_with_the_plans_buffer():
    """The strategy passes InputOptions(fetch to device, buffer K) to experimental_distribute_dataset when Keras
    gives none, and fit trains exactly as with TensorFlow's default options."""
    script = """
import json, sys
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink
buffer = json.loads(sys.argv[1])
seen = []
original = tf.distribute.MirroredStrategy.experimental_distribute_dataset
def spy(self, dataset, options=None):
    seen.append(None if options is None else [options.experimental_fetch_to_device,
                                              options.experimental_per_replica_buffer_size])
    return original(self, dataset, options)
tf.distribute.MirroredStrategy.experimental_distribute_dataset = spy
s = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"], input_buffer=buffer)
rng = np.random.default_rng(0)
x = rng.normal(size=(128, 6)).astype("float32"); y = rng.normal(size=(128, 1)).astype("float32")
with s.scope():
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
m.fit(ds, epochs=2, verbose=0)
print(json.dumps({"options": seen[0], "plan_buffer": s.plan.input_buffer,
                  "weights": [w.tolist() for w in m.get_weights()]}))
"""
    records = {}
    for buffer in (None, 3):
        proc = run_python(["-c", script, json.dumps(buffer)], timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records[buffer] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert records[None]["options"] is None and records[None]["plan_buffer"] == 0  # CPU: TensorFlow's defaults
    assert records[3]["options"] == [True, 3] and records[3]["plan_buffer"] == 3
    assert records[3]["weights"] == records[None]["weights"]


def test_strategy_refuses_bad_step_options_before_building(tf):
    import tf_nvlink

    for kwargs, match in [({"xla_flags": "fast"}, "xla_flags should be one of"),
                          ({"allreduce_dtype": "int8"}, "allreduce_dtype should be one of"),
                          ({"input_buffer": 0}, "input_buffer should be a positive integer")]:
        with pytest.raises(ValueError, match=match):
            tf_nvlink.strategy(**kwargs)


def test_report_shows_the_step_options_and_the_users_xla_flags():
    from tf_nvlink.tools import report

    topo = nvml.probe(FakeNvml(fake_nvml.MACHINES["h200_x2"]()))
    data = report.collect(topology=topo, with_tf=False, environ={})
    assert data["plan"]["xla_flags"] == [GRAPHS, LHS] and data["plan"]["input_buffer"] == 1
    options = next(line for line in report.render_text(data).splitlines() if line.startswith("  options"))
    assert options == (f"  options    XLA_FLAGS += {GRAPHS} {LHS}; gradients all-reduced in float32; input prefetched 1 "
                     f"batch deep per GPU")
    user = "--xla_gpu_enable_latency_hiding_scheduler=false"
    data = report.collect(topology=topo, with_tf=False, environ={"XLA_FLAGS": user})
    assert data["plan"]["xla_flags"] == [GRAPHS] and data["plan"]["xla_flags_kept"] == [user]
    assert f"user's XLA_FLAGS kept: {user}" in data["plan"]["summary"]


def test_command_buffer_flags_are_known_and_checked():
    """XLA's command-buffer (CUDA graph) flags of TensorFlow 2.21's XLA: accepted as given, the empty value of
    --xla_gpu_enable_command_buffer (graphs off) included; an unknown thunk kind is refused naming the valid ones."""
    flags = ["--xla_gpu_enable_command_buffer=", "--xla_gpu_graph_min_graph_size=1",
             "--xla_enable_command_buffers_during_profiling=true"]
    assert step_options.choose_step_options(plan_for("h200_x2", "0"), xla_flags=flags).xla_flags == tuple(flags)
    kinds = "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUDNN,WHILE"
    assert step_options.validate_xla_flags([kinds]) == (kinds,)
    with pytest.raises(ValueError, match=r"comma list of \['FUSION'.*Received: \['CONV'\]"):
        step_options.validate_xla_flags(["--xla_gpu_enable_command_buffer=FUSION,CONV"])
    with pytest.raises(ValueError, match="xla_flags entries"):
        step_options.validate_xla_flags(["--xla_gpu_graph_min_graph_size="])  # only the enable flag may be empty
