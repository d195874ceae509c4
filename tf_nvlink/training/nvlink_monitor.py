"""Live NVLink traffic from NVML's counters: does training use NVLink, and how much?

NVML counts, per NVLink link, the KiB each GPU sent (TX) and received (RX) since the driver loaded
(`tf_nvlink.machine.nvml.NvLinkCounterReader`). Two reads give the traffic in between; this module turns them into bytes
and GB/s (wrap-around and resets handled), compares them with what the all-reduce of the gradients should move,
and offers that as a Keras callback, a benchmark helper and a `tf-nvlink report --nvlink_traffic` sample.

    import tf_nvlink
    with tf_nvlink.strategy().scope():
        model = build_model()
        model.compile(...)
    model.fit(data, epochs=5, callbacks=[tf_nvlink.NVLinkMonitor()])
    # Epoch 1/5 ... nvlink_bytes_per_step: 1.0236e+08 - nvlink_gbps: 131.2

The counters belong to the GPU, not to this process: another job's traffic on the same GPUs is counted too.
This module imports Keras (and TensorFlow, for its TensorBoard summaries); `tf_nvlink.NVLinkMonitor` imports it on
first use, and the Keras-free measuring parts are in `tf_nvlink.training.nvlink_sampling`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Sequence

import keras

from tf_nvlink.internals import callbacks as callback_seams
from tf_nvlink.machine.nvlink_traffic import (expected_allreduce_bytes, gradient_bytes, per_gpu_bytes, per_gpu_gbps,
                                              traffic_delta, unreadable_reasons, verdict)
from tf_nvlink.machine.nvml import NvLinkCounterReader
from tf_nvlink.training.nvlink_sampling import BatchSampler, EpochTraffic, strategy_gpus

log = logging.getLogger("tf_nvlink")


class NVLinkMonitor(keras.callbacks.Callback):
    """Measures the NVLink traffic of the strategy's GPUs while `model.fit` runs.

    Each epoch adds `nvlink_gbps` (mean GB/s per GPU and direction) and `nvlink_bytes_per_step` (mean bytes
    per GPU and direction per step) to the epoch logs, so the progress bar and History show them; `history`
    keeps an `EpochTraffic` per epoch. The training thread reads the counters once when training begins and
    once per epoch end (each epoch runs from the previous read); `every_n_batches` reads run in a background
    thread, never in the training thread. With a keras.callbacks.TensorBoard in the same callback list (or
    `log_dir`), per-GPU TX/RX GB/s go to <log_dir>/nvlink. After the first epoch it compares the bytes per
    step with the ring all-reduce of the gradients (gradient bytes x 2(n-1)/n) and says in one line when
    they are far apart. Without usable counters (no NVML, PCIe-only GPUs, MIG, fields not supported, one GPU,
    CPU replicas) it says why in one line and adds nothing to the logs.

    Args:
        gpus: NVML indices to watch; default: the strategy's GPUs (tf_nvlink's plan, else by PCI bus id).
        every_n_batches: also read every N batches (in a background thread): GB/s over those batches in
            `batch_gbps` and TensorBoard; a read still pending when the next is due is skipped (`skipped_reads`).
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
        self.read_seconds: list[float] = []  # each read in the training thread (the monitor's cost to training)
        self.background_read_seconds: list[float] = []  # every_n_batches reads, in the background thread
        self.skipped_reads = 0
        self.batch_gbps: list = []  # every_n_batches: (epoch, batch, {gpu: (TX GB/s, RX GB/s)}) since the last
        self.expected_bytes_per_step = 0.0
        self._reader: Optional[NvLinkCounterReader] = None
        self._sampler: Optional[BatchSampler] = None
        self._writer = None
        self._said_verdict = False

    # -- set-up ------------------------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        self.history, self.read_seconds, self.batch_gbps, self._said_verdict = [], [], [], False
        self.background_read_seconds, self.skipped_reads = [], 0
        self._epoch = self._batches = self._global_batch = 0
        log_dir = self.log_dir or callback_seams.tensorboard_log_dir_beside(self)
        why = self._start()
        if why:
            self.unavailable = why
            log.warning("NVLinkMonitor: no NVLink traffic figures: unavailable because %s", why)
            return
        self.unavailable = None
        self._last = self._read()  # the first epoch's start; each epoch-end read starts the next epoch
        if self.every_n_batches:
            self._sampler = BatchSampler(self._reader, self._last)
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
            gpus, why = strategy_gpus(strategy, self.nvml)
            if why:
                return why
        if len(gpus) < 2:
            return f"one GPU ({list(gpus)}): a single replica all-reduces nothing over NVLink"
        reader = NvLinkCounterReader(gpus, self.nvml, payload_only=True).open()
        if reader.error or len(reader.readable) < 2:
            reader.close()
            return reader.error or (f"fewer than 2 of GPUs {list(gpus)} have readable counters "
                                    f"({unreadable_reasons(reader)})")
        if reader.unavailable:
            log.warning("NVLinkMonitor: watching GPUs %s only; %s", list(reader.readable),
                        unreadable_reasons(reader))
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
            self._global_batch += self._batches
            self._epoch, self._batches = epoch, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self._reader is None:
            return
        self._batches = batch + 1
        if self._sampler is not None and batch and batch % self.every_n_batches == 0:
            self._sampler.request(self._epoch, batch, self._global_batch + batch)

    def _collect_batch_samples(self) -> None:
        if self._sampler is None:
            return
        for epoch, batch, step, traffic in self._sampler.drain():
            self.batch_gbps.append((epoch, batch, {g: (t.tx_gbps, t.rx_gbps) for g, t in traffic.items()}))
            self._write(traffic, "nvlink_batch", step)
        self.background_read_seconds = list(self._sampler.read_seconds)
        self.skipped_reads = self._sampler.skipped

    def on_epoch_end(self, epoch, logs=None):
        if self._reader is None:
            return
        self._collect_batch_samples()  # waits for a pending batch read, so the end read comes after it
        end = self._read()
        traffic, self._last = traffic_delta(self._last, end), end
        if self._sampler is not None:
            self._sampler.restart_from(end)
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
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def read_overhead(self) -> float:
        """Seconds the training thread spent reading counters, as a fraction of the measured epochs' time."""
        measured = sum(r.seconds for r in self.history)
        return sum(self.read_seconds) / measured if measured > 0 else 0.0

