"""Reliability round 2 (issue 15): each numbered item of the issue found by hostile use, kept as a test case.

Pure functions are tested directly against fake machines (tests/fake_nvml.py and the meshes built here);
TensorFlow runs only in subprocesses (conftest.run_python), one per table.
"""

import dataclasses
import json
import textwrap

import pytest

import fake_nvml
from conftest import ROOT, run_python
from fake_nvml import FakeGpu, FakeLink, FakeMachine, FakeNvml
from tf_nvlink.machine import nvml


from tf_nvlink.plan import policy
from tf_nvlink.plan import cube_mesh
from tf_nvlink.plan import gpu_request
def topo_of(name):
    return nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))


def mesh_of(edges, n=8, name="Tesla V100-SXM2-16GB"):
    """A machine of `n` GPUs wired by direct NVLink along `edges` ({(a, b): links})."""
    buses = [0x06 + 0x10 * i for i in range(n)]
    links = {i: [] for i in range(n)}
    for (a, b), count in edges.items():
        for _ in range(count):
            links[a].append(FakeLink(fake_nvml.GPU, fake_nvml._pci(buses[b])))
            links[b].append(FakeLink(fake_nvml.GPU, fake_nvml._pci(buses[a])))
    gpus = [FakeGpu(name, fake_nvml._pci(bus), f"GPU-mesh-{i}", (7, 0), 16, links=links[i], nvlink_version=2)
            for i, bus in enumerate(buses)]
    machine = FakeMachine(gpus, p2p_nvlink={tuple(sorted(e)): 0 for e in edges}, pcie_level={})
    return nvml.probe(FakeNvml(machine))


# ================================================================== items 1-2: hierarchical only on real quads
DGX1 = "dgx1_v100_x8"
QUADS_FIRST = [0, 1, 2, 3, 4, 5, 6, 7]  # DGX-1: quads 0-3 and 4-7, i <-> i+4 linked


@pytest.mark.parametrize("request_kind, gpus, visible", [
    ("gpus interleaved", "0,4,1,5,2,6,3,7", None),
    ("gpus reversed", [7, 6, 5, 4, 3, 2, 1, 0], None),
    ("CUDA_VISIBLE_DEVICES interleaved, gpus=all", "all", [0, 4, 1, 5, 2, 6, 3, 7]),
    ("CUDA_VISIBLE_DEVICES shuffled, gpus=auto", "auto", [3, 6, 0, 5, 7, 1, 4, 2]),
    ("hierarchical asked, interleaved", "0,4,1,5,2,6,3,7", None),
])
def test_item1_hierarchical_halves_are_the_nvlink_quads(request_kind, gpus, visible):
    topo = topo_of(DGX1)
    ops = "hierarchical" if "asked" in request_kind else "auto"
    plan = policy.make_plan(topo, gpus, ops, visible=visible)
    assert plan.cross_device_ops == "hierarchical"
    first, second = plan.gpus[:4], plan.gpus[4:]
    for half in (first, second):  # each half (what HierarchicalCopyAllReduce reduces within) is a quad
        assert all(topo.pair(a, b).direct_links for a in half for b in half if a < b), plan.gpus
    for k in range(4):  # position k copies to position k + 4: a direct link
        assert topo.pair(first[k], second[k]).direct_links, plan.gpus
    assert sorted(plan.gpus) == QUADS_FIRST


def test_item1_cube_mesh_order_of_the_dgx1():
    topo = topo_of(DGX1)
    assert cube_mesh.cube_mesh_order(topo, [0, 4, 1, 5, 2, 6, 3, 7]) == (0, 1, 2, 3, 4, 5, 6, 7)
    assert cube_mesh.cube_mesh_order(topo, QUADS_FIRST[:4]) is None
    assert cube_mesh.replica_order(topo, (0, 4, 1, 5, 2, 6, 3, 7), "nccl") == (0, 4, 1, 5, 2, 6, 3, 7)  # kept


