"""The compile cache across processes (counted, not timed): a second process reads what the first compiled; two
processes writing at once leave entries a third reads; a corrupt entry is dropped with one warning and compiled
again; a changed XLA flag misses (another context folder); an unwritable folder gives one warning naming it and
training goes on. The folder's path holds a space (quoted in TF_XLA_FLAGS). Each process trains a tiny
jit-compiled model over logical CPU replicas (2 unless asked; split mode: one XLA program per replica) and prints
one JSON line: the cache folder, its entries (name, mtime) and the log lines. Last, an absl example run twice: its
second run reads every program back."""

import json
import logging
import os
import re
import time
import types

import pytest

import scenarios
from conftest import ROOT
from tf_nvlink.plan import compile_cache

WORKER = r"""
import json, logging, os, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("tf_nvlink").addHandler(Keep())
logging.getLogger("tf_nvlink").setLevel(logging.INFO)
setting = sys.argv[1]
replicas = int(sys.argv[2]) if len(sys.argv) > 2 else 2
devices = [f"/cpu:{index}" for index in range(replicas)]
from tf_nvlink.plan import compile_cache
# before the CPU is split into logical devices (TensorFlow reads TF_XLA_FLAGS then), as tf_nvlink.strategy() does
compile_cache.prepare_process(setting, compile_cache.request_text(devices=devices))
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
import keras, numpy as np
keras.utils.set_random_seed(1)
from tf_nvlink.training import install
strategy = install.build_strategy(devices=devices, compile_cache=setting)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)],
                             name="tiny")
    model.compile("sgd", "mse", jit_compile=True, steps_per_execution=2)
x = np.linspace(0, 1, 256, dtype="float32").reshape(32, 8)
history = model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
from tf_nvlink.distribute import single_host
state = single_host.current_compile_cache()
found = compile_cache.entries(state.folder) if state.folder else []
print(json.dumps({"folder": state.folder, "loss": history.history["loss"][-1], "records": records,
                  "entries": {os.path.basename(e.path): e.mtime for e in found}}))
"""


def start(setting, replicas=2, **env):
    """The worker, forked from the process that imported TensorFlow once (TensorFlow reads TF_XLA_FLAGS at its first
    device listing, which comes after the fork)."""
    # TF_XLA_FLAGS="": a flag this pytest process set must not reach the worker
    return scenarios.start_preloaded(WORKER, env=dict(TF_CPP_MIN_LOG_LEVEL="2", TF_XLA_FLAGS="", **env), timeout=300,
                                     argv=[str(setting), str(replicas)])


def result(process):
    done = process.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def warnings(run, *words):
    return [text for level, text in run["records"] if level == "WARNING" and all(w in text for w in words)]


def test_second_process_reads_concurrent_writers_and_a_corrupt_entry_is_compiled_again(tmp_path):
    cache = tmp_path / "the cache"  # a space: TF_XLA_FLAGS carries the folder in double quotes
    blocked = tmp_path / "afile"  # a folder cannot be made under a file: no cache, one warning, training goes on
    blocked.write_text("")
    writers = [start(cache), start(cache), start(blocked / "xla")]
    first, second, unwritable = (result(process) for process in writers)
    assert first["folder"] == second["folder"] and len(first["entries"]) == 2  # one program per replica
    assert set(first["entries"]) == set(second["entries"])

    stored = {entry: os.path.getmtime(os.path.join(first["folder"], entry)) for entry in first["entries"]}
    reader = result(start(cache))  # a third process: every program from the cache, nothing written
    assert reader["entries"] == stored
    assert any("programs read from the compile cache" in text for _, text in reader["records"])
    assert any("first train execution of model 'tiny' on 2 replicas (per-step path, split" in text
               for _, text in reader["records"])
    assert reader["loss"] == first["loss"]

    assert unwritable["folder"] is None and len(warnings(unwritable, "not writable")) == 1
    assert str(blocked / "xla") in warnings(unwritable, "not writable")[0]
    assert unwritable["loss"] == first["loss"]

    victim = os.path.join(first["folder"], sorted(first["entries"])[0])
    with open(victim, "wb") as handle:
        handle.write(b"\x0a\xff\xff garbage, not an XLA entry")
    again = result(start(cache))
    assert len(warnings(again, "could not load")) == 1 and len(again["records"]) >= 3
    assert set(again["entries"]) == set(first["entries"])  # the program was compiled and stored again
    assert any("1 program compiled" in text for _, text in again["records"])
    assert again["loss"] == first["loss"]


def test_a_changed_xla_flag_misses(tmp_path):
    cache = tmp_path / "cache"
    plain = result(start(cache))
    flagged = result(start(cache, XLA_FLAGS="--xla_cpu_enable_fast_math=false"))
    assert len(compile_cache.entries(str(cache))) == 4
    assert plain["folder"] != flagged["folder"] and os.path.dirname(plain["folder"]) == \
        os.path.dirname(flagged["folder"])
    assert len(flagged["entries"]) == 2 and any("2 programs compiled" in text for _, text in flagged["records"])


