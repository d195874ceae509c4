"""examples/mnist_mlp.py end to end, each run in its own process (one MirroredStrategy per process), on the CPU
with the offline digits set. Each run takes a few seconds on a 2-core machine."""

import importlib.util
import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile

import pytest

from conftest import ROOT, run_python

MNIST_MLP = str(ROOT / "examples" / "mnist_mlp.py")
EXAMPLES = str(ROOT / "examples")
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None


def _with_cpu_replicas(n, argv, before_main="", script=MNIST_MLP):
    """Python code running an example's main (mnist_mlp.py's by default) with the CPU split into `n` logical
    devices (n replicas)."""
    name = os.path.splitext(os.path.basename(script))[0]
    return textwrap.dedent(f"""
        import sys
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * {n})
        sys.argv = [{script!r}] + {list(argv)!r}
        sys.path.insert(0, {str(ROOT / "examples")!r})
        import {name}
        from absl import app
        {before_main}
        app.run({name}.main)
        """)


def test_mnist_mlp_trains_checkpoints_and_reloads(tmp_path):
    result = run_python([MNIST_MLP, "--epochs", "2", "--dataset", "digits", "--model_dir", str(tmp_path)],
                        timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"^tf_nvlink plan: CPU \(no GPU\) -> \w+", out, re.M), out
    assert (out + result.stderr).count("tf_nvlink plan:") == 1, out + result.stderr  # said once, not per replica
    assert re.search(r"^dataset: UCI handwritten digits \(offline.*1437 train / 360 test", out, re.M), out
    assert "replicas: 1, global batch 1024 = 1024 per replica, 12 steps per epoch, training set repeated 8x" in out
    assert re.search(r"^Epoch 2/2$", out, re.M) and re.search(r"^training: [\d,]+ examples/s", out, re.M), out
    accuracy = float(re.search(r"^test accuracy: (\d\.\d{4})$", out, re.M).group(1))
    assert accuracy >= 0.8, out  # measured 0.91 after these 2 epochs (0.96 after the default 10)
    assert re.search(r"^reloaded .*model\.keras: predictions on 256 test images match", out, re.M), out
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["epoch_001.keras", "epoch_002.keras"]
    assert (tmp_path / "model.keras").is_file()
    assert not (tmp_path / "backup").exists()  # BackupAndRestore deletes its backup once training has finished
    if HAS_TENSORBOARD:
        assert any((tmp_path / "logs").rglob("events.out.tfevents.*"))
    else:
        assert "no TensorBoard logs (pip install tensorboard)" in out


@pytest.mark.slow  # trains; test_bad_example_flags and test_global_batch_split_over_replicas check without training
def test_mnist_mlp_two_replicas_split_a_global_batch_that_is_not_a_multiple(tmp_path):
    argv = ["--batch_size", "63", "--steps_per_epoch", "5", "--epochs", "1", "--dataset", "digits",
            "--model_dir", str(tmp_path)]
    result = run_python(_with_cpu_replicas(2, argv), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replicas: 2, global batch 63 = 32 + 31, 5 steps per epoch" in result.stdout
    assert re.search(r"^test accuracy: \d\.\d{4}$", result.stdout, re.M), result.stdout


def test_mnist_mlp_bad_strategy_flags_are_usage_errors(flag_results):
    """absl's app.run(main) as the script runs it, in the flags process: a usage error, no traceback, no training."""
    code, stderr = flag_results[0]["app.run: num_packs with collective"]
    assert code not in (0, None)
    assert "num_packs" in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow  # test_mnist_mlp_bad_strategy_flags_are_usage_errors checks it through app.run in the flags process
def test_mnist_mlp_bad_strategy_flags_are_usage_errors_in_a_real_run(tmp_path):
    result = run_python([MNIST_MLP, "--cross_device_ops", "collective", "--num_packs", "2", "--dataset", "digits",
                         "--model_dir", str(tmp_path)], timeout=120)
    assert result.returncode != 0
    assert "num_packs" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "Epoch" not in result.stdout


def test_mnist_mlp_helpfull_documents_the_flags_without_importing_tensorflow():
    result = run_python(["-X", "importtime", MNIST_MLP, "--helpfull"], timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]  # absl's help flags exit with status 1
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "import time:" in line}
    assert not {"tensorflow", "keras"} & imported, sorted(m for m in imported if "tensorflow" in m or "keras" in m)
    for flag in ("--gpus", "<auto|autotune|nccl|hierarchical|reduce_to_one|collective>",
                 "--num_packs", "--batch_size: GLOBAL batch size", "--epochs", "--model_dir", "--[no]jit_compile",
                 "--dataset: <auto|mnist|digits>", "--steps_per_epoch"):
        assert flag in result.stdout, flag
    assert "falls back to the UCI handwritten" in result.stdout


@pytest.mark.parametrize("python", [
    "adding --no-tf",
    # [adding --no-tf] checks the logs in the default run, test_report.py the report of the real TensorFlow
    pytest.param("as is", marks=pytest.mark.slow)])
