"""tf_nvlink.tools.costmodel: hand-computed step times, monotonicity, calibration, links from fake NVML topologies."""

import subprocess
import sys

import pytest

from fake_nvml import FakeNvml, bridged_pairs_x4, dgx1_v100_x8, h100_hgx_x8, h200_x2, pcie_x4, rtx3090_x2_bridge
from tf_nvlink.tools.costmodel import model as costmodel
from tf_nvlink.machine import nvml
from tf_nvlink.tools.costmodel.links import link_for_topology
from tf_nvlink.tools.costmodel.model import LINKS, MIB, LinkModel, Workload, allreduce_ms, fit_overhead, predict
from tf_nvlink.tools.costmodel.table import render_table

# A round-number link and workload whose predictions are easy to compute by hand.
LINK = LinkModel("test", busbw_gbps=100.0, hop_latency_us=5.0)
WORK = Workload(compute_ms=100.0, gradient_bytes=10**9, gradient_tensors=10, per_gpu_batch=50, packs=1, name="w")
RESNET = Workload(compute_ms=39.7, gradient_bytes=int(97.5 * MIB), gradient_tensors=161, per_gpu_batch=128,
                  name="resnet50")


def probe(machine_factory):
    return nvml.probe(FakeNvml(machine_factory()))


# ---- hand-computed cases -----------------------------------------------------------------------------------

def test_allreduce_time_by_hand():
    # 4 GPUs: 1e9 B x 2*3/4 / 100 GB/s = 15 ms; latency 8.4 + 6 x 5 = 38.4 us; TensorFlow 230 us.
    assert allreduce_ms(10**9, LINK, 4) == pytest.approx(15.0 + 0.0384 + 0.230, abs=1e-12)
    # 3 calls pay the fixed part three times, the bytes once.
    assert allreduce_ms(10**9, LINK, 4, calls=3) == pytest.approx(15.0 + 3 * 0.2684, abs=1e-12)
    assert allreduce_ms(10**9, LINK, 4, framework_overhead_us=0.0) == pytest.approx(15.0384, abs=1e-12)


def test_allreduce_on_h200_uses_the_measured_busbw_and_nccls_latency():
    # 256 MiB on 2 GPUs: 268435456 B / 280 GB/s = 0.958698 ms, + 230 us + (8.4 + 2 x 3.4) us.
    assert allreduce_ms(256 * MIB, LINKS["nvswitch-h200"], 2) == pytest.approx(0.958698 + 0.230 + 0.0152, abs=1e-6)


def test_predict_by_hand():
    p = predict(WORK, LINK, 4, replica_overhead_ms=1.0)
    assert p.comm_ms == pytest.approx(15.2684)
    assert p.exposed_comm_ms == pytest.approx(15.2684)
    assert p.overhead_ms == 3.0
    assert p.step_ms == pytest.approx(118.2684)
    assert p.scaling == pytest.approx(100.0 / 118.2684)
    assert p.samples_per_s == pytest.approx(4 * 50 * 1000 / 118.2684)
    assert p.images_per_s == p.samples_per_s
    assert (p.workload, p.link, p.n_gpus, p.allreduce_dtype, p.busbw_gbps) == ("w", "test", 4, "float32", 100.0)


def test_overlap_hides_that_fraction_of_the_allreduce():
    p = predict(WORK, LINK, 4, fused_overlap=0.75, replica_overhead_ms=0.0)
    assert p.exposed_comm_ms == pytest.approx(0.25 * p.comm_ms)
    assert p.step_ms == pytest.approx(100.0 + 0.25 * 15.2684)
    assert predict(WORK, LINK, 4, fused_overlap=1.0, replica_overhead_ms=0.0).step_ms == 100.0


def test_bfloat16_halves_the_bytes_not_the_fixed_cost():
    fixed = 0.2684
    fp32 = predict(WORK, LINK, 4, allreduce_dtype="float32")
    bf16 = predict(WORK, LINK, 4, allreduce_dtype="bfloat16")
    assert bf16.comm_ms - fixed == pytest.approx((fp32.comm_ms - fixed) / 2)
    assert bf16.comm_ms == pytest.approx(7.5 + fixed)
    assert predict(WORK, LINK, 4, allreduce_dtype="float16").comm_ms == bf16.comm_ms


