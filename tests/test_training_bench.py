"""The training benchmark (tf_nvlink/training_bench.py, examples/benchmark.py) on logical CPU devices."""

import pytest

from conftest import run_python
from tf_nvlink import training_bench


@pytest.mark.parametrize("text, expected", [
    ("1gpu,auto", ["1gpu", "auto"]),
    ("nccl@nop2p, auto@split", ["nccl@nop2p", "auto@split"]),
    ("auto@nop2p@fused", ["auto@nop2p@fused"]),
    ("workers,workers@nop2p", ["workers", "workers@nop2p"]),
])
def test_parse_candidates(text, expected):
    assert training_bench.parse_candidates(text) == expected


@pytest.mark.parametrize("text", ["", "gpu", "auto@fast", "auto@split@fused", "auto@nop2p@nop2p"])
def test_parse_candidates_rejects_unknown_names_listing_valid_ones(text):
    with pytest.raises(ValueError, match="reduce_to_one"):
        training_bench.parse_candidates(text)


@pytest.mark.parametrize("text", ["workers@split", "1gpu@fused", "stock@split"])
def test_xla_modes_only_for_tf_nvlink_single_process_strategies(text):
    with pytest.raises(ValueError, match="only '@nop2p' applies"):
        training_bench.parse_candidates(text)


def test_workers_candidate_needs_two_gpus_without_cpu_workers(monkeypatch):
    from tf_nvlink import nvml
    from tf_nvlink.topology import Topology

    assert training_bench.worker_layout(cpu_devices=3) == ["", "", ""]
    monkeypatch.setattr(nvml, "probe", lambda: Topology(error="NVML Shared Library Not Found"))
    with pytest.raises(ValueError, match="needs 2 or more GPUs.*--cpu_devices"):
        training_bench.worker_layout()


@pytest.mark.parametrize("jit", [False, True], ids=["nojit", "jit"])
def test_workers_candidate_trains_on_two_cpu_workers_in_lockstep(jit):
    """Two MultiWorkerMirroredStrategy processes on localhost, started and reaped together. With XLA the
    gradients are compiled per worker and all-reduced outside XLA ("split"): XLA's own all-reduce cannot span
    processes (it failed on 2x H200)."""
    records = training_bench.run_candidates("convnet", ["workers"], steps=2, jit=jit, cpu_devices=2, timeout=240)
    record = records[0]
    assert "error" not in record, record.get("error")
    assert record["workers"] == 2 and record["replicas"] == 2 and len(record["worker_step_ms"]) == 2
    assert record["examples_per_s"] > 0 and "MultiWorkerMirroredStrategy, 2 workers" in record["plan"]
    assert record["jit_compile"] is jit and record["xla_allreduce"] == ("split" if jit else None)


def test_table_ratios_scaling_and_nvlink_speedup():
    rows = [
        {"candidate": "1gpu", "replicas": 1, "jit_compile": True, "step_ms": 40.0, "examples_per_s": 3200.0},
        {"candidate": "stock", "replicas": 2, "jit_compile": False, "step_ms": 200.0, "examples_per_s": 1280.0},
        {"candidate": "auto", "replicas": 2, "jit_compile": True, "step_ms": 44.0, "examples_per_s": 5760.0,
         "plan": "tf_nvlink plan: X"},
        {"candidate": "auto@nop2p", "replicas": 2, "jit_compile": True, "step_ms": 50.0, "examples_per_s": 4800.0},
        {"candidate": "nccl", "error": "boom"},
    ]
    table = training_bench.render_table(rows)
    auto_row = next(line for line in table.splitlines() if line.startswith("auto "))
    assert auto_row.split()[-3:] == ["1.80", "0.90", "4.50"]  # vs 1 GPU, scaling, vs stock
    assert "NVLink speed-up for auto: 1.20x" in table
    assert "nccl" in table and "FAILED: boom" in table and "# tf_nvlink plan: X" in table
    assert "run-to-run noise" not in table


