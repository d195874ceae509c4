"""NVLink traffic from NVML's counters, as plain data: deltas (wrap-around and resets handled), bytes and GB/s per
GPU, the bytes a ring all-reduce of the gradients should move, a verdict, and samples for `tf-nvlink report
--nvlink_traffic SECONDS`. No TensorFlow, no Keras; the Keras callback is `tf_nvlink.training.nvlink_monitor.NVLinkMonitor`.

Example:
    >>> before = sample_nvlink_bytes([0, 1]); train(); after = sample_nvlink_bytes([0, 1])
    >>> per_gpu_bytes(traffic_delta(before, after)) / steps       # NVLink bytes per step and GPU
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional

from tf_nvlink.machine.nvml import GpuCounters, NvLinkCounterReader

log = logging.getLogger("tf_nvlink")

KIB = 1024
FAR_BELOW = 0.2  # measured < 20% of the expected all-reduce bytes: the all-reduce did not cross NVLink
FAR_ABOVE = 3.0  # measured > 3x expected: something else shares the links
LOG_KEYS = ("nvlink_gbps", "nvlink_bytes_per_step")


# ---- pure arithmetic ----------------------------------------------------------------------------------------------

class CounterDelta(NamedTuple):
    kib: int  # KiB counted between the two reads (a lower bound after a reset)
    reset: bool  # the counter went down without wrapping (driver reload, GPU reset): traffic before it is lost


def counter_delta(before: int, after: int, bits: int = 64) -> CounterDelta:
    """What a cumulative counter of width `bits` counted between two reads.

    Going down is a wrap-around when the counter was in the top half of its range (it passed 2**bits - 1 and
    started over at 0); otherwise a reset to 0, and only what was counted since (`after`) is known.

    Example:
        >>> counter_delta(100, 250)
        CounterDelta(kib=150, reset=False)
        >>> counter_delta(2**64 - 10, 5)             # wrapped
        CounterDelta(kib=15, reset=False)
        >>> counter_delta(5_000_000, 40)             # reset
        CounterDelta(kib=40, reset=True)
    """
    if after >= before:
        return CounterDelta(after - before, False)
    if before >= 2 ** (bits - 1):
        return CounterDelta(2**bits - before + after, False)
    return CounterDelta(after, True)


class GpuTraffic(NamedTuple):
    """One GPU's NVLink traffic between two reads."""

    gpu: int  # NVML (nvidia-smi) index
    tx_bytes: int  # bytes sent over all its active links
    rx_bytes: int  # bytes received over all its active links
    seconds: float  # time between the two reads
    links: int  # active links counted
    source: str  # "data" (payload: fields 138/139) or "raw" (payload + protocol: 140/141, when data is missing)
    resets: int = 0  # counters that were reset in between (their traffic before the reset is not counted)

    @property
    def tx_gbps(self) -> float:
        return self.tx_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def rx_gbps(self) -> float:
        return self.rx_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_dict(self) -> dict:
        return dict(self._asdict(), tx_gbps=self.tx_gbps, rx_gbps=self.rx_gbps)


def _fields(counters: GpuCounters) -> dict:
    return {(v.field, v.link): v for v in counters.values}


def gpu_traffic(before: GpuCounters, after: GpuCounters) -> Optional[GpuTraffic]:
    """The traffic of one GPU between two reads; None when either read failed or no counter is in both."""
    if before.error or after.error:
        return None
    old, new = _fields(before), _fields(after)
    common = old.keys() & new.keys()
    kinds = {field for field, _ in common}
    source = "data" if {"data_tx", "data_rx"} <= kinds else "raw" if {"raw_tx", "raw_rx"} <= kinds else None
    if source is None:
        return None
    totals, resets, links, intervals = {"tx": 0, "rx": 0}, 0, set(), []
    for field, link in sorted(common):
        kind, direction = field.split("_")
        if kind != source:
            continue
        delta = counter_delta(old[(field, link)].kib, new[(field, link)].kib, new[(field, link)].bits)
        totals[direction] += delta.kib * KIB
        resets += delta.reset
        links.add(link)
        intervals.append((old[(field, link)].at_us, new[(field, link)].at_us))
    return GpuTraffic(after.gpu, totals["tx"], totals["rx"], read_interval_s(before, after, intervals), len(links),
                      source, resets)


def read_interval_s(before: GpuCounters, after: GpuCounters, stamps: Iterable[tuple[int, int]] = ()) -> float:
    """Seconds between two reads: the mean of each value's interval between NVML's own timestamps (microseconds),
    where NVML stamped every value both times and the clock went forward; otherwise the reads' monotonic times.

    Example:
        >>> read_interval_s(b, a, [(1_000_000, 3_000_000), (1_000_010, 3_000_010)])
        2.0
    """
    stamps = list(stamps)
    if stamps and all(old > 0 and new > old for old, new in stamps):
        return sum(new - old for old, new in stamps) / len(stamps) / 1e6
    return after.read_at_s - before.read_at_s


