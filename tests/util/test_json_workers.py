"""Worker processes of the benchmarks (tf_nvlink/json_workers.py)."""

import os
import sys
import time

from tf_nvlink.util import json_workers

PY = sys.executable


def test_run_json_workers_returns_each_record():
    commands = [[PY, "-c", f"print('noise'); print('{{\"rank\": {i}}}')"] for i in range(3)]
    outcomes = json_workers.run_json_workers(commands, [dict(os.environ)] * 3, timeout=60)
    assert outcomes == [({"rank": 0}, ""), ({"rank": 1}, ""), ({"rank": 2}, "")]


def test_one_failing_worker_stops_the_others_at_once():
    commands = [[PY, "-c", "import sys; print('bad peer', file=sys.stderr); sys.exit(3)"],
                [PY, "-c", "import time; time.sleep(120); print('{}')"]]
    started = time.monotonic()
    outcomes = json_workers.run_json_workers(commands, [dict(os.environ)] * 2, timeout=110)
    assert time.monotonic() - started < 30
    assert outcomes[0][0] is None and "status 3" in outcomes[0][1] and "bad peer" in outcomes[0][1]
    assert outcomes[1] == (None, "stopped: process 0 failed first (exit status 3), and this one could not finish "
                                 "without it")


def test_workers_past_the_timeout_are_killed():
    commands = [[PY, "-c", "import time; time.sleep(120)"]] * 2
    started = time.monotonic()
    outcomes = json_workers.run_json_workers(commands, [dict(os.environ)] * 2, timeout=1)
    assert time.monotonic() - started < 30
    assert all(record is None and "timed out after 1 s" in error for record, error in outcomes)


def test_free_ports_are_distinct():
    ports = json_workers.free_ports(4)
    assert len(set(ports)) == 4 and all(0 < p < 65536 for p in ports)


def test_package_env_puts_the_folder_above_tf_nvlink_first_on_the_path(tmp_path):
    """A worker started from any folder imports this tf_nvlink, and none of its subpackages as top-level names."""
    import subprocess

    import tf_nvlink

    env = json_workers.package_env({"TF_NVLINK_TEST_MARK": "1"})
    root = os.path.dirname(os.path.dirname(os.path.abspath(tf_nvlink.__file__)))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == root and env["TF_NVLINK_TEST_MARK"] == "1"
    found = subprocess.run([sys.executable, "-c", "import tf_nvlink; print(tf_nvlink.__file__)"], env=env,
                           cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == os.path.abspath(tf_nvlink.__file__), found.stderr