def test_table_gives_the_cost_of_the_batch_norm_statistics_sync():
    rows = [{"candidate": name, "replicas": 2, "jit_compile": True, "step_ms": 3.0, "examples_per_s": eps}
            for name, eps in (("auto@fused", 990.0), ("auto@fused@nosync", 1000.0))]
    assert "BatchNorm-statistics sync costs auto@fused 1.0% (990 vs 1000 examples/s without it)" in (
        training_bench.render_table(rows))
    assert training_bench.parse_candidates("auto@fused@nosync") == ["auto@fused@nosync"]


def test_table_says_ops_do_not_matter_under_fused_xla():
    rows = [{"candidate": name, "replicas": 2, "jit_compile": True, "step_ms": 3.0, "examples_per_s": eps,
             "xla_allreduce": "fused"} for name, eps in (("auto", 690e3), ("hierarchical", 868e3))]
    rows.append({"candidate": "nccl@split", "replicas": 2, "jit_compile": True, "step_ms": 3.0,
                 "examples_per_s": 600e3, "xla_allreduce": "split"})
    line = next(x for x in training_bench.render_table(rows).splitlines() if "noise" in x)
    assert line.startswith("# auto, hierarchical: the all-reduce ran inside XLA") and "nccl@split" not in line


def test_benchmark_example_runs_candidates_in_their_own_processes(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_python(["examples/benchmark.py", "--model", "convnet", "--candidates", "1gpu,auto",
                       "--cpu_devices", "2", "--steps", "2", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "examples/s" in proc.stdout and "# tf_nvlink plan: CPU" in proc.stdout
    import json

    records = json.loads(out.read_text())
    assert [r["candidate"] for r in records] == ["1gpu", "auto"]
    assert records[1]["replicas"] == 2 and records[1]["jit_compile"] and records[0]["examples_per_s"] > 0


def test_benchmark_example_rejects_bad_candidates():
    proc = run_python(["examples/benchmark.py", "--candidates", "warp_drive"], timeout=120)
    assert proc.returncode != 0 and "Unknown candidate 'warp_drive'" in proc.stderr


def test_rounds_report_the_median_round_and_the_spread():
    rounds = [{"candidate": "auto", "examples_per_s": eps, "step_ms": 1.0} for eps in (700.0, 600.0, 800.0)]
    combined = training_bench.combine_rounds(rounds)
    assert combined["examples_per_s"] == 700.0 and combined["rounds_examples_per_s"] == [700.0, 600.0, 800.0]
    assert combined["spread"] == pytest.approx(200 / 700, abs=1e-4)
    partly = training_bench.combine_rounds([{"candidate": "auto", "error": "boom"}, rounds[1], rounds[2]])
    assert partly["examples_per_s"] == 600.0 and partly["failed_rounds"] == ["boom"]  # lower middle of 2
    assert "error" in training_bench.combine_rounds([{"candidate": "x", "error": "a"}, {"candidate": "x",
                                                                                         "error": "b"}])
    assert training_bench.combine_rounds(rounds[:1]) == rounds[0]


def test_two_interleaved_rounds_on_cpu(capsys):
    records = training_bench.run_candidates("convnet", ["1gpu", "auto"], steps=2, jit=False, cpu_devices=2,
                                            rounds=2, timeout=240)
    assert [len(r["rounds_examples_per_s"]) for r in records] == [2, 2]
    order = [line.split(":")[0].strip() for line in capsys.readouterr().err.splitlines() if "round" in line]
    assert order == ["1gpu (round 1/2)", "auto (round 1/2)", "1gpu (round 2/2)", "auto (round 2/2)"]
    table = training_bench.render_table(records)
    assert "spread" in table and "2 rounds, candidates interleaved" in table
    with pytest.raises(ValueError, match="rounds should be a positive integer"):
        training_bench.run_candidates("convnet", ["1gpu"], rounds=0)
