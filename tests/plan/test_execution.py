"""The one rule for how a step runs (tf_nvlink.plan.execution): facts in, path, all-reduce place and reason out."""

import dataclasses

import pytest

from tf_nvlink.plan.execution import (COMPILED, FUSED, PER_STEP, PLAIN, SPLIT, StepFacts, decide_execution,
                                      synchronized_batch_norm_possible)

TWO_GPUS = StepFacts(replicas=2, all_gpu=True, workers=1, xla_allreduce="fused", compiled_execution=True,
                     jit_compile=True, run_eagerly=False, steps_per_execution=8)


@pytest.mark.parametrize("change, path, sync, unrolled, reason", [
    ({}, COMPILED, FUSED, False, "8 steps per execution as one XLA program per replica (fused: all-reduce inside XLA)"),
    (dict(replicas=1, xla_allreduce="split"), COMPILED, FUSED, False,
     "8 steps per execution as one XLA program per replica (one replica)"),
    (dict(steps_per_execution=1), PER_STEP, FUSED, False, "steps_per_execution=1"),
    (dict(compiled_execution=False), PER_STEP, FUSED, True,
     "compiled execution turned off: tf_nvlink.strategy(compiled_execution=False)"),
    (dict(compiled_execution=None), PER_STEP, FUSED, True, "not under a tf_nvlink strategy: Keras' own loop"),
    (dict(jit_compile=False), PER_STEP, PLAIN, False,
     "the model is not compiled with jit_compile=True (or runs eagerly)"),
    (dict(run_eagerly=True), PER_STEP, PLAIN, False,
     "the model is not compiled with jit_compile=True (or runs eagerly)"),
    (dict(workers=2), PER_STEP, FUSED, True, "several workers: an all-reduce inside XLA cannot span processes"),
    (dict(workers=2, all_gpu=False, xla_allreduce="split"), PER_STEP, SPLIT, True,
     "several workers: an all-reduce inside XLA cannot span processes"),
    (dict(xla_allreduce="split"), PER_STEP, SPLIT, False,
     "xla_allreduce='split': the all-reduce runs outside XLA, so each step is its own program"),
    (dict(all_gpu=False, xla_allreduce="split"), PER_STEP, SPLIT, False,
     "the replicas are not all GPUs: the all-reduce runs outside XLA (split mode), so each step is its own program"),
    (dict(replicas=1, all_gpu=False, xla_allreduce="split"), PER_STEP, PLAIN, False,
     "the replicas are not all GPUs: the all-reduce runs outside XLA (split mode), so each step is its own program"),
])
def test_each_setup_gets_its_path_place_and_reason(change, path, sync, unrolled, reason):
    mode = decide_execution(dataclasses.replace(TWO_GPUS, **change))
    assert (mode.path, mode.sync, mode.unrolled, mode.reason) == (path, sync, unrolled, reason)


@pytest.mark.parametrize("change, possible", [
    ({}, True), (dict(workers=2), False), (dict(all_gpu=False, xla_allreduce="split"), False),
    (dict(all_gpu=False, jit_compile=False), True),
])
def test_synchronized_batch_norm_needs_its_all_reduce_inside_one_process_xla_or_no_xla(change, possible):
    assert synchronized_batch_norm_possible(dataclasses.replace(TWO_GPUS, **change)) is possible