# Every GPU has exactly 4 NVLink peers, yet there is no quad (4 GPUs all linked): circulant C8(1, 2), and the
# 4-regular "two squares crossed" graph. Neither is a DGX-1 cube-mesh.
CIRCULANT = {tuple(sorted((i, (i + d) % 8))): 1 for i in range(8) for d in (1, 2)}
SQUARES = {**{(i, (i + 1) % 4): 1 for i in range(4)}, **{(4 + i, 4 + (i + 1) % 4): 1 for i in range(4)},
           **{(i, 4 + j): 1 for i in range(4) for j in ((i + 1) % 4, (i + 3) % 4)}}
SQUARES = {tuple(sorted(e)): c for e, c in SQUARES.items()}


@pytest.mark.parametrize("edges", [CIRCULANT, SQUARES], ids=["circulant C8(1,2)", "two squares crossed"])
def test_item2_four_peers_without_quads_is_not_hierarchical(edges):
    topo = mesh_of(edges)
    assert all(sum(1 for b in range(8) if b != a and topo.pair(a, b).direct_links) == 4 for a in range(8))
    assert not cube_mesh.is_dgx1_like(topo, range(8))
    plan = policy.make_plan(topo, "all")
    assert plan.shape == "nvlink-partial" and plan.cross_device_ops == "nccl", plan.summary()


# ================================================================== items 3-6: the strategy's requests, honoured or refused
def mixed_t4_a100():
    """NVML 0 is a Tesla T4 (PCI 17:00.0), NVML 1 an A100 PCIe (PCI 65:00.0): CUDA's default FASTEST_FIRST order
    makes the A100 CUDA device 0, so CUDA_VISIBLE_DEVICES=0 shows TensorFlow NVML's GPU 1."""
    gpus = [FakeGpu("Tesla T4", fake_nvml._pci(0x17), "GPU-t4-0", (7, 5), 15, nvlink_supported=False),
            FakeGpu("NVIDIA A100-PCIE-40GB", fake_nvml._pci(0x65), "GPU-a100-1", (8, 0), 40, nvlink_supported=False)]
    return FakeMachine(gpus, p2p_nvlink={}, pcie_level={(0, 1): 50})


A100_AS_CUDA_0 = ("/device:GPU:0", "device: 0, name: NVIDIA A100-PCIE-40GB, pci bus id: 0000:65:00.0, "
                                   "compute capability: 8.0")


def test_item3_mixed_models_map_by_pci_both_ways():
    from tf_nvlink.machine import tf_devices

    topo = nvml.probe(FakeNvml(mixed_t4_a100()))
    env = {"CUDA_VISIBLE_DEVICES": "0"}
    assert tf_devices.visible_needs_tensorflow(topo, env)
    assert not tf_devices.visible_needs_tensorflow(topo, dict(env, CUDA_DEVICE_ORDER="PCI_BUS_ID"))
    assert not tf_devices.visible_needs_tensorflow(topo, {})  # unset: every GPU, order decided by PCI mapping
    assert not tf_devices.visible_needs_tensorflow(topo_of("h200_x2"), env)  # one model: the orders agree
    mapped = tf_devices.map_tf_gpus(topo, [A100_AS_CUDA_0])
    visible = tf_devices.visible_from_tensorflow(mapped)
    assert visible == [1]
    plan = policy.make_plan(topo, "all", visible=visible)
    assert plan.gpus == (1,) and tf_devices.tf_device_for(plan.gpus, mapped) == ["/gpu:0"]
    assert policy.make_plan(topo, [1], visible=visible).gpus == (1,)  # the advice below works
    with pytest.raises(ValueError, match=r"valid GPU indices are \[1\]"):
        policy.make_plan(topo, [0], visible=visible)
    with pytest.raises(ValueError, match=r"Choose among \[1\]"):
        tf_devices.tf_device_for([0], mapped)


