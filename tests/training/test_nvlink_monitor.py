"""NVLink traffic counters (tf_nvlink.machine.nvml.NvLinkCounterReader), their arithmetic (tf_nvlink.training.nvlink_monitor), the report's
sample and the NVLinkMonitor callback in a real CPU-replica fit, all against the fake NVML."""

import json
import sys
import threading
import time
import types

import pynvml
import pytest

import fake_nvml
import scenarios
from conftest import run_python
from fake_nvml import FakeNvml
from tf_nvlink.training import nvlink_sampling

from tf_nvlink.machine import nvlink_traffic
from tf_nvlink.machine import nvml
GIB = 2**30


def _reader(machine, gpus):
    return nvml.NvLinkCounterReader(gpus, FakeNvml(machine)).open()


# ---- reading the counters -----------------------------------------------------------------------------------------

def test_h200_counters_are_read_per_link_in_one_call_per_gpu_and_grow_with_a_peer_copy():
    machine = fake_nvml.h200_x2()
    fake = FakeNvml(machine)
    with nvml.NvLinkCounterReader([0, 1], fake) as reader:
        calls_before = len(fake.calls)
        before = reader.read()
        assert fake.calls[calls_before:] == ["nvmlDeviceGetFieldValues"] * 2  # one batched call per GPU
        fake_nvml.transfer(machine, 0, 1, 10 * GIB)  # the measured 10 GiB GPU0->GPU1 copy
        after = reader.read()
    assert reader.unavailable == {} and reader.readable == (0, 1)
    assert len(before[0].values) == 4 * 18  # 4 fields x 18 active links
    per_link = {v.link: v.kib for v in after[0].values if v.field == "data_tx"}
    old = {v.link: v.kib for v in before[0].values if v.field == "data_tx"}
    assert sorted(per_link[link] - old[link] for link in range(18)) == [582542] * 14 + [582543] * 4
    assert after[0].kib("data_tx") - before[0].kib("data_tx") == 10 * GIB // 1024
    assert after[1].kib("data_rx") - before[1].kib("data_rx") == 10 * GIB // 1024
    assert after[0].kib("data_rx") == before[0].kib("data_rx") and after[1].kib("data_tx") == before[1].kib("data_tx")
    traffic = nvlink_traffic.traffic_delta(before, after)
    assert traffic[0].tx_bytes == 10 * GIB and traffic[0].rx_bytes == 0 and traffic[0].links == 18
    assert traffic[1].rx_bytes == 10 * GIB and traffic[1].source == "data" and traffic[1].resets == 0
    assert fake.init_calls == fake.shutdown_calls == 1


def test_field_values_follow_pynvmls_api():
    """The reader passes (fieldId, scopeId) tuples, as pynvml.nvmlDeviceGetFieldValues unpacks them into
    c_nvmlFieldValue_t, and reads the value member its valueType names."""
    array = (pynvml.c_nvmlFieldValue_t * 2)()
    for entry, request in zip(array, [(138, 3), (141, 17)]):
        (entry.fieldId, entry.scopeId) = request
    assert [(e.fieldId, e.scopeId) for e in array] == [(138, 3), (141, 17)]
    array[0].valueType, array[0].value.ullVal, array[0].nvmlReturn = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 2**63, 0
    fake = types.SimpleNamespace(NVMLError=pynvml.NVMLError, nvmlDeviceGetFieldValues=lambda h, r: array[:1])
    reader = nvml.NvLinkCounterReader([0], fake)
    reader._handles, reader._requests = {0: None}, {0: [(138, 3)]}
    assert reader.read()[0].values == (nvml.CounterValue("data_tx", 3, 2**63, 64),)


def test_fields_are_pynvmls_named_constants_and_links_come_from_nvmls_link_count():
    fake = FakeNvml(fake_nvml.h200_x2())
    asked = []
    original = fake.nvmlDeviceGetNvLinkState
    fake.nvmlDeviceGetNvLinkState = lambda handle, link: asked.append(link) or original(handle, link)
    reader = nvml.NvLinkCounterReader([0], fake).open()
    assert asked == list(range(18))  # NVML_FI_DEV_NVLINK_LINK_COUNT says 18: link 18 is never asked
    assert {field for field, _ in reader._requests[0]} == {
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_TX, pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_RAW_RX}
    assert nvml.nvlink_link_count(fake, 0) == 18 and nvml.nvlink_link_count(FakeNvml(fake_nvml.pcie_x4()), 0) is None
    reader.close()


