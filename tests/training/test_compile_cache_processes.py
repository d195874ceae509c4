"""The compile cache across processes (counted, not timed): a second process reads what the first compiled; two
processes writing at once leave entries a third reads; a corrupt entry is dropped with one warning and compiled
again; a changed XLA flag misses (another context folder); an unwritable folder gives one warning naming it and
training goes on. The folder's path holds a space (quoted in TF_XLA_FLAGS). Each process trains a tiny
jit-compiled model over logical CPU replicas (2 unless asked; split mode: one XLA program per replica) and prints
one JSON line: the cache folder, its entries (name, mtime) and the log lines. Last, an absl example run twice: its
second run reads every program back."""

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
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
validation = bool(os.environ.get("WORKER_VALIDATION"))  # evaluate's programs too: 4 entries on 2 replicas
from tf_nvlink.plan import compile_cache
if not os.environ.get("WORKER_TENSORFLOW_FIRST"):
    # before the CPU is split into logical devices (TensorFlow reads TF_XLA_FLAGS then), as tf_nvlink.strategy() does
    compile_cache.prepare_process(setting, compile_cache.request_text(devices=devices))
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas)
tf.config.list_logical_devices()
import keras, numpy as np
keras.utils.set_random_seed(1)
from tf_nvlink.training import install
from tf_nvlink.distribute import single_host
strategy = install.build_strategy(devices=devices, compile_cache=setting)
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)],
                             name="tiny")
    model.compile("sgd", "mse", jit_compile=True, steps_per_execution=2)
state = single_host.current_compile_cache()
if os.environ.get("WORKER_TRUNCATE_AFTER_STRATEGY"):  # an entry damaged between strategy() and the first step
    victim = compile_cache.entries(state.folder)[0].path
    os.truncate(victim, os.path.getsize(victim) // 2)
if os.environ.get("WORKER_CLEAR_AFTER_STRATEGY"):  # `tf-nvlink cache --clear` while the program runs
    from tf_nvlink.__main__ import main as tf_nvlink_command
    assert tf_nvlink_command(["cache", "--dir", os.path.dirname(state.folder), "--clear", "--json"]) == 0
x = np.linspace(0, 1, 256, dtype="float32").reshape(32, 8)
loss = error = None
try:
    history = model.fit(x, x[:, :1], batch_size=8, epochs=2 if validation else 1, verbose=0,
                        validation_data=(x[:16], x[:16, :1]) if validation else None)
    loss = history.history["loss"][-1]
except Exception as exc:
    error = f"{type(exc).__name__}: {exc}"
found = compile_cache.entries(state.folder) if state.folder else []
print(json.dumps({"folder": state.folder, "loss": loss, "error": error, "records": records,
                  "iterations": int(model.optimizer.iterations.numpy()),
                  "weights": [w.ravel().tolist() for w in model.get_weights()],
                  "entries": {os.path.basename(e.path): e.mtime for e in found}}))
"""


def start(setting, replicas=2, **env):
    """The worker, forked from the process that imported TensorFlow once (TensorFlow reads TF_XLA_FLAGS at its first
    device listing, which comes after the fork)."""
    # TF_XLA_FLAGS="": a flag this pytest process set must not reach the worker
    return scenarios.start_preloaded(WORKER, env={"TF_CPP_MIN_LOG_LEVEL": "2", "TF_XLA_FLAGS": "", **env}, timeout=300,
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


# ---- damaged entries where tf_nvlink may not delete them, and damage after the strategy is built ---------------

@contextlib.contextmanager
def _read_only(folder):
    """`folder` read-only to the worker: chmod 555, or for root (whom chmod does not stop) the immutable attribute
    (`chattr +i`); skips the test where neither can be set."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        try:
            yield
        finally:
            os.chmod(folder, 0o755)
        return
    made = subprocess.run(["chattr", "+i", folder], capture_output=True, text=True) if shutil.which("chattr") else None
    if made is None or made.returncode != 0:
        pytest.skip(f"running as root, and the folder cannot be made immutable: "
                    f"{made.stderr.strip() if made is not None else 'no chattr'}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", folder], check=True)