def test_item4_summary_of_a_plan_on_unmapped_gpus_says_gpus():
    plan = policy.make_plan(topo_of("h200_x2"), "all", visible=[])
    on_mig = dataclasses.replace(plan, devices=("/device:GPU:0",), reason="MIG instance(s) ['MIG-x']")
    assert "TensorFlow devices ['/device:GPU:0']" in on_mig.summary() and "CPU" not in on_mig.summary()


def test_item4_mig_entries():
    from tf_nvlink.machine import tf_devices

    assert tf_devices.mig_entries({"CUDA_VISIBLE_DEVICES": "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"}) == [
        "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"]
    assert tf_devices.mig_entries({"CUDA_VISIBLE_DEVICES": "0,1"}) == [] == tf_devices.mig_entries({})


@pytest.mark.parametrize("machine, gpus, needle", [
    ("no_driver", "0", "Driver Not Loaded"), ("no_driver", [0], "Driver Not Loaded"), ("no_driver", 0, "NVML"),
    ("h200_x2", "0,1", "CUDA_VISIBLE_DEVICES hides every GPU"),
])
def test_item5_explicit_gpus_without_a_usable_gpu_raise(machine, gpus, needle):
    visible = [] if machine == "h200_x2" else None
    with pytest.raises(ValueError) as info:
        policy.make_plan(topo_of(machine), gpus, visible=visible)
    message = str(info.value)
    assert f"gpus={gpus!r}" in message and needle in message and "'all' or 'auto'" in message, message
    for fallback in ("all", "auto"):  # only these fall back to the CPU
        assert policy.make_plan(topo_of(machine), fallback, visible=visible).gpus == ()


def test_item5_reason_given_by_the_caller_is_named():
    with pytest.raises(ValueError, match="built without CUDA"):
        policy.make_plan(topo_of("h200_x2"), "0", visible=[], no_gpu_reason="TensorFlow is built without CUDA")


def test_items4_5_decide_plans_mig_and_names_why_explicit_gpus_cannot_be_honoured():
    """policy.decide, the pure function strategy() and the report call: the MIG plan and the no-GPU reasons."""
    mig = "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"
    on_mig = policy.Facts(topo_of("h200_x2"), visible=(), tf_gpu_count=1, mig=(mig,))
    plan, warnings = policy.decide(on_mig, "all")
    assert plan.gpus == () and plan.cross_device_ops == "reduce_to_one" and "no NVLink plan" in plan.reason
    assert len(warnings) == 1 and mig in warnings[0] and "no NVLink" in warnings[0], warnings
    assert policy.decide(dataclasses.replace(on_mig, tf_gpu_count=2), "auto")[0].cross_device_ops == "collective"
    with pytest.raises(ValueError, match=r"gpus='0' names GPUs.*MIG instance.*gpus='all' mirrors over them"):
        policy.decide(on_mig, "0")
    tf_sees_none = policy.Facts(topo_of("h200_x2"), visible=(0, 1), tf_gpu_count=0,
                                no_gpu_cause="this TensorFlow is built without CUDA")
    with pytest.raises(ValueError, match=r"gpus=\[0\].*TensorFlow sees none: this TensorFlow is built without CUDA"):
        policy.decide(tf_sees_none, [0])
    plan, warnings = policy.decide(tf_sees_none, "all")
    assert plan.gpus == () and len(warnings) == 1 and "falling back to the CPU" in warnings[0]


@pytest.mark.parametrize("gpus", [[-1], "-1", (0, -2)], ids=repr)
def test_item6_gpu_indices_refuses_negative_indices(gpus):
    with pytest.raises(ValueError, match=r"Received: .* in gpus="):
        gpu_request.gpu_indices(gpus, (0, 1))