@pytest.mark.parametrize("link", list(LINKS.values()), ids=list(LINKS))
def test_one_gpu_has_no_communication_and_scales_at_one(link):
    p = predict(RESNET, link, 1, replica_overhead_ms=5.0)
    assert (p.comm_ms, p.exposed_comm_ms, p.overhead_ms, p.busbw_gbps) == (0.0, 0.0, 0.0, 0.0)
    assert p.step_ms == 39.7 and p.scaling == 1.0
    assert p.samples_per_s == pytest.approx(128 / 0.0397)


def test_packs_zero_means_one_allreduce_per_tensor():
    per_tensor = Workload(100.0, 10**9, gradient_tensors=10, packs=0)
    assert per_tensor.allreduce_calls == 10
    assert Workload(100.0, 10**9, gradient_tensors=10, packs=4).allreduce_calls == 4
    assert Workload(100.0, 10**9, gradient_tensors=3, packs=4).allreduce_calls == 3  # no empty packs
    assert predict(per_tensor, LINK, 2).comm_ms - predict(WORK, LINK, 2).comm_ms == pytest.approx(
        9 * (0.230 + 0.0184))


# ---- monotonicity ------------------------------------------------------------------------------------------

def test_more_bytes_is_slower_and_faster_links_are_faster():
    small = Workload(39.7, 10 * MIB)
    large = Workload(39.7, 1000 * MIB)
    for link in LINKS.values():
        for n in (2, 4, 8):
            assert predict(large, link, n).step_ms > predict(small, link, n).step_ms
    slow = LinkModel("slow", 10.0, 5.0)
    fast = LinkModel("fast", 300.0, 5.0)
    for n in (2, 4, 8):
        assert predict(RESNET, fast, n).step_ms < predict(RESNET, slow, n).step_ms
    # The measured NVSwitch beats every PCIe model and the DGX-1 at every GPU count.
    for n in (2, 4, 8):
        h200 = predict(RESNET, LINKS["nvswitch-h200"], n).step_ms
        assert all(h200 < predict(RESNET, LINKS[name], n).step_ms for name in LINKS if name != "nvswitch-h200")


def test_scaling_falls_with_more_gpus_and_faster_with_more_overlap():
    for link in LINKS.values():
        scalings = [predict(RESNET, link, n).scaling for n in (1, 2, 4, 8)]
        assert scalings == sorted(scalings, reverse=True)
    overlaps = [predict(RESNET, LINKS["pcie-gen4"], 8, fused_overlap=o).step_ms for o in (0.0, 0.5, 1.0)]
    assert overlaps == sorted(overlaps, reverse=True)


# ---- links -------------------------------------------------------------------------------------------------

def test_nvswitch_busbw_stays_constant_and_pcie_shares_the_root_complex():
    assert [LINKS["nvswitch-h200"].busbw(n) for n in (2, 4, 8)] == [280.0, 280.0, 280.0]
    assert [LINKS["pcie-gen4"].busbw(n) for n in (2, 4, 8)] == [21.1, 12.5, 6.25]
    assert [LINKS["pcie-gen5"].busbw(n) for n in (2, 4, 8)] == [42.3, 25.0, 12.5]
    assert [LINKS["pcie-host"].busbw(n) for n in (2, 4, 8)] == [23.6, 11.8, 5.9]


def test_dgx1_busbw_counts_rings_of_25_781_gbps_links_at_the_h200_efficiency():
    efficiency = 280.0 / (18 * 26.562)
    assert costmodel.NVLINK_EFFICIENCY == pytest.approx(efficiency)
    dgx1 = LINKS["dgx1-v100"]
    assert [dgx1.busbw(n) for n in (2, 4, 8)] == [round(k * 25.781 * efficiency, 1) for k in (2, 4, 6)]
    assert [dgx1.busbw(n) for n in (2, 4, 8)] == [30.2, 60.4, 90.6]
    with pytest.raises(ValueError, match=r"valid GPU counts: \[2, 4, 8\]. Received: n_gpus=3"):
        dgx1.busbw(3)


def test_ring_latency_follows_nccls_tuning_model():
    assert LINKS["nvswitch-h200"].latency_us(8) == pytest.approx(8.4 + 14 * 3.4)
    assert LINKS["pcie-gen4"].latency_us(4) == pytest.approx(8.4 + 6 * 5.7)
    assert LINKS["pcie-gen4"].latency_us(1) == 0.0


# ---- calibration -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n_gpus, overhead, overlap, dtype", [(2, 0.89, 0.0, "float32"), (4, 2.5, 0.5, "bfloat16"),
                                                              (8, 4.65, 1.0, "float32")])
