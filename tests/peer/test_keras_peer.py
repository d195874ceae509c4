"""The peer tier (`pytest -m peer`; .ci/run runs it on each Keras it tests): Keras' own MirroredStrategy tests, as the
Keras wheel ships them, with stock `tf.distribute.MirroredStrategy` and with `tf_nvlink.strategy()` over the same
devices, and again with every model compiled with `jit_compile=True` (XLA per replica: split mode on CPU replicas),
with `steps_per_execution=3`, with both, and in fused mode emulated on CPU replicas (the GPUs' per-replica steps and
compiled execution, without XLA). tests/peer/peer_runs.py holds the groups of modules and the runs; keras_plugin.py
what replaces the strategy and what each test records.

Every test that passes with stock passes with tf_nvlink in every run, with stock's numbers (what each `fit` and
`evaluate` returned), unless `EXCUSED` names it with a difference the README documents. Stock itself cannot train
these tests with jit_compile=True on several replicas, nor with steps_per_execution > 1 (its "stock jit" and
"stock spe" runs say where): the tf_nvlink runs with those settings are held to stock's plain run, and to the tests'
own one-device references. A test that fails with stock is not held against tf_nvlink; the summary at the end of
the run lists both.
"""

import math

import pytest

from tests.peer import peer_runs

pytestmark = pytest.mark.peer

TF_NVLINK_RUNS = [name for name, run in peer_runs.RUNS.items() if run.strategy != "stock"]
GROUPS = [group for group in peer_runs.GROUPS if peer_runs.shipped_modules(group)]
# Where a tf_nvlink run and stock's may differ: the float32 rounding of another summation order or of XLA's fusion.
RTOL, ATOL = 1e-5, 1e-6
# Keras tests that pass with stock and not with tf_nvlink for a difference the README documents:
# {(node id, run): (what the failure says, the difference)}. An excused test may pass; a failure that does not say
# what its entry says is not excused.
EXCUSED: dict = {}


def test_every_keras_test_module_that_builds_a_mirrored_strategy_is_in_a_group():
    folder = peer_runs.keras_tests_folder()
    found = peer_runs.modules_naming_mirrored_strategy(folder)
    assert found, (f"{folder} holds no Keras test module that names MirroredStrategy (keras-nightly wheels ship no "
                   f"tests): set {peer_runs.KERAS_TESTS_ENV} to an unpacked Keras wheel that does, as .ci/run does")
    grouped = {module for modules in peer_runs.GROUPS.values() for module in modules}
    assert set(found) <= grouped, (f"Keras test modules that build a MirroredStrategy and are in no group of "
                                   f"tests/peer/peer_runs.py GROUPS: {sorted(set(found) - grouped)}; add each to the "
                                   f"group of the devices it asks for")


@pytest.mark.parametrize("group", GROUPS)
def test_stock_runs_the_keras_tests_through_the_replaced_name(group):
    record = peer_runs.result("stock", group)
    assert record["tests"], f"no Keras test of {peer_runs.GROUPS[group]} builds a MirroredStrategy"
    assert peer_runs.counts(record).get("passed"), peer_runs.summary_lines()
    for node, test in record["tests"].items():
        if test["outcome"] in ("passed", "failed"):  # a test skipped before its setUp built nothing
            assert test["strategies"], f"{node} built no strategy through tf.distribute.MirroredStrategy"
            built = [asked for asked in test["strategies"] if "class" in asked]  # the others raised
            assert all(asked["class"] == "MirroredStrategy" for asked in built), built


def _differences(mine, stock, where=""):
    """Where two records of `fit` and `evaluate` results differ beyond RTOL/ATOL."""
    if isinstance(mine, dict) and isinstance(stock, dict):
        if mine.keys() != stock.keys():
            return [f"{where}: keys {sorted(mine)}, stock {sorted(stock)}"]
        return [line for key in mine for line in _differences(mine[key], stock[key], f"{where}.{key}")]
    if isinstance(mine, list) and isinstance(stock, list):
        if len(mine) != len(stock):
            return [f"{where}: {len(mine)} values, stock {len(stock)}"]
        return [line for index, (a, b) in enumerate(zip(mine, stock)) for line in _differences(a, b, f"{where}[{index}]")]
    if isinstance(mine, float) and isinstance(stock, float):
        same = (math.isnan(mine) and math.isnan(stock)) or math.isclose(mine, stock, rel_tol=RTOL, abs_tol=ATOL)
        return [] if same else [f"{where}: {mine!r}, stock {stock!r}"]
    return [] if mine == stock else [f"{where}: {mine!r}, stock {stock!r}"]


