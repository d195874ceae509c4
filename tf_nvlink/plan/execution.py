"""Which way a model's train and test steps run under a tf_nvlink strategy, and why: one pure rule for everyone who
asks (the step assembly, the compiled execution, replica sync, custom loops, the step doctor).

Example:
    >>> decide_execution(StepFacts(replicas=2, all_gpu=True, workers=1, xla_allreduce="fused",
    ...                            compiled_execution=True, jit_compile=True, run_eagerly=False,
    ...                            steps_per_execution=8)).path
    'compiled'
"""

from __future__ import annotations

import dataclasses
from typing import Optional

COMPILED = "compiled"
PER_STEP = "per-step"

# Where a step's all-reduces run: inside each replica's XLA program, outside it (XLA per replica, the update
# after it through the strategy's cross-device ops), or in Keras' own function (no XLA per replica).
FUSED, SPLIT, PLAIN = "fused", "split", "plain"


@dataclasses.dataclass(frozen=True)
class StepFacts:
    """What decides a step's execution: the replica set (`all_gpu`: every replica a GPU, where TensorFlow skips
    merge_call under XLA), the plan's `xla_allreduce` and `compiled_execution` (None: not a tf_nvlink strategy)
    and the model's compile arguments."""

    replicas: int
    all_gpu: bool
    workers: int
    xla_allreduce: str
    compiled_execution: Optional[bool]
    jit_compile: bool
    run_eagerly: bool
    steps_per_execution: int


@dataclasses.dataclass(frozen=True)
class ExecutionMode:
    """`path`: COMPILED (N steps as one XLA program per replica) or PER_STEP. `sync`: FUSED, SPLIT or PLAIN (see
    above). `unrolled`: the per-step path takes an execution's batches itself and runs its steps unrolled in one
    function (Keras' multi-step loop cannot hold them). `reason`: why, in a user's words."""

    path: str
    sync: str
    unrolled: bool
    reason: str


def all_reduces_in_program(facts: StepFacts) -> bool:
    """Whether a per-replica step's all-reduces (the gradients', the example count's, synchronized BatchNorm's) run
    inside each replica's XLA program without merge_call: all-GPU replicas and the whole step in XLA (fused mode,
    or one replica, which has nothing to all-reduce)."""
    return facts.all_gpu and (facts.xla_allreduce == FUSED or facts.replicas == 1)


def per_replica_xla(facts: StepFacts) -> bool:
    """Whether each replica compiles its own step: several replicas, or one GPU, where Keras' jit function around
    `strategy.run` fails once the optimizer's step counter is updated in a `tf.cond` (a LossScaleOptimizer,
    gradient accumulation: TensorFlow broadcasts it with a merge_call); only with `jit_compile` and not eagerly."""
    return (facts.replicas > 1 or facts.all_gpu) and facts.jit_compile and not facts.run_eagerly


def synchronized_batch_norm_possible(facts: StepFacts) -> bool:
    """Whether `BatchNormalization(synchronized=True)` can all-reduce its statistics: outside XLA, or inside it on
    all-GPU replicas of one process (XLA's all-reduce cannot span processes; elsewhere it needs a merge_call)."""
    return not per_replica_xla(facts) or facts.all_gpu and facts.workers == 1


def decide_execution(facts: StepFacts) -> ExecutionMode:
    """The path, the all-reduce's place and the reason for a model's train/test steps (see the module doc)."""
    if not per_replica_xla(facts):
        sync = PLAIN
    else:
        sync = FUSED if all_reduces_in_program(facts) else SPLIT
    path, reason = _path(facts)
    unrolled = path == PER_STEP and sync != PLAIN and facts.steps_per_execution > 1 and (
        sync == FUSED or facts.workers > 1)
    return ExecutionMode(path, sync, unrolled, reason)


def _path(facts: StepFacts) -> tuple[str, str]:
    steps = facts.steps_per_execution
    if facts.compiled_execution is None:
        return PER_STEP, "not under a tf_nvlink strategy: Keras' own loop"
    if steps <= 1:
        return PER_STEP, "steps_per_execution=1"
    if not facts.compiled_execution:
        return PER_STEP, "compiled execution turned off: tf_nvlink.strategy(compiled_execution=False)"
    if not facts.jit_compile or facts.run_eagerly:
        return PER_STEP, "the model is not compiled with jit_compile=True (or runs eagerly)"
    if facts.workers > 1:
        return PER_STEP, "several workers: an all-reduce inside XLA cannot span processes"
    if not facts.all_gpu:
        return PER_STEP, ("the replicas are not all GPUs: the all-reduce runs outside XLA (split mode), "
                          "so each step is its own program")
    if facts.replicas > 1 and facts.xla_allreduce != FUSED:
        return PER_STEP, "xla_allreduce='split': the all-reduce runs outside XLA, so each step is its own program"
    where = "one replica" if facts.replicas == 1 else "fused: all-reduce inside XLA"
    return COMPILED, f"{steps} steps per execution as one XLA program per replica ({where})"