def test_the_verdict_of_a_first_execution():
    from tf_nvlink.training.first_execution import verdict

    on = compile_cache.CacheState("auto", "/c/k")
    assert verdict(on, {"a"}, {"a", "b", "c"}) == "2 programs compiled and stored in the compile cache"
    assert verdict(on, {"a"}, {"a"}) == "programs read from the compile cache (1 entry), nothing compiled"
    assert verdict(on, set(), set()) == "no program stored (nothing was compiled with XLA)"
    assert "read-only" in verdict(compile_cache.CacheState("auto", "/c/k", read_only=True), {"a"}, {"a"})
    assert verdict(compile_cache.CacheState("off", None), set(), set()) == "compiled (compile cache off)"
    assert verdict(None, set(), set()) == "compiled (compile cache off)"


@pytest.mark.slow  # two TensorFlow processes: about 10 s
def test_one_program_per_replica(tmp_path):
    """What docs/compile_cache.md measured: each replica's program is its own (its own signature and HLO), so a
    fit stores one entry per replica: 1 for 1 replica, 4 for 4."""
    one, four = start(tmp_path / "one", replicas=1), start(tmp_path / "four", replicas=4)
    for run, count in ((result(one), 1), (result(four), 4)):
        assert len(run["entries"]) == count
        assert len({name.split("__")[2] for name in run["entries"]}) == count  # distinct HLO fingerprints


def test_a_slow_first_execution_is_said_loudly(monkeypatch, caplog):
    from tf_nvlink.training import first_execution

    monkeypatch.setattr(first_execution, "LOUD_AFTER_S", 0.05)
    model = types.SimpleNamespace(name="m", distribute_strategy=types.SimpleNamespace(num_replicas_in_sync=2))
    announce = first_execution.FirstExecution(model, "train", "per-step path")
    with caplog.at_level(logging.INFO, logger="tf_nvlink"):
        with announce.reported():
            time.sleep(0.3)
        with announce.reported():  # later executions say nothing
            pass
    levels = [(record.levelname, record.getMessage()[:60]) for record in caplog.records]
    assert [level for level, _ in levels] == ["INFO", "WARNING", "WARNING"], levels
    assert "model 'm' on 2 replicas (per-step path)" in caplog.records[0].getMessage()
    assert "still running after 0 s" in caplog.records[1].getMessage()
    assert "took 0.3 s" in caplog.records[2].getMessage()


MULTI_WORKER = str(ROOT / "examples" / "multi_worker.py")


def run_absl_example(tmp_path, run):
    """examples/multi_worker.py --jit_compile (one step, then the test set), as `python examples/multi_worker.py`
    runs it: TensorFlow imported at its top (preloaded here, its absl init callback, which lists the devices, still
    to run), the strategy built in main, app.run(main). Its temporary folders go under tmp_path/tmp: a preloaded
    process ends without running atexit. Returns (its log, {entry path: mtime} of the cache)."""
    code = (f"import runpy, sys, tempfile\ntempfile.tempdir = None\nsys.argv[0] = {MULTI_WORKER!r}\n"
            f"runpy.run_path({MULTI_WORKER!r}, run_name='__main__')\n")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = dict(TF_NVLINK_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path / "tmp"), TF_XLA_FLAGS="",
               CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2")
    argv = ["--jit_compile", "--epochs", "1", "--steps_per_epoch", "1", "--dataset", "digits",
            "--model_dir", str(tmp_path / f"model{run}")]
    done = scenarios.run_preloaded(code, env=env, timeout=300, argv=argv)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stderr, {entry.path: entry.mtime for entry in compile_cache.entries(str(tmp_path / "cache" / "xla"))}


def test_an_absl_example_reads_its_programs_back_on_its_second_run(tmp_path):
    cold_log, stored = run_absl_example(tmp_path, 1)
    assert "compile cache not used" not in cold_log and "harmless" not in cold_log, cold_log[-3000:]
    assert re.search(r"first train execution of model 'mnist_mlp' took [\d.]+ s: 1 program compiled and stored",
                     cold_log), cold_log[-3000:]
    (link,) = (tmp_path / "tmp").glob("tf_nvlink-xla-*/cache")  # the link TensorFlow read, at the context folder
    assert os.path.realpath(link) == os.path.dirname(next(iter(stored)))

    warm_log, reread = run_absl_example(tmp_path, 2)
    assert reread == stored  # nothing compiled, nothing rewritten
    read_lines = re.findall(r"first (?:train|test) execution of model 'mnist_mlp' took [\d.]+ s: programs read "
                            r"from the compile cache .*harmless", warm_log)
    assert len(read_lines) == 2, warm_log[-3000:]
    # the ERROR line the warm start's log line explains (TensorFlow reads an entry as text before binary)
    assert "Error parsing text-format tensorflow.XlaSerializedCacheEntry" in warm_log