def test_fit_overhead_recovers_the_parameter(n_gpus, overhead, overlap, dtype):
    link = LINKS["nvswitch-h200"]
    measured = predict(RESNET, link, n_gpus, replica_overhead_ms=overhead, fused_overlap=overlap,
                       allreduce_dtype=dtype).step_ms
    fitted = fit_overhead(RESNET.compute_ms, measured, workload=RESNET, link=link, n_gpus=n_gpus,
                          fused_overlap=overlap, allreduce_dtype=dtype)
    assert fitted == pytest.approx(overhead)


def test_defaults_are_the_fits_of_the_2x_h200_measurements():
    link = LINKS["nvswitch-h200"]
    # training_bench, second session, data on the GPUs: 1 GPU 39.0 ms, 2 GPUs 40.5 ms.
    assert fit_overhead(39.0, 40.5, workload=RESNET, link=link) == pytest.approx(
        costmodel.REPLICA_OVERHEAD_DATA_ON_GPU_MS, abs=0.005)
    # Host-fed median pair (issue 13): 3446 img/s on 1 GPU, 6038 on 2.
    assert fit_overhead(128e3 / 3446, 256e3 / 6038, workload=RESNET, link=link) == pytest.approx(
        costmodel.REPLICA_OVERHEAD_HOST_FED_MS, abs=0.005)


def test_the_model_reproduces_the_2_gpu_measurements_it_was_not_fitted_to():
    # NCCL_P2P_DISABLE=1 in the same session as the fit: 1 GPU 39.0 ms, measured 45.9 ms (scaling 0.85).
    measured_1gpu = dataclasses_replace(RESNET, compute_ms=39.0)
    p = predict(measured_1gpu, LINKS["pcie-host"], 2)
    assert p.step_ms == pytest.approx(45.9, rel=0.04)
    assert p.scaling == pytest.approx(0.85, abs=0.03)
    # TensorFlow's own 2-GPU all-reduce times (nccl:1, 2x H200) within 15%: 16 MiB 322 us, 256 MiB 1348, 1 GiB 3830.
    for size, measured_us in ((16 * MIB, 322), (256 * MIB, 1348), (1024 * MIB, 3830)):
        assert allreduce_ms(size, LINKS["nvswitch-h200"], 2) * 1e3 == pytest.approx(measured_us, rel=0.15)


def dataclasses_replace(workload, **changes):
    import dataclasses
    return dataclasses.replace(workload, **changes)


# ---- errors ------------------------------------------------------------------------------------------------

def test_bad_arguments_name_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"one of \['bfloat16', 'float16', 'float32'\]. Received: "
                                         r"allreduce_dtype='int8'"):
        predict(RESNET, LINK, 2, allreduce_dtype="int8")
    with pytest.raises(ValueError, match="Received: fused_overlap=1.5"):
        predict(RESNET, LINK, 2, fused_overlap=1.5)
    for n in (0, 9, 2.0):
        with pytest.raises(ValueError, match=rf"from 1 to 8 for test. Received: n_gpus={n!r}"):
            predict(RESNET, LINK, n)
    with pytest.raises(ValueError, match="Received: compute_ms=0"):
        Workload(0, 10)
    with pytest.raises(ValueError, match="Received: n_gpus=1"):
        fit_overhead(39.0, 39.0, workload=RESNET, link=LINK, n_gpus=1)


# ---- from fake NVML topologies -----------------------------------------------------------------------------

def test_h200_and_hgx_h100_map_to_the_measured_nvswitch_busbw():
    h200 = link_for_topology(probe(h200_x2))
    assert (h200.busbw_gbps, h200.hop_latency_us, h200.max_gpus) == (280.0, 3.4, 2)
    assert h200.name == "nvswitch (2x NVIDIA H200, 18 x 26.562 GB/s)"
    hgx = link_for_topology(probe(h100_hgx_x8))
    assert (hgx.busbw_gbps, hgx.max_gpus) == (280.0, 8)
    assert predict(RESNET, hgx, 8).step_ms == predict(RESNET, LINKS["nvswitch-h200"], 8).step_ms


@pytest.mark.parametrize("gpus, rings, busbw", [
    (None, 6, 90.6),  # all 8: three link-disjoint rings through the cube-mesh, both directions
    ((0, 1, 2, 3), 4, 60.4),  # one quad
    ((4, 5, 6, 7), 4, 60.4),
    ((0, 3), 2, 30.2),  # a doubled pair
    ((0, 1), 1, 15.1),  # a single link
    ((0, 1, 4, 5), 2, 30.2),  # only one ring 0-1-5-4 exists: its single links limit it
])
def test_dgx1_subsets_count_link_disjoint_rings(gpus, rings, busbw):
    link = link_for_topology(probe(dgx1_v100_x8), gpus)
    assert link.name.startswith(f"nvlink rings (") and f"{rings} x 25.781 GB/s" in link.name
    assert link.busbw_gbps == busbw


