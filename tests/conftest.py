"""Shared test setup.

TensorFlow fixes its device list at first use and tolerates one MirroredStrategy per process, so:
- the `tf` fixture imports TensorFlow once and splits the CPU into N_LOGICAL_CPUS logical devices;
- tests that need another device layout or another strategy run a subprocess (`run_python`).
"""

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/fake_nvml.py
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Never read or write the user's autotune cache: a stored winner there would change what "auto" picks.
os.environ["TF_NVLINK_CACHE_DIR"] = tempfile.mkdtemp(prefix="tf_nvlink_test_cache_")
atexit.register(shutil.rmtree, os.environ["TF_NVLINK_CACHE_DIR"], ignore_errors=True)
N_LOGICAL_CPUS = 4
# The time limit of a test marked slow or gpu that names none itself (pytest-timeout; the default tier's limit is
# `timeout` in setup.cfg's [tool:pytest]).
SLOW_TIMEOUT_S = 1800


@pytest.fixture(scope="session")
def tf():
    """TensorFlow with the CPU split into N_LOGICAL_CPUS logical devices (configured once per process)."""
    import tensorflow as tf_module

    cpus = tf_module.config.list_physical_devices("CPU")
    try:
        tf_module.config.set_logical_device_configuration(
            cpus[0], [tf_module.config.LogicalDeviceConfiguration()] * N_LOGICAL_CPUS)
    except RuntimeError:
        pass  # already initialised by an earlier test in this process: keep its layout
    return tf_module


def pytest_collection_modifyitems(config, items):
    """Slow and gpu tests train for minutes: they get SLOW_TIMEOUT_S unless they carry their own timeout mark."""
    for item in items:
        if item.get_closest_marker("timeout") is None and (item.get_closest_marker("slow")
                                                          or item.get_closest_marker("gpu")):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


def pytest_collection_finish(session):
    """Scenario processes (tests/scenarios.py) of the collected modules start now, in the background."""
    import scenarios

    if not session.config.option.collectonly:
        scenarios.start_for(session.items)


def pytest_sessionfinish(session):
    import scenarios

    scenarios.stop_all()


def run_python(code_or_args, env=None, timeout=600, cwd=ROOT):
    """Run `python -c code` (str) or `python args...` (list) in a fresh process; returns CompletedProcess."""
    args = [sys.executable, "-c", code_or_args] if isinstance(code_or_args, str) else [sys.executable,
                                                                                         *code_or_args]
    full_env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    return subprocess.run(args, env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


# The modes of a ModeScript test: fused (the GPU path, through the CPU emulation) in the default run; plain (no
# XLA) and split (XLA per replica, all-reduce outside) take the same hooks on TensorFlow's merge_call path and run
# in the slow tier (CI runs both tiers).
SLOW_PLAIN_AND_SPLIT = [pytest.param("plain", marks=pytest.mark.slow), pytest.param("split", marks=pytest.mark.slow),
                        "fused"]


class ModeScript:
    """A test script run once per mode in its own process (one strategy per process): `script` holds the word
    MODE where the mode's repr goes, and prints one JSON line last. `result(mode)` runs it on first use; the modes
    of `background` ({mode: expected_s}, those of the default run) start in the background when the tests are
    collected (tests/scenarios.py)."""

    def __init__(self, script, background=None):
        import scenarios

        self.script, self.results = script, {}
        module = sys._getframe(1).f_globals.get("__file__")
        self.background = {mode: scenarios.Background(f"{os.path.basename(module)}: {mode}", self._code(mode),
                                                      expected_s=expected_s, _module=module)
                           for mode, expected_s in (background or {}).items()}

    def _code(self, mode):
        return self.script.replace("MODE", repr(mode))

    def result(self, mode):
        import json

        if mode not in self.results:
            import scenarios

            if mode in self.background:
                proc = self.background[mode].wait()
            else:
                proc = scenarios.run_preloaded(self._code(mode))  # TensorFlow imported once
            assert proc.returncode == 0, proc.stderr[-3000:]
            self.results[mode] = json.loads(proc.stdout.strip().splitlines()[-1])
        return self.results[mode]


# Source text for the subprocess scripts that check tf_nvlink's fused XLA mode on CPU: prepend it to a script,
# then call `fused_strategy_emulated_on_cpu()` (after configuring the logical CPUs) instead of tf_nvlink.strategy().
FUSED_CPU_EMULATION = r'''
def fused_strategy_emulated_on_cpu(devices=("/cpu:0", "/cpu:1")):
    """A tf_nvlink strategy in fused XLA mode on CPU replicas, without XLA itself (XLA on CPU cannot compile
    collectives): `internals.tf_runtime.emulate_fused_mode_on_cpu()` switches on TensorFlow's no-merge_call path, which it
    takes under XLA on all-GPU replicas, and the per-replica functions (fit's PerReplicaXlaStep, custom loops'
    PerReplicaCustomStep) are built exactly as in fused mode but without jit. Call it once per process, before
    building models."""
    import dataclasses
    import tf_nvlink
    from tf_nvlink.internals import tf_runtime as internals
    from tf_nvlink.distribute import base

    internals.emulate_fused_mode_on_cpu()
    strategy = tf_nvlink.strategy(devices=list(devices), cross_device_ops="collective")
    base.attach_plan(strategy, dataclasses.replace(strategy.plan, xla_allreduce="fused"))
    return strategy


def two_cpu_strategy(mode):
    """2 logical CPU devices, then the strategy a test script runs as `mode`: "single" (TensorFlow's default, one
    device), "stock" (tf.distribute.MirroredStrategy), "fused" (fused_strategy_emulated_on_cpu), anything else
    tf_nvlink.strategy() over both CPUs (split mode with jit_compile=True, plain without)."""
    import tensorflow as tf
    import tf_nvlink

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    if mode == "fused":
        return fused_strategy_emulated_on_cpu()
    if mode == "single":
        return tf.distribute.get_strategy()
    if mode == "stock":
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    return tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"])
'''
