"""The step doctor: the breakdown's arithmetic on synthetic traces (XSpace protobufs built here), each verdict and
its advice, the predictions, the outputs, the Keras callback on CPU, and a GPU trace fixture when present."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import re
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import scenarios
from tests.conftest import run_python
from tf_nvlink.tools.costmodel import model as costmodel
from tf_nvlink.tools.doctor import outputs
from tf_nvlink.tools.doctor.breakdown import gaps, merge, overlap, replica_breakdown
from tf_nvlink.tools.doctor.diagnosis import diagnose_space, diagnose_trace
from tf_nvlink.tools.doctor.predictions import nvlink_answer, scaling
from tf_nvlink.tools.doctor.trace import classify, gpu_activity, load_space, parse_memcpy_details
from tf_nvlink.tools.doctor.verdict import GAP_REMOVED_BY_MULTI_STEP, PINNED_COPY_GB_PER_S, StepContext, diagnose

FIXTURE = Path(__file__).parent / "fixtures" / "step_doctor_resnet50"  # --trace_out tests/tools/fixtures
MS = 10**9  # picoseconds per ms
RESNET_BYTES = 102_236_160


def xspace(gpus: dict, details_as_ref=False):
    """An XSpace with one plane per GPU: {plane name: [(event name, start_ms, duration_ms[, memcpy_details]), ...]},
    all on one "Stream #7(Compute)" line, plus a host plane and a non-Stream annotation line that must be ignored.
    A fourth item is the event's `memcpy_details` stat, stored as text (or, `details_as_ref`, as a reference to a
    stat metadata name, as XPlane may store repeated strings)."""
    from tf_nvlink.internals import tf_runtime as internals

    pb = internals.xplane_protobuf_module()
    space = pb.XSpace()
    space.planes.add(name="/host:CPU").lines.add(name="python")
    for plane_name, events in gpus.items():
        plane = space.planes.add(name=plane_name)
        ids = {}
        for name, *_ in events:
            if name not in ids:
                ids[name] = len(ids) + 1
                plane.event_metadata[ids[name]].id = ids[name]
                plane.event_metadata[ids[name]].name = name
        plane.stat_metadata[1].id, plane.stat_metadata[1].name = 1, "memcpy_details"
        line = plane.lines.add(name="Stream #7(Compute)", timestamp_ns=1_000_000)
        for name, start_ms, duration_ms, *details in events:
            event = line.events.add(metadata_id=ids[name], offset_ps=int(start_ms * MS),
                                    duration_ps=int(duration_ms * MS))
            if details and details_as_ref:
                ref = 100 + len(plane.stat_metadata)
                plane.stat_metadata[ref].id, plane.stat_metadata[ref].name = ref, details[0]
                event.stats.add(metadata_id=1, ref_value=ref)
            elif details:
                event.stats.add(metadata_id=1, str_value=details[0])
        annotation = plane.lines.add(name="XLA Ops", timestamp_ns=1_000_000)
        annotation.events.add(metadata_id=1, offset_ps=0, duration_ps=int(1000 * MS))
    return space


def host_bound_steps(steps=4):
    """Each 30 ms step: 1 ms H2D copy, 18 ms of kernels with a 1 ms NCCL all-reduce half under the last kernel,
    then the host gap to the next call."""
    events = []
    for step in range(steps):
        t = step * 30.0
        events += [("MemcpyH2D", t, 1.0), ("fusion_conv", t + 1.0, 17.0), ("ncclDevKernel_AllReduce_Sum_f32", t + 17.5, 1.0)]
    return events


CONTEXT_1 = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=RESNET_BYTES, gradient_tensors=161,
                        per_replica_batch=128)


def test_interval_arithmetic():
    assert merge([(5, 8), (0, 2), (1, 3), (8, 9)]) == [(0, 3), (5, 9)]
    assert overlap([(0, 10), (20, 30)], [(5, 25)]) == 10
    assert gaps([(0, 1), (3, 4), (10, 11)]) == [6, 2]


def test_classify_names_each_kind():
    assert classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "collective"
    assert classify("all-reduce-start.1") == "collective"
    assert classify("MemcpyH2D") == "h2d"
    assert classify("MemcpyDtoH") == "d2h"
    assert classify("Memset") == "d2d"
    assert classify("loop_convolution_fusion") == "compute"


PAGEABLE_H2D = "kind_src:pageable kind_dst:device size:{} dest:0 async:1"
PINNED_H2D = "kind_src:pinned kind_dst:device size:{} dest:0 async:1"
P2P = "kind_src:device kind_dst:device size:{} dest:1 async:1"


def test_classify_reads_each_copy_kind_from_the_trace():
    """CUPTI's copy event names and, for MemcpyOther, the memcpy_details memory kinds; copy kernels keep the
    name rule (the fixture's memcpy32_post / memcpy128 inside CUDA graphs are copies, as before)."""
    assert classify("MemcpyP2P", P2P.format(4096)) == "p2p" and classify("MemcpyP2P") == "p2p"
    assert classify("MemcpyH2D", PAGEABLE_H2D.format(8)) == "h2d" and classify("MemcpyD2D") == "d2d"
    assert classify("MemcpyD2H", "kind_src:device kind_dst:pinned size:8 dest:0 async:1") == "d2h"
    assert classify("MemcpyOther", "kind_src:pinned kind_dst:device size:8 dest:0 async:0") == "h2d"
    assert classify("MemcpyOther", "kind_src:device kind_dst:pageable size:8 dest:0 async:0") == "d2h"
    assert classify("MemcpyOther", "kind_src:device kind_dst:managed size:8 dest:0 async:0") == "d2d"
    assert classify("memcpy32_post") == "d2d" and classify("Memset 3") == "d2d"
    assert parse_memcpy_details(PINNED_H2D.format(5)) == {"kind_src": "pinned", "kind_dst": "device", "size": "5",
                                                           "dest": "0", "async": "1"}


@pytest.mark.parametrize("as_ref", [False, True])
def test_peer_copies_are_all_reduce_time_hidden_or_exposed_not_other_copies(as_ref):
    """A reduce_to_one-style step: peer copies (MemcpyP2P), half of them under compute, and a device copy."""
    events = []
    for step in range(2):
        t = step * 20.0
        events += [("fusion", t, 10.0), ("MemcpyP2P", t + 9.0, 2.0, P2P.format(50_000_000)),
                   ("MemcpyD2D", t + 12.0, 0.5, "kind_src:device kind_dst:device size:100 dest:0 async:1")]
    (activity,) = gpu_activity(xspace({"/device:GPU:0": events}, details_as_ref=as_ref)).values()
    assert activity.copy_bytes["p2p"] == 100_000_000
    b = replica_breakdown(activity, step_ms=20.0, steps=2, calls=2)
    assert b.peer_copy_ms == pytest.approx(2.0) and b.collective_ms == pytest.approx(2.0)
    assert b.hidden_collective_ms == pytest.approx(1.0) and b.exposed_collective_ms == pytest.approx(1.0)
    assert b.other_copies_ms == pytest.approx(0.5)  # the device copy alone
    assert b.compute_ms == pytest.approx(10.0) and b.h2d_pageable_ms == b.h2d_pinned_ms == 0
    report, _ = diagnose_space(xspace({"/device:GPU:0": events}), step_ms=20.0, steps=2, calls=2, context=CONTEXT_1)
    assert "all-reduce peer copies        2.00" in outputs.render_table(report)


def test_host_memory_of_the_input_copy_is_read_from_the_stat():
    """pinned or pageable from memcpy_details whatever the rate; the rate's guess only without the stat."""
    batch = dataclasses.replace(CONTEXT_1, batch_bytes=5_000_000)  # 5 MB in 1 ms: 5 GB/s, below the threshold

    def copy_of(details):
        events = [(name, start, duration, details.format(5_000_000)) if name == "MemcpyH2D" and details else
                  (name, start, duration) for name, start, duration in host_bound_steps()]
        report, _ = diagnose_space(xspace({"/device:GPU:0": events}), step_ms=30.0, steps=4, calls=4, context=batch)
        return report

    pinned = copy_of(PINNED_H2D)
    assert pinned["input_copy"]["host_memory"] == "pinned" and "pinned" in pinned["input_copy"]["note"]
    assert "(from pinned host memory (the trace's memcpy_details))" in outputs.render_table(pinned)
    assert pinned["input_copy"]["host_memory_from"] == "trace" and pinned["mean"]["h2d_pinned_ms"] == pytest.approx(1.0)
    pageable = copy_of(PAGEABLE_H2D)
    assert pageable["input_copy"]["host_memory"] == "pageable" and "memcpy_details" in pageable["input_copy"]["note"]
    assert pageable["mean"]["h2d_pageable_ms"] == pytest.approx(1.0)
    guessed = copy_of(None)
    assert guessed["input_copy"]["host_memory_from"] == "rate" and guessed["input_copy"]["host_memory"] == "pageable"
    # the verdict and the breakdown do not depend on the stat
    for report in (pinned, pageable):
        assert report["verdict"] == guessed["verdict"]
        assert {k: report["mean"][k] for k in ("compute_ms", "idle_ms", "exposed_h2d_ms", "collective_ms")} == {
            k: guessed["mean"][k] for k in ("compute_ms", "idle_ms", "exposed_h2d_ms", "collective_ms")}
    fast_pageable = dataclasses.replace(CONTEXT_1, batch_bytes=50_000_000)  # 50 GB/s, yet pageable by the stat
    events = [(n, a, d, PAGEABLE_H2D.format(50_000_000)) if n == "MemcpyH2D" else (n, a, d)
              for n, a, d in host_bound_steps()]
    report, _ = diagnose_space(xspace({"/device:GPU:0": events}), step_ms=30.0, steps=4, calls=4,
                               context=fast_pageable)
    assert report["input_copy"]["host_memory"] == "pageable"


def test_breakdown_arithmetic_on_a_synthetic_trace():
    space = xspace({"/device:GPU:0": host_bound_steps()})
    (activity,) = gpu_activity(space).values()  # the annotation line is not counted
    b = replica_breakdown(activity, step_ms=30.0, steps=4, calls=4)
    assert b.compute_ms == pytest.approx(17.0)
    assert b.collective_ms == pytest.approx(1.0)
    assert b.hidden_collective_ms == pytest.approx(0.5)  # 17.5..18 under the kernel
    assert b.exposed_collective_ms == pytest.approx(0.5)
    assert b.h2d_ms == pytest.approx(1.0) and b.exposed_h2d_ms == pytest.approx(1.0)
    assert b.busy_ms == pytest.approx(1.0 + 17.0 + 0.5)  # union: copy, kernel, the NCCL tail
    assert b.idle_ms == pytest.approx(30.0 - 18.5)
    assert b.per_call_gap_ms == pytest.approx(30.0 - 18.5)  # the 3 gaps between the 4 calls
    # between calls: from the NCCL tail to the next kernel, 12.5 ms, less the 1 ms copy inside
    assert b.boundary_idle_ms == pytest.approx(11.5)
    assert b.top_kernels[0][0] == "fusion_conv"


def test_host_bound_verdict_advises_steps_per_execution_with_its_gain():
    space = xspace({"/device:GPU:0": host_bound_steps()})
    report, why = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=CONTEXT_1)
    assert why is None
    verdict = report["verdict"]
    assert verdict["kind"] == "host-bound"
    first = verdict["advice"][0]
    # the 11.5 ms gap: the smallest N leaving <= 2% of 30 ms (0.6 ms) is 32 -> 11.5 * (1 - 1/32) saved
    assert first["change"] == "steps_per_execution=32"
    removed = GAP_REMOVED_BY_MULTI_STEP
    assert first["saved_ms"] == pytest.approx(11.5 * (1 - 1 / 32) * removed, rel=1e-3)
    assert first["gain"] == pytest.approx(30.0 / (30.0 - 11.5 * (1 - 1 / 32) * removed) - 1, rel=1e-3)


