"""The compiled execution (tf_nvlink.training.compiled_execution): steps_per_execution=N as one program per replica.

Fused mode runs on CPU replicas through conftest.FUSED_CPU_EMULATION (no XLA: the per-replica programs hold the
same step, the loop is unrolled conds there). `compiled_execution_cases.py` trains every case per step and
compiled in one process per layout; the GPU tests (tests/test_gpu.py) run the same cases under XLA.
"""

import types
from pathlib import Path

import numpy as np
import pytest

import scenarios

_CASES = str(Path(__file__).resolve().parent / "compiled_execution_cases.py")


def _cases_body(layout, cases):
    """A scenario case that runs compiled_execution_cases.py as its own program (it builds its own strategy)."""
    return (f"import runpy, sys\n"
            f"sys.argv = [{_CASES!r}, {layout!r}, {cases!r}]\n"
            f"result = runpy.run_path({_CASES!r}, run_name='__main__')['results']\n")


# Started in the background when the tests are collected (tests/scenarios.py), so they run beside other tests.
# The default run's cases on 2 replicas: steps_per_epoch (full executions, partial ones of full and short batches,
# 3 epochs in two fits of the same tf.data datasets, with validation) and host_input (the batches kept in host memory, the execution's function copying them); the one-replica run adds numpy input and the rest of fit (validation, checkpoints, backup and
# resume, predict). The slow tier's on 2 replicas: numpy input, a dataset of unknown length, the rest of fit, a
# LossScaleOptimizer, gradient accumulation and a model without BatchNorm (the GPU tests run them all under XLA).
_TWO_CASES = ["steps_per_epoch", "host_input"]
_TWO_SLOW_CASES = ["numpy", "loss_scale", "rest_of_fit", "unknown_length", "accumulate", "no_batchnorm"]
TWO = scenarios.Scenario("compiled_execution_two_replicas", prelude="", cases={
    "all": _cases_body("emulated2", ",".join(_TWO_CASES))}, timeout=900, expected_s=23)
TWO_SLOW = scenarios.Scenario("compiled_execution_two_replicas_slow", prelude="", cases={
    "all": _cases_body("emulated2", ",".join(_TWO_SLOW_CASES))}, timeout=900, slow=True)
ONE = scenarios.Scenario("compiled_execution_one_replica", prelude="", cases={
    "all": _cases_body("emulated1", "numpy,rest_of_fit,memory_check")}, timeout=900, expected_s=10)


