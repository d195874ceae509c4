"""tf_nvlink.tools.allreduce_bench: parsing, the nccl-tests math and tables, candidate validity, and one real CPU run.

The real run (2 logical CPU devices, 2 tiny sizes, reduce_to_one measured and nccl skipped) is shared by the tests
that need measured output: the command line here, its worker (`worker.main`, what `python -m
tf_nvlink.tools.allreduce_bench.worker` runs) in a scenario process that also inspects the chained graph; the slow
tier runs it again with the worker spawned as its own process. Everything else uses fake workers.
"""

import contextlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import fake_nvml
import scenarios
from fake_nvml import FakeNvml
from tf_nvlink.tools import allreduce_bench
from tf_nvlink.plan import allreduce_sizes
from tf_nvlink.tools.allreduce_bench import cli
from tf_nvlink.tools.allreduce_bench import render
from tf_nvlink.tools.allreduce_bench import runner
from tf_nvlink.tools.allreduce_bench import specs
from tf_nvlink.util.error_lines import one_line_error
from tf_nvlink.machine import nvml
from tf_nvlink.machine.topology import Topology

HAVE_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
CPU2 = specs.Target("CPU", 2, fingerprint=Topology().fingerprint(), shape="cpu")


def machine(name):
    return nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))


def run_main(argv):
    """cli.main(argv) in this process (workers are still separate processes): (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse errors
            code = exc.code
    return code, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------------------------- parsing
class TestParsing:
    @pytest.mark.parametrize("text,expected", [("1M", 2**20), ("64K", 65536), ("1G", 2**30), ("16MiB", 2**24),
                                               ("4096", 4096), (" 2m ", 2 * 2**20), ("1KB", 1024)])
    def test_sizes(self, text, expected):
        assert specs.parse_size(text) == expected

    @pytest.mark.parametrize("text", ["", "abc", "1T", "-4", "0", "6", "1.5M"])
    def test_bad_sizes(self, text):
        with pytest.raises(specs.BenchError, match="size"):
            specs.parse_size(text)

    def test_size_list_sorted_unique(self):
        assert specs.parse_sizes("16M,1M,16M") == [2**20, 2**24]
        assert [allreduce_sizes.format_size(s) for s in specs.DEFAULT_SIZES] == ["1M", "4M", "16M", "64M", "256M", "1G"]

    def test_candidates(self):
        parsed = specs.parse_candidates("collective, nccl,nccl:4,hierarchical,reduce_to_one,auto,nccl:1,XLA")
        assert [c.label for c in parsed] == ["collective", "nccl:1", "nccl:4", "hierarchical:1", "reduce_to_one",
                                             "auto", "xla"]
        with pytest.raises(specs.BenchError, match="takes no PACKS"):
            specs.parse_candidate("xla:2")

    @pytest.mark.parametrize("text,match", [("nccl,bogus", "unknown candidate 'bogus'"),
                                            ("reduce_to_one:2", "takes no PACKS"),
                                            ("nccl:x", "PACKS"), ("nccl:999", "PACKS"), (",", "comma list")])
    def test_bad_candidates_list_valid_choices(self, text, match):
        with pytest.raises(specs.BenchError, match=match) as info:
            specs.parse_candidates(text)
        if "unknown" in match:
            for name in ("collective", "nccl[:PACKS]", "hierarchical[:PACKS]", "reduce_to_one", "auto", "xla"):
                assert name in str(info.value)

    def test_env(self):
        assert specs.parse_env(["NCCL_P2P_DISABLE=1", "A=b=c"]) == {"NCCL_P2P_DISABLE": "1", "A": "b=c"}
        with pytest.raises(specs.BenchError, match="KEY=VALUE"):
            specs.parse_env(["1BAD=1"])

    def test_cli_rejects_bad_candidates_before_running(self):
        code, out, err = run_main(["--devices", "cpu:2", "--candidates", "nccl,bogus"])
        assert code == 2 and out == ""
        assert "unknown candidate 'bogus'" in err and "reduce_to_one" in err and "hierarchical[:PACKS]" in err


# ------------------------------------------------------------------------------------------------- math
class TestMath:
    @pytest.mark.parametrize("n,factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75)])
    def test_bus_factor(self, n, factor):
        assert specs.bus_factor(n) == pytest.approx(factor)

    def test_algbw_and_busbw(self):
        # 1 GB in 1 s: 1 GB/s of algorithm bandwidth; 8 GPUs move 2*7/8 of it over each link.
        assert specs.algbw_gbps(10**9, 1e6) == pytest.approx(1.0)
        assert specs.busbw_gbps(10**9, 1e6, 8) == pytest.approx(1.75)
        # 256 MiB in 1647 us on 2 GPUs: about 163 GB/s, hardware-facts' TensorFlow default figure.
        assert specs.busbw_gbps(256 * 2**20, 1647.0, 2) == pytest.approx(163.0, rel=0.01)

    @pytest.mark.parametrize("raw,local,expected", [
        (1000.0, 160.0, (840.0, False)),  # 256 MiB-like: the max costs a small share, all of it subtracted
        (10.0, 5.0, (5.0, False)),  # exactly half: still subtracted in full
        (10.0, 8.0, (5.0, True)),  # more than half: capped, at most MAX_LOCAL_SHARE of the chained time goes
        (10.0, 30.0, (5.0, True)),
        (10.0, 0.0, (10.0, False)), (10.0, None, (10.0, False)), (10.0, -1.0, (10.0, False)),
    ])
    def test_subtract_local(self, raw, local, expected):
        assert specs.MAX_LOCAL_SHARE == 0.5
        time_us, capped = specs.subtract_local(raw, local)
        assert (time_us, capped) == pytest.approx(expected)

    def test_local_work_is_in_the_records_and_the_footer(self):
        output = {"ok": True, "ops": "reduce_to_one", "num_packs": None, "n_replicas": 2, "n_gpus": 2,
                  "results": [{"size_bytes": 2**28, "count": 2**26, "time_us": 1400.0, "raw_time_us": 1560.0,
                               "local_us": 160.0, "local_capped": False, "wrong": 0},
                              {"size_bytes": 2**10, "count": 2**8, "time_us": 10.0, "raw_time_us": 20.0,
                               "local_us": 15.0, "local_capped": True, "wrong": 0}]}
        records = runner.to_records(output, specs.Candidate("reduce_to_one"), specs.Target("GPU", 2, (0, 1)))
        assert [(r["raw_time_us"], r["local_us"], r["local_capped"]) for r in records] == [
            (1560.0, 160.0, False), (20.0, 15.0, True)]
        assert records[0]["algbw"] == pytest.approx(2**28 / 1400e-6 / 1e9)  # from the corrected time
        lines = render.render_candidate_table(records).splitlines()
        assert lines[-3] == ("# Local work subtracted: 256M 160.0, 1K 15.0 (capped: 10.0 subtracted) us per "
                             "all-reduce (the chain without the all-reduce, less an empty call)")
        assert lines[-2] == "# Out of bounds values : 0 OK"

    def test_nvlink_bytes_per_all_reduce_beside_the_expected_ones(self):
        """Issue 17: the worker reads NVML's NVLink counters around the timed all-reduces; the table shows the
        bytes per GPU per all-reduce beside the ring's 2(n-1)/n x size."""
        output = {"ok": True, "ops": "nccl", "num_packs": 1, "n_replicas": 2, "n_gpus": 2, "nvlink_unavailable": None,
                  "results": [{"size_bytes": 2**28, "count": 2**26, "time_us": 1600.0, "wrong": 0,
                               "nvlink_bytes": 1.003 * 2**28, "nvlink_expected_bytes": 2**28},
                              {"size_bytes": 2**10, "count": 2**8, "time_us": 20.0, "wrong": 0,
                               "nvlink_bytes": None, "nvlink_expected_bytes": 2**10}]}
        records = runner.to_records(output, specs.Candidate("nccl"), specs.Target("GPU", 2, (0, 1)))
        assert records[0]["nvlink_bytes"] == 1.003 * 2**28 and records[0]["nvlink_expected_bytes"] == 2**28
        lines = render.render_candidate_table(records).splitlines()
        assert lines[1].split()[-2:] == ["NVLink", "expected"] and lines[2].split()[-2:] == ["(MiB/GPU)"] * 2
        assert lines[3].split()[-2:] == ["256.768", "256.000"]
        assert lines[4].split()[-2:] == ["n/a", "0.001"]
        assert lines[-3].startswith("# NVLink: bytes each GPU sent and received per all-reduce over NVLink")

    def test_without_nvlink_counters_the_table_says_why(self):
        output = {"ok": True, "ops": "nccl", "num_packs": 1, "n_replicas": 2, "n_gpus": 2,
                  "nvlink_unavailable": "GPU 0: no NVLink (a PCIe-only GPU)",
                  "results": [{"size_bytes": 2**20, "count": 2**18, "time_us": 100.0, "wrong": 0,
                               "nvlink_bytes": None, "nvlink_expected_bytes": 2**20}]}
        records = runner.to_records(output, specs.Candidate("nccl"), specs.Target("GPU", 2, (0, 1)))
        table = render.render_candidate_table(records)
        assert "NVLink" not in table.splitlines()[1]
        assert "# NVLink bytes not measured: GPU 0: no NVLink (a PCIe-only GPU)" in table

    def test_worker_reads_nvlink_only_where_counters_exist(self):
        import types

        import fake_nvml
        from fake_nvml import FakeNvml
        from tf_nvlink.tools.allreduce_bench import worker

        plan = types.SimpleNamespace(gpus=(0, 1))
        reader, why = worker._nvlink_reader(plan, 2, False, FakeNvml(fake_nvml.h200_x2()))
        assert why is None and reader.readable == (0, 1)
        assert {f for f, _ in reader._requests[0]} == {138, 139}  # DATA TX/RX only: half the values per read
        reader.close()
        reader, why = worker._nvlink_reader(plan, 2, False, FakeNvml(fake_nvml.pcie_x4()))
        assert reader is None and why.startswith("GPU 0: no NVLink (a PCIe-only GPU")
        assert worker._nvlink_reader(plan, 2, True) == (None, "fewer than 2 GPUs: nothing crosses NVLink")

    def test_records_carry_the_formula(self):
        output = {"ok": True, "ops": "reduce_to_one", "num_packs": None, "n_replicas": 4, "n_gpus": 4,
                  "results": [{"size_bytes": 2**20, "count": 2**18, "time_us": 100.0, "wrong": 0}]}
        gpu4 = specs.Target("GPU", 4, (0, 1, 2, 3))
        [record] = runner.to_records(output, specs.Candidate("reduce_to_one"), gpu4)
        assert record["algbw"] == pytest.approx(2**20 / 100e-6 / 1e9)
        assert record["busbw"] == pytest.approx(record["algbw"] * 1.5)
        assert record["status"] == "ok" and record["n_gpus"] == 4


