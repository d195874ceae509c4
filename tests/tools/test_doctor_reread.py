"""Re-reading a saved doctor run (tf_nvlink.tools.doctor.reread and `tf-nvlink doctor --reread`): the saved window
and context with the trace found where runs keep it, the live reading given back, the context's link restored, and
one-line errors for a missing report or trace. A run is made from the 1x H200 ResNet-50 fixture's trace."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tf_nvlink.__main__ import build_parser, main
from tf_nvlink.tools.costmodel import model as costmodel
from tf_nvlink.tools.doctor import outputs
from tf_nvlink.tools.doctor.diagnosis import context_dict, diagnose_trace
from tf_nvlink.tools.doctor.reread import RereadError, context_from_dict, reread, saved_trace_path
from tf_nvlink.tools.doctor.verdict import StepContext

FIXTURE = Path(__file__).parent / "fixtures" / "step_doctor_resnet50"
pytestmark = pytest.mark.skipif(not (FIXTURE / "observation.json").exists(),
                                reason=f"no GPU trace fixture at {FIXTURE}")


def fixture_trace() -> Path:
    (trace,) = (FIXTURE / "profile").glob("plugins/profile/*/*.xplane.pb.gz")
    return trace


@pytest.fixture(scope="module")
def live_report():
    """The report a live run writes for the fixture's window: the diagnosis, then what the callback adds (the
    window, the counters' NVLink answer, the fit call's fixed cost), the profiler's path on the GPU machine."""
    observation = json.loads((FIXTURE / "observation.json").read_text())
    context = StepContext(**{k: v for k, v in observation["context"].items() if k != "link"})
    report, why = diagnose_trace(str(FIXTURE / "profile"), observation["step_ms"], observation["steps"],
                                 observation["calls"], context, model_flops_per_step=1.0e12)
    assert why is None
    report["trace"] = "/root/out/doctor/profile/plugins/profile/2026_12_02_01_44_28/vm.xplane.pb"  # not here
    report["window"] = {"epoch": 0, "steps": observation["steps"], "calls": observation["calls"],
                        "step_ms": observation["step_ms"]}
    report["nvlink_bytes_per_step"] = "unavailable: one replica, nothing is all-reduced over NVLink"
    report["fit_call"] = {"fixed_ms": 812.5, "measured": "from on_train_begin to the first batch of the window's fit"}
    return json.loads(json.dumps(report))  # as written to step_doctor.json


def saved_run(folder: Path, report: dict, trace_at: str = "profile") -> Path:
    """`report` as step_doctor.json in `folder`, the fixture's trace under folder/profile (as the profiler writes
    it), beside the folder as <folder>.xplane.pb.gz (as the benchmarks keep it) or nowhere (`trace_at`)."""
    folder.mkdir(parents=True)
    (folder / "step_doctor.json").write_text(json.dumps(report))
    if trace_at == "profile":
        target = folder / "profile" / "plugins" / "profile" / "run1" / "vm.xplane.pb.gz"
        target.parent.mkdir(parents=True)
        shutil.copy(fixture_trace(), target)
    elif trace_at == "beside":
        shutil.copy(fixture_trace(), folder.parent / f"{folder.name}.xplane.pb.gz")
    return folder


def test_a_reread_gives_the_live_reading_back_with_what_the_run_measured(tmp_path, live_report):
    run = saved_run(tmp_path / "doctor", live_report)
    report, why = reread(str(run))
    assert why is None
    assert report["mean"] == live_report["mean"] and report["work_bounds"] == live_report["work_bounds"]
    assert report["verdict"] == live_report["verdict"] and report["mfu"] == live_report["mfu"]
    for key in ("window", "fit_call", "nvlink_bytes_per_step"):
        assert report[key] == live_report[key], key
    assert report["reread"] == {
        "report": str(run / "step_doctor.json"), "trace": report["trace"], "trace_found": "beside the report",
        "saved_trace": live_report["trace"], "notes": []}
    assert report["trace"].endswith("profile/plugins/profile/run1/vm.xplane.pb.gz")
    assert outputs.render_table(report) == outputs.render_table(live_report)


def test_the_trace_is_the_one_given_else_the_reports_else_beside_the_report(tmp_path, live_report, monkeypatch):
    kept = saved_run(tmp_path / "doctor_mfu" / "resnet50", live_report, trace_at="beside")  # the benchmarks' layout
    report_path = str(kept / "step_doctor.json")
    assert saved_trace_path(report_path, live_report) == (str(kept) + ".xplane.pb.gz", "beside the report")
    monkeypatch.chdir(kept)  # a relative report path gives a relative trace path
    assert saved_trace_path("step_doctor.json", live_report) == ("../resnet50.xplane.pb.gz", "beside the report")
    stored = dict(live_report, trace=str(fixture_trace()))
    assert saved_trace_path(report_path, stored) == (str(fixture_trace()), "the report")
    given = str(kept) + ".xplane.pb.gz"
    assert saved_trace_path(report_path, stored, trace=given) == (given, "given")
    assert saved_trace_path(report_path, stored, trace=str(FIXTURE / "profile")) == (str(fixture_trace()), "given")


