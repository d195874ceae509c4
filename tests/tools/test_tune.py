"""tf_nvlink.tools.tune: the autotune cache (atomic, locked, strict, private), scoring, stored_choice, one real CPU run."""

import argparse
import contextlib
import io
import json
import logging
import multiprocessing
import os
import stat

import pytest

import fake_nvml
from fake_nvml import FakeNvml
from fake_allreduce import BENCH_ARGS, fake_measure
from tf_nvlink.tools.allreduce_bench import runner
from tf_nvlink.tools.allreduce_bench import specs
from tf_nvlink.machine import nvml
from tf_nvlink.tools import tune
from tf_nvlink.plan import tune_cache
from tf_nvlink.util.strict_json import strict_loads
from tf_nvlink.machine.topology import Topology


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """Every test gets its own cache folder (through TF_NVLINK_CACHE_DIR, as users override it)."""
    folder = tmp_path / "cache" / "tf_nvlink"
    monkeypatch.setenv("TF_NVLINK_CACHE_DIR", str(folder))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    tune_cache._WARNED.clear()
    return folder


def record(fingerprint="abc123def456", tf_version="2.21.0", gpus=(0, 1), ops="nccl", packs=4, score=230.0):
    return {"fingerprint": fingerprint, "tf_version": tf_version,
            "gpus": gpus if isinstance(gpus, str) else list(gpus), "candidate": f"{ops}:{packs}" if packs else ops,
            "cross_device_ops": ops, "num_packs": packs, "score": score, "sizes": [16 * 2**20, 256 * 2**20],
            "scores": {f"{ops}:{packs}" if packs else ops: score, "collective": 160.0}, "n_replicas": 2,
            "measured_at": "2026-11-30T04:00:00+00:00", "metric": tune.METRIC}


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == "tf_nvlink" and r.levelno == logging.WARNING]


def h200():
    return nvml.probe(FakeNvml(fake_nvml.h200_x2()))