def _assert_same_training(case, per_step, compiled):
    assert compiled["function"] == compiled["test_function"] == "CompiledExecution", case
    for a, b in zip(per_step["weights"], compiled["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6, err_msg=case)
    np.testing.assert_allclose(compiled["evaluate"], per_step["evaluate"], rtol=1e-5, atol=1e-6, err_msg=case)
    np.testing.assert_allclose(compiled["loss"], per_step["loss"], rtol=1e-5, atol=1e-6, err_msg=case)


# Batch ends the callbacks see (every N steps, as Keras reports steps_per_execution), per case: 70 examples in
# batches of 15 are 4 + 1 steps an epoch; steps_per_epoch=7 is 4 + 3.
_BATCH_ENDS = {"numpy": [3, 4, 3, 4], "steps_per_epoch": [3, 6] * 3, "unknown_length": [3, 7, 3, 7],
               "accumulate": [3, 4, 3, 4], "loss_scale": [3, 4, 3, 4], "no_batchnorm": [3, 4, 3, 4],
               "rest_of_fit": [3, 4, 3, 4], "host_input": [3, 4, 3, 6, 3, 6]}


@pytest.mark.parametrize("case", _TWO_CASES + [pytest.param(case, marks=pytest.mark.slow) for case in _TWO_SLOW_CASES])
def test_two_replicas_compiled_equal_per_step_training(case):
    """2 replicas in fused mode, an uneven 8 + 7 split in every full execution: the same weights, losses, metrics
    and evaluate results as one program per step, full and partial executions, a short last batch as its own
    partial execution (programs per replica bounded whatever the epochs), the steps each epoch asks for; validation data,
    checkpoints, backup and resume, and predict as on the per-step path."""
    runs = (TWO if case in _TWO_CASES else TWO_SLOW).result("all")[case]
    per_step, compiled = runs["per_step"], runs["compiled"]
    _assert_same_training(case, per_step, compiled)
    # Per replica: one program for full executions, one per batch shape of the partial ones, none per epoch.
    partial = 2 if case in ("steps_per_epoch", "host_input") else 1  # partial executions of full and short batches
    assert compiled["programs_traced"] == {"full": [1, 1], "partial": [partial, partial]}
    assert compiled["batch_ends"] == _BATCH_ENDS[case]
    assert not compiled["holds_input_after_fit"]  # no input pipeline kept running (or batches kept) after fit
    steps = {"steps_per_epoch": 21, "accumulate": 5, "host_input": 19}.get(case, 10)  # accumulate: 5 updates
    # host_input: the host batches of the second fit's next execution copied while the one before ran, twice
    assert compiled["copied_ahead"] == (2 if case == "host_input" else 0)
    assert compiled["iterations"] == steps
    if case == "steps_per_epoch":  # two fits of the same tf.data datasets, each staged once (validation too)
        assert (compiled["stagings"], per_step["stagings"]) == (2, 0)
    if case != "unknown_length":  # per step, Keras counts the call that finds the data at its end as a step too
        assert per_step["iterations"] == steps
    if case == "rest_of_fit":
        _assert_rest_of_fit(per_step, compiled)


def _assert_rest_of_fit(per_step, compiled):
    """Validation, checkpoints, a resumed fit (epoch 2 of 2) and predict as on the per-step path."""
    assert compiled["checkpoints"] == per_step["checkpoints"] == ["epoch_001.keras", "epoch_002.keras"]
    np.testing.assert_allclose(compiled["predictions"], per_step["predictions"], rtol=1e-5, atol=1e-6)


def test_one_replica_compiled_equals_per_step_training():
    for case, runs in ONE.result("all").items():
        if case == "memory_check":
            continue
        _assert_same_training(case, runs["per_step"], runs["compiled"])
        assert runs["compiled"]["programs_traced"] == {"full": [1], "partial": [1]}, case
        assert not runs["compiled"]["holds_input_after_fit"], case
        if case == "rest_of_fit":
            _assert_rest_of_fit(runs["per_step"], runs["compiled"])


def test_batches_that_do_not_fit_raise_before_training():
    result = ONE.result("all")["memory_check"]
    assert result["weights_unchanged"]
    assert "steps_per_execution=4 stages 4 batches on each replica's device" in result["error"]
    assert "(1000 bytes) free" in result["error"] and "smaller steps_per_execution (e.g. 2)" in result["error"]
    assert "compiled_execution=False" in result["error"]


_PER_STEP_PRELUDE = r"""
import numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras, tf_nvlink
from tf_nvlink.training import compiled_execution, input_staging
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
rng = np.random.default_rng(0)
data = tf.data.Dataset.from_tensor_slices((rng.normal(size=(64, 8)).astype("float32"),
                                           rng.normal(size=(64, 1)).astype("float32"))).batch(8).repeat()

def iterations(jit):
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse", jit_compile=jit, steps_per_execution=5)
    model.fit(data, steps_per_epoch=7, epochs=3, verbose=0)
    return int(model.optimizer.iterations.numpy()), list(compiled_execution.execution_path(model))
"""
PER_STEP = scenarios.Scenario("compiled_execution_per_step", prelude=_PER_STEP_PRELUDE, cases={
    "split": "result = iterations(True)",
    "plain": "result = iterations(False)",
})


@pytest.mark.parametrize("mode", ["split", "plain"])
def test_per_step_paths_run_the_steps_each_epoch_asks_for(mode):
    """steps_per_epoch=7 at steps_per_execution=5 under a tf_nvlink strategy: 7 steps an epoch (5 + 2), 21 in 3
    epochs, where Keras runs 10 an epoch; CPU replicas keep the per-step path and say why."""
    steps, (path, reason) = PER_STEP.result(mode)
    assert steps == 21 and path == "per-step"
    assert reason == ("the replicas are not all GPUs: the all-reduce runs outside XLA (split mode), so each step "
                      "is its own program" if mode == "split" else
                      "the model is not compiled with jit_compile=True (or runs eagerly)")


def _model(spe=4, jit=True, eager=False, replicas=2, devices=("GPU:0", "GPU:1"), xla_allreduce="fused",
           compiled=True, workers=1):
    plan = types.SimpleNamespace(compiled_execution=compiled, input_buffer=1)
    extended = types.SimpleNamespace(worker_devices=devices, _num_workers=workers)
    strategy = types.SimpleNamespace(plan=plan, extended=extended, num_replicas_in_sync=replicas,
                                     xla_allreduce=xla_allreduce)
    return types.SimpleNamespace(distribute_strategy=strategy, steps_per_execution=spe, jit_compile=jit,
                                 run_eagerly=eager)


@pytest.mark.parametrize("kwargs, path, reason", [
    ({}, "compiled", "4 steps per execution as one XLA program per replica (fused: all-reduce inside XLA)"),
    (dict(replicas=1, devices=("GPU:0",), xla_allreduce="split"), "compiled",
     "4 steps per execution as one XLA program per replica (one replica)"),
    (dict(spe=1), "per-step", "steps_per_execution=1"),
    (dict(compiled=False), "per-step",
     "compiled execution turned off: tf_nvlink.strategy(compiled_execution=False)"),
    (dict(jit=False), "per-step", "the model is not compiled with jit_compile=True (or runs eagerly)"),
    (dict(eager=True), "per-step", "the model is not compiled with jit_compile=True (or runs eagerly)"),
    (dict(workers=2), "per-step", "several workers: an all-reduce inside XLA cannot span processes"),
    (dict(xla_allreduce="split"), "per-step",
     "xla_allreduce='split': the all-reduce runs outside XLA, so each step is its own program"),
    (dict(devices=("CPU:0", "CPU:1")), "per-step",
     "the replicas are not all GPUs: the all-reduce runs outside XLA (split mode), so each step is its own program"),
])
def test_execution_path_says_which_path_and_why(tf, kwargs, path, reason):
    from tf_nvlink.training import compiled_execution, input_staging

    model = _model(**kwargs)
    assert compiled_execution.execution_path(model) == (path, reason)
    assert input_staging.input_depth(model) == (4 if path == "compiled" else None)


def test_restage_input_prefetches_the_asked_depth_and_leaves_a_distributed_dataset_alone(tf):
    from tf_nvlink.training import input_staging as internals

    seen = []
    strategy = types.SimpleNamespace(experimental_distribute_dataset=lambda dataset, options: seen.append(
        (dataset, options)) or "restaged")
    dataset = tf.data.Dataset.range(4)
    epoch_iterator = types.SimpleNamespace(_distributed_dataset="first",
                                           data_adapter=types.SimpleNamespace(get_tf_dataset=lambda: dataset))
    model = types.SimpleNamespace(distribute_strategy=strategy)
    assert internals.restage_input(model, epoch_iterator, 16)
    assert epoch_iterator._distributed_dataset == "restaged"
    assert seen[0][0] is dataset and seen[0][1].experimental_per_replica_buffer_size == 16
    assert seen[0][1].experimental_fetch_to_device
    assert internals.restage_input(model, epoch_iterator, 8, to_device=False)  # kept in host memory, 8 deep
    assert not seen[1][1].experimental_fetch_to_device and list(seen[1][0]) == [0, 1, 2, 3]
    assert not internals.restage_input(model, epoch_iterator, None)
    distributed = type("UserDistributedDataset", (tf.distribute.DistributedDataset,), {})()
    epoch_iterator.data_adapter.get_tf_dataset = lambda: distributed
    assert not internals.restage_input(model, epoch_iterator, 16) and len(seen) == 2


def test_restage_input_stages_a_users_tf_data_dataset_once_per_model(tf):
    """A user's tf.data dataset is staged once and taken again by later fits, evaluates and validation epochs of
    the same model under the same staging; numpy input (a new dataset every call) is not kept; at most three are
    kept per model (fit's input, its validation data, evaluate's test data), and nothing keeps the model alive."""
    import gc
    import weakref

    from keras.src.trainers.data_adapters import array_data_adapter, tf_dataset_adapter

    from tf_nvlink.training import input_staging as internals

    built = []
    strategy = types.SimpleNamespace(experimental_distribute_dataset=lambda dataset, options: built.append(
        dataset) or object())
    model = type("Model", (), {"distribute_strategy": strategy})()

    def restage(adapter, key=(4, True, True)):
        epoch_iterator = types.SimpleNamespace(_distributed_dataset=None, data_adapter=adapter)
        assert internals.restage_input(model, epoch_iterator, 4, transform=lambda d: d.map(lambda v: v),
                                       reuse_key=key)
        return epoch_iterator._distributed_dataset

    train, validation, other = (tf_dataset_adapter.TFDatasetAdapter(tf.data.Dataset.range(n)) for n in (4, 2, 3))
    first = restage(train)
    assert restage(validation) is not first and len(built) == 2
    assert restage(train) is first and restage(validation) is restage(validation) and len(built) == 2
    assert restage(train, key=(8, True, True)) is not first and len(built) == 3  # another staging: built again
    restage(other)  # a fourth: the least recently used one (train at depth 4) goes
    assert len(built) == 4 and restage(validation) is not None and len(built) == 4
    assert restage(train) is not first and len(built) == 5
    arrays = array_data_adapter.ArrayDataAdapter(np.arange(6.0), batch_size=3)
    restage(arrays)
    restage(arrays)
    assert len(built) == 7  # numpy input is restaged every time, never kept
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None and not any(True for _ in internals._RESTAGED.keys())


def _xla_loop_hlo(tf, count):
    """The optimized HLO of a jit program whose loop runs `count` times (an int, or a tensor) on CPU."""
    from tf_nvlink.training.replica_programs import execution_body

    total = tf.Variable(0.0)

    def step_body(batch):
        total.assign_add(tf.reduce_sum(batch))
        return {"total": total.read_value()}

    batches = tuple(tf.fill([3], float(i)) for i in range(4))
    if isinstance(count, int):
        program = tf.function(execution_body(step_body, full=True), jit_compile=True, autograph=False)
        return program, program.experimental_get_compiler_ir(batches)(stage="optimized_hlo"), batches
    program = tf.function(execution_body(step_body, full=False), jit_compile=True, autograph=False)
    return program, program.experimental_get_compiler_ir(batches, count)(stage="optimized_hlo"), batches


def test_a_full_execution_loop_has_a_trip_count_xla_knows(tf):
    """A full execution's loop count is a constant XLA annotates (known_trip_count): its GPU runtime then runs the
    iterations back to back, without copying the loop condition to the host after each step. A partial
    execution's tensor count is read on the device (no known trip count); both run their steps exactly."""
    full, hlo, batches = _xla_loop_hlo(tf, 4)
    assert '"known_trip_count":{"n":"4"}' in hlo
    assert full(batches)["total"].numpy() == 3.0 * (0 + 1 + 2 + 3)
    partial, hlo, batches = _xla_loop_hlo(tf, tf.constant(2))
    assert "known_trip_count" not in hlo and " while(" in hlo
    assert partial(batches, tf.constant(2))["total"].numpy() == 3.0 * (0 + 1)


def test_a_program_traces_the_step_once_and_runs_it_every_step(tf):
    """Where XLA runs the loop, the loop's start value and its body share one trace of the step (a fresh process
    pays the Python trace of the model's step once per program, not twice), and every step still runs: the
    variable it updates and the outputs it returns are those of the last of its 4 steps."""
    from tf_nvlink.training.replica_programs import execution_body

    calls, total = [], tf.Variable(0.0)

    def step_body(batch):
        calls.append(1)
        total.assign_add(tf.reduce_sum(batch))
        return {"total": total.read_value(), "last": batch[0]}

    batches = tuple(tf.fill([3], float(i)) for i in range(4))
    program = tf.function(execution_body(step_body, full=True), jit_compile=True, autograph=False)
    logs = program(batches)
    assert len(calls) == 1
    assert logs["total"].numpy() == total.numpy() == 3.0 * (0 + 1 + 2 + 3) and logs["last"].numpy() == 3.0
    logs = program(batches)
    assert len(calls) == 1 and logs["total"].numpy() == 2 * 18.0


def test_pinned_batches_hold_the_same_batches_in_the_same_structure(tf):
    """The compiled execution's host stage (each batch through tf.data's map-and-batch, which allocates pinned
    memory on GPU machines) yields every batch unchanged, the short last one included, for tuple, dict, namedtuple
    and single tensor elements; batches with ragged parts are left alone."""
    import collections

    from tf_nvlink.training.input_staging import pinned_batches

    x = np.arange(70 * 3, dtype="uint8").reshape(70, 3)
    y = np.arange(70, dtype="int32")
    Pair = collections.namedtuple("Pair", "x y")
    for dataset in (tf.data.Dataset.from_tensor_slices((x, y)).batch(15),
                    tf.data.Dataset.from_tensor_slices({"a": x, "b": y}).batch(15),
                    tf.data.Dataset.from_tensor_slices(Pair(x, y)).batch(15),
                    tf.data.Dataset.from_tensor_slices(x).batch(15)):
        staged = pinned_batches(dataset)
        assert staged.element_spec == dataset.element_spec
        pairs = list(zip(dataset, staged))
        assert len(pairs) == 5 == len(list(staged))
        for a, b in pairs:
            tf.nest.map_structure(np.testing.assert_array_equal, a, b)
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [1, 2]])).batch(2)
    assert pinned_batches(ragged) is ragged


