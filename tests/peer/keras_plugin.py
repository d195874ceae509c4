"""A pytest plugin that runs Keras' own MirroredStrategy tests, as the installed Keras ships them, against stock
`tf.distribute.MirroredStrategy` or against `tf_nvlink.strategy()` over the same devices (the peer tier,
tests/peer/test_keras_peer.py, runs it in its own processes).

    python -m pytest -c /dev/null --rootdir SITE_PACKAGES -p tests.peer.keras_plugin --peer-strategy tf_nvlink \\
        --peer-results out.json --pyargs keras.src.backend.tensorflow.distribute_test

It keeps the collected tests whose function, or whose class's setUp, names `MirroredStrategy` (the rest of a
module does not meet a strategy), seeds every test alike so that runs can be compared number for number, and for
each test records in `--peer-results` (JSON, by node id): its outcome and error line, the devices of each strategy
it built, whether each model it compiled runs with XLA, and what each `fit` and `evaluate` returned.
`--peer-jit` and `--peer-steps-per-execution N` compile every model of a test with `jit_compile=True` and
`steps_per_execution=N` whatever the test asks.
"""

import importlib.abc
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import types

import pytest

from tests.peer import keras_conftest

sys.modules["conftest"] = keras_conftest  # Keras' test modules import from their repository's conftest.py

SEED = 1337
RECORDS: dict = {}  # node id: what the test did (the module doc)


def pytest_addoption(parser):
    group = parser.getgroup("tf_nvlink peer", "Keras' MirroredStrategy tests against tf_nvlink.strategy()")
    group.addoption("--peer-strategy", choices=["stock", "tf_nvlink", "tf_nvlink_fused"], required=True,
                    help="stock: tf.distribute.MirroredStrategy as TensorFlow gives it; tf_nvlink: "
                         "tf_nvlink.strategy(devices=...) over the devices the test names; tf_nvlink_fused: the same "
                         "in fused XLA mode emulated on CPU replicas (the GPUs' per-replica steps and compiled "
                         "execution, without XLA: tests/conftest.py FUSED_CPU_EMULATION)")
    group.addoption("--peer-jit", action="store_true", help="compile every model with jit_compile=True")
    group.addoption("--peer-steps-per-execution", type=int, default=None, metavar="N",
                    help="compile every model with steps_per_execution=N")
    group.addoption("--peer-results", required=True, metavar="PATH", help="where the JSON record goes")
    group.addoption("--peer-keras-tests", default=None, metavar="FOLDER",
                    help="take Keras' test modules (keras.src...._test) from FOLDER, an unpacked Keras wheel, and "
                         "Keras itself from the installed package (keras-nightly wheels ship no tests)")


class KerasTestModulesFinder(importlib.abc.MetaPathFinder):
    """Finds Keras' test modules (`keras.` names ending in `_test`) in `folder`, an unpacked Keras wheel; every other
    module of Keras comes from the installed package."""

    def __init__(self, folder):
        self.folder = os.path.abspath(folder)

    def find_spec(self, fullname, path=None, target=None):
        if not (fullname.startswith("keras.") and fullname.endswith("_test")):
            return None
        candidate = os.path.join(self.folder, *fullname.split(".")) + ".py"
        return importlib.util.spec_from_file_location(fullname, candidate) if os.path.isfile(candidate) else None


def pytest_configure(config):
    import keras  # noqa: F401 - before any placeholder of another backend's framework exists

    folder = config.getoption("peer_keras_tests")
    if folder is not None:
        if not os.path.isdir(os.path.join(folder, "keras", "src")):
            raise pytest.UsageError(f"--peer-keras-tests should name an unpacked Keras wheel (a folder holding "
                                    f"keras/src/); {folder!r} does not hold one")
        sys.meta_path.insert(0, KerasTestModulesFinder(folder))
    for marker, meaning in keras_conftest.MARKERS.items():
        config.addinivalue_line("markers", f"{marker}: {meaning}")
    if config.getoption("peer_steps_per_execution") is not None and config.getoption("peer_steps_per_execution") < 1:
        raise pytest.UsageError("--peer-steps-per-execution should be a whole number of steps, 1 or more. Received: "
                                f"{config.getoption('peer_steps_per_execution')}")


# Other Keras backends' frameworks, which some Keras test modules import at the top for their own branches: where one
# is not installed, a placeholder stands in while such a module is imported (only then; Keras itself is imported
# before, and never sees it), and any use of it raises.
OTHER_BACKENDS = ("jax", "torch")


