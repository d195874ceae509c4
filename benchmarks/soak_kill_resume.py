r"""Soak test (not in CI): SIGKILL training and `tf-nvlink tune` at random moments, restart, check nothing is lost.

    python benchmarks/soak_kill_resume.py --kills 50 --tune_kills 20 --out /tmp/soak

Training: examples/mnist_mlp.py (digits, on the CPU) is started in a fresh model_dir and SIGKILLed at a random moment
(uniform between 0 and the wall time of one uninterrupted run), restarted with the same command, killed again, ...
until a run finishes; then the next cycle starts in a new model_dir, until --kills kills have happened. After every
kill and at the end of every cycle it checks:
  - no corrupt file: every checkpoints/epoch_*.keras and model.keras is a whole zip, the backup's metadata is JSON;
  - no epoch lost: a restart resumes at exactly (epochs the backup had committed when killed) + 1;
  - no epoch repeated: once committed, an epoch is never trained again (the Epoch k/E lines of all runs of a cycle,
    counted for the committed epochs, appear once each);
  - the final test accuracy equals the uninterrupted run's (printed to 4 digits; the difference is reported).
Tune: `tf-nvlink tune --devices cpu:2` with a cache that already holds another entry is SIGKILLed, every other time
0-20 ms after its store() creates the lock file (inside the read-modify-write of the cache), otherwise at a random
moment weighted towards the end of the run; after every kill the cache must be strict JSON whose entries all
validate, with the earlier entry intact.

Prints one summary block (and --json FILE writes it) with the figures docs/results.md records.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

from absl import app
from absl import flags

flags.DEFINE_integer("kills", 50, "SIGKILLs of mnist_mlp.py", lower_bound=0)
flags.DEFINE_integer("epochs", 4, "epochs per training run", lower_bound=1)
flags.DEFINE_integer("tune_kills", 20, "SIGKILLs of tf-nvlink tune", lower_bound=0)
flags.DEFINE_integer("seed", 0, "seed of the kill moments")
flags.DEFINE_string("out", "/tmp/tf_nvlink_soak", "scratch folder (model dirs, logs)")
flags.DEFINE_string("json", None, "also write the summary here")
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MNIST = os.path.join(ROOT, "examples", "mnist_mlp.py")


def env_for(cache_dir):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", TF_NVLINK_CACHE_DIR=cache_dir)
    env.pop("TF_CONFIG", None)
    return env


def run_until(command, env, kill_after, log_path):
    """Run `command` in its own process group; SIGKILL the group after `kill_after` s. Returns (rc, output, secs)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        try:
            process.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    with open(log_path) as log:
        return process.returncode, log.read(), time.monotonic() - start


def run_until_file_appears(command, env, watched, delay, log_path, timeout=600):
    """Run `command` in its own process group; SIGKILL the group `delay` s after `watched` appears (or at exit)."""
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        while process.poll() is None and not os.path.exists(watched) and time.monotonic() - start < timeout:
            time.sleep(0.0005)
        if process.poll() is None:
            time.sleep(delay)
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return process.returncode, time.monotonic() - start


def committed_epochs(model_dir):
    """Epochs the backup says are done (0 without a backup); raises if its metadata is torn."""
    path = os.path.join(model_dir, "backup", "training_metadata.json")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(json.load(f)["epoch"])


def corrupt_files(model_dir):
    """Files under their final name that are not whole (temporary '.name.*.tmp*' files do not count)."""
    bad = []
    for folder, _, names in os.walk(model_dir):
        for name in names:
            path = os.path.join(folder, name)
            if name.startswith("."):
                continue  # a temporary file a kill left behind: never under a final name
            if name.endswith(".keras") and not zipfile.is_zipfile(path):
                bad.append(path)
            if name.endswith(".json"):
                try:
                    with open(path) as f:
                        json.load(f)
                except ValueError:
                    bad.append(path)
    return bad


def accuracy_of(output):
    match = re.search(r"^test accuracy: (\d\.\d{4})$", output, re.M)
    return float(match.group(1)) if match else None