def test_steps_per_execution_choice_and_calls_per_step():
    space = xspace({"/device:GPU:0": host_bound_steps(steps=8)})
    (activity,) = gpu_activity(space).values()
    # the same 8 steps made in 2 calls of 4: only the longest call gap counts, paid 2/8 per step
    b = replica_breakdown(activity, step_ms=30.0, steps=8, calls=2)
    context = StepContext(replicas=1, steps_per_execution=4, gradient_bytes=RESNET_BYTES, gradient_tensors=161)
    verdict = diagnose(b, context)
    advice = [a for a in verdict.advice if a.change.startswith("steps_per_execution")][0]
    assert advice.saved_ms == pytest.approx((11.5 * (2 / 8) - 11.5 / 32) * GAP_REMOVED_BY_MULTI_STEP, rel=1e-3)


def test_steps_per_execution_advice_on_the_compiled_path_counts_the_whole_gap_and_the_staged_memory():
    """Where the N steps run as one XLA program per replica the idle between calls is paid once per N steps, the
    input copy still runs (from pinned memory when the batch's bytes are known), and N stops where about 4N
    staged batches would take over a quarter of the device's free memory."""
    space = xspace({"/device:GPU:0": host_bound_steps(steps=8)})
    (activity,) = gpu_activity(space).values()
    b = replica_breakdown(activity, step_ms=30.0, steps=8, calls=8)
    compiled = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=RESNET_BYTES, gradient_tensors=161,
                           compiled_execution=True)
    advice = [a for a in diagnose(b, compiled).advice if a.change.startswith("steps_per_execution")][0]
    assert advice.change == "steps_per_execution=32"
    # no GAP_REMOVED_BY_MULTI_STEP; the copy stays as measured (the batch's bytes unknown)
    assert advice.saved_ms == pytest.approx(11.5 * (1 - 1 / 32), rel=1e-3)
    assert "one XLA program per replica" in advice.why
    batch = 19 * 2**20  # ResNet-50's 128 uint8 images: 4 x 8 of them fit in a quarter of 2.5 GiB, 4 x 16 do not
    tight = dataclasses.replace(compiled, batch_bytes=batch, device_free_bytes=int(2.5 * 2**30))
    advice = [a for a in diagnose(b, tight).advice if a.change.startswith("steps_per_execution")][0]
    assert advice.change == "steps_per_execution=8"
    pinned_copy_ms = batch / (PINNED_COPY_GB_PER_S * 1e6)  # 0.5 ms at 40 GB/s, in place of the 1 ms measured
    assert advice.saved_ms == pytest.approx(11.5 * (1 - 1 / 8) + b.exposed_h2d_ms - pinned_copy_ms, rel=1e-3)
    assert "at most 8: about 4N batches of 19.0 MiB are held per device" in advice.why
    none_fit = dataclasses.replace(tight, device_free_bytes=batch)
    assert not [a for a in diagnose(b, none_fit).advice if a.change.startswith("steps_per_execution")]


