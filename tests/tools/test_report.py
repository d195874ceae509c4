"""tf_nvlink.tools.report and the `tf-nvlink` command line, on every fake machine (no GPU; TensorFlow faked, but for
one report of the real one)."""

import json
import re
import sys
import time
import types

import pytest

import fake_nvml
from conftest import ROOT, run_python
from fake_nvml import FakeNvml
from tf_nvlink import __main__ as cli
from tf_nvlink.internals import tf_runtime as internals

from tf_nvlink.machine import nvml
from tf_nvlink.tools import memory_report, report
H200_DESCS = [
    ("/device:GPU:0", "device: 0, name: NVIDIA H200, pci bus id: 0000:00:06.0, compute capability: 9.0a"),
    ("/device:GPU:1", "device: 1, name: NVIDIA H200, pci bus id: 0000:00:07.0, compute capability: 9.0a"),
]


def _rows(*rows):
    return [row.split() for row in rows]


# Per machine: the `nvidia-smi topo -m` matrix, GPU0's NVLink table row (active links, version, GB/s per link,
# total GB/s, what the links reach), the "Fully NVLink-connected" answer, the plan's ops and gpus="auto"'s line.
EXPECTED = {
    "h200_x2": dict(
        matrix=_rows("X NV18", "NV18 X"),
        gpu0=["18", "4.0", "26.562", "478.1", "NVSwitch x18"], connected="yes (nvswitch)",
        plan_gpus="[0, 1] (nvswitch, 478 GB/s per direction over NVLink)", ops="nccl, num_packs=1",
        auto="[0, 1] (nvswitch, 478 GB/s per direction over NVLink) -> nccl, num_packs=1 (the same)"),
    "h100_hgx_x8": dict(
        matrix=[["X" if a == b else "NV18" for b in range(8)] for a in range(8)],
        gpu0=["18", "4.0", "26.562", "478.1", "NVSwitch x18"], connected="yes (nvswitch)",
        plan_gpus="[0, 1, 2, 3, 4, 5, 6, 7] (nvswitch, 478 GB/s per direction over NVLink)",
        ops="nccl, num_packs=1",
        auto="[0, 1, 2, 3, 4, 5, 6, 7] (nvswitch, 478 GB/s per direction over NVLink) -> nccl, num_packs=1 "
             "(the same)"),
    "dgx1_v100_x8": dict(
        matrix=_rows(*fake_nvml.DGX1_TOPO_MATRIX),
        gpu0=["6", "2.0", "25.781", "154.7", "GPU1 x1, GPU2 x1, GPU3 x2, GPU4 x2"],
        connected="no (12 of 28 GPU pairs have no NVLink: GPU0-GPU5, GPU0-GPU6, GPU0-GPU7, ...)",
        plan_gpus="[0, 1, 2, 3, 4, 5, 6, 7] (nvlink-partial)", ops="hierarchical, num_packs=1",
        auto="[0, 1, 2, 3, 4, 5, 6, 7] (nvlink-partial) -> hierarchical, num_packs=1 (the same)"),
    "rtx3090_x2_bridge": dict(
        matrix=_rows("X NV4", "NV4 X"),
        gpu0=["4", "3.1", "14.062", "56.2", "GPU1 x4"], connected="yes (nvlink-all)",
        plan_gpus="[0, 1] (nvlink-all, 56 GB/s per direction over NVLink)", ops="nccl, num_packs=1",
        auto="[0, 1] (nvlink-all, 56 GB/s per direction over NVLink) -> nccl, num_packs=1 (the same)"),
    "pcie_x4": dict(
        matrix=_rows("X PIX PHB PHB", "PIX X PHB PHB", "PHB PHB X PIX", "PHB PHB PIX X"),
        gpu0=["0", "-", "-", "0.0", "none (PCIe only)"],
        connected="no (6 of 6 GPU pairs have no NVLink: GPU0-GPU1, GPU0-GPU2, GPU0-GPU3, ...)",
        plan_gpus="[0, 1, 2, 3] (pcie)", ops="nccl, num_packs=1", auto="[0] (single) -> reduce_to_one"),
    "bridged_pairs_x4": dict(
        matrix=_rows("X NV12 SYS SYS", "NV12 X SYS SYS", "SYS SYS X NV12", "SYS SYS NV12 X"),
        gpu0=["12", "3.1", "25", "300.0", "GPU1 x12"],
        connected="no (4 of 6 GPU pairs have no NVLink: GPU0-GPU2, GPU0-GPU3, GPU1-GPU2, ...)",
        plan_gpus="[0, 1, 2, 3] (nvlink-partial)", ops="nccl, num_packs=1",
        auto="[0, 1] (nvlink-all, 300 GB/s per direction over NVLink) -> nccl, num_packs=1"),
}


