"""`tf-nvlink cache`: lists the compile cache's context folders, entries and size, as text or JSON; `--clear`
deletes the entries only (a folder given by hand keeps its other files); `tf-nvlink report` has its line."""

import json
import os

from tests.plan.test_compile_cache import write_entry
from tf_nvlink.__main__ import main
from tf_nvlink.plan import compile_cache


def test_cache_lists_and_clears(tmp_path, capsys):
    write_entry(tmp_path / "ctx1", signature=1)
    write_entry(tmp_path / "ctx1", signature=2)
    write_entry(tmp_path / "ctx2", signature=3)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "project").mkdir()
    assert main(["cache", "--dir", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["entries"] == 3 and data["folder"] == str(tmp_path)
    assert [(c["context"], c["entries"]) for c in data["contexts"]] == [("ctx1", 2), ("ctx2", 1), ("project", 0)]
    assert main(["cache", "--dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "3 entries in 3 context folders" in text and "ctx1" in text
    assert main(["cache", "--dir", str(tmp_path), "--clear"]) == 0
    assert "cleared 3 entries" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"]  # empty folders go, other files stay


def test_cache_default_folder_and_the_report_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TF_NVLINK_CACHE_DIR", str(tmp_path))
    write_entry(tmp_path / "xla" / "ctx", signature=1)
    assert main(["cache", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["folder"] == str(tmp_path / "xla")
    assert main(["report", "--no-tf"]) == 0
    assert f"XLA compile cache: {tmp_path / 'xla'}, 1 entry in 1 context folder" in capsys.readouterr().out
    monkeypatch.setenv(compile_cache.ENV_SETTING, "off")
    assert "XLA compile cache: off" in compile_cache.summary_line(compile_cache.summary())