def test_compiled_path_advice_keeps_the_idle_inside_a_step():
    """On the compiled path the idle between calls is paid once per execution; the idle inside a step stays (the
    same kernels run, the gaps between them too, as the compiled execution's traces show)."""
    events = []
    for step in range(8):  # each 30 ms step: a 1 ms copy, 8 ms of kernels, 3 ms idle, 8 ms more, a 10 ms gap
        t = step * 30.0
        events += [("MemcpyH2D", t, 1.0), ("fusion_a", t + 1.0, 8.0), ("fusion_b", t + 12.0, 8.0)]
    (activity,) = gpu_activity(xspace({"/device:GPU:0": events})).values()
    b = replica_breakdown(activity, step_ms=30.0, steps=8, calls=8)
    assert b.idle_ms == pytest.approx(13.0) and b.per_call_gap_ms == pytest.approx(10.0)
    compiled = StepContext(replicas=1, steps_per_execution=1, gradient_bytes=RESNET_BYTES, gradient_tensors=161,
                           compiled_execution=True)
    advice = [a for a in diagnose(b, compiled).advice if a.change.startswith("steps_per_execution")][0]
    # 30 ms less the 10 ms between calls: 20 ms (the 3 ms inside the step and the copy stay); 10 / N <= 2% of
    # 20 ms needs N >= 25: 32
    assert b.boundary_idle_ms == pytest.approx(10.0)
    assert advice.change == "steps_per_execution=32"
    assert advice.predicted_step_ms == pytest.approx(20.0 + 10.0 / 32)
    assert "the 10.00 ms the GPU waits between calls" in advice.why
    per_step = dataclasses.replace(compiled, compiled_execution=False)
    advice = [a for a in diagnose(b, per_step).advice if a.change.startswith("steps_per_execution")][0]
    assert advice.saved_ms == pytest.approx(10.0 * (1 - 1 / 32) * GAP_REMOVED_BY_MULTI_STEP)


def test_input_bound_verdict_float_and_uint8_input():
    events = [("MemcpyH2D", 0.0, 12.0), ("fusion", 12.0, 18.0)]
    b = replica_breakdown(gpu_activity(xspace({"/device:GPU:0": events}))["/device:GPU:0"], step_ms=30.5,
                          steps=1, calls=1)
    as_float = diagnose(b, StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4, gradient_tensors=1,
                                       float_input=True))
    assert as_float.kind == "input-bound"
    assert "uint8" in as_float.advice[0].change
    assert as_float.advice[0].saved_ms == pytest.approx(9.0)
    as_uint8 = diagnose(b, StepContext(replicas=1, steps_per_execution=1, gradient_bytes=4, gradient_tensors=1))
    assert "prefetch" in as_uint8.advice[0].change
    assert as_uint8.advice[0].saved_ms == pytest.approx(12.0)


def test_link_bound_verdict_advises_bfloat16_from_bytes_and_link():
    events = [("fusion", 0.0, 20.0), ("ncclDevKernel_AllReduce", 20.0, 10.0)]
    link = costmodel.LINKS["pcie-host"]
    context = StepContext(replicas=2, steps_per_execution=1, gradient_bytes=RESNET_BYTES * 4, gradient_tensors=161,
                          link=link, machine_kind="pcie")
    b = replica_breakdown(gpu_activity(xspace({"/device:GPU:0": events}))["/device:GPU:0"], step_ms=30.0,
                          steps=1, calls=1)
    verdict = diagnose(b, context)
    assert verdict.kind == "link-bound"
    bf16 = [a for a in verdict.advice if "bfloat16" in a.change][0]
    full = costmodel.allreduce_ms(RESNET_BYTES * 4, link, 2)
    half = costmodel.allreduce_ms(RESNET_BYTES * 2, link, 2)
    assert bf16.saved_ms == pytest.approx(10.0 * (full - half) / full, rel=1e-4)
    assert any("latency_hiding" in a.change for a in verdict.advice)