def test_without_nvmls_link_count_the_links_are_asked_until_invalid_argument():
    machine = fake_nvml.h200_x2()
    for gpu in machine.gpus:
        gpu.link_count_field = False
    fake = FakeNvml(machine)
    reader = nvml.NvLinkCounterReader([0, 1], fake).open()
    assert reader.readable == (0, 1) and fake.calls.count("nvmlDeviceGetNvLinkState") == 2 * 19
    assert len(reader._requests[0]) == 4 * 18
    reader.close()


def test_a_pynvml_without_the_names_falls_back_to_nvml_h_numbers():
    assert nvml.field_ids(types.SimpleNamespace()) == {"data_tx": 138, "data_rx": 139, "raw_tx": 140, "raw_rx": 141}
    assert nvml.field_ids(pynvml) == nvml.TRAFFIC_FIELDS  # the names and the numbers agree


def test_rates_divide_by_nvmls_own_timestamps(monkeypatch):
    """The calls return 5 s apart on our clock, but NVML stamped its samples 2 s apart: 2 GB moved in 2 s."""
    machine = fake_nvml.h200_x2()
    clock, stamps = iter([100.0, 105.0]), iter([1_000_000_000, 1_002_000_000])
    with nvml.NvLinkCounterReader([0], FakeNvml(machine), payload_only=True) as reader:
        monkeypatch.setattr(nvml, "time", types.SimpleNamespace(monotonic=lambda: next(clock)))  # nvml's clock alone
        monkeypatch.setattr(fake_nvml, "nvml_stamp_us", lambda: next(stamps))
        before = reader.read()
        fake_nvml.transfer(machine, 0, 1, 2 * 10**9)
        after = reader.read()
    assert {v.at_us for v in before[0].values} == {1_000_000_000}
    traffic = nvlink_traffic.traffic_delta(before, after)[0]
    assert traffic.seconds == 2.0 and traffic.tx_gbps == pytest.approx(1.0, abs=1e-3)


def test_without_nvml_timestamps_rates_use_the_reads_clock():
    def counters(at_s, kib, at_us):
        return nvml.GpuCounters(0, at_s, (nvml.CounterValue("data_tx", 0, kib, 64, at_us),
                                          nvml.CounterValue("data_rx", 0, 0, 64, at_us)))

    assert nvlink_traffic.gpu_traffic(counters(10.0, 0, 0), counters(14.0, 4, 0)).seconds == 4.0
    # a clock that did not move forward (a stale cached sample) is not trusted either
    assert nvlink_traffic.gpu_traffic(counters(10.0, 0, 7), counters(14.0, 4, 7)).seconds == 4.0
    assert nvlink_traffic.gpu_traffic(counters(10.0, 0, 7), counters(14.0, 4, 500_007)).seconds == 0.5


@pytest.mark.parametrize("machine, gpus, reason", [
    ("pcie_x4", [0, 1], "no NVLink (a PCIe-only GPU"),
    ("no_driver", [0, 1], "no NVIDIA driver / NVML (nvmlInit failed: Driver Not Loaded)"),
    ("h200_x2", [0, 7], None),
])
def test_gpus_without_counters_say_why(machine, gpus, reason):
    reader = _reader(fake_nvml.MACHINES[machine](), gpus)
    if reason is None:  # GPU 7 does not exist; GPU 0 still reads
        assert reader.readable == (0,) and reader.unavailable[7].startswith("NVML has no GPU 7")
    else:
        assert reader.readable == () and all(why.startswith(reason) for why in reader.unavailable.values())
        assert sorted(reader.unavailable) == gpus
    assert reader.read().keys() == set(reader.readable)
    reader.close()


