"""tf_nvlink.plan.tune_cache: the autotune cache refuses what it cannot trust (corrupt JSON, symlinked locks,
FIFOs, out-of-range entries, relative XDG_CACHE_HOME) with one warning, never a hang or a crash."""

import json
import os
import threading

import pytest

from error_messages import raises_naming
from tf_nvlink.plan import tune_cache


def test_bad_gpus_key():
    raises_naming(lambda: tune_cache.gpus_key("0,x"), "'0,x'", "'cpu:N'")


def test_corrupt_cache_is_ignored_with_one_warning_and_replaced(tmp_path, caplog):
    path = tmp_path / "autotune.json"
    path.write_text('{"format": 1, "entries": {"k": {"score": NaN}}}')
    with caplog.at_level("WARNING", logger="tf_nvlink"):
        assert tune_cache.entries(str(path)) == {}
        assert tune_cache.entries(str(path)) == {}  # the same bad file warns once
    assert len([r for r in caplog.records if r.name == "tf_nvlink"]) == 1
    assert "NaN is not valid JSON" in caplog.text and str(path) in caplog.text
    tune_cache.store(tune_record()[0], path=str(path))
    assert len(tune_cache.entries(str(path))) == 1


def tune_record(**changes):
    record = {"fingerprint": "abc123abc123", "tf_version": "2.21.0", "gpus": [0, 1], "candidate": "nccl:1",
              "cross_device_ops": "nccl", "num_packs": 1, "score": 200.0, "sizes": [16 * 2**20],
              "scores": {"nccl:1": 200.0}, "n_replicas": 2, "measured_at": "2026-11-30T00:00:00+00:00"}
    record.update(changes)
    return record, tune_cache.make_key(record["fingerprint"], record["tf_version"], record["gpus"])


def test_lock_file_is_not_followed_through_a_symlink(tmp_path):
    path = tmp_path / "autotune.json"
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "autotune.json.lock").symlink_to(elsewhere)  # dangling
    with pytest.raises(tune_cache.CacheError, match="symbolic link"):
        tune_cache.store(tune_record()[0], str(path))
    assert not elsewhere.exists()


def test_fifo_at_the_cache_path_is_refused_not_waited_on(tmp_path, caplog):
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
def test_hand_edited_entries_out_of_range_are_ignored(tmp_path, change):
    path = tmp_path / "autotune.json"
    good, good_key = tune_record()
    bad, bad_key = tune_record(**change)
    if bad_key == good_key:
        bad, bad_key = tune_record(**change, tf_version="2.20.0")
    path.write_text(json.dumps({"format": tune_cache.FORMAT_VERSION, "entries": {good_key: good, bad_key: bad}}))
    assert set(tune_cache.entries(str(path))) == {good_key}


@pytest.mark.parametrize("xdg, expected", [("relative/cache", "~/.cache/tf_nvlink"), ("", "~/.cache/tf_nvlink"),
                                           ("/abs/cache", "/abs/cache/tf_nvlink")])
def test_relative_xdg_cache_home_is_ignored(monkeypatch, xdg, expected):
    monkeypatch.delenv("TF_NVLINK_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert tune_cache.cache_dir() == os.path.expanduser(expected)


def test_a_cache_folder_that_is_a_file_is_named_as_the_cause(tmp_path):
    """The cache folder is a regular file, or lies below one: the error names the folder, not the lock."""
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("x")
    raises_naming(lambda: tune_cache.store(tune_record()[0], str(blocker / "autotune.json")),
                  f"the autotune cache folder {blocker} is not a folder", "TF_NVLINK_CACHE_DIR",
                  error=tune_cache.CacheError)
    below = blocker / "sub"
    raises_naming(lambda: tune_cache.store(tune_record()[0], str(below / "autotune.json")),
                  f"cannot make the autotune cache folder {below}", "Not a directory", "TF_NVLINK_CACHE_DIR",
                  error=tune_cache.CacheError)
    assert f"the autotune cache folder {blocker} is not a folder" in tune_cache.cache_unusable_reason(
        str(blocker / "autotune.json"))
    assert blocker.read_text() == "x"  # nothing lost