def test_compute_bound_verdict_gives_no_gain_it_cannot_predict():
    events = [("fusion", 0.0, 29.0)]
    b = replica_breakdown(gpu_activity(xspace({"/device:GPU:0": events}))["/device:GPU:0"], step_ms=30.0,
                          steps=1, calls=1)
    verdict = diagnose(b, CONTEXT_1)
    assert verdict.kind == "compute-bound"
    assert verdict.fractions["compute-bound"] == pytest.approx(29 / 30)


def test_two_replicas_mean_and_nvlink_answer():
    gpu1 = [(n, s, d * 1.5 if n.startswith("nccl") else d) for n, s, d in host_bound_steps()]
    space = xspace({"/device:GPU:1": gpu1, "/device:GPU:0": host_bound_steps()})
    link = costmodel.LINKS["nvswitch-h200"]
    context = StepContext(replicas=2, steps_per_execution=1, gradient_bytes=RESNET_BYTES, gradient_tensors=161,
                          per_replica_batch=128, link=link, machine_kind="nvswitch")
    report, _ = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=context, nvlink_bytes_per_step=5.1e7)
    assert [r["plane"] for r in report["replicas"]] == ["/device:GPU:0", "/device:GPU:1"]
    assert report["mean"]["collective_ms"] == pytest.approx(1.25)
    nvlink = report["nvlink"]
    extra = costmodel.allreduce_ms(RESNET_BYTES, costmodel.LINKS["pcie-host"], 2) - costmodel.allreduce_ms(
        RESNET_BYTES, link, 2)
    hidden = report["mean"]["hidden_collective_ms"]
    expected_step = 30.0 - report["mean"]["exposed_collective_ms"] + max(1.25 + extra - hidden, 0)
    assert nvlink["step_ms_without_nvlink"] == pytest.approx(expected_step, rel=1e-3)
    assert nvlink["speedup_from_nvlink"] == pytest.approx(expected_step / 30.0, rel=1e-3)
    assert nvlink["allreduce_bytes_per_step_measured"] == 5.1e7
    machines = {row["machine"] for row in report["scaling"]}
    assert {"this machine", "nvswitch-h200", "pcie-gen4", "pcie-host"} <= machines
    assert {row["gpus"] for row in report["scaling"]} == {2, 4, 8}


def test_one_replica_nvlink_answer_predicts_two_gpus():
    b = replica_breakdown(gpu_activity(xspace({"/device:GPU:0": host_bound_steps()}))["/device:GPU:0"],
                          step_ms=30.0, steps=4, calls=4)
    answer = nvlink_answer(b, CONTEXT_1)
    assert answer["answer"].startswith("one replica")
    assert answer["gpus"] == 2 and answer["speedup_from_nvlink"] > 1.0
    rows = scaling(b, CONTEXT_1)
    pcie_8 = [r for r in rows if r["machine"] == "pcie-gen4" and r["gpus"] == 8][0]
    nvswitch_8 = [r for r in rows if r["machine"] == "nvswitch-h200" and r["gpus"] == 8][0]
    assert pcie_8["scaling"] < nvswitch_8["scaling"] <= 1.0
    assert "this machine" not in {r["machine"] for r in rows}


def test_no_gpu_plane_says_why():
    space = xspace({})
    report, why = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=CONTEXT_1)
    assert "no GPU activity" in why and "/host:CPU" in why
    assert report["unavailable"] == why and report["context"]["gradient_bytes"] == RESNET_BYTES


def test_missing_trace_says_which_folder(tmp_path):
    report, why = diagnose_trace(str(tmp_path), step_ms=1.0, steps=1, calls=1, context=CONTEXT_1)
    assert str(tmp_path) in why and "xplane.pb" in why


def test_outputs_table_json_chart(tmp_path):
    space = xspace({"/device:GPU:0": host_bound_steps()})
    report, _ = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=CONTEXT_1)
    report["nvlink_bytes_per_step"] = "unavailable: one replica, nothing is all-reduced over NVLink"
    report["fit_call"] = {"fixed_ms": 12.5, "measured": "from on_train_begin to the first batch"}
    table = outputs.render_table(report)
    assert "verdict: host-bound" in table and "steps_per_execution=32" in table
    assert "GPU idle" in table and "11.50" in table and "unavailable: one replica" in table
    path = outputs.write_json(report, str(tmp_path / "out" / "doctor.json"))
    assert json.loads(Path(path).read_text())["verdict"]["kind"] == "host-bound"
    events = outputs.write_tensorboard(report, str(tmp_path / "tb"), step=3)
    assert list(Path(events).glob("events.out.tfevents.*"))
    assert summaries(events)["step_doctor/verdict"] == "text"
    pytest.importorskip("matplotlib")
    chart = outputs.write_chart(report, str(tmp_path / "doctor.png"))
    assert Path(chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = outputs.write_tensorboard(report, str(tmp_path / "tb2"), step=3, chart=chart)
    written = summaries(events)
    assert written["step_doctor/chart"] == "images" and written["step_doctor/verdict"] == "text"
    assert written["step_doctor/compute_ms"] == "scalars"
    assert "verdict: host-bound" in outputs.render_markdown(report)


def summaries(directory) -> dict:
    """{tag: TensorBoard plugin} of every summary in the event files under `directory` (TensorFlow's reader)."""
    import tensorflow as tf

    found = {}
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                found[value.tag] = value.metadata.plugin_data.plugin_name
    return found


def step_markers(trace_path) -> list:
    """(step_num, is root) of every `train` step marker on the host plane of the trace at `trace_path`."""
    space = load_space(str(trace_path))
    markers = []
    for plane in space.planes:
        names = {key: meta.name for key, meta in plane.event_metadata.items()}
        stats = {key: meta.name for key, meta in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                if names.get(event.metadata_id) == "train":
                    values = {stats.get(s.metadata_id): s.int64_value or s.uint64_value for s in event.stats}
                    markers.append((values.get("step_num"), values.get("_r") == 1))
    return sorted(markers)


def test_the_table_ends_with_the_optimizer_states():
    rows = {"replicas": 4, "replicated": {"optimizer_states": 8 * 10**9},
            "sharded": {"optimizer_states": 2 * 10**9 + 12, "largest_share": 2 * 10**9}}
    assert outputs.optimizer_states_line({"mode": "sharded", "memory": rows}) == (
        "optimizer_states='sharded': 8.00 GB per replica replicated, 2.00 GB sharded over 4 replicas (largest share "
        "2.00 GB)")
    assert outputs.optimizer_states_line({"mode": "replicated", "memory": None}) == "optimizer_states='replicated'"


def test_input_copy_rate_from_the_batch_bytes_and_the_copy_time():
    """The report says the input's bytes per step and the rate the GPU copied them at (GB/s); a rate only
    pageable host memory gives is named as such, unless the copy is too small for its rate to say so."""
    space = xspace({"/device:GPU:0": host_bound_steps()})  # 1 ms of MemcpyH2D per step
    batch = dataclasses.replace(CONTEXT_1, batch_bytes=19_267_584)  # 128 uint8 images of 224x224x3
    report, _ = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=batch)
    copy = report["input_copy"]
    assert copy["bytes_per_step"] == 19_267_584 and copy["ms_per_step"] == pytest.approx(1.0)
    assert copy["gb_per_s"] == pytest.approx(19.27, abs=0.01) and copy["note"] == ""
    assert "input copy: 18.4 MiB per step per replica in 1.00 ms, 19.3 GB/s" in outputs.render_table(report)
    slow = dataclasses.replace(CONTEXT_1, batch_bytes=5_000_000)
    report, _ = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=slow)
    assert report["input_copy"]["gb_per_s"] == pytest.approx(5.0) and "pageable" in report["input_copy"]["note"]
    tokens = dataclasses.replace(CONTEXT_1, batch_bytes=16_384)  # 8 x 512 int32 tokens: 16 KiB in 1 ms
    report, _ = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=tokens)
    assert report["input_copy"]["note"] == "a small copy: its fixed cost, not the host memory, sets the rate"
    unknown, _ = diagnose_space(space, step_ms=30.0, steps=4, calls=4, context=CONTEXT_1)
    assert unknown["input_copy"] is None and "input copy:" not in outputs.render_table(unknown)