# The strategy glue (tf_nvlink.distribute.single_host), one subprocess: what TensorFlow sees is faked as in test_reliability.
STRATEGY_SCRIPT = textwrap.dedent("""
    import json, logging, os, sys
    sys.path.insert(0, {tests!r})
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import fake_nvml, test_reliability_round2 as round2
    from tf_nvlink import internals

    from tf_nvlink.machine import nvml
    from tf_nvlink.distribute import single_host
    records = []
    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())
    logging.getLogger("tf_nvlink").addHandler(Collect())
    real_list_physical, real_list_logical = tf.config.list_physical_devices, tf.config.list_logical_devices
    out = {{}}
    for name, case in json.loads({cases!r}).items():
        records.clear()
        for key in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "TF_CONFIG"):
            os.environ.pop(key, None)
        os.environ.update(case.get("env", {{}}))
        machine = (round2.mixed_t4_a100() if case["machine"] == "mixed"
                   else fake_nvml.MACHINES[case["machine"]]())
        topology = nvml.probe(fake_nvml.FakeNvml(machine))
        tf_gpus = case.get("tf_gpus", 0)
        tf.config.list_physical_devices = lambda kind=None: (
            [tf.config.PhysicalDevice(f"/physical_device:GPU:{{i}}", "GPU") for i in range(tf_gpus)]
            if kind == "GPU" else real_list_physical(kind))
        tf.config.list_logical_devices = lambda kind=None: (
            real_list_logical("CPU")[:tf_gpus] if kind == "GPU" else real_list_logical(kind))
        internals.tf_gpu_descs = lambda: [tuple(d) for d in case.get("descs", [])]
        try:
            if case.get("call") == "strategy":
                kwargs = dict(case["kwargs"])
                if kwargs.get("topology") == "FAKE":
                    kwargs["topology"] = topology
                single_host.strategy(**kwargs)
                result = {{"error": None}}
            else:
                built, plan = single_host._build(case.get("gpus", "all"), "auto", None, case.get("devices"),
                                                topology, "auto")
                result = {{"plan": plan.to_dict(), "summary": plan.summary(),
                           "replicas": built.num_replicas_in_sync}}
        except Exception as error:
            result = {{"error": type(error).__name__ + ": " + str(error)}}
        result["warnings"] = list(records)
        out[name] = result
    print("STRATEGY " + json.dumps(out))
    """)
MIG = "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"
STRATEGY_CASES = {  # name -> (case, expected error needles or None, check)
    "item3 mixed, CUDA_VISIBLE_DEVICES=0, gpus=all": dict(
        machine="mixed", env={"CUDA_VISIBLE_DEVICES": "0"}, tf_gpus=1, descs=[A100_AS_CUDA_0], devices=["/cpu:0"]),
    "item3 mixed, CUDA_VISIBLE_DEVICES=0, gpus=[1]": dict(
        machine="mixed", env={"CUDA_VISIBLE_DEVICES": "0"}, tf_gpus=1, descs=[A100_AS_CUDA_0], devices=["/cpu:0"],
        gpus=[1]),
    "item3 mixed, CUDA_VISIBLE_DEVICES=0, gpus=[0]": dict(
        machine="mixed", env={"CUDA_VISIBLE_DEVICES": "0"}, tf_gpus=1, descs=[A100_AS_CUDA_0], devices=["/cpu:0"],
        gpus=[0]),
    "item4 MIG, gpus=all": dict(machine="h200_x2", env={"CUDA_VISIBLE_DEVICES": MIG}, tf_gpus=1),
    "item4 MIG, gpus=0": dict(machine="h200_x2", env={"CUDA_VISIBLE_DEVICES": MIG}, tf_gpus=1, gpus="0"),
    "item5 gpus=0, TensorFlow sees no GPU": dict(machine="h200_x2", gpus="0"),
    "item5 gpus=[0], no driver": dict(machine="no_driver", gpus=[0]),
    "item5 gpus=all, TensorFlow sees no GPU": dict(machine="h200_x2"),
    "item6 devices=[/gpu:9]": dict(machine="no_driver", devices=["/gpu:9"]),
    "item6 duplicate devices": dict(machine="no_driver", devices=["/cpu:0", "/device:CPU:0"]),
    "item6 topology='x'": dict(machine="no_driver", call="strategy", kwargs={"topology": "x"}),
    "item6 peer_timeout_s=-5": dict(machine="no_driver", call="strategy",
                                    kwargs={"topology": "FAKE", "peer_timeout_s": -5}),
}