def traffic_delta(before: Mapping[int, GpuCounters], after: Mapping[int, GpuCounters],
                  gpus: Optional[Iterable[int]] = None) -> dict[int, GpuTraffic]:
    """{gpu: GpuTraffic} for the GPUs read both times (only `gpus`, when given: others are ignored).

    Example:
        >>> before = sample_nvlink_bytes([0, 1]); train(); after = sample_nvlink_bytes([0, 1])
        >>> traffic_delta(before, after)[0].tx_bytes
        102236160
    """
    wanted = set(after) if gpus is None else set(gpus)
    result = {}
    for gpu in sorted(wanted & set(before) & set(after)):
        traffic = gpu_traffic(before[gpu], after[gpu])
        if traffic is not None:
            result[gpu] = traffic
    return result


def per_gpu_bytes(traffic: Mapping[int, GpuTraffic]) -> float:
    """Mean over GPUs of (TX + RX) / 2: the bytes one GPU moved per direction."""
    if not traffic:
        return 0.0
    return sum((t.tx_bytes + t.rx_bytes) / 2 for t in traffic.values()) / len(traffic)


def per_gpu_gbps(traffic: Mapping[int, GpuTraffic]) -> float:
    """Mean over GPUs of (TX + RX) / 2 GB/s: comparable with a link's GB/s per direction."""
    if not traffic:
        return 0.0
    return sum((t.tx_gbps + t.rx_gbps) / 2 for t in traffic.values()) / len(traffic)


def expected_allreduce_bytes(gradient_bytes: float, replicas: int) -> float:
    """Bytes each GPU sends (and receives) to all-reduce `gradient_bytes` over `replicas` GPUs with a ring, as
    NCCL does: 2(n-1)/n times the buffer (reduce-scatter, then all-gather). 0 for one replica.

    Example:
        >>> expected_allreduce_bytes(100 * 2**20, 2)        # ResNet-50's ~100 MiB of fp32 gradients on 2 GPUs
        104857600.0
        >>> expected_allreduce_bytes(100 * 2**20, 8) / 2**20
        175.0
    """
    if replicas < 1:
        raise ValueError(f"replicas should be a positive number of GPUs. Received: replicas={replicas!r}")
    return gradient_bytes * 2 * (replicas - 1) / replicas


_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
             "int32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


def gradient_bytes(variables: Iterable[Any], dtype: Optional[str] = None) -> int:
    """Bytes of the gradients of `variables` (their shapes; each variable's own dtype, or `dtype` for all).

    Keras' mixed precision keeps variables (and so their gradients) in float32: the all-reduce moves float32.

    Example:
        >>> gradient_bytes(model.trainable_variables)             # ResNet-50: 102,236,160 (25.6M fp32 values)
    """
    total = 0
    for variable in variables:
        name = str(dtype or getattr(variable.dtype, "name", variable.dtype))
        if name not in _ITEMSIZE:
            raise ValueError(f"gradient dtype should be one of {sorted(_ITEMSIZE)}. Received: {name!r} "
                             f"(variable {getattr(variable, 'path', getattr(variable, 'name', '?'))})")
        count = 1
        for dim in variable.shape:
            count *= int(dim)
        total += count * _ITEMSIZE[name]
    return total


def verdict(measured_bytes: float, expected_bytes: float, far_below: float = FAR_BELOW,
            far_above: float = FAR_ABOVE) -> Optional[str]:
    """One line when NVLink's measured bytes per step are far from the expected all-reduce bytes, else None.

    Example:
        >>> verdict(1e6, 1.02e8)
        'NVLink carried 1% of the expected all-reduce bytes (1.0 MB vs 102.0 MB per step per GPU): ...'
    """
    if expected_bytes <= 0:
        return None
    ratio = measured_bytes / expected_bytes
    amounts = f"({_mb(measured_bytes)} vs {_mb(expected_bytes)} per step per GPU)"
    if ratio < far_below:
        return (f"NVLink carried {ratio:.0%} of the expected all-reduce bytes {amounts}: the all-reduce did not "
                f"use NVLink (NCCL peer-to-peer off, e.g. NCCL_P2P_DISABLE=1, or traffic over PCIe or host "
                f"memory)")
    if ratio > far_above:
        return (f"NVLink carried {ratio:.1f}x the expected all-reduce bytes {amounts}: other traffic shares "
                f"these links (another process on the same GPUs, or model-parallel copies)")
    return None


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.1f} MB"