def test_mig_and_unsupported_fields_are_reasons_not_errors():
    machine = fake_nvml.h200_x2()
    machine.gpus[0].mig = 1
    machine.gpus[1].traffic_fields = ()  # an older GPU/driver: every value answers NOT_SUPPORTED
    reader = _reader(machine, [0, 1])
    assert reader.unavailable[0].startswith("MIG mode is on")
    assert reader.unavailable[1].startswith(nvml.NO_THROUGHPUT_FIELDS)
    assert "nvmlDeviceGetNvLinkUtilizationCounter" in reader.unavailable[1]  # old GPUs answer only that one
    assert reader.read() == {}


def test_an_unsupported_field_is_left_out_and_raw_counters_stand_in_for_data():
    machine = fake_nvml.h200_x2()
    machine.gpus[0].traffic_fields = (140, 141)  # RAW only
    with nvml.NvLinkCounterReader([0, 1], FakeNvml(machine)) as reader:
        before = reader.read()
        fake_nvml.transfer(machine, 0, 1, 16 * 1024 * 1024)
        after = reader.read()
    assert {v.field for v in before[0].values} == {"raw_tx", "raw_rx"}
    traffic = nvlink_traffic.traffic_delta(before, after)
    assert traffic[0].source == "raw" and traffic[0].tx_bytes == (16384 + 1024) * 1024  # payload + 1/16 protocol
    assert traffic[1].source == "data" and traffic[1].rx_bytes == 16 * 1024 * 1024


def test_payload_only_reads_half_the_values_and_keeps_raw_where_data_is_missing():
    """NVLinkMonitor asks only for DATA TX/RX (36 values per H200, not 72): each read costs NVML less."""
    machine = fake_nvml.h200_x2()
    machine.gpus[1].traffic_fields = (140, 141)  # RAW only on GPU 1
    with nvml.NvLinkCounterReader([0, 1], FakeNvml(machine), payload_only=True) as reader:
        before = reader.read()
        fake_nvml.transfer(machine, 0, 1, 16 * 1024 * 1024)
        after = reader.read()
    assert len(before[0].values) == 2 * 18 and {v.field for v in before[0].values} == {"data_tx", "data_rx"}
    assert {v.field for v in before[1].values} == {"raw_tx", "raw_rx"}  # its only counters, still read
    traffic = nvlink_traffic.traffic_delta(before, after)
    assert traffic[0].tx_bytes == 16 * 1024 * 1024 and traffic[1].source == "raw"


def test_batch_reads_run_in_a_background_thread_and_a_busy_sampler_skips():
    """every_n_batches reads never block the training thread: `request` returns at once, a request made while one
    is still queued is skipped (counted), and `drain` hands the samples back oldest first."""
    import threading

    machine = fake_nvml.h200_x2()
    release = threading.Event()
    with nvml.NvLinkCounterReader([0, 1], FakeNvml(machine)) as reader:
        start = reader.read()
        real_read = reader.read

        def slow_read():
            release.wait(10)
            return real_read()

        reader.read = slow_read
        sampler = nvlink_sampling.BatchSampler(reader, start)
        sampler.request(0, 2, 2)  # taken by the thread, which now waits in slow_read
        for _ in range(200):
            if sampler._requests.empty():
                break
            threading.Event().wait(0.01)
        sampler.request(0, 4, 4)  # queued
        sampler.request(0, 6, 6)  # the queue is full: skipped
        assert sampler.skipped == 1
        fake_nvml.transfer(machine, 0, 1, 2**20)
        release.set()
        samples = sampler.drain()
        sampler.close()
    assert [(e, b, s) for e, b, s, _ in samples] == [(0, 2, 2), (0, 4, 4)]
    assert samples[0][3][0].tx_bytes == 2**20 and samples[1][3][0].tx_bytes == 0
    assert len(sampler.read_seconds) == 2 and not sampler._thread.is_alive()


def test_a_failed_read_drops_that_gpu_from_the_delta():
    machine = fake_nvml.h200_x2()
    fake = FakeNvml(machine)
    reader = nvml.NvLinkCounterReader([0, 1], fake).open()
    before = reader.read()
    machine.failing_calls["nvmlDeviceGetFieldValues"] = pynvml.NVML_ERROR_GPU_IS_LOST
    after = reader.read()
    reader.close()
    assert after[0].error.startswith("nvmlDeviceGetFieldValues failed: GPU is lost") and after[0].values == ()
    assert nvlink_traffic.traffic_delta(before, after) == {}
    assert fake.init_calls == fake.shutdown_calls == 1