def test_input_staging_prefetches_n_pinned_batches_on_the_compiled_path_only(tf):
    from tf_nvlink.training import input_staging

    model = _model()
    depth, transform, restore, to_device, reuse_key = input_staging.input_staging(model)
    assert (depth, restore, to_device, reuse_key) == (4, input_staging.restored_ints, True, (4, True, True))
    dataset = tf.data.Dataset.from_tensors((np.ones((2, 3), "float32"), np.arange(2, dtype="int32"))).repeat(3)
    staged = transform(dataset)
    assert isinstance(staged.element_spec[1], input_staging.Int32Bits)
    assert next(iter(staged))[0].dtype == tf.float32
    tokens = tf.data.Dataset.from_tensors(np.arange(4, dtype="int32"))  # a lone int32 tensor: pinned, then back
    np.testing.assert_array_equal(input_staging.restored_ints(next(iter(transform(tokens)))), np.arange(4))
    model.train_function = types.SimpleNamespace(pinned_input=False)  # the benchmark's pageable setup
    assert input_staging.input_staging(model).transform is input_staging.int32_as_bits
    model.train_function = types.SimpleNamespace(input_to_device=False)  # the benchmark's host-input setup
    assert input_staging.input_staging(model)[3:] == (False, (4, True, False))
    model.train_function = types.SimpleNamespace(reuse_staged_input=False)  # the benchmark's restaged setup
    assert input_staging.input_staging(model).reuse_key is None
    assert input_staging.input_staging(_model(compiled=False)) is None


