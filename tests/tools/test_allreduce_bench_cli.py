"""tf_nvlink.tools.allreduce_bench.cli (`tf-nvlink bench`): an unusable --json is refused before measuring, a write
failing after measuring still prints the records, and --from_json refuses malformed records naming them."""

import json

import pytest

from fake_allreduce import BENCH_ARGS, fake_measure
from tf_nvlink.tools.allreduce_bench import cli




@pytest.mark.parametrize("where", ["under a file", "missing folder", "a folder"])
def test_unusable_json_path_refused_before_measuring(tmp_path, monkeypatch, capsys, where):
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


def test_json_write_failing_after_measuring_prints_the_records(tmp_path, monkeypatch, capsys):
    import shutil
    folder = tmp_path / "out"
    folder.mkdir()
    calls = []
    monkeypatch.setattr(cli, "measure", fake_measure(calls, before_return=lambda: shutil.rmtree(folder)))
    code = cli.main(BENCH_ARGS + ["--json", str(folder / "records.json")])
    out, err = capsys.readouterr()
    assert code == 1 and calls == [[1024]]
    assert '"label": "reduce_to_one"' in out and "could not write --json" in err, (out, err)
    assert err.count("error") == 1 and "Traceback" not in err


GOOD_RECORD = {"label": "nccl:1", "candidate": "nccl:1", "variant": "", "size_bytes": 1024, "status": "ok",
               "busbw": 1.5, "wrong": 0}


@pytest.mark.parametrize("change, needle", [
    ({"size_bytes": "16M"}, "size_bytes='16M'"), ({"busbw": None}, "busbw=None"), ({"busbw": "fast"}, "busbw='fast'"),
    ({"wrong": -1}, "wrong=-1"), ({"status": "great"}, "status='great'"), ({"label": 3}, "label=3"),
    ({"variant": None}, "variant=None"),
])
def test_from_json_malformed_record_is_a_clear_error(tmp_path, capsys, change, needle):
    path = tmp_path / "records.json"
    path.write_text(json.dumps([GOOD_RECORD, dict(GOOD_RECORD, **change)]))
    with pytest.raises(SystemExit) as info:
        cli.main(["--from_json", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "record 1" in err and needle in err and "Traceback" not in err, err
    path.write_text(json.dumps([GOOD_RECORD]))
    assert cli.main(["--from_json", str(path)]) == 0