# ------------------------------------------------------------------------------------ targets and skipping
class TestTargets:
    def test_cpu_target(self):
        target = specs.resolve_target("cpu:2")
        assert (target.device_type, target.n, target.spec, target.gpus_key) == ("CPU", 2, "cpu:2", "cpu:2")

    def test_gpu_target_from_topology(self):
        target = specs.resolve_target("gpu", "all", machine("h200_x2"))
        assert target.gpus == (0, 1) and target.spec == "gpu:0,1" and target.shape == "nvswitch"
        assert target.fingerprint == machine("h200_x2").fingerprint()

    def test_no_gpu_hints_at_cpu_devices(self):
        with pytest.raises(specs.BenchError, match="--devices cpu:2"):
            specs.resolve_target("gpu", "all", machine("no_driver"))

    @pytest.mark.parametrize("devices", ["tpu", "cpu:0", "cpu:x"])
    def test_bad_devices(self, devices):
        with pytest.raises(specs.BenchError, match="devices"):
            specs.resolve_target(devices)

    def test_unknown_gpu(self):
        with pytest.raises(specs.BenchError, match="does not exist"):
            specs.resolve_target("gpu", "5", machine("h200_x2"))

    def test_nccl_and_hierarchical_skipped_on_cpu_with_reasons(self):
        runs, skipped = specs.plan_runs(specs.parse_candidates(specs.DEFAULT_CANDIDATES), CPU2)
        assert [c.label for c in runs] == ["collective", "reduce_to_one", "auto"]
        reasons = dict(skipped)
        assert reasons["nccl:1"] == reasons["nccl:4"] == "NCCL does not run on CPU devices"
        assert "needs GPUs" in reasons["hierarchical:1"]
        assert "all-GPU replicas" in reasons["xla"] and "merge_call" in reasons["xla"]

    def test_xla_runs_on_gpus_and_says_what_it_measures(self):
        runs, skipped = specs.plan_runs([specs.parse_candidate("xla")], specs.Target("GPU", 2, (0, 1)))
        assert [c.label for c in runs] == ["xla"] and not skipped
        output = {"ok": True, "ops": "xla", "num_packs": None, "n_replicas": 2, "n_gpus": 2, "tf_version": "2.21.0",
                  "results": [{"size_bytes": 2**28, "count": 2**26, "time_us": 1000.0, "wrong": 0}]}
        records = runner.to_records(output, specs.parse_candidate("xla"), specs.Target("GPU", 2, (0, 1)))
        assert records[0]["label"] == "xla" and records[0]["busbw"] == pytest.approx(2**28 / 1e6)
        assert "one XLA program per replica" in render.render_candidate_table(records)

    def test_hierarchical_needs_an_even_gpu_count(self):
        candidates = specs.parse_candidates("hierarchical,nccl")
        three = specs.Target("GPU", 3, (0, 1, 2))
        runs, skipped = specs.plan_runs(candidates, three)
        assert [c.label for c in runs] == ["nccl:1"] and "even number" in dict(skipped)["hierarchical:1"]
        runs, skipped = specs.plan_runs(candidates, specs.Target("GPU", 2, (0, 1)))
        assert len(runs) == 2 and not skipped

    def test_cli_with_only_invalid_candidates(self):
        code, out, err = run_main(["--devices", "cpu:2", "--candidates", "nccl"])
        assert code == 2 and "no candidate can run" in err and "NCCL does not run on CPU devices" in err