def test_int32_parts_travel_as_uint32_bits_and_come_back_unchanged(tf):
    """The compiled execution's input carries int32 parts (token ids, labels) as uint32 bits, so TensorFlow's
    prefetch to the GPU does not copy them through the host; `restored_ints` (the program's first step) gives the
    batch back exactly, negative values included. Other dtypes, uint32 too, and datasets with ragged parts are
    left alone."""
    from tf_nvlink.training.input_staging import Int32Bits, int32_as_bits, restored_ints

    tokens = np.array([[-7, 0], [2**31 - 1, -2**31]], "int32")
    hashed = np.array([[1, 2**32 - 1], [3, 4]], "uint32")
    for element in ((tokens, hashed), {"tokens": tokens, "hashed": hashed}, tokens):  # a lone tensor stays one
        dataset = tf.data.Dataset.from_tensor_slices(element).batch(2)
        staged = int32_as_bits(dataset)
        carried = next(iter(staged))
        assert all(leaf.dtype in (tf.uint32,) for leaf in tf.nest.flatten(carried))
        back = tf.function(restored_ints, jit_compile=False)(carried)
        assert tf.nest.map_structure(lambda t: t.dtype, back) == tf.nest.map_structure(
            lambda t: t.dtype, dataset.element_spec)
        tf.nest.map_structure(np.testing.assert_array_equal, next(iter(dataset)), back)
    assert isinstance(restored_ints((Int32Bits(tf.constant([5], tf.uint32)),))[0], tf.Tensor)
    plain = tf.data.Dataset.from_tensor_slices(np.ones((2, 2), "float32"))
    assert int32_as_bits(plain) is plain
    ragged = tf.data.Dataset.from_tensor_slices(tf.ragged.constant([[1], [1, 2]])).batch(2)
    assert int32_as_bits(ragged) is ragged
