"""benchmarks/time_to_first_step.py: its summary and table (cheap), and one CPU run of fresh processes (slow): the
cold process compiles one program per replica and stores it, the warm one reads them back (no new entry)."""

import json
from pathlib import Path

import pytest

from tests.conftest import run_python
from tests.tools.test_doctor import benchmark_module

ROOT = Path(__file__).resolve().parents[2]


def test_summary_and_table():
    with benchmark_module("time_to_first_step") as bench:
        job = {"model": "convnet", "path": "perstep", "n": 2, "steps": 8, "batch": 8, "cpu_devices": 2}
        runs = {"cold": [{"first_s": 4.0, "fit_s": 5.0, "entries_new": 2, "steady_steps_per_s": 10.0},
                         {"first_s": 6.0, "fit_s": 7.0, "entries_new": 2, "steady_steps_per_s": 12.0},
                         {"error": "timed out after 9 s"}],
                "warm": [{"first_s": 1.0, "fit_s": 2.0, "entries_new": 0, "steady_steps_per_s": 11.0},
                         {"first_s": 1.5, "fit_s": 2.5, "entries_new": 0, "steady_steps_per_s": 11.0},
                         {"first_s": 2.0, "fit_s": 3.0, "entries_new": 0, "steady_steps_per_s": 11.0}]}
        record = bench.summarize(job, runs)
        assert record["cold_first_s"]["median"] == 4.0 and record["cold_first_s"]["values"] == [4.0, 6.0, None]
        assert record["warm_first_s"]["median"] == 1.5 and record["warm_over_cold_first"] == 1.5 / 4.0
        table = bench.render([record])
        assert "first cold s" in table.splitlines()[0]
        assert "convnet  perstep" in table and "0.38" in table and "2,2," in table


def test_first_step_split_at_the_first_execution_from_its_log_line():
    with benchmark_module("time_to_first_step") as bench:
        line = ("WARNING tf_nvlink: first train execution of model 'resnet50' took 12.5 s: 2 programs compiled and "
                "stored in the compile cache")
        assert bench.first_execution_split({"first_s": 20.0, "log": [line]}) == {
            "execution_s": 12.5, "before_execution_s": 7.5}
        assert bench.first_execution_split({"first_s": 20.0, "log": ["something else"]}) == {}


@pytest.mark.slow  # 4 TensorFlow processes: about 25 s
def test_cpu_run_cold_then_warm(tmp_path):
    out = tmp_path / "ttfs.json"
    result = run_python([str(ROOT / "benchmarks" / "time_to_first_step.py"), "--models", "mlp", "--paths",
                         "compiled,perstep", "--cpu_devices", "2", "--rounds", "1", "--steps", "4",
                         "--steps_per_execution", "2", "--json", str(out), "--timeout", "240"], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())
    assert [(r["model"], r["path"]) for r in records] == [("mlp", "compiled"), ("mlp", "perstep")]
    for record in records:
        cold, warm = record["runs"]["cold"][0], record["runs"]["warm"][0]
        assert cold["entries_new"] == 2 and cold["replicas"] == 2  # one program per replica, stored
        assert warm["entries_new"] == 0 and warm["entries_before"] == 2  # read back, nothing compiled
        assert 0 < cold["first_s"] <= cold["fit_s"]
        for run in (cold, warm):  # the first execution's own line, INFO on CPU, splits first_s
            assert 0 < run["execution_s"] <= run["first_s"] and run["before_execution_s"] >= 0
    assert "first warm s" in result.stdout