def test_a_missing_report_or_trace_says_what_is_missing(tmp_path, live_report):
    with pytest.raises(RereadError, match=r"no such file or folder: .*nowhere \(give a doctor run's step_doctor.json"):
        reread(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(RereadError, match=r"no step_doctor.json in the folder .*empty"):
        reread(str(tmp_path / "empty"))
    (tmp_path / "other.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(RereadError, match=r"other.json has no window steps/calls/step_ms"):
        reread(str(tmp_path / "other.json"))
    bare = saved_run(tmp_path / "bare", live_report, trace_at="nowhere")
    with pytest.raises(RereadError) as raised:
        reread(str(bare))
    assert str(raised.value) == (
        f"no trace for {bare / 'step_doctor.json'}: looked at the report's trace {live_report['trace']} (gone); {bare} "
        f"and below; {bare}.xplane.pb.gz; pass --trace PATH")
    with pytest.raises(RereadError, match=r"no trace at .*missing.xplane.pb \(give an .xplane.pb or"):
        reread(str(bare), trace=str(tmp_path / "missing.xplane.pb"))
    with pytest.raises(RereadError, match=r"cannot read the trace .*step_doctor.json"):
        reread(str(bare), trace=str(bare / "step_doctor.json"))
    no_steps = dict(live_report, context={"replicas": 1})
    (tmp_path / "partial.json").write_text(json.dumps(no_steps))
    with pytest.raises(RereadError, match=r"the context in .*partial.json lacks steps_per_execution, gradient_bytes, "
                                          r"gradient_tensors"):
        reread(str(tmp_path / "partial.json"), trace=str(fixture_trace()))


def test_the_contexts_link_comes_back_from_its_saved_model_else_its_name():
    link = costmodel.LinkModel("nvlink rings (4x NVIDIA A100, 2 x 25 GB/s)", 40.0, 3.4,
                               busbw_by_gpus=((2, 20.0), (4, 40.0)), max_gpus=4, source="probed")
    context = StepContext(replicas=4, steps_per_execution=8, gradient_bytes=102_236_160, gradient_tensors=161,
                          link=link, machine_kind="nvlink-all")
    assert context_from_dict(json.loads(json.dumps(context_dict(context)))) == (context, [])
    named = dict(context_dict(context), link_model=None, link="nvswitch-h200")
    assert context_from_dict(named)[0].link == costmodel.LINKS["nvswitch-h200"]
    old = dict(context_dict(context), link_model=None)
    restored, notes = context_from_dict(old)
    assert restored.link is None and notes == [
        "the link 'nvlink rings (4x NVIDIA A100, 2 x 25 GB/s)' is saved by its name alone: the scaling predictions use "
        "the reference machines only"]


def test_the_command_prints_the_table_and_writes_the_new_report(tmp_path, live_report, capsys):
    run = saved_run(tmp_path / "doctor", live_report)
    assert main(["doctor", "--reread", str(run / "step_doctor.json"), "--no-chart"]) == 0
    out = capsys.readouterr().out
    written = run / "reread" / "step_doctor.json"   # the default: beside the saved report, which stays as it was
    assert outputs.render_table(live_report) in out and "kinds of work against their bound" in out
    assert out.splitlines()[-1] == (f"step doctor: {written} (re-read {run / 'step_doctor.json'} with the trace "
                                    f"{json.loads(written.read_text())['trace']})")
    assert json.loads((run / "step_doctor.json").read_text()) == live_report
    assert json.loads(written.read_text())["mean"] == live_report["mean"]
    assert main(["doctor", "--reread", str(run), "--trace", str(fixture_trace()), "--output-dir",
                 str(tmp_path / "again"), "--no-chart"]) == 0
    assert json.loads((tmp_path / "again" / "step_doctor.json").read_text())["reread"]["trace_found"] == "given"


@pytest.mark.parametrize("argv, words", [
    (["--reread", "NOWHERE"], "--reread: no such file or folder: NOWHERE"),
    (["--trace", "t.xplane.pb"], "--trace is read with --reread"),
    (["--reread", "run", "--batch_per_replica", "8", "--log_dir", "logs"],
     "--reread reads a saved run: --batch_per_replica, --log_dir belong to a training run"),
])
def test_the_command_ends_a_bad_reread_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        main(["doctor", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and words in err and "Traceback" not in err, err
    assert build_parser().parse_args(["doctor", *argv]).output_dir is None