# ---- arithmetic ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("before, after, bits, expected", [
    (100, 250, 64, (150, False)),
    (2**64 - 10, 5, 64, (15, False)),  # wrapped past 2**64 - 1
    (2**32 - 1, 0, 32, (1, False)),  # a 32-bit counter wraps at 2**32
    (5_000_000, 40, 64, (40, True)),  # reset to 0: only what came after is known
    (7, 7, 64, (0, False)),
])
def test_counter_delta(before, after, bits, expected):
    assert nvlink_traffic.counter_delta(before, after, bits) == expected


def test_wrap_around_and_reset_in_real_counter_reads():
    machine = fake_nvml.h200_x2()
    for link in range(18):
        machine.gpus[0].counters_kib[(138, link)] = 2**64 - 100  # 100 KiB before the wrap
        machine.gpus[1].counters_kib[(139, link)] = 9_000_000
    with nvml.NvLinkCounterReader([0, 1], FakeNvml(machine)) as reader:
        before = reader.read()
        fake_nvml.transfer(machine, 0, 1, 18 * 1024 * 1024)  # 1024 KiB on each link
        for link in range(18):  # GPU 1's RX counters were reset (driver reload) and then counted 5 KiB
            machine.gpus[1].counters_kib[(139, link)] = 5
        after = reader.read()
    assert {v.kib for v in after[0].values if v.field == "data_tx"} == {924}  # wrapped
    traffic = nvlink_traffic.traffic_delta(before, after)
    assert traffic[0].tx_bytes == 18 * 1024 * 1024 and traffic[0].resets == 0
    assert traffic[1].rx_bytes == 18 * 5 * 1024 and traffic[1].resets == 18


def test_gpus_outside_the_watched_set_are_ignored():
    machine = fake_nvml.h100_hgx_x8()
    with nvml.NvLinkCounterReader(range(8), FakeNvml(machine)) as reader:
        before = reader.read()
        fake_nvml.ring_allreduce(machine, [0, 1], 1024 * 1024)
        fake_nvml.transfer(machine, 5, 6, 64 * 1024 * 1024)  # another job on GPUs 5 and 6
        after = reader.read()
    traffic = nvlink_traffic.traffic_delta(before, after, gpus=[0, 1])
    assert sorted(traffic) == [0, 1]
    assert nvlink_traffic.per_gpu_bytes(traffic) == 1024 * 1024
    assert nvlink_traffic.traffic_delta(before, after)[5].tx_bytes == 64 * 1024 * 1024


def test_expected_allreduce_bytes_is_the_ring_formula():
    assert nvlink_traffic.expected_allreduce_bytes(1000, 1) == 0
    assert nvlink_traffic.expected_allreduce_bytes(1000, 2) == 1000
    assert nvlink_traffic.expected_allreduce_bytes(1000, 4) == 1500
    assert nvlink_traffic.expected_allreduce_bytes(800, 8) == 1400
    with pytest.raises(ValueError, match="Received: replicas=0"):
        nvlink_traffic.expected_allreduce_bytes(1000, 0)


def test_gradient_bytes_from_shapes_and_dtypes():
    var = types.SimpleNamespace
    variables = [var(shape=(784, 256), dtype="float32"), var(shape=(256,), dtype="float32"),
                 var(shape=(10,), dtype="bfloat16")]
    assert nvlink_traffic.gradient_bytes(variables) == 784 * 256 * 4 + 256 * 4 + 10 * 2
    assert nvlink_traffic.gradient_bytes(variables, "bfloat16") == (784 * 256 + 256 + 10) * 2
    with pytest.raises(ValueError, match="Received: 'complex64'"):
        nvlink_traffic.gradient_bytes([var(shape=(2,), dtype="complex64", path="dense/kernel")])


def test_verdict_speaks_only_when_measured_is_far_from_expected():
    assert nvlink_traffic.verdict(0.9e8, 1e8) is None and nvlink_traffic.verdict(2.5e8, 1e8) is None
    assert nvlink_traffic.verdict(0.21e8, 1e8) is None
    low = nvlink_traffic.verdict(1e6, 1e8)
    assert low.startswith("NVLink carried 1% of the expected all-reduce bytes (1.0 MB vs 100.0 MB per step per GPU)")
    assert "did not use NVLink" in low and "NCCL_P2P_DISABLE=1" in low
    assert "other traffic shares these links" in nvlink_traffic.verdict(5e8, 1e8)
    assert nvlink_traffic.verdict(0, 0) is None  # nothing expected (one replica): nothing to say