# ------------------------------------------------------------------------------------- fake worker runs
def fake_spawn(wrong=0, fail=None, slow_without_p2p=1.0, calls=None):
    def spawn(candidate, target, sizes, iters, warmup, repeats, env=None, timeout=None):
        if calls is not None:
            calls.append((candidate.label, dict(env or {})))
        if fail == candidate.label:
            return {"ok": False, "candidate": candidate.label, "error": "RuntimeError: boom"}
        scale = slow_without_p2p if (env or {}).get("NCCL_P2P_DISABLE") == "1" else 1.0
        ops = "reduce_to_one" if candidate.name == "auto" else candidate.name
        return {"ok": True, "candidate": candidate.label, "ops": ops,
                "num_packs": candidate.num_packs, "n_replicas": target.n, "n_gpus": len(target.gpus),
                "tf_version": "2.21.0", "plan": f"plan for {candidate.label}", "iters": iters, "repeats": repeats,
                "results": [{"size_bytes": s, "count": s // 4, "time_us": scale * s / 1000.0,
                             "wrong": wrong if candidate.name == "collective" else 0} for s in sizes]}
    return spawn


class TestFakeRuns:
    def test_wrong_sums_mean_exit_1(self):
        records, skipped = runner.measure(specs.parse_candidates("collective,reduce_to_one,nccl"), CPU2,
                                         [1024, 4096], spawn=fake_spawn(wrong=3), progress=None)
        assert [r["status"] for r in records] == ["wrong", "wrong", "ok", "ok"]
        assert skipped == [("nccl:1", "NCCL does not run on CPU devices")]
        assert render.exit_code(records) == 1
        text = render.render_text("cmd", CPU2, records, skipped, 2, 1, 1, {})
        assert "# Out of bounds values : 6 WRONG" in text and "WRONG sums from collective" in text

    def test_failed_worker_is_a_row(self):
        records, _ = runner.measure(specs.parse_candidates("collective,auto"), CPU2, [1024],
                                   spawn=fake_spawn(fail="collective"), progress=None)
        assert records[0]["status"] == "failed" and records[0]["error"] == "RuntimeError: boom"
        assert records[1]["label"] == "auto(reduce_to_one)"
        text = render.render_text("cmd", CPU2, records, [], 2, 1, 1, {})
        assert "FAILED: RuntimeError: boom" in text and render.exit_code(records) == 1

    def test_table_has_names_units_and_footer(self):
        records, _ = runner.measure([specs.Candidate("reduce_to_one")], CPU2, [1024, 2**20], spawn=fake_spawn(),
                                   progress=None)
        lines = render.render_candidate_table(records).splitlines()
        assert lines[1].split() == ["#", "size", "count", "type", "redop", "time", "algbw", "busbw", "#wrong"]
        assert lines[2].split() == ["#", "(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)"]
        assert lines[3].split() == ["1024", "256", "float", "sum", "1.0", "1.00", "1.00", "0"]
        assert lines[-2] == "# Out of bounds values : 0 OK"
        assert lines[-1] == "# Avg bus bandwidth    : 1.0000 GB/s"

    def test_compare_p2p_runs_twice_and_prints_ratio(self, monkeypatch):
        calls = []
        monkeypatch.setattr(runner, "spawn_worker", fake_spawn(slow_without_p2p=7.0, calls=calls))
        monkeypatch.setattr(cli, "resolve_target", lambda devices, gpus, topology=None: CPU2)
        code, out, _ = run_main(["--devices", "cpu:2", "--sizes", "1K,4K", "--candidates", "collective",
                                 "--compare_p2p", "--env", "FOO=1"])
        assert code == 0
        assert calls == [("collective", {"FOO": "1"}), ("collective", {"FOO": "1", "NCCL_P2P_DISABLE": "1"})]
        assert "collective@nop2p" in out and "# NVLink speed-up" in out
        ratio_rows = out.split("# NVLink speed-up")[1].splitlines()[2:4]
        assert [row.split() for row in ratio_rows] == [["1K", "7.00x"], ["4K", "7.00x"]]

    def test_compare_p2p_conflicts_with_env(self):
        code, _, err = run_main(["--devices", "cpu:2", "--compare_p2p", "--env", "NCCL_P2P_DISABLE=0"])
        assert code == 2 and "--compare_p2p sets NCCL_P2P_DISABLE" in err

    def test_json_to_stdout(self, monkeypatch):
        monkeypatch.setattr(runner, "spawn_worker", fake_spawn())
        code, out, err = run_main(["--devices", "cpu:2", "--sizes", "1K", "--candidates", "reduce_to_one,nccl",
                                   "--json"])
        assert code == 0 and "skipped nccl:1" in err
        records = json.loads(out)
        assert [(r["candidate"], r["status"]) for r in records] == [("reduce_to_one", "ok"), ("nccl:1", "skipped")]

    def test_plot_without_matplotlib_is_a_clear_error(self, monkeypatch):
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib"
                            else real(name, *a))
        monkeypatch.setattr(runner, "spawn_worker", lambda *a, **k: pytest.fail("must fail before measuring"))
        code, _, err = run_main(["--devices", "cpu:2", "--plot", "out.png"])
        assert code == 2 and "pip install tf-nvlink[plot]" in err

    def test_spawn_worker_without_result_line(self, monkeypatch):
        def fake_run(args, **kwargs):
            assert isinstance(args, list) and "shell" not in kwargs
            assert args[1:4] == ["-m", "tf_nvlink.tools.allreduce_bench.worker", "--candidate"]
            assert kwargs["env"]["CUDA_VISIBLE_DEVICES"] == ""
            return subprocess.CompletedProcess(args, 1, stdout="noise\n", stderr="a\nb\nImportError: x\n")

        monkeypatch.setattr(subprocess, "run", fake_run)
        output = runner.spawn_worker(specs.Candidate("collective"), CPU2, [1024], 2, 1, 1)
        assert not output["ok"] and "status 1" in output["error"] and "ImportError: x" in output["error"]