def test_bad_arguments_name_the_problem():
    from tf_nvlink.tools.doctor.callback import _positive_int

    with pytest.raises(ValueError, match="window_steps should be a positive integer"):
        _positive_int("window_steps", 0)
    with pytest.raises(ValueError, match="steps and calls must be >= 1"):
        replica_breakdown(next(iter(gpu_activity(xspace({"/device:GPU:0": host_bound_steps()})).values())),
                          step_ms=1.0, steps=0, calls=1)


# The Keras callback in real fits, in one scenario process of 2 logical CPUs: first one replica without a strategy
# (the CPU trace has no GPU plane), then a tf_nvlink strategy over both CPUs with a fake 2x H200 NVML.
_TWO_CPUS_PRELUDE = r"""
import contextlib, io, json, logging, os, tempfile, time
import numpy as np, keras, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import fake_nvml
import tf_nvlink
from tf_nvlink.tools.doctor import callback, diagnosis
"""
CALLBACK_ON_CPU = r"""
out = tempfile.mkdtemp(prefix="tf_nvlink_doctor_")
records = []
class Catch(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
catch = Catch()
logging.getLogger("tf_nvlink").addHandler(catch)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32"); y = x.sum(axis=1, keepdims=True)
doctor = tf_nvlink.StepDoctor(warmup_steps=10, window_steps=4, output_dir=out, global_batch=8)
tensorboard = keras.callbacks.TensorBoard(log_dir=os.path.join(out, "tb"))
history = model.fit(x, y, batch_size=8, epochs=3, verbose=0, callbacks=[doctor, tensorboard])
logging.getLogger("tf_nvlink").removeHandler(catch)
losses = history.history["loss"]
result = {"out": out, "records": records, "unavailable": doctor.unavailable, "report": doctor.report,
          "history_doctor": getattr(history, "step_doctor", None),
          "losses": losses, "files": doctor.files, "overhead_s": doctor.overhead_s,
          "iterations": int(model.optimizer.iterations.numpy())}
"""
DOCTOR_ON_TWO_CPUS = r"""
out = tempfile.mkdtemp(prefix="tf_nvlink_doctor_")
machine = fake_nvml.h200_x2()
real_diagnose = diagnosis.diagnose_trace
def diagnose_the_gpu_trace(profile_dir, **kwargs):  # the CPU trace has no GPU plane: read the 1x H200 one instead
    return real_diagnose(FIXTURE_PROFILE, **kwargs)
callback.diagnose_trace = diagnose_the_gpu_trace
strategy = tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"], optimizer_states="sharded")
with strategy.scope():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
x = np.ones((64, 8), "float32"); y = np.ones((64, 1), "float32")
doctor = tf_nvlink.StepDoctor(warmup_steps=2, window_steps=3, output_dir=out, global_batch=8, gpus=[0, 1],
                              nvml=fake_nvml.FakeNvml(machine))
tensorboard = keras.callbacks.TensorBoard(log_dir=out + "/tb")
traffic = keras.callbacks.LambdaCallback(  # what an all-reduce would move over NVLink every step
    on_train_batch_begin=lambda batch, logs: fake_nvml.transfer(machine, 0, 1, 3 << 20))
printed = io.StringIO()
with contextlib.redirect_stdout(printed):
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[traffic, doctor, tensorboard])
callback.diagnose_trace = real_diagnose
result = {"out": out, "unavailable": doctor.unavailable, "files": doctor.files, "report": doctor.report,
          "stdout": printed.getvalue()}
""".replace("FIXTURE_PROFILE", repr(str(FIXTURE / "profile")))
TWO_CPUS = scenarios.Scenario("doctor: 2 CPUs", _TWO_CPUS_PRELUDE, {
    "callback on cpu": CALLBACK_ON_CPU,
    **({"two replicas": DOCTOR_ON_TWO_CPUS} if (FIXTURE / "observation.json").exists() else {})})


def scenario_result(case, request):
    """The case's result; the folder it wrote goes when the test ends."""
    data = TWO_CPUS.result(case)
    request.config.add_cleanup(lambda: shutil.rmtree(data["out"], ignore_errors=True))  # tests share it
    return data