def collect(name, **kwargs):
    kwargs.setdefault("with_tf", False)
    kwargs.setdefault("environ", {})
    return report.collect(topology=nvml.probe(FakeNvml(fake_nvml.MACHINES[name]())), **kwargs)


def grid(text, title_prefix):
    """{"GPU0": [cells...], ...} of the GPU grid under the line starting with `title_prefix`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title_prefix))
    assert lines[start + 1].split() == [f"GPU{i}" for i in range(len(lines[start + 1].split()))]
    rows = {}
    for line in lines[start + 2:]:
        match = re.match(r"^(GPU\d+)\s+(.*)$", line)
        if not match:
            break
        rows[match.group(1)] = match.group(2).split()
    return rows


def nvlink_table(text):
    """Header rows and data rows (cells split on 2+ spaces) of the NVLink table."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NVLink per GPU"))
    header, units = lines[start + 1], lines[start + 2]
    rows = []
    for line in lines[start + 3:]:
        if not line.strip():
            break
        rows.append(re.split(r"\s{2,}", line.strip()))
    return header, units, rows


def line_after(text, prefix):
    return next(line[len(prefix):] for line in text.splitlines() if line.startswith(prefix))


def test_every_fake_machine_is_covered():
    assert set(EXPECTED) | {"no_driver"} == set(fake_nvml.MACHINES)


@pytest.fixture(params=sorted(EXPECTED))
def machine(request):
    data = collect(request.param)
    return request.param, data, report.render_text(data), EXPECTED[request.param]


def test_matrix(machine):
    _, data, text, want = machine
    rows = grid(text, "GPU topology (as `nvidia-smi topo -m`)")
    assert rows == {f"GPU{i}": row for i, row in enumerate(want["matrix"])}
    assert data["matrix"]["labels"] == want["matrix"]
    assert "Legend: X = self; NV# = a bonded set of # NVLinks" in text
    for label in ("PIX", "PXB", "PHB", "NODE", "SYS"):
        assert f"{label} = " in text


def test_nvlink_table(machine):
    name, data, text, want = machine
    header, units, rows = nvlink_table(text)
    assert header.startswith("# GPU") and units.startswith("#")  # nccl-tests style: names row, units row
    assert re.split(r"\s{2,}", header.strip("# ")) == ["GPU", "name", "PCI bus id", "active", "NVLink",
                                                       "per link", "total", "reaches"]
    assert units.split() == ["#", "links", "version", "(GB/s)", "(GB/s)"]
    topo = nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))
    assert len(rows) == len(topo.gpus)
    for row, gpu in zip(rows, topo.gpus):
        assert row[:3] == [str(gpu.index), gpu.name, str(gpu.pci_bus_id)]
    assert rows[0][3:] == want["gpu0"]
    assert data["gpus"][0]["reaches"] == want["gpu0"][-1]


def test_facts(machine):
    name, data, text, want = machine
    topo = nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))
    assert text.startswith(f"tf_nvlink 0.1.0 report: {len(topo.gpus)} GPUs, driver 580.159.04, NVML ")
    assert line_after(text, "NVLink groups: ") == " ".join(str(list(g)) for g in topo.nvlink_groups())
    assert line_after(text, "Fully NVLink-connected: ") == want["connected"]
    assert line_after(text, "Topology fingerprint: ") == topo.fingerprint() == data["fingerprint"]
    assert "Probe warnings: none" in text
    assert data["fully_nvlink_connected"] is want["connected"].startswith("yes")
    assert ("NVSwitch x18" in text) is (name in ("h200_x2", "h100_hgx_x8"))