# ---- reading: snapshots for benchmarks, samples for the report ----------------------------------------------------

def sample_nvlink_bytes(gpus: Optional[Iterable[int]] = None, nvml: Any = None) -> dict[int, GpuCounters]:
    """A snapshot of the NVLink counters of `gpus` (NVML indices; default all): {gpu: GpuCounters}, {} when none
    can be read. Opens and closes NVML (a few ms); for many reads use `nvml.NvLinkCounterReader` directly.

    Example (what the training benchmark records per candidate):
        >>> before = sample_nvlink_bytes(plan.gpus)
        >>> model.fit(data, steps_per_epoch=30, epochs=1)
        >>> traffic = traffic_delta(before, sample_nvlink_bytes(plan.gpus))
        >>> per_gpu_bytes(traffic) / 30                             # NVLink bytes per step per GPU
    """
    with NvLinkCounterReader(gpus, nvml) as reader:
        return reader.read()


def unreadable_reasons(reader: NvLinkCounterReader) -> str:
    """Why some of `reader`'s GPUs give no counters, as "GPU i: why; ..." ("" when every GPU does)."""
    return "; ".join(f"GPU {g}: {why}" for g, why in sorted(reader.unavailable.items()))


class TrafficSample(NamedTuple):
    seconds: float  # the interval asked for
    traffic: dict  # {gpu: GpuTraffic}
    unavailable: dict  # {gpu: why its counters could not be read}
    error: Optional[str] = None  # why no GPU could be read (no NVML)


def sample_traffic(seconds: float = 1.0, gpus: Optional[Iterable[int]] = None, nvml: Any = None,
                   sleep: Callable[[float], None] = time.sleep) -> TrafficSample:
    """NVLink traffic per GPU over `seconds` (what `tf-nvlink report --nvlink_traffic SECONDS` prints).

    Example:
        >>> print(render_traffic(sample_traffic(2.0)))
    """
    if not seconds > 0:
        raise ValueError(f"seconds should be a positive interval. Received: seconds={seconds!r}")
    with NvLinkCounterReader(gpus, nvml) as reader:
        before = reader.read()
        sleep(seconds)
        after = reader.read()
        return TrafficSample(seconds, traffic_delta(before, after), dict(reader.unavailable), reader.error)


def render_traffic(sample: TrafficSample) -> str:
    """A table of GB/s sent and received per GPU, and why the other GPUs have no figure."""
    if sample.error:
        return f"NVLink traffic: unavailable because {sample.error}"
    lines = [f"NVLink traffic over {sample.seconds:g} s (NVML throughput counters, GB/s; all processes):",
             f"{'GPU':>3}  {'TX GB/s':>8}  {'RX GB/s':>8}  {'links':>5}  counts"]
    for gpu, t in sorted(sample.traffic.items()):
        what = "payload" if t.source == "data" else "payload + protocol"
        lines.append(f"{gpu:>3}  {t.tx_gbps:>8.2f}  {t.rx_gbps:>8.2f}  {t.links:>5}  {what}"
                     + (f" ({t.resets} counters reset)" if t.resets else ""))
    for gpu, why in sorted(sample.unavailable.items()):
        lines.append(f"{gpu:>3}  unavailable because {why}")
    if not sample.traffic and not sample.unavailable:
        lines.append("  (no GPU)")
    return "\n".join(lines)


def measure_read_seconds(reader: NvLinkCounterReader, reads: int = 100) -> float:
    """Mean seconds of one `reader.read()` (one nvmlDeviceGetFieldValues call per GPU), over `reads` reads.

    Example:
        >>> with NvLinkCounterReader([0, 1]) as reader:
        ...     print(f"{measure_read_seconds(reader) * 1e6:.0f} us per read")
    """
    started = time.perf_counter()
    for _ in range(reads):
        reader.read()
    return (time.perf_counter() - started) / reads


def bench_record(callback: Any) -> dict:
    """What a benchmark records from an NVLinkMonitor after `fit`: NVLink bytes per step per GPU (median of the
    epochs after the first, which compiles), the expected all-reduce bytes, GB/s, or why there is no figure."""
    epochs = callback.history[1:] or callback.history
    if not epochs:
        return {"nvlink_bytes_per_step": None, "nvlink_expected_bytes_per_step": None, "nvlink_gbps": None,
                "nvlink_unavailable": callback.unavailable or "no epoch measured"}
    middle = sorted(epochs, key=lambda e: e.bytes_per_step)[len(epochs) // 2]
    return {"nvlink_bytes_per_step": middle.bytes_per_step,
            "nvlink_expected_bytes_per_step": middle.expected_bytes_per_step, "nvlink_gbps": middle.gbps,
            "nvlink_unavailable": None}


# ---- `tf-nvlink report --nvlink_traffic SECONDS` ------------------------------------------------------------------

def _positive_seconds(text: str) -> float:
    import argparse  # noqa: PLC0415

    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"should be a positive number of seconds. Received: {text!r}")
    return value


