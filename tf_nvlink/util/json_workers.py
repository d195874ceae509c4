"""Benchmark worker processes: TensorFlow tolerates one MirroredStrategy per process, so each candidate runs in
its own `python -m tf_nvlink.<module> --worker ...` and reports one JSON line on stdout.

Example:
    >>> record, error = run_json_worker([sys.executable, "-m", "tf_nvlink.tools.allreduce_bench", "--worker", ...],
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
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above tf_nvlink/
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
    record = _last_json(proc.stdout, accept)
    if record is not None:
        return record, ""
    return None, _no_result(proc.returncode, proc.stdout, proc.stderr)


def free_ports(n: int, host: str = "localhost") -> list[int]:
    """`n` distinct TCP ports free on `host` right now (held open together, so they differ), for TF_CONFIG."""
    import socket  # noqa: PLC0415

    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def run_json_workers(commands: Sequence[Sequence[str]], envs: Sequence[dict], timeout: float,
                     accept: Callable[[dict], bool] = lambda record: True) -> list[tuple[Optional[dict], str]]:
    """Start every command at once (processes that must meet, like the workers of one cluster) and wait for all.

    Returns (record, error) per command as `run_json_worker` does. When one fails or the time is up, the others
    are killed at once (a lone worker would wait for its peers until its own timeout), so none outlives this call.
    """
    import time  # noqa: PLC0415

    procs = [subprocess.Popen(list(command), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for command, env in zip(commands, envs)]
    outputs: list[Optional[tuple[str, str]]] = [None] * len(procs)
    deadline = time.monotonic() + timeout
    timed_out = False
    stopped_for: dict[int, int] = {}  # process killed here -> the failed process it could not finish without
    try:
        pending = set(range(len(procs)))
        while pending:
            for i in sorted(pending):
                try:
                    outputs[i] = procs[i].communicate(timeout=0.2)
                except subprocess.TimeoutExpired:
                    continue
                pending.discard(i)
                if procs[i].returncode != 0 and not timed_out and i not in stopped_for:  # the others need it
                    for j in pending:
                        if procs[j].poll() is None and j not in stopped_for:
                            stopped_for[j] = i
                            procs[j].kill()
            if pending and time.monotonic() > deadline:
                timed_out = True
                for j in pending:
                    procs[j].kill()
    finally:
        for i, proc in enumerate(procs):
            if proc.poll() is None:
                proc.kill()
            if outputs[i] is None:
                outputs[i] = proc.communicate()
    results = []
    for i, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        record = _last_json(stdout, accept)
        if record is not None:
            results.append((record, ""))
        elif i in stopped_for:
            results.append((None, f"stopped: process {stopped_for[i]} failed first (exit status "
                                  f"{procs[stopped_for[i]].returncode}), and this one could not finish without it"))
        elif timed_out and proc.returncode and proc.returncode < 0:
            results.append((None, f"worker timed out after {timeout:.0f} s"))
        else:
            results.append((None, _no_result(proc.returncode, stdout, stderr)))
    return results


def _no_result(returncode: int, stdout: str, stderr: str) -> str:
    tail = " | ".join((stderr or stdout or "").strip().splitlines()[-3:])
    return f"worker exited with status {returncode} without a result: {tail}"


def _last_json(stdout: str, accept: Callable[[dict], bool]) -> Optional[dict]:
    for line in reversed((stdout or "").splitlines()):
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and accept(record):
                return record
    return None