def test_plan_lines(machine):
    _, data, text, want = machine
    assert "Plan for tf_nvlink.strategy(gpus='all', cross_device_ops='auto'):" in text
    assert line_after(text, "  GPUs       ") == want["plan_gpus"]
    assert line_after(text, "  ops        ").startswith(want["ops"] + " (tf.distribute.")
    assert line_after(text, "  reason     ") == data["plan"]["reason"]
    assert line_after(text, "gpus='auto' would choose: ") == want["auto"]
    assert data["plan"]["summary"].startswith("tf_nvlink plan: ")


def test_json_round_trips_and_renders_the_same(machine):
    _, data, text, _ = machine
    again = json.loads(report.to_json(data))
    assert again == data
    assert report.render_text(again) == text
    assert again["no_gpu"] is False and again["error"] is None
    assert again["tensorflow"] == {"checked": False}


def test_expected_gbps_matrix_h200():
    text = report.render_text(collect("h200_x2"))
    rows = grid(text, "Expected NVLink GB/s per direction between GPUs")
    assert rows == {"GPU0": ["-", "478.1"], "GPU1": ["478.1", "-"]}


def test_expected_gbps_none_on_pcie_only():
    text = report.render_text(collect("pcie_x4"))
    assert "Expected NVLink GB/s per direction between GPUs: none (no GPU pair has NVLink; PCIe only)." in text


def test_h200_json_numbers():
    data = collect("h200_x2")
    gpu = data["gpus"][0]
    assert (gpu["active_links"], gpu["nvlink_version"], gpu["link_gbps"], gpu["nvlink_gbps"]) == (
        18, "4.0", 26.562, 478.116)
    assert gpu["reaches"] == "NVSwitch x18"
    assert data["matrix"]["nvlink_gbps"] == [[None, 478.116], [478.116, None]]
    assert data["nvlink_groups"] == [[0, 1]] and data["shape"] == "nvswitch"
    assert data["plan"]["gpus"] == [0, 1] and data["plan"]["cross_device_ops"] == "nccl"
    assert data["auto_plan"]["gpus"] == [0, 1]


def test_no_gpu_report():
    data = collect("no_driver")
    assert data["gpus"] == [] and data["no_gpu"] is True and "no NVIDIA driver / NVML" in data["error"]
    text = report.render_text(data)
    assert "No NVIDIA GPU found: no NVIDIA driver / NVML: nvmlInit failed: Driver Not Loaded." in text
    assert "GPU topology" not in text and "NVLink per GPU" not in text
    assert line_after(text, "  GPUs       ") == "none (CPU)"
    assert line_after(text, "  ops        ") == "reduce_to_one (tf.distribute.ReductionToOneDevice)"
    assert data["plan"]["gpus"] == [] and data["plan"]["cross_device_ops"] == "reduce_to_one"
    assert json.loads(report.to_json(data)) == data


def test_probe_warnings_are_shown():
    machine = fake_nvml.h200_x2()
    machine.gpus[1].lost = True
    data = report.collect(topology=nvml.probe(FakeNvml(machine)), with_tf=False, environ={})
    text = report.render_text(data)
    assert "Probe warnings (1):" in text
    assert "  WARNING: NVML GPU 1 handle failed: GPU is lost; GPU left out" in text
    assert line_after(text, "Fully NVLink-connected: ") == "yes (one GPU)"


def test_cuda_visible_devices_limits_the_plan():
    data = collect("h100_hgx_x8", environ={"CUDA_VISIBLE_DEVICES": "6,2"})
    assert data["cuda_visible_devices"] == "6,2" and data["visible_nvml_indices"] == [6, 2]
    assert data["plan"]["gpus"] == [6, 2]
    text = report.render_text(data)
    assert "CUDA_VISIBLE_DEVICES='6,2': TensorFlow would see NVML GPUs [6, 2]." in text