# ------------------------------------------------------------------------------- one real run on CPU
CPU_ARGV = ["--devices", "cpu:2", "--sizes", "1K,64K", "--iters", "3", "--warmup", "1", "--repeats", "2",
            "--candidates", "reduce_to_one,nccl"]
CHAINED_ITERS = 4
# The worker's own arguments (runner.worker_command without `python -m worker`): the run CPU_ARGV asks for, and the
# graph inspection. Both use reduce_to_one over 2 logical CPUs, so they share one process (one strategy).
WORKER_ARGV = {
    "inspect": ["--inspect", "--candidate", "reduce_to_one", "--target", "cpu:2", "--sizes", "1K", "--iters",
                str(CHAINED_ITERS)],
    "measure": runner.worker_command(specs.Candidate("reduce_to_one"), CPU2, [1024, 65536], 3, 1, 2)[3:],
}
WORKER = scenarios.Scenario("allreduce_bench worker: reduce_to_one on 2 CPUs", r"""
import contextlib, io, json
from tf_nvlink.tools.allreduce_bench import worker


def worker_line(argv):  # worker.main's exit code and the JSON line it prints last, as the runner reads it
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = worker.main(argv)
    return {"code": code, "record": json.loads(out.getvalue().strip().splitlines()[-1])}
""", {name: f"result = worker_line({argv!r})" for name, argv in WORKER_ARGV.items()},
    env={"CUDA_VISIBLE_DEVICES": ""})  # as runner.worker_env sets it for a CPU run