def test_reproduce_script_keeps_whole_logs_and_rejects_unknown_stages(tmp_path, python):
    """The report stage's command in commands.txt and its whole output in report.log. In the default run PYTHON is
    a wrapper of this interpreter that adds --no-tf, so the stage does not import TensorFlow."""
    script = str(ROOT / "benchmarks" / "reproduce.sh")
    interpreter = sys.executable
    if python == "adding --no-tf":
        interpreter = tmp_path / "bin" / "python"
        interpreter.parent.mkdir()
        interpreter.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@" --no-tf\n')
        interpreter.chmod(0o755)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", script, str(out), "report"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=str(interpreter), PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-m tf_nvlink report" in (out / "commands.txt").read_text()
    assert "Plan for tf_nvlink.strategy" in (out / "report.log").read_text()
    bad = subprocess.run(["bash", script, str(out), "warp"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "valid: report allreduce tests mlp resnet50 workers" in bad.stderr


CUSTOM_LOOP = str(ROOT / "examples" / "custom_loop.py")


@pytest.mark.slow  # two trainings; tests/training/test_per_replica_steps.py covers the jit step through strategy.run
def test_custom_loop_trains_with_xla_on_two_replicas_checkpoints_and_resumes(tmp_path):
    """examples/custom_loop.py: a jit step through strategy.run on 2 CPU replicas (split mode), then a rerun with
    more epochs (and --steps_per_execution 4) resumes from the tf.train.Checkpoint and trains only the missing
    epoch. The global batch, 255, is
    not a multiple of the replicas: it splits 128 + 127 and trains as one device would."""
    flags = ["--dataset", "digits", "--batch_size", "255", "--model_dir", str(tmp_path)]
    first = run_python(_with_cpu_replicas(2, flags + ["--epochs", "1"], script=CUSTOM_LOOP), timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert len(re.findall(r"^tf_nvlink plan: ", out, re.M)) == 1, out
    assert "replicas: 2, global batch 255 = 128 + 127, 11 steps per epoch; XLA: split" in out
    assert re.search(r"^epoch 1/1: loss [\d.]+, accuracy [\d.]+, [\d,]+ examples/s .*saved .*ckpt-1$", out, re.M)
    second = run_python(_with_cpu_replicas(2, flags + ["--epochs", "2", "--steps_per_execution", "4"],
                                           script=CUSTOM_LOOP), timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert "XLA: split; 4 steps per call" in out  # tf_nvlink.compiled_steps (split mode: one strategy.run a step)
    assert re.search(r"^resumed from .*ckpt-1: 1 epoch\(s\) done$", out, re.M), out
    assert "epoch 1/2" not in out and re.search(r"^epoch 2/2: .*saved .*ckpt-2$", out, re.M), out
    accuracy = float(re.search(r"^test accuracy: (\d\.\d{4})$", out, re.M).group(1))
    assert accuracy >= 0.8, out  # measured 0.89 after 2 epochs


# ---------------------------------------------------------------- the example's flags, each bad one a usage error
# The example's flags: absl's own checks (bounds, enums) and main()'s (gpus, num_packs, model_dir, batch split).
# One subprocess imports the example once and tries every case; main() is stopped before it trains. Last, one bad
# combination goes through absl's app.run(main), as `python mnist_mlp.py` runs it: its exit code and stderr.
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
    import contextlib, io, json, os, sys
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
    single_host._CURRENT.clear()
    flags.FLAGS.unparse_flags()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            app.run(mnist_mlp.main, argv=["mnist_mlp.py", "--dataset=digits", "--model_dir={model_dir}",
                                          "--cross_device_ops=collective", "--num_packs=2"])
            code = 0
        except SystemExit as stopped:  # a UsageError: absl printed the usage and the error, then exited
            code = stopped.code
    out["app.run: num_packs with collective"] = [code, stderr.getvalue()]
    out["replica_split 7 over 2"] = mnist_mlp.replica_split(7, 2)
    out["replica_split 64 over 2"] = mnist_mlp.replica_split(64, 2)
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


def test_global_batch_split_over_replicas(flag_results):
    """Any global batch trains (exact batches): the example says how it splits."""
    assert flag_results[0]["replica_split 7 over 2"] == "4 + 3"
    assert flag_results[0]["replica_split 64 over 2"] == "32 per replica"


# ---------------------------------------------------------------- no lost training: killed, rerun, resumed
def _example_env(tmp_path):
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="2", TF_NVLINK_CACHE_DIR=str(tmp_path / "cache"))


def _read_lines(stream, lines):
    for line in iter(stream.readline, ""):
        lines.put(line)
    lines.put(None)


@pytest.mark.slow  # 6 epochs, twice; test_killed_after_the_last_epoch_before_the_save_loses_nothing and
# tests/training/test_callbacks.py cover the backup and the resume in seconds
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


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
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


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_benchmark_example_without_gpu_says_so_first(tmp_path):
    """examples/benchmark.py with no flags on this GPU-less machine: the first lines say so; no failed rows."""
    result = run_python([str(ROOT / "examples" / "benchmark.py"), "--steps", "2", "--candidates",
                         "stock,nccl,hierarchical", "--json", str(tmp_path / "r.json")], timeout=300)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert lines[1].startswith("# no GPU here (") and "--cpu_devices 2" in lines[1], lines[:3]
    assert "left out nccl, hierarchical (they need GPUs)" in lines[1]
    assert "FAILED" not in result.stdout and "Traceback" not in result.stdout + result.stderr, result.stdout
    assert [r["candidate"] for r in json.loads((tmp_path / "r.json").read_text())] == ["stock"]