def test_given_plan_is_shown():
    from tf_nvlink.plan import policy

    topo = nvml.probe(FakeNvml(fake_nvml.h200_x2()))
    plan = policy.make_plan(topo, "1", "reduce_to_one")
    data = report.collect(topology=topo, with_tf=False, plan=plan, environ={})
    assert data["plan"]["gpus"] == [1] and data["plan"]["summary"] == plan.summary()
    text = report.render_text(data)
    assert "Plan for tf_nvlink.strategy(gpus='1', cross_device_ops='reduce_to_one'):" in text
    assert line_after(text, "  reason     ") == "requested by the caller"


def test_import_does_not_import_tensorflow():
    result = run_python("import sys, tf_nvlink.tools.report, tf_nvlink.__main__; "
                        "print('tensorflow' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


# ---- TensorFlow's view, with TensorFlow faked ---------------------------------------------------------------

@pytest.fixture
def fake_tf(monkeypatch):
    """report's TensorFlow import and device_lib listing replaced: H200 descs, CUDA build."""
    tf = types.SimpleNamespace(__version__="2.21.0", test=types.SimpleNamespace(is_built_with_cuda=lambda: True))
    monkeypatch.setattr(report, "_import_tensorflow", lambda: tf)
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: list(H200_DESCS))
    return tf


def test_tf_view_maps_gpus(fake_tf):
    data = collect("h200_x2", with_tf=True)
    tf = data["tensorflow"]
    assert tf["checked"] and tf["version"] == "2.21.0" and tf["built_with_cuda"] is True and tf["problem"] is None
    assert [(g["tf_name"], g["nvml_index"], g["pci_bus_id"]) for g in tf["gpus"]] == [
        ("/device:GPU:0", 0, "0000:00:06.0"), ("/device:GPU:1", 1, "0000:00:07.0")]
    assert tf["unmapped"] == [] and tf["hidden_nvml"] == [] and tf["notes"] == []
    text = report.render_text(data)
    assert "TensorFlow 2.21.0, CUDA build, CUDA_VISIBLE_DEVICES unset:" in text
    assert "  /device:GPU:0     0  0000:00:06.0  " + H200_DESCS[0][1] in text
    assert "WARNING:" not in text and "NOTE:" not in text
    assert json.loads(report.to_json(data)) == data


def test_tf_view_flags_hidden_gpus(fake_tf, monkeypatch):
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: [
        ("/device:GPU:0", H200_DESCS[1][1].replace("device: 1", "device: 0"))])
    data = collect("h200_x2", with_tf=True, environ={"CUDA_VISIBLE_DEVICES": "1"})
    assert data["tensorflow"]["hidden_nvml"] == [0]
    assert data["tensorflow"]["gpus"][0]["nvml_index"] == 1
    text = report.render_text(data)
    assert "  NOTE: NVML GPU(s) [0] are not visible to TensorFlow: hidden by CUDA_VISIBLE_DEVICES='1'." in text
    assert "TensorFlow 2.21.0, CUDA build, CUDA_VISIBLE_DEVICES='1':" in text
    assert data["plan"]["gpus"] == [1]


def test_tf_view_without_cuda_libraries(fake_tf, monkeypatch):
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: [])
    text = report.render_text(collect("h200_x2", with_tf=True))
    assert "  TensorFlow sees no GPU." in text
    assert "NVML GPU(s) [0, 1] are not visible to TensorFlow: CUDA_VISIBLE_DEVICES is unset" in text
    assert "tensorflow[and-cuda]" in text


def test_tf_view_flags_unmapped_gpus(fake_tf, monkeypatch):
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: [
        H200_DESCS[0], ("/device:GPU:1", H200_DESCS[1][1].replace("00:07.0", "00:09.0"))])
    data = collect("h200_x2", with_tf=True)
    assert data["tensorflow"]["unmapped"] == ["/device:GPU:1"]
    text = report.render_text(data)
    assert ("  WARNING: TensorFlow GPU(s) /device:GPU:1 match no NVML GPU by PCI bus id; tf_nvlink cannot place "
            "replicas on them.") in text
    assert "  /device:GPU:1     ?  0000:00:09.0" in text