def test_callback_on_cpu_says_why_in_one_line_and_training_goes_on(request):
    data = scenario_result("callback on cpu", request)
    doctor_lines = [r for r in data["records"] if r.startswith("StepDoctor")]
    assert len(doctor_lines) == 1 and "no GPU activity" in doctor_lines[0], data["records"]
    assert data["iterations"] == 24 and len(data["losses"]) == 3  # all 3 epochs of 8 steps trained
    assert data["losses"][-1] < data["losses"][0]
    assert data["unavailable"] in doctor_lines[0]
    # 8 steps per epoch: the window (steps 10..13) lies inside the second epoch
    assert data["report"]["window"] == {"epoch": 1, "steps": 4, "calls": 4, "step_ms": data["report"]["window"][
        "step_ms"]}
    assert json.loads(Path(data["files"]["json"]).read_text())["unavailable"] == data["unavailable"]
    assert data["history_doctor"] == data["report"]
    assert data["report"]["optimizer_states"] == {"mode": "replicated", "memory": None}  # no tf_nvlink strategy


def test_the_doctor_traces_into_the_tensorboard_run_with_its_steps_marked(request):
    """With a keras.callbacks.TensorBoard in the list, the window's trace is where TensorBoard's profile plugin reads
    it (`<log_dir>/train/plugins/profile/<session>/<host>.xplane.pb`, uncompressed), each traced step is marked as
    tf_keras' profile_batch marks it (a root `train` event with its step_num), and the verdict (here: why there is
    no breakdown) is a text summary under `<log_dir>/step_doctor`."""
    data = scenario_result("callback on cpu", request)
    run = Path(data["out"]) / "tb"
    (trace,) = (run / "train" / "plugins" / "profile").glob("*/*.xplane.pb")
    assert re.fullmatch(r"\d{4}(_\d\d){5}", trace.parent.name), trace  # the profiler's session folder
    assert data["files"]["profile"] == str(run / "train") and not (Path(data["out"]) / "profile").exists()
    assert step_markers(trace) == [(10, True), (11, True), (12, True), (13, True)]  # the window's 4 steps
    written = summaries(run / "step_doctor")
    assert written == {"step_doctor/verdict": "text"}  # no breakdown on CPU: no scalars, no chart
    assert data["report"]["trace"] == str(trace)


# A Python with TensorBoard's profile plugin (xprof): $XPROF_PYTHON (.ci/run installs the plugin from the package
# index into a virtualenv of its own: its dependencies are heavy), else this one when it has xprof.
XPROF_PYTHON = os.environ.get("XPROF_PYTHON") or (sys.executable if importlib.util.find_spec("xprof") else None)


@pytest.mark.skipif(XPROF_PYTHON is None,
                    reason="the profile plugin's converter (pip install tensorboard-plugin-profile, which brings "
                           "xprof) is not installed; set XPROF_PYTHON to a Python that has it")