@pytest.mark.parametrize("gpus", [(0, 5), (0, 1, 5)])  # no NVLink between 0 and 5: the ring crosses PCIe
def test_dgx1_sets_without_an_nvlink_ring_fall_back_to_pcie(gpus):
    assert link_for_topology(probe(dgx1_v100_x8), gpus).name == "pcie-gen4"


def test_pcie_machines_and_bridged_pairs_use_the_chosen_pcie_model():
    assert link_for_topology(probe(pcie_x4)) == LINKS["pcie-gen4"]
    assert link_for_topology(probe(pcie_x4), pcie="pcie-gen5") == LINKS["pcie-gen5"]
    # 0-1 and 2-3 are bridged, 1-2 is not: no ring through all four stays on NVLink.
    assert link_for_topology(probe(bridged_pairs_x4)).name == "pcie-gen4"
    pair = link_for_topology(probe(bridged_pairs_x4), (2, 3))
    assert pair.busbw_gbps == round(12 * 25.0 * costmodel.NVLINK_EFFICIENCY, 1) == 175.7


def test_consumer_bridge_uses_its_slower_links():
    link = link_for_topology(probe(rtx3090_x2_bridge))
    assert link.busbw_gbps == round(4 * 14.0625 * costmodel.NVLINK_EFFICIENCY, 1) == 32.9


def test_link_for_topology_rejects_one_gpu_and_unknown_pcie():
    with pytest.raises(ValueError, match=r"needs 2 or more GPUs; the chosen GPUs \[0\] are 'single'"):
        link_for_topology(probe(h200_x2), [0])
    with pytest.raises(ValueError, match="Received: pcie='nvswitch-h200'"):
        link_for_topology(probe(pcie_x4), pcie="nvswitch-h200")


# ---- table and command line --------------------------------------------------------------------------------

def test_render_table_has_names_and_units_rows_like_nccl_tests():
    lines = render_table([predict(WORK, LINK, n, replica_overhead_ms=1.0) for n in (1, 4)]).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("# workload") and "busbw" in lines[0] and "scaling" in lines[0]
    assert lines[1].startswith("#") and "(GB/s)" in lines[1] and "(ms)" in lines[1]
    assert lines[3].split() == ["w", "test", "4", "float32", "replicated", "100.0", "15.27", "15.27", "3.00", "118.27", "0.846",
                                "1691"]
    # Columns line up: every row is as wide as the header.
    assert len({len(line) for line in (lines[0], lines[2], lines[3])}) == 1


def test_command_line_prints_every_link_for_1_2_4_8_gpus():
    result = subprocess.run([sys.executable, "-m", "tf_nvlink.tools.costmodel", "--compute_ms", "39.7",
                             "--gradient_mib", "97.5"], capture_output=True, text=True, check=True)
    rows = [line.split() for line in result.stdout.split("\n\n")[0].splitlines() if not line.startswith("#")]
    assert [(row[1], row[2]) for row in rows] == [(name, str(n)) for name in LINKS for n in (1, 2, 4, 8)]
    assert "tensorflow" not in result.stderr.lower()


def test_importing_the_cost_model_imports_no_tensorflow():
    code = "import sys, tf_nvlink.tools.costmodel; print('tensorflow' in sys.modules, 'pynvml' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# ---- optimizer states sharded --------------------------------------------------------------------------------

def test_sharded_states_add_one_all_reduce_of_the_float32_weights():
    replicated = predict(WORK, LINK, 4, replica_overhead_ms=0.0)
    sharded = predict(WORK, LINK, 4, replica_overhead_ms=0.0, optimizer_states="sharded")
    # 1e9 B of gradients in 1 pack: 15.2684 ms; the weights, 1e9 B in one call: 15.2684 ms more
    assert replicated.comm_ms == pytest.approx(15.2684) and sharded.comm_ms == pytest.approx(30.5368)
    assert sharded.step_ms == pytest.approx(130.5368) and sharded.optimizer_states == "sharded"
    assert replicated.optimizer_states == "replicated"
    # bfloat16 halves the gradients on the wire, not the weights: 7.5 + 0.2684, then 15.2684
    half = predict(WORK, LINK, 4, allreduce_dtype="bfloat16", optimizer_states="sharded")
    assert half.comm_ms == pytest.approx(7.7684 + 15.2684)
    # one GPU: nothing to send either way
    assert predict(WORK, LINK, 1, optimizer_states="sharded").comm_ms == 0.0


