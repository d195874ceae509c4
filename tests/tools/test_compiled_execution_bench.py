"""benchmarks/compiled_execution.py's Transformer rows: the PyTorch peer beside each Transformer, the model's TFLOP/s
and MFU in the table and the JSON, the doctor's kinds of work in the log and beside the peer's kind by kind, and a CPU
run of the 2048-token path's code on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import run_python
from tests.tools.test_doctor import benchmark_module
from tf_nvlink.plan import gpu_peaks
from tf_nvlink.tools import bench_models

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("compiled_execution") as module:
        yield module


def test_the_peer_runs_beside_resnet50_and_every_transformer(bench):
    setups = ["per-step", "compiled", "torch"]
    for name in ("resnet50", "transformer", "transformer_2048", "transformer_tiny"):
        assert bench.setups_for(name, setups, torch=True) == setups, name
    assert bench.setups_for("convnet", setups, torch=True) == ["per-step", "compiled"]
    assert bench.setups_for("transformer", setups, torch=False) == ["per-step", "compiled"]
    assert bench.DEFAULT_BATCH["transformer_2048"] == 2 and bench.DEFAULT_STEPS_PER_EXECUTION["transformer_2048"] == 8


def transformer_record(bench, gpu):
    """A record as bench_model writes it: 8 x 512 tokens, the compiled execution at 42.3 ms, the peer at 33.5."""
    flops = bench_models.transformer_flops_per_step("transformer", 8)
    rows = {}
    for setup, ms, path in (("compiled", 42.3, ("compiled execution",)), ("torch", 33.5, None)):
        rows[setup] = {"fit_s": [ms * 0.096] * 3, "median_s": ms * 0.096, "spread": 0.01,
                       "samples_per_s": 8 / (ms / 1e3), "ms_per_step": ms, "path": path,
                       "utilisation": gpu_peaks.utilisation(flops, ms / 1e3, gpu)}
    return {"model": "transformer", "global_batch": 8, "steps": 96, "steps_per_execution": 8, "rounds": 3,
            "optimizer": "adamw", "gpu": gpu, "model_flops_per_step": flops, "flop_count": bench.FLOP_COUNT,
            "rows": rows, "doctor": None}


def test_the_table_gives_each_transformer_row_its_tflops_and_mfu(bench):
    text = bench.render(transformer_record(bench, "NVIDIA H100 80GB HBM3"))
    lines = text.splitlines()
    assert "| setup | samples/s (median) | ms/step | spread | vs per-step | vs torch | model TFLOP/s per GPU | MFU | " \
           "path |" in lines
    assert "| compiled | 189.1 | 42.30 | 1.0% | - | 0.792 | 209.3 | 21.2% | compiled execution |" in lines
    assert "| torch | 238.8 | 33.50 | 1.0% | - | 1.000 | 264.3 | 26.7% | - |" in lines
    assert any(line.startswith("model FLOPs per step 8.854 TFLOP (6·N·T + 12·L·D·S·T") and "the H100 SXM's 989.4"
               in line for line in lines)
    unknown = bench.render(transformer_record(bench, "NVIDIA A10")).splitlines()
    assert "| compiled | 189.1 | 42.30 | 1.0% | - | 0.792 | 209.3 | n/a | compiled execution |" in unknown
    assert any("no peak: the GPU 'NVIDIA A10' is not in tf_nvlink.plan.gpu_peaks" in line for line in unknown)


def test_a_model_without_flops_keeps_the_table_it_had(bench):
    record = transformer_record(bench, "NVIDIA H200")
    record.update(model="resnet50", model_flops_per_step=None)
    for row in record["rows"].values():
        del row["utilisation"]
    text = bench.render(record)
    assert "| setup | samples/s (median) | ms/step | spread | vs per-step | vs torch | path |" in text.splitlines()
    assert "MFU" not in text and "model FLOPs" not in text


def test_the_doctors_kinds_of_work_and_mfu_go_to_the_log(bench):
    report = {"mean": {"work_ms": {"matmul": 20.5, "attention": 6.25, "optimizer": 0.0}},
              "mfu": {"model_flops_per_step": 8.854e12, "tflops_per_gpu": 250.0, "gpu": "NVIDIA H200",
                      "peak_label": "H200 SXM", "peak_tflops": 989.4, "mfu": 0.2527, "mfu_of_kernel_time": 0.27}}
    assert bench.doctor_work_lines(report, "compiled, N=8") == [
        "doctor (compiled, N=8) by kind of work, ms per step: matmul 20.50, attention 6.25",
        "doctor (compiled, N=8): model FLOPs 8.854 TFLOP a step: 250.0 TFLOP/s per GPU, MFU 25.3% of the H200 SXM's "
        "989.4 TFLOP/s (bf16 dense); on the kernels' time alone 27.0%"]
    assert bench.doctor_work_lines({"unavailable": "no GPU"}, "spe=1") == []


def test_the_two_steps_compare_kind_by_kind_with_the_doctors_bounds(bench):
    """The doctor's window of the compiled execution (its bounds) beside the PyTorch peer's kernels by kind."""
    record = transformer_record(bench, "NVIDIA H100 80GB HBM3")
    record["doctor"] = {"mean": {"work_ms": {"matmul": 99.0}, "busy_ms": 99.0}}  # spe=1: not the one shown
    record["doctor_compiled"] = {
        "setup": "compiled",
        "mean": {"work_ms": {"matmul": 12.37, "attention": 2.22, "normalisation": 6.14, "copy": 0.01},
                 "busy_ms": 31.44, "step_ms": 33.7, "compute_ms": 31.4, "idle_ms": 2.26, "exposed_h2d_ms": 0.0},
        "work_bounds": {"kinds": {"matmul": {"bound_ms": 8.3, "x_bound": 1.4904},
                                  "normalisation": {"bound_ms": 0.7, "x_bound": 8.7714},
                                  "attention": {"bound_ms": None, "x_bound": None}}}}
    record["torch_work"] = {"steps": 10, "work_ms": {"matmul": 11.02, "attention": 1.9, "elementwise": 3.1},
                            "busy_ms": 26.9, "kernels": []}
    lines = bench.render(record).splitlines()
    start = lines.index("by kind of work, ms per step: tf_nvlink (the step doctor, compiled, N=8) and torch "
                        "(torch.profiler, 10 steps)")
    assert lines[start + 1:] == [
        "| kind | tf_nvlink | its bound | x bound | torch |", "| --- | --- | --- | --- | --- |",
        "| matmul | 12.37 | 8.30 | 1.49 | 11.02 |", "| attention | 2.22 | - | - | 1.90 |",
        "| normalisation | 6.14 | 0.70 | 8.77 | - |", "| elementwise | - | - | - | 3.10 |",
        "| copy | 0.01 | - | - | - |", "| GPU busy | 31.44 | - | - | 26.90 |"]
    del record["doctor_compiled"], record["torch_work"]
    assert bench.kind_table(record)[0] == ("by kind of work, ms per step: tf_nvlink (the step doctor, spe=1) and "
                                           "torch (not run)")
    record["doctor"] = None
    assert bench.kind_table(record) == []


@pytest.mark.slow  # a TensorFlow process training the tiny Transformer twice: about 15 s
def test_a_cpu_run_of_a_transformer_with_adamw_writes_its_flops_and_no_mfu(tmp_path):
    result = run_python([str(ROOT / "benchmarks" / "compiled_execution.py"), "--models", "transformer_tiny",
                         "--devices", "cpu", "--rounds", "1", "--notorch", "--steps", "8", "--warmup_steps", "4",
                         "--setups", "per-step,compiled,torch", "--optimizer", "adamw", "--nodoctor",
                         "--json", str(tmp_path / "out.json"), "--output_dir", str(tmp_path / "doctor")], timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads((tmp_path / "out.json").read_text())
    assert list(record["rows"]) == ["per-step", "compiled"] and record["optimizer"] == "adamw"
    assert record["model_flops_per_step"] == bench_models.transformer_flops_per_step("transformer_tiny", 4)
    use = record["rows"]["compiled"]["utilisation"]
    assert use["mfu"] is None and use["gpu"] is None and use["tflops_per_gpu"] == pytest.approx(
        record["model_flops_per_step"] / (record["rows"]["compiled"]["ms_per_step"] / 1e3) / 1e12, abs=0.01)
    assert "MFU against no peak: no GPU" in result.stdout


def test_the_gpu_is_named_by_nvml_for_the_plans_first_gpu(bench, monkeypatch):
    import types

    from tests import fake_nvml
    from tf_nvlink.machine import nvml

    real_probe = nvml.probe
    monkeypatch.setattr(nvml, "probe", lambda: real_probe(fake_nvml.FakeNvml(fake_nvml.h100_hgx_x8())))
    strategy = types.SimpleNamespace(plan=types.SimpleNamespace(gpus=(3,)))
    assert bench.gpu_name(strategy) == "NVIDIA H100 80GB HBM3"
    assert bench.gpu_name(types.SimpleNamespace(plan=types.SimpleNamespace(gpus=()))) is None  # CPU replicas