def test_tf_view_notes_order_mismatch(fake_tf):
    data = collect("h200_x2", with_tf=True, environ={"CUDA_VISIBLE_DEVICES": "1,0"})
    assert data["tensorflow"]["notes"] == ["CUDA_VISIBLE_DEVICES predicts NVML GPUs [1, 0] in TensorFlow's order, "
                                           "but TensorFlow's PCI bus ids say [0, 1]; tf_nvlink goes by the PCI "
                                           "bus ids"]


def test_tf_not_importable(monkeypatch):
    def missing():
        raise ModuleNotFoundError("No module named 'tensorflow'")

    monkeypatch.setattr(report, "_import_tensorflow", missing)
    monkeypatch.setattr(internals, "tf_gpu_descs", pytest.fail)
    data = collect("h200_x2", with_tf=True)
    text = report.render_text(data)
    tf_lines = [line for line in text.splitlines() if line.startswith("TensorFlow")]
    assert tf_lines == ["TensorFlow cannot be imported (ModuleNotFoundError: No module named 'tensorflow'); "
                        "TensorFlow's view skipped."]
    assert data["tensorflow"]["gpus"] == []


def test_tf_without_gpu_support(fake_tf, monkeypatch):
    monkeypatch.setattr(fake_tf.test, "is_built_with_cuda", lambda: False)
    monkeypatch.setattr(internals, "tf_gpu_descs", pytest.fail)
    data = collect("h200_x2", with_tf=True)
    assert data["tensorflow"]["built_with_cuda"] is False
    tf_lines = [line for line in report.render_text(data).splitlines() if line.startswith("TensorFlow")]
    assert len(tf_lines) == 1
    assert "has no GPU support (tf.test.is_built_with_cuda() is False)" in tf_lines[0]


def test_with_tf_false_never_touches_tensorflow(monkeypatch):
    monkeypatch.setattr(report, "_import_tensorflow", pytest.fail)
    monkeypatch.setattr(internals, "tf_gpu_descs", pytest.fail)
    assert collect("h200_x2", with_tf=False)["tensorflow"] == {"checked": False}


# ---- command line ------------------------------------------------------------------------------------------