# ---- report sample, benchmark snapshot, read cost -------------------------------------------------------------------

def test_sample_traffic_renders_gbps_per_gpu_and_reasons():
    machine = fake_nvml.h100_hgx_x8()
    machine.gpus[3].mig = 1
    sample = nvlink_traffic.sample_traffic(0.5, gpus=[0, 1, 3], nvml=FakeNvml(machine),
                                    sleep=lambda s: fake_nvml.transfer(machine, 0, 1, 10**9))
    assert sample.traffic[0].seconds > 0
    text = nvlink_traffic.render_traffic(sample._replace(traffic={
        g: t._replace(seconds=0.5) for g, t in sample.traffic.items()}))
    lines = text.splitlines()
    assert lines[0] == "NVLink traffic over 0.5 s (NVML throughput counters, GB/s; all processes):"
    assert lines[2].split() == ["0", "2.00", "0.00", "18", "payload"]  # 10**9 bytes (floored to KiB) in 0.5 s
    assert lines[3].split() == ["1", "0.00", "2.00", "18", "payload"]
    assert lines[4].startswith("  3  unavailable because MIG mode is on")
    none = nvlink_traffic.sample_traffic(0.1, nvml=FakeNvml(fake_nvml.no_driver()), sleep=lambda s: None)
    assert nvlink_traffic.render_traffic(none) == ("NVLink traffic: unavailable because no NVIDIA driver / NVML "
                                            "(nvmlInit failed: Driver Not Loaded)")
    with pytest.raises(ValueError, match="Received: seconds=0"):
        nvlink_traffic.sample_traffic(0)