# ------------------------------------------------------------------------------------------------ location
def test_cache_dir_precedence(monkeypatch, tmp_path):
    assert tune_cache.cache_path() == str(tmp_path / "cache" / "tf_nvlink" / "autotune.json")
    monkeypatch.delenv("TF_NVLINK_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tune_cache.cache_dir() == str(tmp_path / "xdg" / "tf_nvlink")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert tune_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "tf_nvlink")


# ----------------------------------------------------------------------------------------------- the cache
class TestStore:
    def test_roundtrip_and_modes(self, cache):
        key = tune_cache.store(record())
        assert key == "abc123def456|tensorflow-2.21.0|gpus:0,1"
        assert tune_cache.lookup("abc123def456", "2.21.0", [0, 1]) == record()
        assert stat.S_IMODE(os.stat(cache / "autotune.json").st_mode) == 0o600
        assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700
        assert sorted(os.listdir(cache)) == ["autotune.json", "autotune.json.lock"]  # no temporary file left

    def test_keyed_by_fingerprint_tf_version_and_gpus(self):
        tune_cache.store(record())
        tune_cache.store(record(gpus=(0, 1, 2, 3), ops="reduce_to_one", packs=None, score=250.0))
        assert tune_cache.lookup("abc123def456", "2.21.0", (1, 0))["num_packs"] == 4  # a set: order does not matter
        assert tune_cache.lookup("abc123def456", "2.21.0", "0,1,2,3")["cross_device_ops"] == "reduce_to_one"
        assert tune_cache.lookup("000000000000", "2.21.0", [0, 1]) is None
        assert tune_cache.lookup("abc123def456", "2.20.0", [0, 1]) is None
        assert tune_cache.lookup("abc123def456", "2.21.0", [0, 2]) is None
        assert tune_cache.lookup("abc123def456", "2.21.0", "cpu:2") is None

    def test_store_replaces_the_same_key(self):
        tune_cache.store(record(score=1.0))
        tune_cache.store(record(score=2.0))
        assert len(tune_cache.entries()) == 1 and tune_cache.lookup("abc123def456", "2.21.0", [0, 1])["score"] == 2.0

    def test_write_is_atomic(self, cache, monkeypatch):
        tune_cache.store(record(score=1.0))
        before = (cache / "autotune.json").read_bytes()

        def broken_replace(src, dst):
            raise OSError("disk full")

        monkeypatch.setattr(tune_cache.os, "replace", broken_replace)
        with pytest.raises(OSError, match="disk full"):
            tune_cache.store(record(score=2.0, gpus=(2, 3)))
        assert (cache / "autotune.json").read_bytes() == before
        assert sorted(os.listdir(cache)) == ["autotune.json", "autotune.json.lock"]

    def test_existing_file_with_wide_mode_becomes_private(self, cache):
        cache.mkdir(parents=True)
        (cache / "autotune.json").write_text('{"format": 1, "entries": {}}')
        os.chmod(cache / "autotune.json", 0o644)
        tune_cache.store(record())
        assert stat.S_IMODE(os.stat(cache / "autotune.json").st_mode) == 0o600

    @pytest.mark.parametrize("bad", [dict(score=float("nan")), dict(score=float("inf")), dict(score=-1.0),
                                     dict(ops="bogus"), dict(gpus=[0, 0]), dict(ops="reduce_to_one", packs=2),
                                     dict(fingerprint="")])
    def test_bad_records_are_refused(self, bad):
        with pytest.raises(ValueError):
            tune_cache.store(record(**bad))
        assert not os.path.exists(tune_cache.cache_path())


def _store_many(worker_id, count, barrier):
    barrier.wait(30)  # both processes start storing together, so their read-modify-writes interleave
    for i in range(count):
        tune_cache.store(record(fingerprint=f"p{worker_id}-{i:03d}", score=float(i)))


def test_concurrent_stores_from_two_processes_all_land(cache):
    context = multiprocessing.get_context("spawn")  # not fork: other tests may have started TensorFlow's threads
    barrier = context.Barrier(2)
    processes = [context.Process(target=_store_many, args=(w, 40, barrier)) for w in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(60)
        assert p.exitcode == 0
    data = strict_loads((cache / "autotune.json").read_text())
    assert len(data["entries"]) == 80
    assert set(tune_cache.entries()) == {f"p{w}-{i:03d}|tensorflow-2.21.0|gpus:0,1" for w in range(2) for i in range(40)}
    assert sorted(os.listdir(cache)) == ["autotune.json", "autotune.json.lock"]


class TestCorruptAndStrict:
    @pytest.mark.parametrize("content", ["{not json", "[1, 2]", '"text"', "", '{"format": 99, "entries": {}}',
                                         '{"format": 1, "entries": []}', b"\xff\xfe{}"])
    def test_corrupt_file_one_warning_then_overwritten(self, cache, caplog, content):
        cache.mkdir(parents=True)
        path = cache / "autotune.json"
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        assert tune_cache.lookup("abc123def456", "2.21.0", [0, 1]) is None
        assert tune_cache.lookup("abc123def456", "2.21.0", [0, 1]) is None
        tune_cache.store(record())
        assert len(warnings_of(caplog)) == 1 and "ignoring the autotune cache" in warnings_of(caplog)[0].message
        assert tune_cache.lookup("abc123def456", "2.21.0", [0, 1]) == record()
        assert len(warnings_of(caplog)) == 1

    def test_nan_infinity_and_duplicates_rejected(self, cache, caplog):
        for text in ("NaN", "[Infinity]", "-Infinity", "1e400", '{"a": 1, "a": 2}'):
            with pytest.raises(ValueError):
                strict_loads(text)
        cache.mkdir(parents=True)
        text = json.dumps({"format": 1, "entries": {tune_cache.make_key("abc123def456", "2.21.0", [0, 1]): record()}})
        (cache / "autotune.json").write_text(text.replace("230.0", "NaN"))
        assert tune_cache.lookup("abc123def456", "2.21.0", [0, 1]) is None
        assert "NaN is not valid JSON" in warnings_of(caplog)[0].message

    def test_mistyped_entries_dropped_others_kept(self, cache, caplog):
        good = record(gpus=(2, 3))
        bad = [record(), record(fingerprint="b2"), record(fingerprint="b3"), record(fingerprint="b4")]
        bad[0]["gpus"] = "0,1"  # a string where a list belongs
        bad[1]["num_packs"] = "4"
        bad[2]["score"] = True
        del bad[3]["sizes"]
        entries = {tune_cache.make_key(r["fingerprint"], "2.21.0", [0, 1]): r for r in bad}
        entries[tune_cache.make_key("abc123def456", "2.21.0", [0, 1])] = bad[0]
        entries["wrong-key"] = record(fingerprint="b5")
        entries[tune_cache.make_key("abc123def456", "2.21.0", [2, 3])] = good
        cache.mkdir(parents=True)
        (cache / "autotune.json").write_text(json.dumps({"format": 1, "entries": entries}))
        assert list(tune_cache.entries().values()) == [good]
        assert len(warnings_of(caplog)) == 1 and "5 malformed entries" in warnings_of(caplog)[0].message


# ---------------------------------------------------------------------------------- scoring and tune()
def fake_spawn(busbw_by_label, wrong_for=(), calls=None):
    """Workers whose time gives each candidate the busbw asked for (2 replicas: busbw == algbw)."""
    def spawn(candidate, target, sizes, iters, warmup, repeats, env=None, timeout=None):
        if calls is not None:
            calls.append(candidate.label)
        ops = "nccl" if candidate.name == "auto" else candidate.name
        packs = 1 if candidate.name == "auto" else candidate.num_packs
        return {"ok": True, "ops": ops, "num_packs": packs, "n_replicas": target.n, "n_gpus": len(target.gpus),
                "tf_version": "2.21.0", "plan": "p", "iters": iters, "repeats": repeats,
                "results": [{"size_bytes": s, "count": s // 4,
                             "time_us": s / 1e3 / busbw_by_label[candidate.label][i],
                             "wrong": 5 if candidate.label in wrong_for else 0} for i, s in enumerate(sizes)]}
    return spawn


class TestScoring:
    def test_sizes(self):
        assert tune.tuning_sizes() == [16 * 2**20, 256 * 2**20]
        assert tune.tuning_sizes(grad_bytes=102) == [104]  # whole float32s
        assert tune.tuning_sizes("1M", grad_bytes=4096) == [4096, 2**20]
        with pytest.raises(specs.BenchError):
            tune.tuning_sizes(grad_bytes=0)

    def test_geometric_mean_and_disqualification(self):
        records, _ = runner.measure(specs.parse_candidates("collective,reduce_to_one"), specs.resolve_target("cpu:2"),
                                   [4096, 65536], progress=None,
                                   spawn=fake_spawn({"collective": [1.0, 100.0], "reduce_to_one": [20.0, 30.0]},
                                                    wrong_for={"reduce_to_one"}))
        scores, out = tune.score_candidates(records, [4096, 65536])
        assert scores == {"collective": pytest.approx(10.0)}
        assert out == {"reduce_to_one": "5 wrong elements at 4K; 5 wrong elements at 64K"}

    def test_tune_picks_the_highest_and_stores(self, cache):
        result = tune.tune(gpus="all", topology=h200(), sizes="16M,256M", progress=None,
                           spawn=fake_spawn({"collective": [150, 163], "nccl:1": [220, 228], "nccl:4": [200, 240],
                                             "hierarchical:1": [250, 253], "reduce_to_one": [10, 265]}))
        assert result.winner == "hierarchical:1" and result.num_packs == 1
        assert result.score == pytest.approx((250 * 253) ** 0.5)
        assert result.cache_path == tune_cache.cache_path()
        stored = tune_cache.lookup(h200().fingerprint(), "2.21.0", [0, 1])
        assert stored["candidate"] == "hierarchical:1" and stored["cross_device_ops"] == "hierarchical"

    def test_auto_winner_stores_what_it_resolved_to(self):
        result = tune.tune(topology=h200(), candidates="collective,auto", sizes="1M", progress=None,
                           store_result=False, spawn=fake_spawn({"collective": [1.0], "auto": [2.0]}))
        assert (result.winner, result.cross_device_ops, result.num_packs) == ("auto(nccl:1)", "nccl", 1)
        assert result.cache_path is None and not os.path.exists(tune_cache.cache_path())

    def test_nothing_correct_stores_nothing(self):
        with pytest.raises(RuntimeError, match="nothing stored"):
            tune.tune(devices="cpu:2", candidates="collective", sizes="4K", progress=None,
                      spawn=fake_spawn({"collective": [1.0]}, wrong_for={"collective"}))
        assert not os.path.exists(tune_cache.cache_path())

    def test_xla_is_not_a_cross_device_ops_choice(self):
        with pytest.raises(specs.BenchError, match="'xla' is the all-reduce jit_compile=True models use"):
            tune.tune(topology=h200(), candidates="nccl,xla", sizes="1M", progress=None, store_result=False,
                      spawn=fake_spawn({"nccl:1": [1.0], "xla": [2.0]}))

    def test_one_device_is_refused(self):
        with pytest.raises(specs.BenchError, match="at least 2 devices"):
            tune.tune(devices="cpu:1", progress=None, spawn=fake_spawn({}))


class TestStoredChoice:
    def test_none_until_tuned(self):
        assert tune_cache.stored_choice(h200(), (0, 1), "2.21.0") is None

    def test_returns_policy_shaped_choice(self):
        tune_cache.store(record(fingerprint=h200().fingerprint()))
        ops, packs, reason = tune_cache.stored_choice(h200(), (1, 0), "2.21.0")
        assert (ops, packs) == ("nccl", 4)
        assert "autotuned" in reason and "nccl:4" in reason and tune_cache.cache_path() in reason
        assert tune_cache.stored_choice(h200(), (0, 1), "2.22.0") is None  # another TensorFlow: measure again
        assert tune_cache.stored_choice(h200(), (0,), "2.21.0") is None

    def test_hierarchical_on_odd_gpu_count_is_not_offered(self):
        tune_cache.store(record(fingerprint=h200().fingerprint(), gpus=(0, 1, 2), ops="hierarchical", packs=1))
        assert tune_cache.stored_choice(h200(), (0, 1, 2), "2.21.0") is None

    def test_autotune_choice_measures_once(self, monkeypatch):
        calls = []
        monkeypatch.setattr(tune_cache, "_tf_version", lambda: "2.21.0")
        spawn = fake_spawn({"collective": [100.0, 100.0], "nccl:1": [200.0, 200.0], "nccl:4": [190.0, 190.0],
                            "hierarchical:1": [150.0, 150.0], "reduce_to_one": [180.0, 180.0]}, calls=calls)
        first = tune.autotune_choice(h200(), (0, 1), spawn=spawn, progress=None)
        assert first[:2] == ("nccl", 1) and "just now" in first[2] and len(calls) == 5
        second = tune.autotune_choice(h200(), (0, 1), spawn=spawn, progress=None)
        assert second[:2] == ("nccl", 1) and "stored in" in second[2] and len(calls) == 5


# ------------------------------------------------------------------------------------ one real CPU run
@pytest.mark.slow  # real worker processes; the tests above cover tune with a fake spawn
def test_tune_end_to_end_on_cpu(cache):
    """`tf-nvlink tune` over 2 logical CPU devices, tiny sizes: two worker processes, a winner stored."""
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    args = parser.parse_args(["--devices", "cpu:2", "--sizes", "4K,64K", "--iters", "2", "--warmup", "1",
                              "--repeats", "1", "--candidates", "reduce_to_one,collective,nccl:4"])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = tune.run(args)
    text = out.getvalue()
    assert code == 0, err.getvalue()
    assert "# skipped nccl:4: NCCL does not run on CPU devices" in text
    assert "# tune: winner " in text and f"#   in {tune_cache.cache_path()}" in text
    [(key, stored)] = tune_cache.entries().items()
    assert key.startswith(Topology().fingerprint() + "|tensorflow-") and key.endswith("|cpu:2")
    assert stored["candidate"] in ("reduce_to_one", "collective") and stored["sizes"] == [4096, 65536]
    assert set(stored["scores"]) == {"reduce_to_one", "collective"}
    assert tune_cache.lookup(Topology().fingerprint(), stored["tf_version"], "cpu:2") == stored
    assert stat.S_IMODE(os.stat(tune_cache.cache_path()).st_mode) == 0o600

    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        assert tune.run(parser.parse_args(["--list"])) == 0
    assert "(1 entry)" in listing.getvalue() and stored["candidate"] in listing.getvalue()


def test_report_and_auto_plan_show_a_stored_winner():
    """What `tf-nvlink report` says "auto" picks is what tf_nvlink.strategy() picks: the stored winner."""
    from tf_nvlink.plan import step_options

    from tf_nvlink.plan import policy
    from tf_nvlink.tools import report
    topo = h200()
    before = report.collect(topology=topo, with_tf=False)["plan"]
    assert (before["cross_device_ops"], before["num_packs"]) == ("nccl", 1)
    tune_cache.store(record(fingerprint=topo.fingerprint(), tf_version=tune_cache._tf_version(), ops="hierarchical", packs=2))
    after = report.collect(topology=topo, with_tf=False)["plan"]
    assert (after["cross_device_ops"], after["num_packs"]) == ("hierarchical", 2)
    assert after["reason"].startswith("autotuned on this machine: hierarchical:2")
    facts = policy.Facts(topo, tf_gpu_count=2, tune_choice=lambda gpus: tune_cache.stored_choice(topo, gpus))
    plan, warnings = policy.decide(facts)  # what tf_nvlink.strategy() decides from the same facts
    assert (plan.cross_device_ops, plan.num_packs, plan.xla_allreduce) == ("hierarchical", 2, "fused")
    assert plan.to_dict() == {k: v for k, v in after.items() if k not in ("summary", "error", "warnings")}
    assert warnings == []
    single, _ = policy.decide(facts, gpus="0")  # one GPU: no winner applies; only the step options are added
    assert single == step_options.choose_step_options(policy.make_plan(topo, gpus="0"))
    assert (single.cross_device_ops, single.input_buffer) == (policy.make_plan(topo, gpus="0").cross_device_ops, 1)


def test_list_with_a_folder_at_the_cache_path_warns_and_names_it(cache, caplog):
    """`tf-nvlink tune --list` when autotune.json is a folder: a warning naming the path, no traceback."""
    path = cache / "autotune.json"
    path.mkdir(parents=True)
    parser = argparse.ArgumentParser()
    tune.add_arguments(parser)
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing), caplog.at_level(logging.WARNING, logger="tf_nvlink"):
        assert tune.run(parser.parse_args(["--list"])) == 0
    assert "(0 entries)" in listing.getvalue() or "no" in listing.getvalue().lower()
    assert [str(path) in r.getMessage() and "not a regular file" in r.getMessage() for r in warnings_of(caplog)] \
        == [True]


# ---------------------------------------------------------------- no measurement lost to an unusable cache


def test_main_refuses_an_unusable_cache_before_measuring(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("TF_NVLINK_CACHE_DIR", str(tmp_path / "file" / "cache"))
    calls = []
    monkeypatch.setattr(runner, "measure", fake_measure(calls))
    with pytest.raises(SystemExit) as info:
        tune.main(BENCH_ARGS)
    err = capsys.readouterr().err
    assert info.value.code == 2 and calls == [], err
    assert "cannot be written" in err and "TF_NVLINK_CACHE_DIR" in err and "Traceback" not in err, err


def test_main_prints_the_result_when_storing_it_fails(tmp_path, monkeypatch, capsys):
    import shutil
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