class NotInstalled(types.ModuleType):
    """A placeholder for a framework that is not installed: any attribute raises ImportError naming it (a dunder
    one AttributeError, so that `hasattr` answers)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"{self.__name__} is not installed: the peer tier runs Keras' TensorFlow backend only "
                          f"(asked for {self.__name__}.{name})")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    placeholders = {}
    if isinstance(collector, pytest.Module):
        placeholders = {name: NotInstalled(name) for name in OTHER_BACKENDS
                        if name not in sys.modules and importlib.util.find_spec(name) is None}
    sys.modules.update(placeholders)
    try:
        yield
    finally:
        for name, placeholder in placeholders.items():
            if sys.modules.get(name) is placeholder:
                del sys.modules[name]


def builds_a_mirrored_strategy(item) -> bool:
    """Whether a collected test's function, or its unittest class's setUp, names `MirroredStrategy`.

    Example:
        >>> builds_a_mirrored_strategy(item)   # keras/src/backend/tensorflow/distribute_test.py::...::test_strategy_run
        True
    """
    sources = [getattr(item, "function", None), getattr(getattr(item, "cls", None), "setUp", None)]
    for function in sources:
        if function is None:
            continue
        try:
            if "MirroredStrategy" in inspect.getsource(inspect.unwrap(function)):
                return True
        except (OSError, TypeError):
            continue
    return False


def pytest_collection_modifyitems(config, items):
    kept = [item for item in items if builds_a_mirrored_strategy(item)]
    deselected = [item for item in items if item not in kept]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = kept


def _plain(value):
    """Keras' logs and evaluate results as JSON numbers."""
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def fused_strategy_emulated_on_cpu(devices):
    """tf_nvlink.strategy() over `devices` in fused XLA mode emulated on CPU replicas, as tests/conftest.py's
    FUSED_CPU_EMULATION builds it (the same strategy on every later call of the process).

    Example:
        >>> fused_strategy_emulated_on_cpu(["CPU:0", "CPU:1"]).plan.xla_allreduce
        'fused'
    """
    import dataclasses

    import tf_nvlink
    from tf_nvlink.distribute import base
    from tf_nvlink.internals import tf_runtime

    if not tf_runtime.fused_mode_emulated():
        tf_runtime.emulate_fused_mode_on_cpu()
    built = tf_nvlink.strategy(devices=devices, cross_device_ops="collective")
    if built.plan.xla_allreduce != "fused":
        base.attach_plan(built, dataclasses.replace(built.plan, xla_allreduce="fused"))
    return built


@pytest.fixture(autouse=True)
def peer_strategy(request, monkeypatch):
    """Replaces `tf.distribute.MirroredStrategy` (and wraps Keras' compile, fit and evaluate) for one test."""
    import keras
    import tensorflow as tf

    config = request.config
    record = RECORDS.setdefault(request.node.nodeid, {})
    record.update(strategies=[], compiled=[], numbers=[])
    stock = tf.distribute.MirroredStrategy
    which = config.getoption("peer_strategy")
    if which != "stock":
        import tf_nvlink.training.install  # noqa: F401 - its strategy class subclasses the real MirroredStrategy

    def build(devices, cross_device_ops):
        asked = {"devices": None if devices is None else list(devices)}
        record["strategies"].append(asked)
        if which == "stock":
            built = stock(devices=devices, cross_device_ops=cross_device_ops)
        elif which == "tf_nvlink":
            import tf_nvlink

            built = tf_nvlink.strategy(devices=devices, cross_device_ops=cross_device_ops or "auto")
        else:
            built = fused_strategy_emulated_on_cpu(devices)
        plan = getattr(built, "plan", None)
        asked.update({"class": type(built).__name__, "object": id(built),
                      "xla_allreduce": getattr(plan, "xla_allreduce", None)})
        return built

    class _SameClass(type(stock)):
        # isinstance(x, tf.distribute.MirroredStrategy) keeps its meaning while the name is replaced.
        def __instancecheck__(cls, instance):
            return isinstance(instance, stock)

        def __subclasscheck__(cls, subclass):
            return issubclass(subclass, stock)

    class MirroredStrategy(stock, metaclass=_SameClass):
        def __new__(cls, devices=None, cross_device_ops=None):
            return build(devices, cross_device_ops)

    monkeypatch.setattr(tf.distribute, "MirroredStrategy", MirroredStrategy)

    # Patched where Keras defines them: Keras takes a compile other than its own for a custom one (and then does not
    # compile a loaded model).
    owners = {name: next(cls for cls in keras.Model.__mro__ if name in vars(cls))
              for name in ("compile", "fit", "evaluate")}
    compile_, fit, evaluate = (vars(owners[name])[name] for name in ("compile", "fit", "evaluate"))
    jit, steps = config.getoption("peer_jit"), config.getoption("peer_steps_per_execution")

    def compile_as_asked(self, *args, **kwargs):
        arguments = inspect.signature(compile_).bind(self, *args, **kwargs).arguments
        if jit:
            arguments["jit_compile"] = True
        if steps is not None:
            arguments["steps_per_execution"] = steps
        result = compile_(**arguments)
        record["compiled"].append({"under_strategy": tf.distribute.has_strategy(),
                                   "jit_compile": self.jit_compile is True,
                                   "steps_per_execution": int(self.steps_per_execution)})
        return result

    def recorded_fit(self, *args, **kwargs):
        history = fit(self, *args, **kwargs)
        record["numbers"].append({"fit": _plain(history.history)})
        return history

    def recorded_evaluate(self, *args, **kwargs):
        result = evaluate(self, *args, **kwargs)
        record["numbers"].append({"evaluate": _plain(result)})
        return result

    monkeypatch.setattr(owners["compile"], "compile", compile_as_asked)
    monkeypatch.setattr(owners["fit"], "fit", recorded_fit)
    monkeypatch.setattr(owners["evaluate"], "evaluate", recorded_evaluate)
    keras.utils.set_random_seed(SEED)
    tf_nvlink_log = logging.getLogger("tf_nvlink")
    paths = PathLines(record)
    level = tf_nvlink_log.level
    tf_nvlink_log.addHandler(paths)
    tf_nvlink_log.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        yield
    finally:
        tf_nvlink_log.removeHandler(paths)
        tf_nvlink_log.setLevel(level)