def test_report_command_samples_traffic(capsys, monkeypatch):
    from tf_nvlink.__main__ import main

    monkeypatch.setattr(nvml, "_load_pynvml", lambda: FakeNvml(fake_nvml.h200_x2()))  # same on GPU machines
    assert main(["report", "--nvlink_traffic", "0.01"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "NVLink traffic over 0.01 s (NVML throughput counters, GB/s; all processes):"
    assert [line.split() for line in lines[2:]] == [["0", "0.00", "0.00", "18", "payload"],
                                                    ["1", "0.00", "0.00", "18", "payload"]]
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: FakeNvml(fake_nvml.no_driver()))
    assert main(["report", "--nvlink_traffic", "0.01", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["error"].startswith("no NVIDIA driver / NVML (nvmlInit failed")


def test_report_watch_prints_a_line_per_interval(capsys, monkeypatch):
    """`--nvlink_watch N`: one line per interval with every GPU's TX/RX GB/s; NVML opened once."""
    from tf_nvlink.__main__ import main

    machine = fake_nvml.h200_x2()
    fake = FakeNvml(machine)
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: fake)
    sleeps, clock, real_sleep, test_thread = [], [1000.0], time.sleep, threading.current_thread()

    def sleep(seconds):  # 2 GB from GPU 0 to GPU 1 during each interval, on a clock that advances by `seconds`
        if threading.current_thread() is not test_thread:
            return real_sleep(seconds)  # another thread's wait (tests/scenarios.py polls its processes)
        sleeps.append(seconds)
        clock[0] += seconds
        fake_nvml.transfer(machine, 0, 1, 2 * 10**9)

    monkeypatch.setattr(nvlink_traffic.time, "sleep", sleep)
    monkeypatch.setattr(nvml.time, "monotonic", lambda: clock[0])  # the reads' timestamps
    assert main(["report", "--nvlink_traffic", "2", "--nvlink_watch", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["#", "time", "gpu0", "TX", "gpu0", "RX", "gpu1", "TX", "gpu1", "RX", "(GB/s)"]
    assert len(lines) == 4 and sleeps == [2.0] * 3 and fake.init_calls == 1
    for line in lines[1:]:  # 2 GB in 2 s: 1 GB/s out of GPU 0 and into GPU 1 (whole KiB in the fake)
        assert [float(v) for v in line.split()[1:]] == pytest.approx([1.0, 0.0, 0.0, 1.0], abs=0.01)
    assert main(["report", "--nvlink_traffic", "2", "--nvlink_watch", "1", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["seconds"] == 2.0 and record["gpus"]["1"]["rx_bytes"] == pytest.approx(2 * 10**9, abs=1024)


def test_report_watch_without_an_interval_or_counters_says_why(capsys, monkeypatch):
    from tf_nvlink.__main__ import main

    assert main(["report", "--nvlink_watch", "3"]) == 2
    assert "--nvlink_watch needs --nvlink_traffic SECONDS" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["report", "--nvlink_traffic", "1", "--nvlink_watch", "-1"])
    assert "should be a number of samples, 0 for until Ctrl-C. Received: '-1'" in capsys.readouterr().err
    monkeypatch.setattr(nvml, "_load_pynvml", lambda: FakeNvml(fake_nvml.pcie_x4()))
    assert main(["report", "--nvlink_traffic", "1", "--nvlink_watch", "2"]) == 1
    assert "unavailable because GPU 0: no NVLink" in capsys.readouterr().out


def test_benchmark_snapshot_and_delta():
    machine = fake_nvml.h200_x2()
    fake = FakeNvml(machine)
    before = nvlink_traffic.sample_nvlink_bytes([0, 1], fake)
    fake_nvml.ring_allreduce(machine, [0, 1], 100 * 2**20)
    traffic = nvlink_traffic.traffic_delta(before, nvlink_traffic.sample_nvlink_bytes([0, 1], fake))
    assert nvlink_traffic.per_gpu_bytes(traffic) == nvlink_traffic.expected_allreduce_bytes(100 * 2**20, 2)
    record = json.loads(json.dumps({g: t.to_dict() for g, t in traffic.items()}))
    assert record["0"]["tx_bytes"] == 100 * 2**20 and record["1"]["source"] == "data"
    assert nvlink_traffic.sample_nvlink_bytes([0], FakeNvml(fake_nvml.pcie_x4())) == {}


def test_one_counter_read_costs_little_on_the_fake():
    """The monitor's own cost per read on the fake (72 values per GPU); the GPU figure is measured on hardware."""
    with nvml.NvLinkCounterReader([0, 1], FakeNvml(fake_nvml.h200_x2())) as reader:
        seconds = nvlink_traffic.measure_read_seconds(reader, reads=200)
    print(f"one read of 2 GPUs x 18 links x 4 fields on the fake NVML: {seconds * 1e6:.0f} us", file=sys.stderr)
    assert 0 < seconds < 0.01


# ---- the callback in a real fit on CPU replicas ----------------------------------------------------------------------

_FIT = r"""
import logging, os, tempfile
import tensorflow as tf
cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(cpus[0], [tf.config.LogicalDeviceConfiguration()] * 4)
import keras, numpy as np
import fake_nvml, tf_nvlink
from fake_nvml import FakeNvml
from tf_nvlink.training import nvlink_monitor

from tf_nvlink.machine import nvlink_traffic
lines = []
class Lines(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("tf_nvlink").addHandler(Lines())

strategy = tf.distribute.MirroredStrategy([d.name for d in tf.config.list_logical_devices("CPU")])
with strategy.scope():
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
x = np.random.default_rng(0).normal(size=(256, 20)).astype("float32")
y = (np.arange(256) % 4).astype("int32")
grad_bytes = (20 * 64 + 64 + 64 * 4 + 4) * 4

class Traffic(keras.callbacks.Callback):
    '''What the all-reduce of each step moves: a ring over the 4 watched GPUs, plus another job on GPUs 5-6.'''
    def __init__(self, machine, nvlink=True):
        super().__init__()
        self.machine, self.nvlink = machine, nvlink
    def on_train_batch_end(self, batch, logs=None):
        if self.nvlink and len(self.machine.gpus) >= 4:
            fake_nvml.ring_allreduce(self.machine, [0, 1, 2, 3], grad_bytes)
        if len(self.machine.gpus) > 6:
            fake_nvml.transfer(self.machine, 5, 6, 10 * 2**20)

def fit(machine, gpus=None, nvlink=True, tensorboard=None, epochs=2):
    lines.clear()
    mon = tf_nvlink.NVLinkMonitor(gpus=gpus, nvml=FakeNvml(machine), every_n_batches=2)
    callbacks = [Traffic(machine, nvlink), mon] + ([keras.callbacks.TensorBoard(tensorboard)] if tensorboard else [])
    history = model.fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=callbacks)
    return {"keys": sorted(history.history), "history": {k: v for k, v in history.history.items() if "nvlink" in k},
            "lines": list(lines), "expected": mon.expected_bytes_per_step, "unavailable": mon.unavailable,
            "steps": [e.steps for e in mon.history], "reads": len(mon.read_seconds),
            "background_reads": len(mon.background_read_seconds), "skipped": mon.skipped_reads,
            "batch_gbps": [[e, b, sorted(g)] for e, b, g in mon.batch_gbps], "bench": nvlink_traffic.bench_record(mon),
            "overhead": mon.read_overhead()}

TB = tempfile.mkdtemp(prefix="tf_nvlink_tb_")
"""
# One process (tests/scenarios.py), started in the background when the tests are collected; its cases run in this
# order and train the same model on.
MONITOR = scenarios.Scenario("nvlink_monitor: MirroredStrategy on 4 CPUs", _FIT, {
    "nvlink": """
result = fit(fake_nvml.h100_hgx_x8(), gpus=[0, 1, 2, 3], tensorboard=TB)
result.update(grad_bytes=grad_bytes, tb_files=sorted(os.listdir(os.path.join(TB, "nvlink"))))
""",
    "nop2p": "result = fit(fake_nvml.h100_hgx_x8(), gpus=[0, 1, 2, 3], nvlink=False)",
    "pcie": "result = fit(fake_nvml.pcie_x4(), gpus=[0, 1, 2, 3], epochs=1)",
    "one_gpu": "result = fit(fake_nvml.h200_x2(), gpus=[0], epochs=1)",
    "cpu_strategy": "result = fit(fake_nvml.h200_x2(), epochs=1)",
}, timeout=900)


def test_fit_logs_nvlink_bytes_per_step_equal_to_the_simulated_allreduce():
    run = MONITOR.result("nvlink")
    expected = run["grad_bytes"] * 2 * 3 / 4  # 4 replicas
    assert run["expected"] == expected and run["unavailable"] is None
    assert run["steps"] == [4, 4]  # 256 examples / 64
    assert len(run["history"]["nvlink_bytes_per_step"]) == 2  # in History, so the progress bar showed them
    for measured in run["history"]["nvlink_bytes_per_step"]:
        assert abs(measured - expected) <= 1024  # the fake counts whole KiB per transfer
    assert all(gbps > 0 for gbps in run["history"]["nvlink_gbps"])
    assert run["lines"] == []  # close to expected: nothing to say; GPUs 5-6's traffic was ignored
    assert run["reads"] == 1 + 2  # in the training thread: once at train begin, then once per epoch end
    assert run["background_reads"] == 2 and run["skipped"] == 0  # batch 2 of each epoch (every_n_batches=2)
    assert run["batch_gbps"] == [[0, 2, [0, 1, 2, 3]], [1, 2, [0, 1, 2, 3]]]
    bench = run["bench"]
    assert bench["nvlink_expected_bytes_per_step"] == expected and bench["nvlink_unavailable"] is None
    assert bench["nvlink_bytes_per_step"] == run["history"]["nvlink_bytes_per_step"][1]  # epochs after the first
    assert 0 <= run["overhead"] < 1
    assert any(name.startswith("events.out.tfevents") for name in run["tb_files"])  # beside TensorBoard's logs


def test_fit_without_nvlink_traffic_says_so_once():
    run = MONITOR.result("nop2p")
    assert run["history"]["nvlink_bytes_per_step"] == [0.0, 0.0]
    assert len(run["lines"]) == 1
    assert run["lines"][0].startswith("NVLinkMonitor: NVLink carried 0% of the expected all-reduce bytes")
    assert "did not use NVLink" in run["lines"][0]


@pytest.mark.parametrize("case, reason", [
    ("pcie", "fewer than 2 of GPUs [0, 1, 2, 3] have readable counters (GPU 0: no NVLink (a PCIe-only GPU"),
    ("one_gpu", "one GPU ([0]): a single replica all-reduces nothing over NVLink"),
    ("cpu_strategy", "the strategy runs on ['/job:localhost/replica:0/task:0/device:CPU:0'"),
])
def test_fit_without_usable_counters_says_why_in_one_line_and_adds_no_keys(case, reason):
    run = MONITOR.result(case)
    assert run["history"] == {} and run["keys"] == ["loss"]
    assert len(run["lines"]) == 1
    assert run["lines"][0].startswith("NVLinkMonitor: no NVLink traffic figures: unavailable because " + reason)
    assert run["unavailable"].startswith(reason)
    assert run["bench"] == {"nvlink_bytes_per_step": None, "nvlink_expected_bytes_per_step": None,
                            "nvlink_gbps": None, "nvlink_unavailable": run["unavailable"]}


@pytest.mark.slow  # the example end to end; the fit test above checks the figures
def test_mnist_mlp_monitor_nvlink_flag_shows_the_figures_in_each_epoch_line(tmp_path):
    from test_examples import _with_cpu_replicas

    before_main = """
        import functools, fake_nvml, tf_nvlink
        from tf_nvlink.training import nvlink_monitor
        from tf_nvlink.machine import nvlink_traffic
        machine = fake_nvml.h200_x2()   # no traffic on its counters: the all-reduce ran on CPU replicas
        tf_nvlink.NVLinkMonitor = functools.partial(nvlink_monitor.NVLinkMonitor, gpus=[0, 1],
                                                    nvml=fake_nvml.FakeNvml(machine))
        """
    code = "import sys; sys.path.insert(0, 'tests')\n" + _with_cpu_replicas(
        2, ["--monitor_nvlink", "--epochs", "2", "--steps_per_epoch", "3", "--dataset", "digits", "--model_dir",
            str(tmp_path)], before_main=before_main)
    result = run_python(code, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    epoch_lines = [line for line in result.stdout.splitlines() if "loss:" in line]
    assert len(epoch_lines) == 2 and all("nvlink_bytes_per_step: 0.0000e+00" in line and "nvlink_gbps: 0.0000e+00"
                                         in line for line in epoch_lines), result.stdout
    said = [line for line in (result.stdout + result.stderr).splitlines() if "NVLinkMonitor:" in line]
    assert len(said) == 1 and "NVLink carried 0% of the expected all-reduce bytes" in said[0], said


def test_strategy_gpus_maps_a_stock_strategys_gpus_by_pci_id(monkeypatch):
    """A strategy without a tf_nvlink plan: its GPU devices are mapped to NVML indices by PCI bus id; a device
    NVML does not know, a GPU-less strategy and a machine without NVML each say why."""
    import types

    from tf_nvlink.internals import tf_runtime as internals
    from tf_nvlink.training.nvlink_sampling import strategy_gpus

    descs = [("/device:GPU:0", "device: 0, name: NVIDIA H200, pci bus id: 0000:00:07.0, compute capability: 9.0"),
             ("/device:GPU:1", "device: 1, name: NVIDIA H200, pci bus id: 0000:00:06.0, compute capability: 9.0")]
    monkeypatch.setattr(internals, "tf_gpu_descs", lambda: descs)

    def stock(*devices):
        return types.SimpleNamespace(extended=types.SimpleNamespace(worker_devices=devices))

    fake = FakeNvml(fake_nvml.h200_x2())
    gpus = ("/job:localhost/replica:0/task:0/device:GPU:0", "/job:localhost/replica:0/task:0/device:GPU:1")
    assert strategy_gpus(stock(*gpus), fake) == ((1, 0), None)  # TF's GPU:0 is NVML's GPU 1 (00:07.0)
    assert strategy_gpus(stock(gpus[0], "/device:GPU:7"), fake) == (
        None, "TensorFlow's /device:GPU:7 matches no NVML GPU by PCI bus id")
    indices, why = strategy_gpus(stock("/device:CPU:0"), fake)
    assert indices is None and "no GPU: nothing crosses NVLink" in why
    indices, why = strategy_gpus(stock(*gpus), FakeNvml(fake_nvml.no_driver()))
    assert indices is None and why
