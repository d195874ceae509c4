"""The processes of the peer tier (tests/peer/test_keras_peer.py) and what they found.

Each process runs one group of Keras test modules (`GROUPS`: the tests of a group ask for the same devices) under
one of `RUNS` (stock MirroredStrategy or tf_nvlink.strategy(), with or without jit_compile=True and
steps_per_execution), through `keras_plugin`, and prints its JSON record last. They start in the background when the
tier's tests are collected (tests/scenarios.py), forked from the process that imported TensorFlow.

    record = peer_runs.result("tf_nvlink jit", "2 CPUs")
    record["tests"]["keras/src/backend/tensorflow/distribute_test.py::DistributeTest::test_strategy_run"]["outcome"]
"""

import dataclasses
import importlib.util
import json
import os
from pathlib import Path
from typing import Optional

import pytest

import scenarios

# An unpacked Keras wheel whose test modules the tier runs against the installed Keras, for a Keras that ships none
# (keras-nightly): .ci/run sets it on its keras-nightly run.
KERAS_TESTS_ENV = "TF_NVLINK_PEER_KERAS_TESTS"

# The Keras test modules that build a tf.distribute.MirroredStrategy, grouped by the devices they ask for: one
# process runs a group (tf_nvlink builds one strategy per process), its modules in this order. variables_test asks
# for "cpu:0" and "cpu:1" without splitting the CPU itself, so it runs after modules that split it into two logical
# devices (alone, tf_nvlink refuses "cpu:1", a device the process does not have: README, `devices`).
GROUPS = {
    "2 CPUs": ("keras.src.backend.tensorflow.distribute_test", "keras.src.backend.tensorflow.optimizer_distribute_test",
               "keras.src.ops.nn_test", "keras.src.callbacks.swap_ema_weights_test",
               "keras.src.backend.common.variables_test"),
    "1 CPU": ("keras.src.trainers.data_adapters.tf_dataset_adapter_test",),
}
STEPS_PER_EXECUTION = 3


@dataclasses.dataclass(frozen=True)
class Run:
    strategy: str  # "stock", "tf_nvlink", or "tf_nvlink_fused" (fused XLA mode emulated on CPU replicas)
    jit: bool  # every model compiled with jit_compile=True
    steps_per_execution: Optional[int]  # every model compiled with it; None: as the test asks
    expected_s: dict  # CPU seconds of each group's process on a 2-core machine
    path: Optional[str] = None  # the path every train and test function of a tf_nvlink model takes, where known

    def stock_counterpart(self) -> Optional[str]:
        """The stock run with the same settings, if the tier has one."""
        return next((name for name, run in RUNS.items()
                     if run.strategy == "stock" and (run.jit, run.steps_per_execution) == (self.jit,
                                                                                           self.steps_per_execution)),
                    None)


RUNS = {
    "stock": Run("stock", False, None, {"2 CPUs": 14, "1 CPU": 4}),
    "tf_nvlink": Run("tf_nvlink", False, None, {"2 CPUs": 14, "1 CPU": 4}),
    "tf_nvlink jit": Run("tf_nvlink", True, None, {"2 CPUs": 22, "1 CPU": 4}),
    "tf_nvlink spe": Run("tf_nvlink", False, STEPS_PER_EXECUTION, {"2 CPUs": 14, "1 CPU": 4}),
    # CPU replicas are split mode: one program per step.
    "tf_nvlink jit spe": Run("tf_nvlink", True, STEPS_PER_EXECUTION, {"2 CPUs": 16, "1 CPU": 4}, "per-step"),
    # The GPUs' path: each replica's step as in fused mode, and with steps_per_execution the compiled execution.
    "tf_nvlink fused": Run("tf_nvlink_fused", True, None, {"2 CPUs": 14, "1 CPU": 4}, "per-step"),
    "tf_nvlink fused spe": Run("tf_nvlink_fused", True, STEPS_PER_EXECUTION, {"2 CPUs": 14, "1 CPU": 4}, "compiled"),
    # Stock with the same settings, where it can run them: the tf_nvlink runs are held to "stock" (their numbers
    # too), and to these where they pass.
    "stock jit": Run("stock", True, None, {"2 CPUs": 11, "1 CPU": 4}),
    "stock spe": Run("stock", False, STEPS_PER_EXECUTION, {"2 CPUs": 14, "1 CPU": 4}),
}
TEST_MODULE = str(Path(__file__).with_name("test_keras_peer.py"))


def keras_tests_folder() -> Path:
    """The folder whose keras/src/ holds the test modules the tier runs: $TF_NVLINK_PEER_KERAS_TESTS, else the
    installed Keras's (found without importing Keras).

    Example:
        >>> keras_tests_folder()
        PosixPath('/work/tf_nvlink/.venv/lib/python3.11/site-packages')
    """
    if os.environ.get(KERAS_TESTS_ENV):
        return Path(os.environ[KERAS_TESTS_ENV]).resolve()
    return Path(importlib.util.find_spec("keras").submodule_search_locations[0]).parent