def _watch_count(text: str) -> int:
    import argparse  # noqa: PLC0415

    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"should be a number of samples, 0 for until Ctrl-C. Received: {text!r}")
    return int(text)


def add_traffic_argument(parser) -> None:
    """The report's --nvlink_traffic and --nvlink_watch options."""
    parser.add_argument("--nvlink_traffic", type=_positive_seconds, metavar="SECONDS", default=None,
                        help="instead of the report, sample the NVLink traffic of every GPU for SECONDS and print "
                             "GB/s sent and received per GPU (NVML counters: every process's traffic)")
    parser.add_argument("--nvlink_watch", type=_watch_count, metavar="COUNT", default=None,
                        help="with --nvlink_traffic: print COUNT samples (0: until Ctrl-C), one line per interval "
                             "with each GPU's TX/RX GB/s (--json: one JSON object per line)")


def watch_traffic(seconds: float, count: int = 0, gpus: Optional[Iterable[int]] = None, nvml: Any = None,
                  as_json: bool = False, sleep: Optional[Callable[[float], None]] = None,
                  write: Callable[[str], Any] = print) -> int:
    """`tf-nvlink report --nvlink_traffic S --nvlink_watch N`: a line per interval, as `nvidia-smi dmon` does.

    NVML stays open between samples (one read per interval). Returns 0 once a GPU was measured, 1 when none
    could be (the reason is printed); Ctrl-C ends the watch with 0.

    Example:
        $ tf-nvlink report --nvlink_traffic 1 --nvlink_watch 0
        #     time  gpu0 TX  gpu0 RX  gpu1 TX  gpu1 RX   (GB/s)
        12:00:01     98.1     98.1     98.1     98.1
    """
    import json  # noqa: PLC0415

    sleep = sleep or time.sleep
    with NvLinkCounterReader(gpus, nvml, payload_only=True) as reader:
        if not reader.readable:
            why = reader.error or unreadable_reasons(reader)
            write(json.dumps({"error": why}) if as_json else f"NVLink traffic: unavailable because {why or 'no GPU'}")
            return 1
        if not as_json:
            write("#     time" + "".join(f"  gpu{g} TX  gpu{g} RX" for g in reader.readable) + "   (GB/s)")
        before, taken = reader.read(), 0
        try:
            while count == 0 or taken < count:
                sleep(seconds)
                after = reader.read()
                traffic, before, taken = traffic_delta(before, after), after, taken + 1
                stamp = time.strftime("%H:%M:%S")
                if as_json:
                    write(json.dumps({"time": stamp, "seconds": seconds,
                                      "gpus": {str(g): t.to_dict() for g, t in sorted(traffic.items())}}))
                else:
                    write(f"{stamp:>10}" + "".join(
                        f"{traffic[g].tx_gbps:>9.2f}{traffic[g].rx_gbps:>9.2f}" if g in traffic else f"{'n/a':>18}"
                        for g in reader.readable))
        except KeyboardInterrupt:
            pass
    return 0


def traffic_command_from_args(args) -> int:
    """`tf-nvlink report --nvlink_traffic SECONDS [--nvlink_watch COUNT] [--json]`."""
    if args.nvlink_traffic is None:
        import sys  # noqa: PLC0415

        print("tf-nvlink report: error: --nvlink_watch needs --nvlink_traffic SECONDS, the interval. "
              f"Received: --nvlink_watch {args.nvlink_watch} alone", file=sys.stderr)
        return 2
    if args.nvlink_watch is not None:
        return watch_traffic(args.nvlink_traffic, args.nvlink_watch, as_json=args.json)
    return traffic_command(args.nvlink_traffic, as_json=args.json)


def traffic_command(seconds: float, as_json: bool = False) -> int:
    """Print one NVLink traffic sample; 0 when at least one GPU was measured, else 1 (the reason is printed)."""
    sample = sample_traffic(seconds)
    if as_json:
        import json  # noqa: PLC0415

        print(json.dumps({"seconds": sample.seconds, "error": sample.error,
                          "gpus": {str(g): t.to_dict() for g, t in sorted(sample.traffic.items())},
                          "unavailable": {str(g): why for g, why in sorted(sample.unavailable.items())}}, indent=2))
    else:
        print(render_traffic(sample))
    return 0 if sample.traffic else 1