def soak_training(args, rng, out):
    command = [sys.executable, MNIST, "--dataset", "digits", "--epochs", str(args.epochs), "--seed", "0"]
    env = env_for(os.path.join(out, "cache"))
    ref_dir = os.path.join(out, "reference")
    rc, output, ref_seconds = run_until(command + ["--model_dir", ref_dir], env, 3600, os.path.join(out, "ref.log"))
    if rc != 0:
        raise SystemExit(f"the uninterrupted run failed (rc {rc}):\n{output[-3000:]}")
    reference = accuracy_of(output)
    print(f"# uninterrupted run: {ref_seconds:.1f} s, test accuracy {reference:.4f}", flush=True)
    kills, cycles, runs, problems, accuracies, resumes = 0, 0, 0, [], [], []
    while kills < args.kills:
        cycles += 1
        model_dir = os.path.join(out, f"cycle_{cycles:03d}")
        trained = {}  # epoch -> times an "Epoch k/E" line appeared after it had been committed
        while True:
            before = committed_epochs(model_dir)
            kill_after = rng.uniform(0.0, ref_seconds) if kills < args.kills else 3600
            runs += 1
            rc, output, _ = run_until(command + ["--model_dir", model_dir], env, kill_after,
                                      os.path.join(out, f"cycle_{cycles:03d}_run_{runs:04d}.log"))
            resumed = re.search(r"resuming the interrupted run at epoch (\d+)/", output)
            if resumed:
                resumes.append(int(resumed.group(1)))
                if int(resumed.group(1)) != before + 1:
                    problems.append(f"cycle {cycles} run {runs}: resumed at epoch {resumed.group(1)}, backup had "
                                    f"{before} committed (lost or repeated epochs)")
            elif before and "Epoch 1/" in output:
                problems.append(f"cycle {cycles} run {runs}: started over although {before} epochs were committed")
            for epoch in map(int, re.findall(r"^Epoch (\d+)/\d+$", output, re.M)):
                if epoch <= before:
                    trained[epoch] = trained.get(epoch, 0) + 1
            bad = corrupt_files(model_dir)
            if bad:
                problems.append(f"cycle {cycles} run {runs}: corrupt files {bad}")
            finished = accuracy_of(output) is not None and not os.path.exists(os.path.join(model_dir, "backup")) \
                and os.path.exists(os.path.join(model_dir, "model.keras"))
            if rc == 0 or finished:  # a kill after the backup's deletion ends a finished training, not a run
                break
            if rc != -signal.SIGKILL:
                problems.append(f"cycle {cycles} run {runs}: exit status {rc}:\n{output[-2000:]}")
                break
            kills += 1
            after = committed_epochs(model_dir)
            print(f"# cycle {cycles} run {runs}: killed after {kill_after:.1f} s, committed epochs {before} -> "
                  f"{after}", flush=True)
        if trained:
            problems.append(f"cycle {cycles}: committed epochs trained again: {trained}")
        checkpoints = sorted(n for n in os.listdir(os.path.join(model_dir, "checkpoints")) if not n.startswith("."))
        if checkpoints != [f"epoch_{e:03d}.keras" for e in range(1, args.epochs + 1)]:
            problems.append(f"cycle {cycles}: checkpoints {checkpoints}")
        if os.path.exists(os.path.join(model_dir, "backup")):
            problems.append(f"cycle {cycles}: backup/ left after the final save")
        accuracy = accuracy_of(output)
        accuracies.append(accuracy)
        print(f"# cycle {cycles} finished: test accuracy {accuracy} (uninterrupted {reference:.4f})", flush=True)
    return {"reference_seconds": round(ref_seconds, 1), "reference_accuracy": reference, "kills": kills,
            "cycles": cycles, "runs": runs, "resumes": len(resumes), "resumed_at_epochs": resumes,
            "final_accuracies": accuracies,
            "max_accuracy_difference": max(abs(a - reference) for a in accuracies if a is not None),
            "problems": problems}