def _excused(node, run_name, test):
    entry = EXCUSED.get((node, run_name))
    return entry is not None and entry[0] in test.get("error_tail", "")


def held_to_stock(run_name, group) -> list:
    """What a tf_nvlink run of one group does otherwise than stock: tests that pass with stock and not here (unless
    excused), numbers that differ from stock's (plain, and with the same settings where stock passes), strategies
    not built by tf_nvlink, models compiled otherwise than the run asks."""
    run = peer_runs.RUNS[run_name]
    mine, stock = peer_runs.result(run_name, group), peer_runs.result("stock", group)
    counterpart = run.stock_counterpart()
    same_settings = peer_runs.result(counterpart, group) if counterpart else {"tests": {}}
    problems = []
    if mine["tests"].keys() != stock["tests"].keys():
        problems.append(f"{group}: ran {sorted(mine['tests'])}, stock {sorted(stock['tests'])}")
    for node, test in mine["tests"].items():
        stock_test = stock["tests"].get(node, {})
        if stock_test.get("outcome") == "passed" and test["outcome"] != "passed" and not _excused(node, run_name, test):
            problems.append(f"{node}: passes with stock, {test['outcome']} with tf_nvlink: {test.get('error', '')}")
        built = [asked for asked in test["strategies"] if "class" in asked]  # the others raised: the test failed
        if test["outcome"] in ("passed", "failed") and not test["strategies"]:
            problems.append(f"{node}: asked for no strategy through tf.distribute.MirroredStrategy")
        if any(asked["class"] != "NVLinkMirroredStrategy" for asked in built):
            problems.append(f"{node}: built {built}, not through tf_nvlink.strategy()")
        if test["outcome"] == "passed":
            for reference_name, reference in (("stock", stock_test),
                                              (counterpart, same_settings["tests"].get(node, {}))):
                if reference.get("outcome") == "passed":
                    problems += [f"{node}: numbers against {reference_name}{line}"
                                 for line in _differences(test["numbers"], reference["numbers"])]
        for model in test["compiled"]:
            if (run.jit and not model["jit_compile"]) or (run.steps_per_execution or 1) != model["steps_per_execution"]:
                problems.append(f"{node}: a model compiled as {model}, not as the run {run_name!r} asks")
        if run.strategy == "tf_nvlink_fused" and any(asked["xla_allreduce"] != "fused" for asked in built):
            problems.append(f"{node}: built {built}, not in fused mode")
        if run.path is not None:
            problems += [f"{node}: {line}, not {run.path!r}" for line in test.get("paths", [])
                         if not line.split(": ", 2)[2].startswith(run.path)]
    return problems


@pytest.mark.parametrize("run_name", TF_NVLINK_RUNS)
def test_tf_nvlink_passes_what_stock_passes_with_stocks_numbers(run_name):
    problems = [problem for group in GROUPS for problem in held_to_stock(run_name, group)]
    assert not problems, "\n".join(problems)
    run = peer_runs.RUNS[run_name]
    if run.jit or run.steps_per_execution:  # the run must have trained something its way under the strategy
        trained = [node for group in GROUPS for node, test in peer_runs.result(run_name, group)["tests"].items()
                   if test["outcome"] == "passed" and test["numbers"]
                   and any(model["under_strategy"] for model in test["compiled"])]
        assert trained, f"no Keras test compiled and trained a model under the strategy in {run_name!r}"


def test_keras_spellings_of_the_same_cpus_are_one_tf_nvlink_request():
    """distribute_test asks for ["CPU:0", "CPU:1"], variables_test for ["cpu:0", "cpu:1"]: one strategy serves both."""
    record, stock = peer_runs.result("tf_nvlink", "2 CPUs"), peer_runs.result("stock", "2 CPUs")
    asked = [(node, strategy) for node, test in record["tests"].items() for strategy in test["strategies"]]
    spellings = {tuple(strategy["devices"]) for _, strategy in asked}
    if len(spellings) < 2:
        pytest.skip(f"this Keras's tests ask for their CPUs one way only: {spellings}")
    built = [strategy for _, strategy in asked if "object" in strategy]
    assert len(built) == len(asked) and len({strategy["object"] for strategy in built}) == 1, asked
    refused = [node for node, _ in asked if record["tests"][node]["outcome"] != "passed"
               and stock["tests"].get(node, {}).get("outcome") == "passed"]
    assert not refused, [record["tests"][node].get("error") for node in refused]
