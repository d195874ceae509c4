"""examples/mnist_mlp.py end to end, each run in its own process (one MirroredStrategy per process), on the CPU
with the offline digits set. Each run takes a few seconds on a 2-core machine."""

import importlib.util
import os
import sys
import re
import textwrap

from conftest import ROOT, run_python

MNIST_MLP = str(ROOT / "examples" / "mnist_mlp.py")
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


def test_mnist_mlp_two_replicas_split_the_global_batch(tmp_path):
    argv = ["--batch_size", "64", "--steps_per_epoch", "5", "--epochs", "1", "--dataset", "digits",
            "--model_dir", str(tmp_path)]
    result = run_python(_with_cpu_replicas(2, argv), timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "replicas: 2, global batch 64 = 32 per replica, 5 steps per epoch" in result.stdout
    assert re.search(r"^test accuracy: \d\.\d{4}$", result.stdout, re.M), result.stdout


def test_mnist_mlp_batch_not_divisible_by_replicas_fails_clearly(tmp_path):
    argv = ["--batch_size", "7", "--dataset", "digits", "--model_dir", str(tmp_path)]
    result = run_python(_with_cpu_replicas(2, argv), timeout=120)
    assert result.returncode != 0
    assert ("--batch_size=7 (the global batch) is not divisible by the 2 replicas; use a multiple of 2, "
            "e.g. 6 or 8.") in result.stdout + result.stderr
    assert "Epoch" not in result.stdout and not (tmp_path / "checkpoints").exists()


def test_mnist_mlp_bad_strategy_flags_are_usage_errors(tmp_path):
    result = run_python([MNIST_MLP, "--cross_device_ops", "collective", "--num_packs", "2", "--dataset", "digits",
                         "--model_dir", str(tmp_path)], timeout=120)
    assert result.returncode != 0
    assert "num_packs" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert "Epoch" not in result.stdout


def test_mnist_mlp_helpfull_documents_the_flags():
    result = run_python([MNIST_MLP, "--helpfull"], timeout=120)
    assert result.returncode == 1, result.stderr  # absl's help flags exit with status 1
    for flag in ("--gpus", "<auto|autotune|nccl|hierarchical|reduce_to_one|collective>",
                 "--num_packs", "--batch_size: GLOBAL batch size", "--epochs", "--model_dir", "--[no]jit_compile",
                 "--dataset: <auto|mnist|digits>", "--steps_per_epoch"):
        assert flag in result.stdout, flag
    assert "falls back to the UCI handwritten" in result.stdout


def test_reproduce_script_keeps_whole_logs_and_rejects_unknown_stages(tmp_path):
    import subprocess

    script = str(ROOT / "benchmarks" / "reproduce.sh")
    proc = subprocess.run(["bash", script, str(tmp_path), "report"], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "-m tf_nvlink report" in (tmp_path / "commands.txt").read_text()
    assert "Plan for tf_nvlink.strategy" in (tmp_path / "report.log").read_text()
    bad = subprocess.run(["bash", script, str(tmp_path), "warp"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "valid: report allreduce tests mlp resnet50 workers" in bad.stderr


CUSTOM_LOOP = str(ROOT / "examples" / "custom_loop.py")


def test_custom_loop_trains_with_xla_on_two_replicas_checkpoints_and_resumes(tmp_path):
    """examples/custom_loop.py: a jit step through strategy.run on 2 CPU replicas (split mode), then a rerun with
    more epochs resumes from the tf.train.Checkpoint and trains only the missing epoch."""
    flags = ["--dataset", "digits", "--batch_size", "256", "--model_dir", str(tmp_path)]
    first = run_python(_with_cpu_replicas(2, flags + ["--epochs", "1"], script=CUSTOM_LOOP), timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    out = first.stdout
    assert len(re.findall(r"^tf_nvlink plan: ", out, re.M)) == 1, out
    assert "replicas: 2, global batch 256 = 128 per replica, 11 steps per epoch; XLA: split" in out
    assert re.search(r"^epoch 1/1: loss [\d.]+, accuracy [\d.]+, [\d,]+ examples/s .*saved .*ckpt-1$", out, re.M)
    second = run_python(_with_cpu_replicas(2, flags + ["--epochs", "2"], script=CUSTOM_LOOP), timeout=600)
    assert second.returncode == 0, second.stdout + second.stderr
    out = second.stdout
    assert re.search(r"^resumed from .*ckpt-1: 1 epoch\(s\) done$", out, re.M), out
    assert "epoch 1/2" not in out and re.search(r"^epoch 2/2: .*saved .*ckpt-2$", out, re.M), out
    accuracy = float(re.search(r"^test accuracy: (\d\.\d{4})$", out, re.M).group(1))
    assert accuracy >= 0.8, out  # measured 0.89 after 2 epochs