def test_an_unknown_optimizer_states_value_names_the_choices():
    with pytest.raises(ValueError, match=r"optimizer_states must be one of \['replicated', 'sharded'\]. "
                                         r"Received: optimizer_states='zero'"):
        predict(WORK, LINK, 2, optimizer_states="zero")


def test_the_table_says_which_states_each_row_is():
    lines = render_table([predict(WORK, LINK, 4, replica_overhead_ms=1.0, optimizer_states=s)
                          for s in ("replicated", "sharded")]).splitlines()
    assert lines[0].split()[:6] == ["#", "workload", "link", "gpus", "dtype", "states"]
    assert lines[2].split()[4:7] == ["replicated", "100.0", "15.27"]
    assert lines[3].split()[4:7] == ["sharded", "100.0", "30.54"]


def _costmodel(argv, capsys):
    from tf_nvlink.__main__ import main  # noqa: PLC0415

    code = main(["costmodel", *argv])
    return code, capsys.readouterr().out


def test_command_line_both_rows_the_note_and_the_memory_per_gpu(capsys):
    code, out = _costmodel(["--compute_ms", "100", "--params", "1e9", "--gradient_tensors", "4", "--gpus", "2,4",
                            "--optimizer_states", "both", "--gpu_memory_gb", "10"], capsys)
    assert code == 0
    rows = [line.split() for line in out.split("\n\n")[0].splitlines() if not line.startswith(("#", "note"))]
    assert [(row[1], row[2], row[4]) for row in rows] == [
        (name, str(n), states) for name in LINKS for n in (2, 4) for states in ("replicated", "sharded")]
    assert "note: sharded rows: tf_nvlink as built" in out and "reduce-scatter + all-gather" in out
    # 1e9 float32 parameters in 4 variables, AdamW's 2 slots: 4 + 4 + 8 GB replicated; sharded, 2 variables' slots
    # on each of 2 GPUs (4 GB), one on each of 4 (2 GB)
    memory = out.split("\n\n")[1].splitlines()
    assert memory == [
        "memory per GPU of workload (1,000,000,000 float32 parameters in 4 equal variables, 2 optimizer state(s) per "
        "parameter, 10.00 GB per GPU; before activations):",
        "# GPUs  states      weights  gradients  optimizer states  total  fits",
        "#                      (GB)       (GB)              (GB)   (GB)",
        "     2  replicated     4.00       4.00              8.00  16.00    no",
        "     2  sharded        4.00       4.00              4.00  12.00    no",
        "     4  replicated     4.00       4.00              8.00  16.00    no",
        "     4  sharded        4.00       4.00              2.00  10.00   yes",
        "  2 GPUs: does not fit, even sharded (2 replicas: 12.00 GB sharded, 16.00 GB replicated, 10.00 GB per GPU)",
        "  4 GPUs: sharding lets this model fit (4 replicas: 10.00 GB sharded, 16.00 GB replicated, 10.00 GB per GPU)"]


def test_command_line_default_rows_are_replicated_and_memory_has_no_fits_without_a_gpu_size(capsys):
    code, out = _costmodel(["--compute_ms", "39.7", "--gradient_mib", "97.5", "--gpus", "2"], capsys)
    assert code == 0 and "note:" not in out and " sharded   " not in out.split("\n\n")[0]
    memory = out.split("\n\n")[1].splitlines()
    assert memory[0].startswith("memory per GPU of workload (25,559,040 float32 parameters in 1 equal variables")
    assert memory[3].split() == ["2", "replicated", "102.24", "102.24", "204.47", "408.94", "-"]
    assert memory[4].split() == ["2", "sharded", "102.24", "102.24", "204.47", "408.94", "-"]  # one variable
    assert len(memory) == 5


@pytest.mark.parametrize("argv, message", [
    (["--optimizer_states", "zero"], "argument --optimizer_states: invalid choice: 'zero' (choose from "
                                     "'replicated', 'sharded', 'both')"),
    (["--params", "1e9"], "give one of --gradient_mib (float32 gradients in MiB) or --params (parameters)"),
    (["--slots", "-1"], "argument --slots: should be a non-negative integer"),
])
def test_command_line_bad_values_exit_2_with_one_line(argv, message, capsys):
    argv = ["--compute_ms", "1", "--gradient_mib", "1", *argv]
    with pytest.raises(SystemExit) as info:
        _costmodel(argv, capsys)
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
