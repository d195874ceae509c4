"""Saying what the first execution of a train or test function waits for: XLA compiling its programs, or the
persistent compile cache (`plan.compile_cache`) handing them back.

A fresh process's first `fit` on a GPU waits tens of seconds before the first step ends, for XLA; nothing else
prints meanwhile. `reported(...)` wraps that first execution: one INFO line when it starts (the model, the
function, the replicas, the path), raised to a WARNING (so that it shows without logging configured) when it
is still running after `LOUD_AFTER_S`; one line when it ends: how long it took, and whether the programs were
compiled (new entries in the cache folder) or read from the cache (no new entry, entries there; then also that
the `Error parsing text-format tensorflow.XlaSerializedCacheEntry` line TensorFlow logs for each entry it reads is
harmless). Another process writing the same cache folder at the same moment adds its entries too: the line says
what the folder shows.

Example (what `compiled_execution` and `step_assembly` do):
    >>> announce = FirstExecution(model, "train", "compiled execution, 8 steps per program")
    >>> with announce.reported():
    ...     outputs = run_the_execution()
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Iterator, Optional

from tf_nvlink.distribute import single_host
from tf_nvlink.plan import compile_cache

log = logging.getLogger("tf_nvlink")
LOUD_AFTER_S = 5.0
# TensorFlow reads an entry with ReadTextOrBinaryProto (xla/tsl/platform/env.cc): as a text proto first, which fails
# on the binary file and logs one ERROR line through protobuf's text_format.cc, then as binary, which loads it. No
# flag, file name or entry format of TensorFlow 2.21 skips the text attempt.
TEXT_FIRST_NOTE = ("; the ERROR line `text_format.cc] Error parsing text-format tensorflow.XlaSerializedCacheEntry` "
                   "TensorFlow logs for each entry it reads is it trying the entry as text before reading it as "
                   "binary: harmless")


class FirstExecution:
    """Reports the first execution of one function (later calls pass through); see the module doc."""

    def __init__(self, model, kind: str, path: str):
        self.model, self.kind, self.path = model, kind, path
        self.done = False

    @contextlib.contextmanager
    def reported(self) -> Iterator[None]:
        if self.done:
            yield
            return
        self.done = True
        state = single_host.current_compile_cache()
        for path, problem, action in compile_cache.recheck(state):
            compile_cache.warn_once(f"compile cache entry {path} cannot be loaded by TensorFlow ({problem}): "
                                    f"{action}")
        folder = state.folder if state is not None and state.active else None
        before = _entry_names(folder)
        replicas = self.model.distribute_strategy.num_replicas_in_sync
        text = (f"tf_nvlink: first {self.kind} execution of model {self.model.name!r} on {replicas} "
                f"replica{'s' if replicas != 1 else ''} ({self.path}): XLA compiles its programs now, or reads "
                f"them from the compile cache ({folder or 'off'}, {_entries_text(len(before))})")
        log.info(text)
        loud = threading.Event()

        def still_running():
            loud.set()
            log.warning("%s; still running after %.0f s", text, LOUD_AFTER_S)

        timer = threading.Timer(LOUD_AFTER_S, still_running)
        timer.daemon = True
        start = time.perf_counter()
        timer.start()
        failed = True
        try:
            yield
            failed = False
        finally:
            timer.cancel()
            seconds = time.perf_counter() - start
            level = logging.WARNING if loud.is_set() or failed else logging.INFO
            if failed:
                log.log(level, "tf_nvlink: first %s execution of model %r failed after %.1f s", self.kind,
                        self.model.name, seconds)
            else:
                after = _entry_names(folder)
                log.log(level, "tf_nvlink: first %s execution of model %r took %.1f s: %s%s", self.kind,
                        self.model.name, seconds, verdict(state, before, after),
                        TEXT_FIRST_NOTE if folder is not None and before and not after - before else "")


def verdict(state: Optional[compile_cache.CacheState], before: set, after: set) -> str:
    """What the cache folder says about the execution that ran between `before` and `after` (its entry names).

    Example:
        >>> verdict(state, set(), {"a.pb", "b.pb"})
        '2 programs compiled and stored in the compile cache'
    """
    if state is None or not state.active:
        return "compiled (compile cache off)"
    new = after - before
    if new:
        return f"{len(new)} program{'s' if len(new) != 1 else ''} compiled and stored in the compile cache"
    if state.read_only:
        return "no new cache entry (the cache folder is read-only: programs compiled here are not kept)"
    if after:
        return f"programs read from the compile cache ({_entries_text(len(after))}), nothing compiled"
    return "no program stored (nothing was compiled with XLA)"


def _entries_text(count: int) -> str:
    return f"{count} entr{'y' if count == 1 else 'ies'}"


def _entry_names(folder: Optional[str]) -> set:
    if folder is None:
        return set()
    return {os.path.basename(entry.path) for entry in compile_cache.entries(folder)}
