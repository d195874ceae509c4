"""The bf16 dense peak and memory bandwidth tables (tf_nvlink.plan.gpu_peaks): names as NVML and TensorFlow print
them, the MFU arithmetic and its bad input."""

import pytest

from tf_nvlink.plan import gpu_peaks


@pytest.mark.parametrize("name, label, tflops", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.4),     # NVML's name of the SXM5 board (tests/fake_nvml.py)
    ("NVIDIA H100 PCIe", "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5),
    ("NVIDIA H200", "H200 SXM", 989.4),               # the lent machines' name (../shared/hardware-facts.md)
    ("NVIDIA H200 NVL", "H200 NVL", 835.5),
    ("NVIDIA GH200 480GB", "GH200", 989.4),           # not read as an H200
    ("NVIDIA A100-SXM4-80GB", "A100", 312.0),
    ("NVIDIA A100-PCIE-40GB", "A100", 312.0),
    ("NVIDIA B200", "B200", 2250.0),
    ("NVIDIA L40S", "L40S", 362.05),
    ("NVIDIA L40", "L40", 181.05),
    ("NVIDIA L4", "L4", 121.0),
])
def test_names_as_nvml_prints_them_find_their_dense_peak(name, label, tflops):
    peak = gpu_peaks.bf16_dense_peak(name)
    assert (peak.label, peak.tflops) == (label, tflops)
    assert "datasheet" in peak.source


@pytest.mark.parametrize("name", ["NVIDIA GB200", "Tesla V100-SXM2-32GB", "NVIDIA GeForce RTX 4090", "", None,
                                  "NVIDIA A10"])
def test_a_gpu_not_in_the_table_has_no_peak_and_no_mfu(name):
    assert gpu_peaks.bf16_dense_peak(name) is None
    assert gpu_peaks.mfu(1e12, 0.01, name) is None
    entry = gpu_peaks.utilisation(1e12, 0.01, name)
    assert entry["mfu"] is None and entry["peak_tflops"] is None and entry["tflops_per_gpu"] == 100.0
    assert gpu_peaks.mfu_text(entry["mfu"]) == "n/a"


def test_each_dense_peak_is_half_the_datasheets_figure_with_sparsity():
    """The table holds the dense figure; the datasheets print twice it with sparsity (the L40S datasheet's 733 is
    1.2% more than twice its printed dense 362.05)."""
    for peak in gpu_peaks.PEAKS:
        assert peak.sparse_tflops / 2 == pytest.approx(peak.tflops, rel=0.015), peak.label
        assert f"{peak.sparse_tflops:,g} TFLOPS with sparsity" in peak.source and "without sparsity" in peak.source


def test_mfu_is_the_model_flops_rate_over_the_gpus_summed_peak():
    # the 368M Transformer, 8 x 512 tokens: 8.854 TFLOP a step in 42.3 ms on one H100 SXM (docs/results.md)
    assert gpu_peaks.mfu(8.854e12, 0.0423, "NVIDIA H100 80GB HBM3") == pytest.approx(8.854e12 / 0.0423 / 989.4e12)
    two = gpu_peaks.mfu(2 * 8.854e12, 0.0423, "NVIDIA H200", gpus=2)
    assert two == pytest.approx(gpu_peaks.mfu(8.854e12, 0.0423, "NVIDIA H200"))
    entry = gpu_peaks.utilisation(2 * 8.854e12, 0.0423, "NVIDIA H200", gpus=2)
    assert entry["tflops_per_gpu"] == pytest.approx(209.31, abs=0.01) and entry["peak_label"] == "H200 SXM"
    assert entry["mfu"] == pytest.approx(0.2116, abs=1e-4) and gpu_peaks.mfu_text(entry["mfu"]) == "21.2%"


@pytest.mark.parametrize("flops, seconds, gpus", [(0, 0.1, 1), (1e12, 0, 1), (1e12, -1, 1), (1e12, 0.1, 0),
                                                   (1e12, 0.1, 1.5), (1e12, 0.1, True)])
def test_bad_mfu_input_names_the_problem(flops, seconds, gpus):
    with pytest.raises(ValueError, match="should be positive and gpus a positive integer. Received: "
                                         "model_flops_per_step="):
        gpu_peaks.mfu(flops, seconds, "NVIDIA H100 80GB HBM3", gpus)


@pytest.mark.parametrize("name, label, tb_per_s", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 3.35),
    ("NVIDIA H100 PCIe", "H100 PCIe", 2.0),
    ("NVIDIA H100 NVL", "H100 NVL", 3.9),
    ("NVIDIA H200", "H200 SXM", 4.8),
    ("NVIDIA H200 NVL", "H200 NVL", 4.8),
    ("NVIDIA GH200 480GB", "GH200", 4.0),              # 96 GB of HBM3 beside 480 GB of LPDDR5X
    ("NVIDIA B200", "B200", 8.0),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1.555),
    ("NVIDIA A100-PCIE-40GB", "A100 40GB", 1.555),
    ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 2.039),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 1.935),
    ("NVIDIA L40S", "L40S", 0.864),
    ("NVIDIA L40", "L40", 0.864),
    ("NVIDIA L4", "L4", 0.3),
    ("Tesla V100-SXM2-32GB", "V100", 0.9),
    ("Tesla V100S-PCIE-32GB", "V100S", 1.134),
    ("NVIDIA GeForce RTX 3090", "RTX 3090", 0.936),
])
def test_names_as_nvml_prints_them_find_their_memory_bandwidth(name, label, tb_per_s):
    row = gpu_peaks.memory_bandwidth(name)
    assert (row.label, row.tb_per_s) == (label, tb_per_s)
    assert row.source.endswith(f"GPU memory bandwidth {row.printed}") and ("datasheet" in row.source
                                                                            or "specifications" in row.source)


@pytest.mark.parametrize("name", ["NVIDIA GeForce RTX 3090 Ti", "NVIDIA GB200", "NVIDIA A10", "", None])
def test_a_gpu_not_in_the_bandwidth_table_has_none(name):
    assert gpu_peaks.memory_bandwidth(name) is None


def test_each_bandwidth_is_the_figure_its_datasheet_prints():
    for row in gpu_peaks.HBM_BANDWIDTHS:
        number, unit = float(row.printed[:-4].replace(",", "")), row.printed[-4:]
        assert unit in ("TB/s", "GB/s"), row.label
        assert row.tb_per_s == pytest.approx(number if unit == "TB/s" else number / 1000), row.label


def test_every_gpu_with_a_bf16_peak_has_a_bandwidth():
    """The bounds of the step doctor need both: each peak row's name pattern finds a bandwidth."""
    for name in ("NVIDIA GH200 480GB", "NVIDIA H200 NVL", "NVIDIA H200", "NVIDIA H100 PCIe", "NVIDIA H100 NVL",
                 "NVIDIA H100 80GB HBM3", "NVIDIA B200", "NVIDIA A100-SXM4-80GB", "NVIDIA L40S", "NVIDIA L40",
                 "NVIDIA L4"):
        assert gpu_peaks.bf16_dense_peak(name).label.split()[0] == gpu_peaks.memory_bandwidth(name).label.split()[0]