def valid_cache(path, earlier_key):
    from tf_nvlink.plan import tune_cache
    from tf_nvlink.util.strict_json import strict_loads

    with open(path) as f:
        data = strict_loads(f.read())
    assert data["format"] == tune_cache.FORMAT_VERSION, data.get("format")
    for key, record in data["entries"].items():
        tune_cache.validate_record(record)
        assert key == tune_cache.make_key(record["fingerprint"], record["tf_version"], record["gpus"]), key
    assert earlier_key in data["entries"], "the earlier entry was lost"
    return set(data["entries"])


def soak_tune(args, rng, out):
    from tf_nvlink.plan import tune_cache

    cache_dir = os.path.join(out, "tune_cache")
    os.makedirs(cache_dir, exist_ok=True)
    path = os.path.join(cache_dir, tune_cache.CACHE_FILE)
    earlier = {"fingerprint": "000000000000", "tf_version": "0.0.0", "gpus": [0, 1], "candidate": "nccl:1",
               "cross_device_ops": "nccl", "num_packs": 1, "score": 1.0, "sizes": [1024], "scores": {"nccl:1": 1.0},
               "n_replicas": 2, "measured_at": "2026-01-01T00:00:00+00:00"}
    command = [sys.executable, "-m", "tf_nvlink", "tune", "--devices", "cpu:2", "--candidates",
               "reduce_to_one,collective", "--sizes", "1K", "--iters", "1", "--warmup", "1", "--repeats", "1"]
    env = env_for(cache_dir)
    rc, output, full = run_until(command, env, 600, os.path.join(out, "tune_ref.log"))
    if rc != 0:
        raise SystemExit(f"the uninterrupted tune failed (rc {rc}):\n{output[-3000:]}")
    problems, stored, kept_old = [], 0, 0
    for kill in range(args.tune_kills):
        os.unlink(path)
        earlier_key = tune_cache.store(earlier, path)
        log_path = os.path.join(out, f"tune_{kill:03d}.log")
        if kill % 2 == 0:  # inside the write: the lock file appears when store() starts; kill 0-20 ms later
            os.unlink(path + ".lock")
            delay = rng.uniform(0.0, 0.02)
            rc, seconds = run_until_file_appears(command, env, path + ".lock", delay, log_path)
            kill_after = seconds
        else:  # at a random moment weighted towards the end of the run
            kill_after = full * rng.uniform(0.7, 1.05)
            rc, output, _ = run_until(command, env, kill_after, log_path)
        try:
            keys = valid_cache(path, earlier_key)
        except (AssertionError, ValueError, KeyError, OSError) as exc:
            problems.append(f"tune kill {kill} after {kill_after:.1f} s (rc {rc}): invalid cache: {exc}")
            continue
        stored += len(keys) > 1
        kept_old += len(keys) == 1
        how = f"{delay * 1000:.1f} ms after store() took the lock" if kill % 2 == 0 else "at random"
        print(f"# tune kill {kill} ({how}): after {kill_after:.1f} s of {full:.1f} s, rc {rc}, cache valid with "
              f"{len(keys)} entr{'y' if len(keys) == 1 else 'ies'}", flush=True)
    leftovers = [n for n in os.listdir(cache_dir) if n.startswith(".")]
    return {"uninterrupted_seconds": round(full, 1), "kills": args.tune_kills, "cache_valid_after_every_kill":
            not problems, "new_entry_written": stored, "old_cache_only": kept_old,
            "temporary_files_left": len(leftovers), "problems": problems}


def main(argv):
    del argv
    args = flags.FLAGS  # soak_training and soak_tune read args.epochs, args.kills, args.tune_kills
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    start = time.monotonic()
    summary = {"command": " ".join(["python", "benchmarks/soak_kill_resume.py"] + sys.argv[1:])}
    if args.kills:
        summary["training"] = soak_training(args, rng, args.out)
        print("# training: " + json.dumps(summary["training"]), flush=True)
    if args.tune_kills:
        summary["tune"] = soak_tune(args, rng, args.out)
    summary["wall_seconds"] = round(time.monotonic() - start, 1)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    failed = summary.get("training", {}).get("problems") or summary.get("tune", {}).get("problems")
    return 1 if failed else 0


if __name__ == "__main__":
    app.run(main)