@pytest.fixture(scope="module")
def strategy_results(tmp_path_factory):
    code = STRATEGY_SCRIPT.format(tests=str(ROOT / "tests"), cases=json.dumps(STRATEGY_CASES))
    result = run_python(code, env={"TF_NVLINK_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}, timeout=180)
    lines = [line for line in result.stdout.splitlines() if line.startswith("STRATEGY ")]
    assert result.returncode == 0 and lines, result.stdout + result.stderr[-3000:]
    return json.loads(lines[-1][len("STRATEGY "):])


def test_item3_strategy_maps_mixed_models_by_pci(strategy_results):
    assert strategy_results["item3 mixed, CUDA_VISIBLE_DEVICES=0, gpus=all"]["plan"]["gpus"] == [1]
    assert strategy_results["item3 mixed, CUDA_VISIBLE_DEVICES=0, gpus=[1]"]["plan"]["gpus"] == [1]
    error = strategy_results["item3 mixed, CUDA_VISIBLE_DEVICES=0, gpus=[0]"]["error"]
    assert error.startswith("ValueError") and "valid GPU indices are [1]" in error, error


def test_item4_mig_instance_is_used_and_said(strategy_results):
    result = strategy_results["item4 MIG, gpus=all"]
    assert result["replicas"] == 1 and result["plan"]["devices"] == ["/device:CPU:0"]  # the faked MIG device
    assert "MIG" in result["plan"]["reason"] and "no NVLink plan" in result["summary"], result["summary"]
    assert len(result["warnings"]) == 1 and MIG in result["warnings"][0] and "no NVLink" in result["warnings"][0]
    error = strategy_results["item4 MIG, gpus=0"]["error"]
    assert error.startswith("ValueError") and "MIG" in error and "gpus='all'" in error, error


def test_item5_explicit_gpus_raise_all_falls_back(strategy_results):
    error = strategy_results["item5 gpus=0, TensorFlow sees no GPU"]["error"]
    assert error.startswith("ValueError") and "TensorFlow sees none" in error and "gpus='0'" in error, error
    error = strategy_results["item5 gpus=[0], no driver"]["error"]
    assert error.startswith("ValueError") and "Driver Not Loaded" in error, error
    fallback = strategy_results["item5 gpus=all, TensorFlow sees no GPU"]
    assert fallback["plan"]["gpus"] == [] and len(fallback["warnings"]) == 1
    assert "falling back to the CPU" in fallback["warnings"][0]


@pytest.mark.parametrize("name, needles", [
    ("item6 devices=[/gpu:9]", ["'/gpu:9'", "does not have", "Received: devices=['/gpu:9']"]),
    ("item6 duplicate devices", ["twice", "Received: devices="]),
    ("item6 topology='x'", ["Topology", "Received: topology='x'"]),
    ("item6 peer_timeout_s=-5", ["positive number", "Received: peer_timeout_s=-5"]),
])
def test_item6_strategy_arguments_validated_up_front(strategy_results, name, needles):
    error = strategy_results[name]["error"]
    assert error and error.startswith("ValueError: "), error
    for needle in needles:
        assert needle in error, (needle, error)


# ================================================================== item 7: no measurement lost to an unusable output
def fake_measure(calls, before_return=None):
    """runner.measure's stand-in: one correct reduce_to_one record per size, no worker process."""
    from tf_nvlink.tools.allreduce_bench import runner
    from tf_nvlink.tools.allreduce_bench import specs

    def measure(candidates, target, sizes, **_):
        calls.append(list(sizes))
        if before_return:
            before_return()
        output = {"ok": True, "ops": "reduce_to_one", "n_replicas": target.n, "tf_version": "2.21.0",
                  "results": [{"size_bytes": s, "count": s // 4, "time_us": 100.0, "wrong": 0} for s in sizes]}
        return runner.to_records(output, specs.parse_candidate("reduce_to_one"), target), []
    return measure


BENCH_ARGS = ["--devices", "cpu:2", "--candidates", "reduce_to_one", "--sizes", "1K", "--iters", "1"]


@pytest.mark.parametrize("where", ["under a file", "missing folder", "a folder"])
def test_item7_bench_json_unusable_path_refused_before_measuring(tmp_path, monkeypatch, capsys, where):
    from tf_nvlink.tools.allreduce_bench import cli

    (tmp_path / "file").write_text("x")
    path = {"under a file": tmp_path / "file" / "out.json", "missing folder": tmp_path / "nope" / "out.json",
            "a folder": tmp_path}[where]
    calls = []
    monkeypatch.setattr(cli, "measure", fake_measure(calls))  # what `tf-nvlink bench` runs
    with pytest.raises(SystemExit) as info:
        cli.main(BENCH_ARGS + ["--json", str(path)])
    assert info.value.code == 2 and calls == []  # refused before measuring
    err = capsys.readouterr().err
    assert f"--json {str(path)!r} cannot be written" in err and "Traceback" not in err, err


def test_item7_bench_json_write_failing_after_measuring_prints_the_records(tmp_path, monkeypatch, capsys):
    import shutil
    from tf_nvlink.tools.allreduce_bench import cli

    folder = tmp_path / "out"
    folder.mkdir()
    calls = []
    monkeypatch.setattr(cli, "measure", fake_measure(calls, before_return=lambda: shutil.rmtree(folder)))
    code = cli.main(BENCH_ARGS + ["--json", str(folder / "records.json")])
    out, err = capsys.readouterr()
    assert code == 1 and calls == [[1024]]
    assert '"label": "reduce_to_one"' in out and "could not write --json" in err, (out, err)
    assert err.count("error") == 1 and "Traceback" not in err


def test_item7_tune_unusable_cache_refused_before_measuring(tmp_path, monkeypatch, capsys):
    from tf_nvlink.tools.allreduce_bench import runner

    from tf_nvlink.tools import tune
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("TF_NVLINK_CACHE_DIR", str(tmp_path / "file" / "cache"))
    calls = []
    monkeypatch.setattr(runner, "measure", fake_measure(calls))
    with pytest.raises(SystemExit) as info:
        tune.main(BENCH_ARGS)
    err = capsys.readouterr().err
    assert info.value.code == 2 and calls == [], err
    assert "cannot be written" in err and "TF_NVLINK_CACHE_DIR" in err and "Traceback" not in err, err


def test_item7_tune_store_failing_after_measuring_prints_the_result(tmp_path, monkeypatch, capsys):
    import shutil
    from tf_nvlink.tools.allreduce_bench import runner

    from tf_nvlink.tools import tune
    cache = tmp_path / "cache"
    monkeypatch.setenv("TF_NVLINK_CACHE_DIR", str(cache))

    def break_the_cache():  # the folder becomes a file while measuring
        shutil.rmtree(cache)
        cache.write_text("not a folder")
    calls = []
    monkeypatch.setattr(runner, "measure", fake_measure(calls, before_return=break_the_cache))
    code = tune.main(BENCH_ARGS)
    out, err = capsys.readouterr()
    assert code == 1 and calls == [[1024]]
    assert "winner reduce_to_one" in out and "could not store the winner" in err and "Traceback" not in err, err


# ================================================================== item 8: bench sizes bounded, records validated
@pytest.mark.parametrize("text", ["99999999999G", "17G", "20000000000"])
def test_item8_sizes_are_bounded(text):
    from tf_nvlink.tools.allreduce_bench import specs

    with pytest.raises(specs.BenchError, match=r"at most 16G.*Received: '" + text):
        specs.parse_size(text)
    assert specs.parse_size("16G") == 16 * 2**30


GOOD_RECORD = {"label": "nccl:1", "candidate": "nccl:1", "variant": "", "size_bytes": 1024, "status": "ok",
               "busbw": 1.5, "wrong": 0}


@pytest.mark.parametrize("change, needle", [
    ({"size_bytes": "16M"}, "size_bytes='16M'"), ({"busbw": None}, "busbw=None"), ({"busbw": "fast"}, "busbw='fast'"),
    ({"wrong": -1}, "wrong=-1"), ({"status": "great"}, "status='great'"), ({"label": 3}, "label=3"),
    ({"variant": None}, "variant=None"),
])
def test_item8_from_json_malformed_record_is_a_clear_error(tmp_path, capsys, change, needle):
    from tf_nvlink.tools.allreduce_bench import cli

    path = tmp_path / "records.json"
    path.write_text(json.dumps([GOOD_RECORD, dict(GOOD_RECORD, **change)]))
    with pytest.raises(SystemExit) as info:
        cli.main(["--from_json", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "record 1" in err and needle in err and "Traceback" not in err, err
    path.write_text(json.dumps([GOOD_RECORD]))
    assert cli.main(["--from_json", str(path)]) == 0


# ================================================================== item 9: cache hardening
def tune_record(**changes):
    from tf_nvlink.plan import tune_cache

    record = {"fingerprint": "abc123abc123", "tf_version": "2.21.0", "gpus": [0, 1], "candidate": "nccl:1",
              "cross_device_ops": "nccl", "num_packs": 1, "score": 200.0, "sizes": [16 * 2**20],
              "scores": {"nccl:1": 200.0}, "n_replicas": 2, "measured_at": "2026-11-30T00:00:00+00:00"}
    record.update(changes)
    return record, tune_cache.make_key(record["fingerprint"], record["tf_version"], record["gpus"])


def test_item9_lock_file_is_not_followed_through_a_symlink(tmp_path):
    from tf_nvlink.plan import tune_cache

    path = tmp_path / "autotune.json"
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "autotune.json.lock").symlink_to(elsewhere)  # dangling
    with pytest.raises(tune_cache.CacheError, match="symbolic link"):
        tune_cache.store(tune_record()[0], str(path))
    assert not elsewhere.exists()


def test_item9_fifo_at_the_cache_path_is_refused_not_waited_on(tmp_path, caplog):
    import os
    import threading
    from tf_nvlink.plan import tune_cache

    path = tmp_path / "autotune.json"
    os.mkfifo(path)
    result = {}
    reader = threading.Thread(target=lambda: result.update(entries=tune_cache.entries(str(path))), daemon=True)
    reader.start()
    reader.join(10)
    assert not reader.is_alive(), "reading a FIFO cache blocked"
    assert result["entries"] == {} and "not a regular file" in caplog.text


@pytest.mark.parametrize("change", [{"num_packs": 10**9}, {"n_replicas": 10**9}, {"sizes": [2**60]},
                                    {"score": 1e300}, {"scores": {"nccl:1": 1e300}}, {"gpus": [0, 10**9]}],
                         ids=lambda c: next(iter(c)))
def test_item9_hand_edited_entries_out_of_range_are_ignored(tmp_path, change):
    from tf_nvlink.plan import tune_cache

    path = tmp_path / "autotune.json"
    good, good_key = tune_record()
    bad, bad_key = tune_record(**change)
    if bad_key == good_key:
        bad, bad_key = tune_record(**change, tf_version="2.20.0")
    path.write_text(json.dumps({"format": tune_cache.FORMAT_VERSION, "entries": {good_key: good, bad_key: bad}}))
    assert set(tune_cache.entries(str(path))) == {good_key}


@pytest.mark.parametrize("xdg, expected", [("relative/cache", "~/.cache/tf_nvlink"), ("", "~/.cache/tf_nvlink"),
                                           ("/abs/cache", "/abs/cache/tf_nvlink")])
def test_item9_relative_xdg_cache_home_is_ignored(monkeypatch, xdg, expected):
    import os
    from tf_nvlink.plan import tune_cache

    monkeypatch.delenv("TF_NVLINK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert tune_cache.cache_dir() == os.path.expanduser(expected)


# ================================================================== item 11: the benchmark example without a GPU
TRACEBACK = ('Traceback (most recent call last):\n  File "/x/training_bench.py", line 12, in <module>\n'
             '    strategy = build()\n    ^^^^^^^^^^^^^^^^\n'
             'tensorflow.python.framework.errors_impl.InvalidArgumentError: No OpKernel was registered to support '
             'Op \'NcclAllReduce\'\n')


@pytest.mark.parametrize("error, expected", [
    (TRACEBACK, "tensorflow.python.framework.errors_impl.InvalidArgumentError: No OpKernel was registered"),
    ("worker timed out after 900 s", "worker timed out after 900 s"),
    ("", "(no message)"),
])
def test_item11_no_traceback_text_in_tables(error, expected):
    from tf_nvlink.tools.training_bench import cli as training_bench

    line = training_bench.error_line(error)
    assert line.startswith(expected[:60]) and "Traceback" not in line and "\n" not in line and len(line) <= 150
    table = training_bench.render_table([{"candidate": "nccl", "error": error}])
    assert "Traceback" not in table and 'File "' not in table


def test_item11_cpu_candidates_leave_out_what_needs_gpus():
    from tf_nvlink.tools.training_bench import cli as training_bench

    kept, dropped = training_bench.cpu_candidates(
        ["1gpu", "stock", "auto", "collective", "nccl", "reduce_to_one", "hierarchical", "auto@nop2p", "auto@fused",
         "auto@split"])
    assert kept == ["1gpu", "stock", "auto", "collective", "reduce_to_one", "auto@split"]
    assert dropped == ["nccl", "hierarchical", "auto@nop2p", "auto@fused"]


def test_item11_benchmark_example_without_gpu_says_so_first(tmp_path):
    """examples/benchmark.py with no flags on this GPU-less machine: the first lines say so; no failed rows."""
    result = run_python([str(ROOT / "examples" / "benchmark.py"), "--steps", "2", "--candidates",
                         "stock,nccl,hierarchical", "--json", str(tmp_path / "r.json")], timeout=300)
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert lines[1].startswith("# no GPU here (") and "--cpu_devices 2" in lines[1], lines[:3]
    assert "left out nccl, hierarchical (they need GPUs)" in lines[1]
    assert "FAILED" not in result.stdout and "Traceback" not in result.stdout + result.stderr, result.stdout
    assert [r["candidate"] for r in json.loads((tmp_path / "r.json").read_text())] == ["stock"]


# ================================================================== item 12: the example's plan line, once; --helpfull light
def test_item12_helpfull_does_not_import_tensorflow():
    result = run_python(["-X", "importtime", str(ROOT / "examples" / "mnist_mlp.py"), "--helpfull"], timeout=120)
    assert "--cross_device_ops" in result.stdout, result.stderr[-2000:]  # absl exits 1 after --helpfull
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "import time:" in line}
    assert not {"tensorflow", "keras"} & imported, sorted(m for m in imported if "tensorflow" in m or "keras" in m)


def test_item12_example_prints_the_plan_line_once(tmp_path):
    result = run_python([str(ROOT / "examples" / "mnist_mlp.py"), "--dataset", "digits", "--epochs", "1",
                         "--steps_per_epoch", "1", "--model_dir", str(tmp_path / "model")], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    both = result.stdout + result.stderr
    assert both.count("tf_nvlink plan:") == 1, both


# ================================================================== item 14: packaging
def test_item14_license_pyproject_and_classifiers():
    import configparser
    import tomllib

    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS" in license_text
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert build["build-backend"] == "setuptools.build_meta" and any(r.startswith("setuptools") for r in
                                                                      build["requires"])
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    metadata = config["metadata"]
    assert metadata["license"] == "Apache-2.0" and metadata["license_files"].strip() == "LICENSE"
    assert "License :: OSI Approved :: Apache Software License" in metadata["classifiers"]
    assert "example.com" not in metadata.get("project_urls", "")  # no made-up URL