class PathLines(logging.Handler):
    """Keeps tf_nvlink's line naming the path each train and test function takes ("tf_nvlink: train function,
    steps_per_execution=3: compiled (...)") in a test's record, as `paths`."""

    def __init__(self, record):
        super().__init__(logging.INFO)
        self.record = record
        record["paths"] = []

    def emit(self, log_record):
        message = log_record.getMessage()
        if re.match(r"tf_nvlink: (train|test) function, steps_per_execution=", message):
            self.record["paths"].append(message)


def error_line(text: str) -> str:
    r"""The line of a failure's text that names the exception (the last "SomethingError: ..." line, else the last
    line), and TensorFlow's first status line after it ("INVALID_ARGUMENT: ...") where there is one.

    Example:
        >>> error_line("Traceback ...\nInvalidArgumentError: Graph execution error:\n...\n  (0) INVALID_ARGUMENT:  Trying...")
        'InvalidArgumentError: Graph execution error: ... INVALID_ARGUMENT:  Trying...'
    """
    lines = [re.sub(r"^E\s+", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    named = [index for index, line in enumerate(lines) if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b:?", line)]
    index = named[-1] if named else len(lines) - 1
    found = lines[index]
    if named:  # the exception's class without its module
        name, colon, message = found.partition(":")
        found = name.rpartition(".")[2] + colon + message
    after = lines[index + 1:]
    status = next((re.sub(r"^\(\d+\)\s*", "", line) for line in after
                   if re.match(r"^(\(\d+\)\s*)?[A-Z][A-Z_]{4,}:\s", line)), None)
    frames = [position for position, line in enumerate(after) if line.startswith("File ")]
    if status is None and found.endswith(":") and frames and frames[-1] + 1 < len(after):
        status = after[frames[-1] + 1]  # one root error: TensorFlow's message follows the op's stack
    return (found + (f" ... {status}" if status else ""))[:500] if lines else ""


def pytest_runtest_logreport(report):
    record = RECORDS.setdefault(report.nodeid, {})
    if report.when == "call" or report.outcome != "passed":
        failed_outside_call = report.failed and report.when != "call"
        if record.get("outcome") in (None, "passed"):
            record["outcome"] = "error" if failed_outside_call else report.outcome
        if report.failed:
            record.setdefault("error", error_line(report.longreprtext))
            record.setdefault("error_tail", report.longreprtext[-3000:])
        elif report.skipped and isinstance(report.longrepr, tuple):
            record.setdefault("reason", report.longrepr[2])


def pytest_sessionfinish(session):
    config = session.config
    with open(config.getoption("peer_results"), "w") as out:
        json.dump({"keras": _keras_version(), "keras_tests": config.getoption("peer_keras_tests"), "strategy": config.getoption("peer_strategy"),
                   "jit": config.getoption("peer_jit"),
                   "steps_per_execution": config.getoption("peer_steps_per_execution"),
                   "tests": RECORDS}, out, indent=1)


def _keras_version():
    import keras

    return keras.__version__


if os.environ.get("KERAS_BACKEND", "tensorflow") != "tensorflow":
    raise RuntimeError(f"the peer tier runs Keras' TensorFlow backend; KERAS_BACKEND={os.environ['KERAS_BACKEND']!r}")
