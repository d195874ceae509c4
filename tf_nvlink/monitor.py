"""Live NVLink traffic from NVML's counters: does training use NVLink, and how much?

NVML counts, per NVLink link, the KiB each GPU sent (TX) and received (RX) since the driver loaded
(`tf_nvlink.nvml.NvLinkCounterReader`). Two reads give the traffic in between; this module turns them into bytes
and GB/s (wrap-around and resets handled), compares them with what the all-reduce of the gradients should move,
and offers that as a Keras callback, a benchmark helper and a `tf-nvlink report --nvlink_traffic` sample.

    import tf_nvlink
    with tf_nvlink.strategy().scope():
        model = build_model()
        model.compile(...)
    model.fit(data, epochs=5, callbacks=[tf_nvlink.NVLinkMonitor()])
    # Epoch 1/5 ... nvlink_bytes_per_step: 1.0236e+08 - nvlink_gbps: 131.2

The counters belong to the GPU, not to this process: another job's traffic on the same GPUs is counted too.
`import tf_nvlink.monitor` imports neither TensorFlow nor Keras; `NVLinkMonitor` imports Keras when first used.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence

from tf_nvlink.nvml import GpuCounters, NvLinkCounterReader

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
    totals, resets, links = {"tx": 0, "rx": 0}, 0, set()
    for field, link in sorted(common):
        kind, direction = field.split("_")
        if kind != source:
            continue
        delta = counter_delta(old[(field, link)].kib, new[(field, link)].kib, new[(field, link)].bits)
        totals[direction] += delta.kib * KIB
        resets += delta.reset
        links.add(link)
    return GpuTraffic(after.gpu, totals["tx"], totals["rx"], after.read_at_s - before.read_at_s, len(links), source,
                      resets)


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


# ---- the Keras callback ---------------------------------------------------------------------------------------

class EpochTraffic(NamedTuple):
    """What the monitor measured in one epoch."""

    epoch: int
    steps: int
    seconds: float  # between the epoch-begin and epoch-end reads
    traffic: dict  # {gpu: GpuTraffic}
    bytes_per_step: float  # mean over GPUs of (TX + RX) / 2 per step
    gbps: float  # mean over GPUs of (TX + RX) / 2 GB/s
    expected_bytes_per_step: float  # the ring all-reduce of the gradients, per GPU per direction


def _strategy_gpus(strategy: Any, nvml: Any = None) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(NVML indices of the strategy's GPUs, None) or (None, why not)."""
    plan = getattr(strategy, "plan", None)
    if plan is not None and plan.gpus:
        return tuple(plan.gpus), None
    try:
        names = list(strategy.extended.worker_devices)
    except (AttributeError, RuntimeError):  # the default strategy has none
        names = []
    gpu_names = [n for n in names if "GPU" in n.upper().rsplit("/", 1)[-1]]
    if not gpu_names:
        return None, f"the strategy runs on {names or 'the default device'}, no GPU: nothing crosses NVLink"
    from tf_nvlink import devices, nvml as nvml_module  # noqa: PLC0415

    topology = nvml_module.probe(nvml)
    if topology.error:
        return None, topology.error
    by_tf_index = {gpu.tf_index: gpu.nvml_index for gpu in devices.tf_gpus(topology)}
    indices = []
    for name in gpu_names:
        nvml_index = by_tf_index.get(int(name.rsplit(":", 1)[-1]))
        if nvml_index is None:
            return None, f"TensorFlow's {name} matches no NVML GPU by PCI bus id"
        indices.append(nvml_index)
    return tuple(indices), None


def _tensorboard_log_dir(callback: Any) -> Optional[str]:
    """The log_dir of a keras.callbacks.TensorBoard beside `callback` in the CallbackList calling it, or None.

    Keras gives a callback no view of its siblings; the CallbackList whose on_train_begin calls ours has them.
    """
    import keras  # noqa: PLC0415

    frame = sys._getframe(1)
    for _ in range(6):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        siblings = getattr(owner, "callbacks", None)
        if isinstance(siblings, list) and any(c is callback for c in siblings):
            for sibling in siblings:
                if isinstance(sibling, keras.callbacks.TensorBoard):
                    return sibling.log_dir
            return None
        frame = frame.f_back
    return None