def modules_naming_mirrored_strategy(folder: Path) -> list:
    """The Keras test modules under `folder`/keras that name `MirroredStrategy`, as module names.

    Example:
        >>> modules_naming_mirrored_strategy(keras_tests_folder())[:1]
        ['keras.src.backend.common.variables_test']
    """
    found = []
    for path in sorted((folder / "keras").rglob("*_test.py")):
        if "MirroredStrategy" in path.read_text(errors="replace"):
            found.append(".".join(path.relative_to(folder).with_suffix("").parts))
    return found


def shipped_modules(group: str, folder: Optional[Path] = None) -> list:
    """The modules of `group` that `folder` (default: `keras_tests_folder()`) holds."""
    folder = keras_tests_folder() if folder is None else folder
    return [module for module in GROUPS[group] if (folder / Path(*module.split("."))).with_suffix(".py").is_file()]


# The process: pytest over the group's modules with keras_plugin; its JSON record as the last line.
_CODE = r"""
import json, os, shutil, sys, tempfile
import pytest
os.environ["KERAS_BACKEND"] = "tensorflow"
strategy, jit, steps, keras_tests, *modules = sys.argv[1:]
folder = tempfile.mkdtemp(prefix="tf_nvlink_peer_")
results = os.path.join(folder, "results.json")
args = ["-c", os.devnull, "--rootdir", keras_tests, "-p", "no:cacheprovider", "-p", "tests.peer.keras_plugin", "-q",
        "-rfE", "--peer-strategy", strategy, "--peer-results", results]
args += ["--peer-jit"] if jit == "jit" else []
args += ["--peer-steps-per-execution", steps] if steps != "as asked" else []
args += ["--peer-keras-tests", keras_tests] if os.environ.get("TF_NVLINK_PEER_KERAS_TESTS") else []
code = pytest.main(args + ["--pyargs", *modules])
try:
    with open(results) as handle:
        print("PEER " + json.dumps(json.load(handle)))
finally:
    shutil.rmtree(folder, ignore_errors=True)
sys.exit(0 if code in (0, 1) else int(code))  # 1: some Keras test failed, which the record says
"""


def _declare():
    processes = {}
    folder = keras_tests_folder()
    for run_name, run in RUNS.items():
        for group in GROUPS:
            modules = shipped_modules(group, folder)
            if not modules:
                continue
            argv = [run.strategy, "jit" if run.jit else "no jit",
                    "as asked" if run.steps_per_execution is None else str(run.steps_per_execution), str(folder),
                    *modules]
            processes[run_name, group] = scenarios.Background(f"peer: {run_name}, {group}", _CODE, argv=argv,
                                                              expected_s=run.expected_s[group], _module=TEST_MODULE)
    return processes


PROCESSES = _declare()
RESULTS: dict = {}  # (run, group): the record, once a test has read it


def result(run: str, group: str) -> dict:
    """The JSON record of one run of one group (waits for its process); fails the test if the process did not
    write one.

    Example:
        >>> result("stock", "1 CPU")["tests"]   # {node id: {"outcome": "passed", "strategies": [...], ...}}
    """
    if (run, group) in RESULTS:
        return RESULTS[run, group]
    if (run, group) not in PROCESSES:
        pytest.fail(f"no peer process for {run!r}, {group!r}: {keras_tests_folder()} holds none of the group's "
                    f"modules {GROUPS[group]}", pytrace=False)
    done = PROCESSES[run, group].wait()
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEER ")]
    if done.returncode != 0 or not lines:
        pytest.fail(f"peer process {run!r}, {group!r} exited with {done.returncode} without its record:\n"
                    f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}", pytrace=False)
    RESULTS[run, group] = json.loads(lines[-1][len("PEER "):])
    return RESULTS[run, group]


def counts(record: dict) -> dict:
    """How many tests of a record passed, failed, were skipped or errored."""
    found = {}
    for test in record["tests"].values():
        found[test.get("outcome", "not run")] = found.get(test.get("outcome", "not run"), 0) + 1
    return found


def summary_lines() -> list:
    """One line per run and group read so far: the Keras, the counts, and the first failures' error lines."""
    lines = []
    order = {key: index for index, key in enumerate((run, group) for run in RUNS for group in GROUPS)}
    for (run, group), record in sorted(RESULTS.items(), key=lambda item: order[item[0]]):
        tally = ", ".join(f"{number} {outcome}" for outcome, number in sorted(counts(record).items()))
        lines.append(f"{run:20} {group:7} Keras {record['keras']}: {tally}")
        failed = [(node, test) for node, test in record["tests"].items() if test.get("outcome") in ("failed", "error")]
        for node, test in failed[:3]:
            lines.append(f"    {node.rpartition('/')[2]}: {test.get('error', '')[:160]}")
        if len(failed) > 3:
            lines.append(f"    and {len(failed) - 3} more")
    return lines