def scenario_worker(candidate, target, sizes, iters, warmup, repeats, env=None, timeout=None):
    """runner.spawn_worker's stand-in: the scenario's worker record, for exactly the worker arguments it ran."""
    assert runner.worker_command(candidate, target, sizes, iters, warmup, repeats)[3:] == WORKER_ARGV["measure"]
    assert not env
    answer = WORKER.result("measure")
    assert answer["code"] == 0, answer
    return answer["record"]


@pytest.fixture(scope="module", params=[
    "scenario worker",
    # [scenario worker] checks the same in the default run; here runner.spawn_worker starts the worker process
    pytest.param("spawned worker", marks=pytest.mark.slow)])
def cpu_run(request, tmp_path_factory):
    """`python -m tf_nvlink.tools.allreduce_bench` over 2 logical CPU devices, tiny sizes, one candidate measured
    (nccl is skipped on CPU; the fake-worker tests above cover several measured candidates)."""
    folder = tmp_path_factory.mktemp("bench")
    argv = CPU_ARGV + ["--json", str(folder / "allreduce_bench.json")]
    if HAVE_MATPLOTLIB:
        argv += ["--plot", str(folder / "allreduce_bench.png")]
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "scenario worker":
            patch.setattr(runner, "spawn_worker", scenario_worker)
        code, out, err = run_main(argv)
    return {"code": code, "out": out, "err": err, "folder": folder, "argv": argv}