def _make_callback_class():
    import keras  # noqa: PLC0415 - Keras only when the callback is used

    class NVLinkMonitor(keras.callbacks.Callback):
        """Measures the NVLink traffic of the strategy's GPUs while `model.fit` runs.

        Each epoch adds `nvlink_gbps` (mean GB/s per GPU and direction) and `nvlink_bytes_per_step` (mean bytes
        per GPU and direction per step) to the epoch logs, so the progress bar and History show them; `history`
        keeps an `EpochTraffic` per epoch. With a keras.callbacks.TensorBoard in the same callback list (or
        `log_dir`), per-GPU TX/RX GB/s go to <log_dir>/nvlink. After the first epoch it compares the bytes per
        step with the ring all-reduce of the gradients (gradient bytes x 2(n-1)/n) and says in one line when
        they are far apart. Without usable counters (no NVML, PCIe-only GPUs, MIG, fields not supported, one GPU,
        CPU replicas) it says why in one line and adds nothing to the logs.

        Args:
            gpus: NVML indices to watch; default: the strategy's GPUs (tf_nvlink's plan, else by PCI bus id).
            every_n_batches: also read every N batches: GB/s over those batches in `batch_gbps` and TensorBoard.
            gradient_dtype: the dtype of the all-reduced gradients (default: each trainable variable's own).
            log_dir: where TensorBoard logs go (default: the TensorBoard callback's log_dir, if any).
            nvml: a pynvml stand-in (tests).

        Example:
            >>> model.fit(data, epochs=3, callbacks=[tf_nvlink.NVLinkMonitor()])
            >>> model.history.history["nvlink_bytes_per_step"]
        """

        def __init__(self, gpus: Optional[Sequence[int]] = None, every_n_batches: Optional[int] = None,
                     gradient_dtype: Optional[str] = None, log_dir: Optional[str] = None, nvml: Any = None):
            super().__init__()
            if every_n_batches is not None and (isinstance(every_n_batches, bool) or int(every_n_batches) < 1):
                raise ValueError(f"every_n_batches should be None or a positive integer. "
                                 f"Received: every_n_batches={every_n_batches!r}")
            self.gpus = tuple(gpus) if gpus is not None else None
            self.every_n_batches = every_n_batches
            self.gradient_dtype = gradient_dtype
            self.log_dir = log_dir
            self.nvml = nvml
            self.history: list[EpochTraffic] = []
            self.unavailable: Optional[str] = None  # why nothing is measured, once known
            self.read_seconds: list[float] = []  # each counter read's own time (the monitor's cost)
            self.batch_gbps: list = []  # every_n_batches: (epoch, batch, {gpu: (TX GB/s, RX GB/s)}) since the last
            self.expected_bytes_per_step = 0.0
            self._reader: Optional[NvLinkCounterReader] = None
            self._writer = None
            self._said_verdict = False

        # -- set-up ------------------------------------------------------------------------------------------
        def on_train_begin(self, logs=None):
            self.history, self.read_seconds, self.batch_gbps, self._said_verdict = [], [], [], False
            self._epoch = self._batches = self._global_batch = 0
            log_dir = self.log_dir or _tensorboard_log_dir(self)
            why = self._start()
            if why:
                self.unavailable = why
                log.warning("NVLinkMonitor: no NVLink traffic figures: unavailable because %s", why)
                return
            self.unavailable = None
            if log_dir:
                import tensorflow as tf  # noqa: PLC0415

                self._writer = tf.summary.create_file_writer(os.path.join(log_dir, "nvlink"))

        def _start(self) -> Optional[str]:
            strategy = self.model.distribute_strategy
            replicas = int(strategy.num_replicas_in_sync)
            gpus = self.gpus
            if gpus is None and replicas < 2:
                return "one replica (no multi-GPU strategy): nothing is all-reduced over NVLink"
            if gpus is None:
                gpus, why = _strategy_gpus(strategy, self.nvml)
                if why:
                    return why
            if len(gpus) < 2:
                return f"one GPU ({list(gpus)}): a single replica all-reduces nothing over NVLink"
            reader = NvLinkCounterReader(gpus, self.nvml).open()
            if reader.error or len(reader.readable) < 2:
                reader.close()
                reasons = "; ".join(f"GPU {g}: {w}" for g, w in sorted(reader.unavailable.items()))
                return reader.error or f"fewer than 2 of GPUs {list(gpus)} have readable counters ({reasons})"
            if reader.unavailable:
                log.warning("NVLinkMonitor: watching GPUs %s only; %s", list(reader.readable),
                            "; ".join(f"GPU {g}: {w}" for g, w in sorted(reader.unavailable.items())))
            self._reader = reader
            self.expected_bytes_per_step = expected_allreduce_bytes(
                gradient_bytes(self.model.trainable_variables, self.gradient_dtype), max(replicas, 1))
            return None

        def _read(self) -> dict:
            started = time.perf_counter()
            counters = self._reader.read()
            self.read_seconds.append(time.perf_counter() - started)
            return counters

        # -- per epoch -----------------------------------------------------------------------------------------
        def on_epoch_begin(self, epoch, logs=None):
            if self._reader is not None:
                self._epoch_start = self._interval_start = self._read()
                self._global_batch += self._batches
                self._epoch, self._batches = epoch, 0

        def on_train_batch_begin(self, batch, logs=None):
            if self._reader is None:
                return
            self._batches = batch + 1
            if self.every_n_batches and batch and batch % self.every_n_batches == 0:
                now = self._read()
                traffic = traffic_delta(self._interval_start, now)
                self.batch_gbps.append((self._epoch, batch, {g: (t.tx_gbps, t.rx_gbps) for g, t in traffic.items()}))
                self._write(traffic, "nvlink_batch", self._global_batch + batch)
                self._interval_start = now

        def on_epoch_end(self, epoch, logs=None):
            if self._reader is None:
                return
            traffic = traffic_delta(self._epoch_start, self._read())
            if not traffic:
                return
            steps = int(self.params.get("steps") or self._batches or 1)
            record = EpochTraffic(epoch, steps, max(t.seconds for t in traffic.values()), traffic,
                                  per_gpu_bytes(traffic) / steps, per_gpu_gbps(traffic),
                                  self.expected_bytes_per_step)
            self.history.append(record)
            if logs is not None:
                logs["nvlink_gbps"] = record.gbps
                logs["nvlink_bytes_per_step"] = record.bytes_per_step
            self._write(traffic, "nvlink", epoch, record)
            line = verdict(record.bytes_per_step, record.expected_bytes_per_step)
            if line and not self._said_verdict:
                self._said_verdict = True
                log.warning("NVLinkMonitor: %s", line)

        def _write(self, traffic: dict, prefix: str, step: int, record: Optional[EpochTraffic] = None):
            if self._writer is None:
                return
            import tensorflow as tf  # noqa: PLC0415

            with self._writer.as_default(step=step):
                for gpu, t in traffic.items():
                    tf.summary.scalar(f"{prefix}/gpu{gpu}_tx_gbps", t.tx_gbps)
                    tf.summary.scalar(f"{prefix}/gpu{gpu}_rx_gbps", t.rx_gbps)
                if record is not None:
                    tf.summary.scalar(f"{prefix}/bytes_per_step", record.bytes_per_step)
                    tf.summary.scalar(f"{prefix}/expected_bytes_per_step", record.expected_bytes_per_step)
            self._writer.flush()

        def on_train_end(self, logs=None):
            if self._reader is not None:
                self._reader.close()
                self._reader = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None

        def read_overhead(self) -> float:
            """Seconds spent reading counters during training, as a fraction of the measured epochs' time."""
            measured = sum(r.seconds for r in self.history)
            return sum(self.read_seconds) / measured if measured > 0 else 0.0

    return NVLinkMonitor


_CALLBACK_CLASS: list = []


def __getattr__(name: str):
    """`NVLinkMonitor` is built on first access, so importing this module does not import Keras."""
    if name == "NVLinkMonitor":
        if not _CALLBACK_CLASS:
            _CALLBACK_CLASS.append(_make_callback_class())
        return _CALLBACK_CLASS[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def add_traffic_argument(parser) -> None:
    """The report's --nvlink_traffic option."""
    parser.add_argument("--nvlink_traffic", type=_positive_seconds, metavar="SECONDS", default=None,
                        help="instead of the report, sample the NVLink traffic of every GPU for SECONDS and print "
                             "GB/s sent and received per GPU (NVML counters: every process's traffic)")


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
