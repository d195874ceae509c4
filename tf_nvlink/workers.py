"""Benchmark worker processes: TensorFlow tolerates one MirroredStrategy per process, so each candidate runs in
its own `python -m tf_nvlink.<module> --worker ...` and reports one JSON line on stdout.

Example:
    >>> record, error = run_json_worker([sys.executable, "-m", "tf_nvlink.bench", "--worker", ...],
    ...                                 package_env(), timeout=600)
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Callable, Optional, Sequence


def package_env(extra: Optional[dict] = None) -> dict[str, str]:
    """This process's environment with tf_nvlink importable and TensorFlow's C++ chatter down, plus `extra`."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.update(extra or {})
    return env


def run_json_worker(command: Sequence[str], env: dict, timeout: float,
                    accept: Callable[[dict], bool] = lambda record: True) -> tuple[Optional[dict], str]:
    """Run `command` (an argument list, never a shell string); return (its last accepted JSON object line, "")
    or (None, why not: the timeout, or the exit status and the last lines it printed)."""
    try:
        proc = subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"worker timed out after {timeout:.0f} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and accept(record):
                return record, ""
    tail = " | ".join((proc.stderr or proc.stdout or "").strip().splitlines()[-3:])
    return None, f"worker exited with status {proc.returncode} without a result: {tail}"