class TestCpuRun:
    def test_exit_and_header(self, cpu_run):
        assert cpu_run["code"] == 0, cpu_run["err"]
        out = cpu_run["out"]
        assert "# command: python -m tf_nvlink.tools.allreduce_bench --devices cpu:2 --sizes 1K,64K" in out
        assert "# skipped nccl:1: NCCL does not run on CPU devices" in out
        assert "# Result: OK" in out and out.count("# Avg bus bandwidth") == 1
        assert "# method: each all-reduce's input is tf.maximum(previous sum, floor)" in out
        assert out.count("# Local work subtracted: 1K ") == 1

    def test_records(self, cpu_run):
        text = (cpu_run["folder"] / "allreduce_bench.json").read_text()
        records = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in JSON"))
        measured = [r for r in records if r["status"] != "skipped"]
        assert {(r["candidate"], r["size_bytes"]) for r in measured} == {("reduce_to_one", s) for s in (1024, 65536)}
        for r in measured:
            assert r["status"] == "ok" and r["wrong"] == 0 and r["n_replicas"] == 2 and r["n_gpus"] == 0
            assert r["time_us"] > 0 and r["count"] == r["size_bytes"] // 4 and r["tf_version"]
            assert r["algbw"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
            assert r["busbw"] == pytest.approx(r["algbw"] * specs.bus_factor(2))
            assert r["local_us"] >= 0 and r["raw_time_us"] >= r["time_us"]
            assert (r["time_us"], r["local_capped"]) == pytest.approx(specs.subtract_local(r["raw_time_us"],
                                                                                            r["local_us"]))
            assert set(("candidate", "ops", "num_packs", "n_gpus", "size_bytes", "time_us", "algbw", "busbw",
                        "wrong")) <= set(r)
        assert [r["error"] for r in records if r["status"] == "skipped"] == ["NCCL does not run on CPU devices"]

    @pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib not installed (pip install tf-nvlink[plot])")
    def test_plot(self, cpu_run):
        png = cpu_run["folder"] / "allreduce_bench.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_chained_reduce_to_one_moves_data_every_iteration():
    """The graph TensorFlow actually runs (after Grappler, partitioned per device) for reduce_to_one over 2 logical
    CPU devices holds one buffer transfer each way per chained all-reduce, and the per-iteration tf.maximum.

    Without the tf.maximum(sum, floor) step Grappler turned the whole chain into ONE AddN on the first device
    with a single transfer, so the benchmark timed no link traffic after the first all-reduce.
    """
    iters = CHAINED_ITERS
    answer = WORKER.result("inspect")  # `worker --inspect`, in the scenario process
    assert answer["code"] == 0, answer
    report = answer["record"]
    timed, local = report["timed"], report["local"]
    # first iteration: replica 1's input goes to CPU:0 (a function argument on CPU, so not counted here); every
    # iteration: the sum goes back to CPU:1; every iteration but the last: replica 1's next input goes to CPU:0.
    assert timed["routes"].get("CPU:1->CPU:0", 0) >= iters - 1, timed  # TensorFlow 2.21: exactly iters - 1
    assert timed["routes"].get("CPU:0->CPU:1", 0) >= iters, timed  # TensorFlow 2.21: exactly iters
    assert timed["sources"] == ["AddN", "Maximum"]
    assert timed["op_counts"]["AddN"] == iters and timed["op_counts"]["Maximum"] == 2 * iters
    # the local-only chain: the same maxes, nothing crosses devices
    assert local["transfers"] == 0 and local["op_counts"]["Maximum"] == 2 * iters


def test_import_is_free_of_tensorflow():
    code = "import sys, tf_nvlink.tools.allreduce_bench, tf_nvlink.tools.tune; print('tensorflow' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=Path(allreduce_bench.__file__).resolve().parents[1])
    assert result.stdout.strip() == "False", result.stderr


def test_multiline_worker_errors_become_one_line():
    error = ("ValueError: in user code:\n\n    File \"allreduce_bench.py\", line 311, in timed  *\n        return x\n"
             "    ValueError: Device assignment required for nccl collective ops")
    [failed] = runner.to_records({"ok": False, "error": error}, specs.Candidate("nccl", 1), CPU2)
    assert failed["error"] == "ValueError: Device assignment required for nccl collective ops"
    assert one_line_error(ValueError("in user code:\n  File x\n  ValueError: boom")) == "ValueError: boom"


class TestFromJson:
    """`--from_json`: the summary and plot of records written elsewhere (a GPU machine without matplotlib)."""

    @staticmethod
    def write_records(path):
        target = specs.Target("GPU", 2, (0, 1))
        records = []
        for variant, time_us in (("", 1000.0), (specs.P2P_VARIANT, 8000.0)):
            output = {"ok": True, "ops": "nccl", "num_packs": 1, "n_replicas": 2, "n_gpus": 2,
                      "tf_version": "2.21.0",
                      "results": [{"size_bytes": 2**28, "count": 2**26, "time_us": time_us, "wrong": 0}]}
            records += runner.to_records(output, specs.parse_candidate("nccl"), target, variant=variant)
        records += runner.skipped_records([("hierarchical:1", "odd")], target)
        path.write_text(json.dumps(records))
        return path

    def test_summary_and_nvlink_ratio_without_measuring(self, tmp_path):
        code, out, _ = run_main(["--from_json", str(self.write_records(tmp_path / "r.json"))])
        assert code == 0 and "busbw (GB/s) by size" in out and "268.44" in out
        assert re.search(r"256M\s+8\.00x", out) and "Result: OK" in out

    @pytest.mark.parametrize("content, match", [("not json", "cannot be read as JSON"),
                                                ('[{"label": "x"}]', "not a list of tf-nvlink bench records")])
    def test_bad_file_is_a_clear_error(self, tmp_path, content, match):
        path = tmp_path / "bad.json"
        path.write_text(content)
        code, _, err = run_main(["--from_json", str(path)])
        assert code == 2 and match in err

    @pytest.mark.skipif(not HAVE_MATPLOTLIB, reason="matplotlib not installed (pip install tf-nvlink[plot])")
    def test_plot(self, tmp_path):
        png = tmp_path / "r.png"
        code, out, _ = run_main(["--from_json", str(self.write_records(tmp_path / "r.json")), "--plot", str(png)])
        assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gpu_exact_sum_check_accepts_the_recorded_h200_run():
    """The GPU test's expectations hold for a real run (benchmarks/results, 2x H200): label names, sizes, sums."""
    from test_gpu import check_allreduce_records

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "2026-11-30b_h200x2_allreduce.json"
    with open(path) as f:
        records = json.load(f)
    check_allreduce_records(records, [2**20, 2**24, 2**28, 2**30])
    with pytest.raises(AssertionError):
        check_allreduce_records([r for r in records if r["candidate"] != "xla"], [2**20])


@pytest.mark.slow  # a faster test covers the substance; CI runs the slow tier
def test_gpu_fit_check_runs_on_cpu_replicas():
    """The GPU fit test's script and comparison, rehearsed on 2 logical CPUs (split mode), so that a bug in the
    test itself shows up without a GPU."""
    from test_gpu import check_fit_matches_single_device

    check_fit_matches_single_device("split", replicas=2, cpus=2)
