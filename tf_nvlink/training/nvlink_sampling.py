"""The NVLink monitor's measuring parts, free of Keras: which GPUs a strategy trains on, one epoch's figures,
and the background sampler of per-batch reads (`tf_nvlink.training.nvlink_monitor.NVLinkMonitor` uses them).

Example:
    >>> from tf_nvlink.training.nvlink_sampling import BatchSampler
    >>> sampler = BatchSampler(reader, start=reader.read())
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, NamedTuple, Optional

from tf_nvlink.machine import nvml as nvml_module
from tf_nvlink.machine import tf_devices
from tf_nvlink.machine.nvlink_traffic import traffic_delta
from tf_nvlink.machine.nvml import NvLinkCounterReader

log = logging.getLogger("tf_nvlink")


def _tf_runtime():
    from tf_nvlink.internals import tf_runtime  # noqa: PLC0415 - imports TensorFlow: only once the callback runs

    return tf_runtime


class EpochTraffic(NamedTuple):
    """What the monitor measured in one epoch."""

    epoch: int
    steps: int
    seconds: float  # from the previous read (training begin, or the last epoch's end) to this epoch's end
    traffic: dict  # {gpu: GpuTraffic}
    bytes_per_step: float  # mean over GPUs of (TX + RX) / 2 per step
    gbps: float  # mean over GPUs of (TX + RX) / 2 GB/s
    expected_bytes_per_step: float  # the ring all-reduce of the gradients, per GPU per direction


def strategy_gpus(strategy: Any, nvml: Any = None) -> tuple[Optional[tuple[int, ...]], Optional[str]]:
    """(NVML indices of the strategy's GPUs, None) or (None, why not).

    Example:
        >>> strategy_gpus(tf_nvlink.strategy())
        ((0, 1), None)
    """
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

    topology = nvml_module.probe(nvml)
    if topology.error:
        return None, topology.error
    mapped = tf_devices.map_tf_gpus(topology, _tf_runtime().tf_gpu_descs())
    by_tf_index = {gpu.tf_index: gpu.nvml_index for gpu in mapped}
    indices = []
    for name in gpu_names:
        nvml_index = by_tf_index.get(int(name.rsplit(":", 1)[-1]))
        if nvml_index is None:
            return None, f"TensorFlow's {name} matches no NVML GPU by PCI bus id"
        indices.append(nvml_index)
    return tuple(indices), None


class BatchSampler:
    """Reads the counters in a background thread when asked, so the training thread never waits on NVML (a read
    of 2 H200s x 18 links takes tens of ms). A request made while one is still queued is skipped and counted.

    Example:
        >>> sampler = BatchSampler(reader, start=reader.read())
        >>> sampler.request(epoch=0, batch=10, step=10)      # returns at once
        >>> sampler.drain()                                   # [(0, 10, 10, {gpu: GpuTraffic})] once read
    """

    def __init__(self, reader: NvLinkCounterReader, start: dict):
        self._reader, self._last = reader, start
        self._requests: queue.Queue = queue.Queue(maxsize=1)
        self._lock = threading.Lock()
        self._done: list = []
        self.skipped = 0
        self.read_seconds: list[float] = []
        self._thread = threading.Thread(target=self._loop, name="tf_nvlink-NVLinkMonitor", daemon=True)
        self._thread.start()

    def request(self, epoch: int, batch: int, step: int) -> None:
        try:
            self._requests.put_nowait((epoch, batch, step))
        except queue.Full:
            self.skipped += 1

    def _loop(self) -> None:
        while True:
            item = self._requests.get()
            try:
                if item is None:
                    return
                started = time.perf_counter()
                now = self._reader.read()
                with self._lock:
                    self.read_seconds.append(time.perf_counter() - started)
                    self._done.append((*item, traffic_delta(self._last, now)))
                    self._last = now
            except Exception as exc:  # noqa: BLE001 - a failed sample must not stop training; said once
                log.warning("NVLinkMonitor: a per-batch counter read failed: %s", exc)
            finally:
                self._requests.task_done()

    def drain(self) -> list:
        """Waits for a pending read; returns the samples taken since the last drain, oldest first."""
        self._requests.join()
        with self._lock:
            done, self._done = self._done, []
        return done

    def restart_from(self, counters: dict) -> None:
        """The next sample counts from `counters` (the epoch-end read), not from the last sample."""
        with self._lock:
            self._last = counters

    def close(self) -> None:
        self._requests.join()
        self._requests.put(None)
        self._thread.join(timeout=10)