def _damage(folder):
    """Three of the folder's four entries damaged: one truncated, one emptied, one overwritten with bytes that are
    no XLA entry; returns their names."""
    names = sorted(name for name in os.listdir(folder) if name.endswith(".pb"))
    assert len(names) == 4, names  # 2 replicas x (train, test)
    truncated, empty, garbage = (os.path.join(folder, name) for name in names[:3])
    os.truncate(truncated, os.path.getsize(truncated) // 2)
    os.truncate(empty, 0)
    with open(garbage, "wb") as handle:
        handle.write(b"\x0a\xff\xff garbage, not an XLA entry")
    return names[:3]


def _contents(folder):
    return {name: open(os.path.join(folder, name), "rb").read() for name in sorted(os.listdir(folder))}


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """The weights of compile_cache="off", and a managed folder and a folder of the user's own each filled by one
    fit (fit and evaluate programs of 2 replicas)."""
    base = str(tmp_path_factory.mktemp("damaged_cache"))
    env = dict(WORKER_VALIDATION="1")
    managed, users = os.path.join(base, "managed"), os.path.join(base, "users")
    os.makedirs(users)
    runs = [start("off", **env), start(managed, **env),
            start("auto", **env, TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={users} "
                                              f"--tf_xla_persistent_cache_prefix=mine")]
    off, managed_run, users_run = (result(run) for run in runs)
    assert off["error"] is None and len(managed_run["entries"]) == 4 and managed_run["weights"] == off["weights"]
    assert len(os.listdir(users)) == 4 and users_run["weights"] == off["weights"]
    return types.SimpleNamespace(base=base, env=env, off=off, managed=managed, context=managed_run["folder"],
                                 users=users)


def _copy(folder, to):
    shutil.copytree(folder, to)
    return to


def test_damaged_entries_of_a_read_only_folder_are_never_read(seeded):
    """A cache folder this process cannot write (shared read-only, mounted read-only) holding a truncated, an
    empty and a garbage entry: TensorFlow reads the sound entry through a private folder of links and never the
    damaged ones; training gives compile_cache="off"'s weights, one warning names them, the folder is unchanged."""
    root = _copy(seeded.managed, os.path.join(seeded.base, "read_only"))
    context = os.path.join(root, os.path.basename(seeded.context))
    damaged = _damage(context)
    before = _contents(context)
    with _read_only(context):
        run = result(start(root, **seeded.env))
    assert run["error"] is None and run["weights"] == seeded.off["weights"] and run["iterations"] == 8
    named = warnings(run, "not writable", *damaged)
    assert len(named) == 1 and "its programs are read" in named[0] and "--clear" in named[0], run["records"]
    assert not os.path.dirname(run["folder"]) == root  # TensorFlow reads a private folder of links
    assert _contents(context) == before


def test_damaged_entries_of_the_users_own_folder_are_never_read_and_the_folder_is_kept(seeded):
    """The user's own `--tf_xla_persistent_cache_directory` holding the same damage: nothing deleted or added
    there, the sound entry read through links, compile_cache="off"'s weights, one warning naming them."""
    users = _copy(seeded.users, os.path.join(seeded.base, "users_damaged"))
    damaged = _damage(users)
    before = _contents(users)
    run = result(start("auto", **seeded.env, TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={users} "
                                                          f"--tf_xla_persistent_cache_prefix=mine"))
    assert run["error"] is None and run["weights"] == seeded.off["weights"]
    named = warnings(run, "TF_XLA_FLAGS names", *damaged)
    assert len(named) == 1 and "does not change that folder" in named[0], run["records"]
    assert _contents(users) == before


def test_an_entry_damaged_after_the_strategy_is_built_is_compiled_again(seeded):
    """An entry truncated between `strategy()` and the first step, in tf_nvlink's own folder: checked again before
    the first execution, deleted (one warning), its program compiled again and stored; the weights are
    compile_cache="off"'s."""
    root = _copy(seeded.managed, os.path.join(seeded.base, "late"))
    run = result(start(root, **seeded.env, WORKER_TRUNCATE_AFTER_STRATEGY="1"))
    assert run["error"] is None and run["weights"] == seeded.off["weights"]
    deleted = warnings(run, "cannot be loaded by TensorFlow", "deleted")
    assert len(deleted) == 1, run["records"]
    assert len(run["entries"]) == 4 and not compile_cache.bad_entries(run["folder"])


def test_clearing_the_cache_while_a_program_runs_costs_a_compile_only(seeded):
    """`tf-nvlink cache --clear` run after this process built its strategy and before its first step: its programs
    are compiled again and stored; the weights are compile_cache="off"'s and the folder is usable."""
    root = _copy(seeded.managed, os.path.join(seeded.base, "cleared"))
    run = result(start(root, **seeded.env, WORKER_CLEAR_AFTER_STRATEGY="1"))
    assert run["error"] is None and run["weights"] == seeded.off["weights"]
    assert len(run["entries"]) == 4 and not compile_cache.bad_entries(run["folder"])
    assert any("first train execution of model 'tiny'" in text and "2 programs compiled and stored" in text
               for _, text in run["records"]), run["records"]


def test_a_damaged_entry_tensorflow_reads_stops_training_with_an_error_naming_it(seeded):
    """When TensorFlow has read TF_XLA_FLAGS before the strategy (absl's app.run) it reads the user's folder itself,
    damaged entries included. Its OutOfRangeError would end every epoch at its first step as if the data had run
    out; under tf_nvlink the fit stops with CompileCacheError naming the entry, inside its first epoch, and the
    folder is kept."""
    users = _copy(seeded.users, os.path.join(seeded.base, "users_read_first"))
    names = sorted(os.listdir(users))
    for name in names:  # every program of the fit damaged the same way: whichever is read first fails
        os.truncate(os.path.join(users, name), os.path.getsize(os.path.join(users, name)) // 2)
    before = _contents(users)
    run = result(start("auto", **seeded.env, WORKER_TENSORFLOW_FIRST="1",
                       TF_XLA_FLAGS=f"--tf_xla_persistent_cache_directory={users} "
                                    f"--tf_xla_persistent_cache_prefix=mine"))
    assert run["error"] is not None and run["error"].startswith("CompileCacheError"), run
    assert "Read less bytes than requested" in run["error"] and names[0] in run["error"]
    assert "as if the data had run out" in run["error"] and "delete the damaged entries" in run["error"]
    assert run["iterations"] < 4  # the first epoch's steps: it did not go on
    assert len(warnings(run, "TensorFlow read TF_XLA_FLAGS before tf_nvlink.strategy()", names[0])) == 1
    assert _contents(users) == before


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


# A notebook's cells in the order a newcomer runs them, and in the order the warning asks for: the log records of
# tf_nvlink and the compile cache the strategy got, as one JSON line.
NOTEBOOK = r"""
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append((record.levelname, record.getMessage()))
logging.getLogger("tf_nvlink").addHandler(Keep())
import tensorflow as tf
import tf_nvlink
from tf_nvlink.distribute import single_host
if sys.argv[1] == "devices listed first":
    tf.config.list_physical_devices("GPU")
strategy = tf_nvlink.strategy()
strategy = tf_nvlink.strategy()  # the cell run again
tf.config.list_physical_devices("GPU")
state = single_host.current_compile_cache()
print(json.dumps({"records": records, "folder": state.folder, "active": state.active}))
"""
NOTEBOOKS = {order: scenarios.Background(f"compile cache: a notebook, {order}", NOTEBOOK, argv=[order],
                                         env={"TF_XLA_FLAGS": "", "TF_CPP_MIN_LOG_LEVEL": "2"}, preload=True,
                                         expected_s=3)
             for order in ("devices listed first", "strategy first")}


def test_a_notebook_that_lists_the_devices_first_gets_one_warning_naming_the_fix():
    done = NOTEBOOKS["devices listed first"].wait()
    assert done.returncode == 0, done.stderr[-3000:]
    run = json.loads(done.stdout.strip().splitlines()[-1])
    assert run["folder"] is None and not run["active"]
    (warning,) = [text for level, text in run["records"] if level == "WARNING" and "compile cache" in text]
    assert "call tf_nvlink.strategy() before any tf.config call or TensorFlow op" in warning
    assert "in a notebook: restart the kernel, then build the strategy in the first cell" in warning
    # the fix: the same cells with the strategy first
    done = NOTEBOOKS["strategy first"].wait()
    assert done.returncode == 0, done.stderr[-3000:]
    fixed = json.loads(done.stdout.strip().splitlines()[-1])
    assert fixed["active"] and fixed["folder"], fixed
    assert not [text for level, text in fixed["records"] if level == "WARNING" and "compile cache" in text]