def test_main_json_no_tf_on_this_machine(capsys):
    assert cli.main(["report", "--no-tf", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["no_gpu"] is (not nvml.probe().gpus)  # True here: this machine has no NVIDIA driver
    assert data["tensorflow"] == {"checked": False}


def test_main_on_a_gpu_less_machine(monkeypatch, capsys):
    monkeypatch.setattr(report, "nvml_probe", lambda nvml=None: nvml_probe_fake("no_driver"))
    assert cli.main(["report", "--no-tf", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["no_gpu"] is True and data["gpus"] == [] and "no NVIDIA driver" in data["error"]
    assert cli.main(["report", "--no-tf"]) == 0
    assert "No NVIDIA GPU found: no NVIDIA driver / NVML" in capsys.readouterr().out


def nvml_probe_fake(name):
    return nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))


def test_main_text_on_fake_h200(monkeypatch, capsys):
    monkeypatch.setattr(report, "nvml_probe", lambda nvml=None: nvml_probe_fake("h200_x2"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cli.main(["report", "--no-tf"]) == 0
    out = capsys.readouterr().out
    assert out == report.render_text(collect("h200_x2"))
    assert grid(out, "GPU topology")["GPU0"] == ["X", "NV18"]


@pytest.mark.parametrize("argv, with_tf, as_json", [
    ([], True, False),  # no subcommand: report
    (["--json"], True, True),
    (["--no-tf"], False, False),
    (["report"], True, False),
    (["report", "--json", "--no-tf"], False, True),
])
def test_default_subcommand_is_report(argv, with_tf, as_json, monkeypatch, capsys):
    calls = []
    canned = collect("h200_x2")

    def fake_collect(with_tf=True, **kwargs):
        calls.append(with_tf)
        return canned

    monkeypatch.setattr(report, "collect", fake_collect)
    assert cli.main(argv) == 0
    assert calls == [with_tf]
    out = capsys.readouterr().out
    assert out.lstrip().startswith("{") is as_json


@pytest.mark.parametrize("argv, message", [
    (["bogus"], "invalid choice: 'bogus'"),
    (["report", "--bogus"], "tf-nvlink report: error: unrecognized arguments: --bogus"),
    (["report", "extra"], "unrecognized arguments: extra"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_arguments_get_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == "tf-nvlink 0.1.0"


def test_subcommands_can_be_added(monkeypatch, capsys):
    seen = []

    def add_arguments(parser):
        parser.add_argument("--steps", type=int, default=3)

    def run(args):
        seen.append(args.steps)
        return 5

    monkeypatch.setitem(cli.SUBCOMMANDS, "bench", cli.Subcommand("measure all-reduce", add_arguments, run))
    assert cli.main(["bench", "--steps", "7"]) == 5 and seen == [7]
    cli.main(["report", "--no-tf"])  # report still there
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "bench" in capsys.readouterr().out


def test_python_dash_m_no_tf_json_is_fast_and_skips_tensorflow():
    started = time.perf_counter()
    result = run_python(["-m", "tf_nvlink", "report", "--no-tf", "--json"])
    elapsed = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["tensorflow"] == {"checked": False}
    assert elapsed < 2.0, f"`report --no-tf` took {elapsed:.2f}s"  # ~0.1 s; importing TensorFlow takes longer
    check = run_python("import sys, tf_nvlink\n"
                       "from tf_nvlink import __main__ as cli; from tf_nvlink.tools import report\n"
                       "assert cli.main(['report', '--no-tf']) == 0\n"
                       "report.render_text(report.collect(with_tf=False))\n"
                       "print('TF-IMPORTED' if 'tensorflow' in sys.modules else 'NO-TF')")
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip().endswith("NO-TF")


def test_example_script_no_tf_json():
    result = run_python([str(ROOT / "examples" / "report.py"), "--no_tf", "--json"], cwd=ROOT / "examples")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["tensorflow"] == {"checked": False}


def test_example_script_rejects_unknown_flags():
    result = run_python([str(ROOT / "examples" / "report.py"), "--bogus"])
    assert result.returncode != 0 and "bogus" in result.stderr


def test_real_tensorflow_report_does_not_crash(tf, capsys):
    """The one test here that asks the real TensorFlow (the test process's: a CUDA build seeing no GPU); in a fresh
    process, `python -m tf_nvlink report` imports it in the reproduce script's test of the slow tier
    (tests/test_examples.py)."""
    assert cli.main(["report", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["tensorflow"]
    assert data["checked"] is True and data["version"] == tf.__version__
    if data["problem"] is None:
        assert data["built_with_cuda"] is True and isinstance(data["gpus"], list)


def test_module_entry_point_exists():
    assert callable(cli.main) and sys.modules["tf_nvlink.__main__"] is cli


@pytest.mark.parametrize("machine, mode", [("h200_x2", "(fused)"), ("pcie_x4", "(fused)"), ("no_driver", "(split)")])
def test_plan_section_says_how_xla_models_all_reduce(machine, mode):
    text = report.render_text(report.collect(topology=nvml.probe(FakeNvml(fake_nvml.MACHINES[machine]())),
                                             with_tf=False))
    xla_line = next(line for line in text.splitlines() if line.startswith("  XLA "))
    assert xla_line.endswith(mode) and "jit_compile=True models" in xla_line


# ---- report --memory ------------------------------------------------------------------------------------------

def test_memory_report_builds_the_model_and_its_slots_and_says_what_fits():
    """mlp (784-256-128-10) with Adam on a fake 2x H200: 940,584 bytes of weights, as many of gradients, 1,881,168
    of slots and 12 of step counters; sharded over 2, the first kernel's slots (1,605,632) on one GPU."""
    result = run_python(
        "import sys; sys.path.insert(0, 'tests')\n"
        "import fake_nvml\n"
        "from tf_nvlink.machine import nvml\n"
        "from tf_nvlink.tools import report\n"
        "from tf_nvlink import __main__ as cli\n"
        "report.nvml_probe = lambda module=None: nvml.probe(fake_nvml.FakeNvml(fake_nvml.h200_x2()))\n"
        "assert cli.main(['report', '--memory', 'mlp', '--optimizer', 'adam']) == 0\n"
        "assert cli.main(['report', '--memory', 'mlp', '--optimizer', 'adam', '--replicas', '2', '--json']) == 0\n")
    assert result.returncode == 0, result.stderr
    text, _, data = result.stdout.partition("\n{")
    assert text.splitlines() == [
        "Memory per GPU: mlp (235,146 parameters in 6 variables), Adam, Keras' defaults; before activations; "
        "151.40 GB per GPU (NVML)",
        "# GPUs  states      weights  gradients  optimizer states  total  fits",
        "#                      (MB)       (MB)              (MB)   (MB)",
        "     1  replicated     0.94       0.94              1.88   3.76   yes",
        "     1  sharded        0.94       0.94              1.88   3.76   yes",
        *[line for n in (2, 4, 8) for line in (
            f"     {n}  replicated     0.94       0.94              1.88   3.76   yes",
            f"     {n}  sharded        0.94       0.94              1.61   3.49   yes")],
        *[f"  {n} GPUs: fits replicated ({n} replicas: {3.76 if n == 1 else 3.49:.2f} MB sharded, 3.76 MB replicated, "
          f"151.40 GB per GPU)" for n in (1, 2, 4, 8)],
        "sharded: tf_nvlink.strategy(optimizer_states=\"sharded\") (docs/sharded_optimizer_states.md)"]
    data = json.loads("{" + data)
    assert (data["model"], data["optimizer"], data["parameters"], data["variables"]) == ("mlp", "Adam", 235146, 6)
    assert data["device_bytes"] == 141 * 2**30 and [rows["replicas"] for rows in data["rows"]] == [2]
    rows = data["rows"][0]
    assert rows["replicated"] == {"weights": 940584, "gradients": 940584, "optimizer_states": 1881180,
                                  "total": 3762348, "fits": True}
    assert rows["sharded"] == {"weights": 940584, "gradients": 940584, "optimizer_states": 1605644,
                               "total": 3486812, "largest_share": 1605632, "fits": True}
    assert rows["sharding_lets_it_fit"] is False


@pytest.mark.parametrize("argv, message", [
    (["--memory", "mlp", "--no-tf"], "--memory builds the model and its optimizer with TensorFlow; drop --no-tf"),
    (["--memory", "bert"], "argument --memory: invalid choice: 'bert' (choose from 'mlp', 'resnet50', 'convnet', "
                           "'transformer', 'transformer_2048', 'transformer_tiny')"),
    (["--memory", "mlp", "--optimizer", "adafactor"], "argument --optimizer: invalid choice: 'adafactor' (choose "
                                                      "from 'sgd', 'adam', 'adamw', 'rmsprop', 'adagrad', 'lion', "
                                                      "'lamb', 'adamax', 'adadelta', 'ftrl', 'nadam')"),
    (["--replicas", "2"], "--optimizer and --replicas go with --memory MODEL"),
    (["--memory", "mlp", "--replicas", "0"], "argument --replicas: should be a positive integer"),
])
def test_memory_report_bad_flags_exit_2_with_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(memory_report, "collect", pytest.fail)  # refused before anything is built
    with pytest.raises(SystemExit) as info:
        cli.main(["report", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_memory_report_gpu_counts_and_memory_from_nvml():
    assert memory_report.gpu_facts(nvml_probe_fake("h200_x2")) == (2, 141 * 2**30)
    assert memory_report.gpu_facts(nvml_probe_fake("h100_hgx_x8")) == (8, 80 * 2**30)
    assert memory_report.gpu_facts(nvml_probe_fake("no_driver")) == (0, None)
    assert memory_report.gpu_counts(None, 0) == [1, 2, 4, 8]
    assert memory_report.gpu_counts(None, 3) == [1, 2, 3, 4, 8]
    assert memory_report.gpu_counts(None, 8) == [1, 2, 4, 8]
    assert memory_report.gpu_counts(16, 2) == [16]