def test_the_profile_plugins_converter_reads_the_steps(request):
    """TensorBoard's profile plugin (xprof) converts the doctor's trace into its overview page with the 4 steps."""
    data = scenario_result("callback on cpu", request)
    (trace,) = (Path(data["out"]) / "tb" / "train" / "plugins" / "profile").glob("*/*.xplane.pb")
    code = ("import json, sys\n"
            "from xprof.convert import _pywrap_profiler_plugin as plugin\n"
            "data, ok = plugin.xspace_to_tools_data([sys.argv[1]], 'overview_page', {})\n"
            "tables = json.loads(data)\n"
            "steps = [row['c'][0]['v'] for t in tables if any(c['id'] == 'stepnum' for c in t.get('cols', []))\n"
            "         for row in t.get('rows') or []]\n"
            "print(json.dumps({'ok': ok, 'steps': steps}))\n")
    result = subprocess.run([XPROF_PYTHON, "-c", code, str(trace)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    answer = json.loads(result.stdout.strip().splitlines()[-1])
    assert answer == {"ok": True, "steps": ["train 10", "train 11", "train 12", "train 13"]}
    assert data["report"]["nvlink_bytes_per_step"].startswith("unavailable: one replica")
    assert data["overhead_s"] < 30


@pytest.mark.skipif(not (FIXTURE / "observation.json").exists(), reason=f"no GPU trace fixture at {FIXTURE}")
def test_doctor_on_two_replicas_reads_the_counters_and_writes_every_output(request):
    """Two CPU replicas with a fake 2x H200 NVML: the window reads the NVLink counters through NvLinkCounterReader,
    and with a GPU trace (the 1x H200 fixture stands in for the CPU trace) the doctor prints its table and writes
    the JSON, the chart and TensorBoard scalars."""
    data = scenario_result("two replicas", request)
    assert data["unavailable"] is None and data["report"]["verdict"]["kind"] in ("host-bound", "input-bound")
    assert data["report"]["context"]["replicas"] == 2  # this model's float32 input: the copy's advice is uint8
    assert "step doctor (ms/step)" in data["stdout"]  # the table
    # 8-4-1 with SGD's momentum: 164 bytes of weights and of slots, 12 of step counters; sharded, the first
    # kernel's 128 bytes of momentum on one replica, the other variables' 36 on the other
    states = data["report"]["optimizer_states"]
    assert states["mode"] == "sharded"
    assert states["memory"]["replicated"] == {"weights": 164, "gradients": 164, "optimizer_states": 176, "total": 504,
                                              "fits": None}
    assert states["memory"]["sharded"] == {"weights": 164, "gradients": 164, "optimizer_states": 140, "total": 468,
                                           "largest_share": 128, "fits": None}
    assert ("optimizer_states='sharded': 176 B per replica replicated, 140 B sharded over 2 replicas (largest share "
            "128 B)") in data["stdout"].splitlines()
    assert json.loads(Path(data["files"]["json"]).read_text())["optimizer_states"] == states
    assert data["report"]["nvlink_bytes_per_step"] > 0  # the counters moved during the window
    assert set(data["files"]) >= {"json", "tensorboard"}
    assert list(Path(data["files"]["tensorboard"]).glob("events.out.tfevents.*"))
    written = summaries(data["files"]["tensorboard"])
    assert written["step_doctor/verdict"] == "text" and written["step_doctor/compute_ms"] == "scalars"
    if "png" in data["files"]:  # matplotlib installed: the chart as an image summary too
        assert Path(data["files"]["png"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert written["step_doctor/chart"] == "images"


@pytest.mark.skipif(not (FIXTURE / "observation.json").exists(),
                    reason=f"no GPU trace fixture at {FIXTURE} (written on a GPU machine by benchmarks/step_doctor.py "
                           "--models resnet50 --trace_out tests/tools/fixtures)")
def test_gpu_fixture_reads_into_a_verdict():
    observation = json.loads((FIXTURE / "observation.json").read_text())
    context = StepContext(**{k: v for k, v in observation["context"].items() if k != "link"},
                          link=costmodel.LINKS["nvswitch-h200"] if observation["context"]["replicas"] > 1 else None)
    report, why = diagnose_trace(str(FIXTURE / "profile"), step_ms=observation["step_ms"],
                                 steps=observation["steps"], calls=observation["calls"], context=context)
    assert why is None
    assert report["verdict"]["kind"] == observation["verdict"]
    mean = report["mean"]
    assert 0 < mean["compute_ms"] <= mean["busy_ms"] <= mean["step_ms"] + 1e-6
    # What the doctor printed on the GPU machine for this very trace (1x H200, ResNet-50, docs/results.md).
    for key, printed in (("compute_ms", 19.8855), ("idle_ms", 9.6451), ("exposed_h2d_ms", 3.1036),
                         ("per_call_gap_ms", 5.7143)):
        assert mean[key] == pytest.approx(printed, abs=1e-3), key
    assert mean["idle_ms"] == pytest.approx(mean["step_ms"] - mean["busy_ms"], abs=1e-3)
    assert report["verdict"]["advice"][0]["change"] == "steps_per_execution=16"
    # the input's copy: pageable host memory, as the trace's memcpy_details says (per step 128 uint8 images of
    # 224x224x3 and 128 int32 labels)
    (activity,) = gpu_activity(load_space(report["trace"])).values()
    assert activity.h2d_memory["pageable"].bytes == 10 * (19_267_584 + 512) and activity.copy_bytes.get("p2p", 0) == 0
    assert mean["h2d_pageable_ms"] == pytest.approx(3.4294, abs=1e-3) and mean["peer_copy_ms"] == 0
    assert mean["other_copies_ms"] == pytest.approx(0.335, abs=1e-3)


@pytest.mark.slow  # two TensorFlow fits in a subprocess: about 15 s
def test_step_doctor_benchmark_cpu_path_writes_rows_and_a_fixture(tmp_path):
    """benchmarks/step_doctor.py on one CPU device with a tiny model: the doctor says why it has no breakdown,
    the (a) setup is timed over the rounds, no advice is applied, and --trace_out saves the trace."""
    root = Path(__file__).resolve().parents[2]
    result = run_python([str(root / "benchmarks" / "step_doctor.py"), "--models", "convnet", "--devices", "cpu",
                         "--rounds", "2", "--steps", "3", "--warmup_steps", "2", "--doctor_warmup", "2",
                         "--doctor_window", "2", "--notorch", "--json", str(tmp_path / "out.json"),
                         "--trace_out", str(tmp_path / "fixtures"), "--output_dir", str(tmp_path / "doctor")],
                        timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads((tmp_path / "out.json").read_text())
    assert list(record["rows"]) == ["a: tf_nvlink spe=1"]
    assert len(record["rows"]["a: tf_nvlink spe=1"]["fit_s"]) == 2
    assert "no GPU activity" in record["doctor_unavailable"] and "advice" not in record
    assert "no steps_per_execution advice to apply" in result.stdout
    assert 0 <= record["doctor_cost"]["fraction_of_2000_step_epoch"] < 0.5
    fixture = tmp_path / "fixtures" / "step_doctor_convnet"
    observation = json.loads((fixture / "observation.json").read_text())
    assert observation["steps"] == 2 and observation["context"]["replicas"] == 1
    assert list((fixture / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))


@contextlib.contextmanager
def benchmark_module(name):
    """The script benchmarks/<name>.py as a module, its absl flags unregistered afterwards (the scripts define
    flags of the same names, which absl refuses twice in one process)."""
    import importlib.util
    import sys

    from absl import flags

    root = Path(__file__).resolve().parents[2]
    before = set(flags.FLAGS)
    sys.path.insert(0, str(root / "benchmarks"))  # compiled_execution.py imports torch_peer beside it
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_bench", root / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(root / "benchmarks"))
        for flag in set(flags.FLAGS) - before:
            delattr(flags.FLAGS, flag)


def test_advised_steps_per_execution_is_read_from_the_report():
    with benchmark_module("step_doctor") as module:
        report = {"verdict": {"advice": [{"change": "send the input as uint8", "gain": 0.1},
                                         {"change": "steps_per_execution=8", "gain": 0.2}]}}
        assert module.advised_steps_per_execution(report)[0] == 8
        assert module.advised_steps_per_execution({"unavailable": "no GPU"}) == (None, None)


def test_machine_context_reads_the_links_from_nvml():
    import keras

    from tests import fake_nvml
    from tf_nvlink.tools.doctor.callback import machine_context

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=3)
    h200 = machine_context(model, gpus=[0, 1], global_batch=64, nvml=fake_nvml.FakeNvml(fake_nvml.h200_x2()))
    assert h200.link.name.startswith("nvswitch") and h200.machine_kind == "nvswitch"
    assert (h200.replicas, h200.steps_per_execution, h200.per_replica_batch) == (1, 3, 64)
    assert h200.gradient_bytes == 4 * (8 * 4 + 4) and h200.gradient_tensors == 2 and h200.float_input
    one_gpu = machine_context(model, gpus=[0], global_batch=0, nvml=fake_nvml.FakeNvml(fake_nvml.h200_x2()))
    assert one_gpu.machine_kind == "single" and one_gpu.link.name.startswith("nvswitch")  # its machine's links
    pcie = machine_context(model, gpus=[0, 1, 2, 3], global_batch=0, nvml=fake_nvml.FakeNvml(fake_nvml.pcie_x4()))
    assert pcie.machine_kind == "pcie" and pcie.link.name.startswith("pcie")
    assert machine_context(model, gpus=None, global_batch=0).link is None  # no plan, no GPUs named


def test_nvlink_answer_on_a_pcie_machine_says_nvlink_buys_nothing():
    b = replica_breakdown(gpu_activity(xspace({"/device:GPU:0": host_bound_steps()}))["/device:GPU:0"],
                          step_ms=30.0, steps=4, calls=4)
    context = StepContext(replicas=4, steps_per_execution=1, gradient_bytes=RESNET_BYTES, gradient_tensors=161,
                          link=costmodel.LINKS["pcie-gen4"], machine_kind="pcie")
    answer = nvlink_answer(b, context)
    assert "not NVLink" in answer["answer"] and answer["speedup_from_nvlink"] == 1.0


@pytest.mark.slow  # a benchmark candidate and the doctor's fit, each in its own process
def test_examples_benchmark_step_doctor_flag_runs_the_doctor(tmp_path):
    result = run_python(["examples/benchmark.py", "--model", "convnet", "--candidates", "auto", "--steps", "2",
                         "--batch_per_replica", "4", "--cpu_devices", "1", "--step_doctor",
                         "--step_doctor_dir", str(tmp_path)], timeout=400)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "# step doctor: -m tf_nvlink.tools.doctor --model convnet" in result.stdout
    report = json.loads((tmp_path / "step_doctor.json").read_text())
    assert "no GPU activity" in report["unavailable"] and report["context"]["replicas"] == 1


def test_scaling_from_two_replicas_takes_off_their_overhead_and_xla_flag_advice_is_not_repeated():
    events = [("fusion", 0.0, 20.0), ("ncclDevKernel_AllReduce", 20.0, 10.0)]
    b = replica_breakdown(gpu_activity(xspace({"/device:GPU:0": events}))["/device:GPU:0"], step_ms=34.0,
                          steps=1, calls=1)
    link = costmodel.LINKS["nvswitch-h200"]
    context = StepContext(replicas=2, steps_per_execution=1, gradient_bytes=RESNET_BYTES, gradient_tensors=161,
                          per_replica_batch=128, link=link, machine_kind="nvswitch")
    rows = scaling(b, context, replica_overhead_ms=2.0)
    two = [r for r in rows if r["machine"] == "nvswitch-h200" and r["gpus"] == 2][0]
    one_gpu_ms = 34.0 - 10.0 - 2.0  # less the exposed all-reduce and one extra replica's overhead
    assert one_gpu_ms > b.compute_ms  # (never below the kernels' 20 ms)
    expected = costmodel.predict(costmodel.Workload(one_gpu_ms, RESNET_BYTES, 161, 128), link, 2,
                                 replica_overhead_ms=2.0)
    assert two["step_ms"] == pytest.approx(expected.step_ms, abs=1e-3)
    with_flag = dataclasses.replace(context, xla_flags="--xla_gpu_enable_latency_hiding_scheduler=true")
    assert any("latency_hiding" in a.change for a in diagnose(b, context).advice)
    assert not any("latency_hiding" in a.change for a in diagnose(b, with_flag).advice)


@pytest.mark.skipif(not (FIXTURE / "observation.json").exists(), reason=f"no GPU trace fixture at {FIXTURE}")
def test_where_the_gpu_waits_groups_the_fixture_trace_idle():
    """benchmarks/xla_flag_variants.py on the 1x H200 ResNet-50 trace (10 steps in 10 calls, spe=1): the GPU's
    idle splits into what lies between its programs (no XLA module lines in this trace: all of it) and the
    stretches between calls, each named by the events around it."""
    (trace,) = (FIXTURE / "profile").glob("plugins/profile/*/*.xplane.pb.gz")
    with benchmark_module("xla_flag_variants") as variants:
        where = variants.where_the_gpu_waits(str(trace), steps=10)["/device:GPU:0"]
        assert variants.parse_variants("a=--x=1 --y=2;b@spe1=") == [("a", False, "--x=1 --y=2"), ("b", True, "")]
    assert where["idle_between_modules_ms"] == pytest.approx(where["span_ms"] - where["busy_ms"], rel=1e-6)
    assert where["span_ms"] > where["busy_ms"] > 0
    assert sum(count for _, _, count in where["gaps"]) >= 9  # at least the 9 gaps between the 10 calls
    assert len(where["longest_gaps_us"]) == 10 and where["longest_gaps_us"][0] > 1000
    assert any("multi_step_on_iterator" in name for name, _ in where["host_during_longest_gaps"])


def test_compiled_execution_benchmark_checks_the_prediction_against_the_steady_state_too():
    record = {"prediction": {"n": 8, "predicted_gain": 0.25}, "doctor": {"mean": {"step_ms": 46.0}},
              "doctor_compiled": {"mean": {"step_ms": 37.4}}}
    with benchmark_module("compiled_execution") as bench:
        steady_check = bench.steady_check
    steady_check(record, 8)
    assert record["prediction"]["measured_gain_steady"] == pytest.approx(46.0 / 37.4 - 1)
    assert record["prediction"]["relative_error_steady"] == pytest.approx((0.25 - (46.0 / 37.4 - 1)) / (46.0 / 37.4 - 1))
    other_n = {"prediction": {"n": 16, "predicted_gain": 0.25}, **{k: record[k] for k in ("doctor", "doctor_compiled")}}
    steady_check(other_n, 8)  # the compiled execution was profiled at another N: nothing to compare
    assert "measured_gain_steady" not in other_n["prediction"]


@pytest.mark.skipif(not (FIXTURE / "observation.json").exists(), reason=f"no GPU trace fixture at {FIXTURE}")
def test_keep_trace_gzips_the_newest_trace_and_says_when_there_is_none(tmp_path):
    from tf_nvlink.tools.doctor.trace import keep_trace

    kept = keep_trace(str(FIXTURE / "profile"), str(tmp_path / "kept.xplane.pb.gz"))
    assert kept == str(tmp_path / "kept.xplane.pb.gz")
    assert list(gpu_activity(load_space(kept))) == ["/device:GPU:0"]
    assert keep_trace(str(tmp_path / "nothing"), str(tmp_path / "none.xplane.pb.gz")) is None
    assert not (tmp_path / "none.xplane.pb.gz").exists()
