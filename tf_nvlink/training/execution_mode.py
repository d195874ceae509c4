"""The facts of a model or strategy for `tf_nvlink.plan.execution`, the one rule that says which way a step runs.

Example:
    >>> mode = execution_mode(model)
    >>> mode.path, mode.sync, mode.reason
    ('compiled', 'fused', '8 steps per execution as one XLA program per replica (fused: all-reduce inside XLA)')
"""

from __future__ import annotations

from typing import Optional

from tf_nvlink.internals import tf_runtime
from tf_nvlink.plan import execution
from tf_nvlink.plan.execution import COMPILED, PER_STEP, ExecutionMode, StepFacts

__all__ = ["COMPILED", "PER_STEP", "ExecutionMode", "all_reduces_in_program", "execution_mode",
           "fused_allreduce_possible", "per_replica_jit_compile", "step_facts"]


def fused_allreduce_possible(strategy) -> bool:
    """True when every replica is a GPU: there MirroredStrategy all-reduces inside XLA (CollectiveAllReduce compiled
    to an XLA all-reduce over NCCL) and applies updates per replica without merge_call. (True on any device while
    the tests emulate fused mode on CPU replicas.)

    Example:
        >>> fused_allreduce_possible(tf_nvlink.strategy(devices=["/cpu:0", "/cpu:1"]))
        False
    """
    if tf_runtime.fused_mode_emulated():
        return True
    try:
        devices = getattr(strategy.extended, "worker_devices", ())
    except RuntimeError:  # the default strategy: "worker_devices() method unsupported"
        return False
    return bool(devices) and all("GPU" in d.upper() for d in devices)


def per_replica_jit_compile() -> bool:
    """Whether per-replica steps compile with XLA (always, except where the tests emulate fused mode on CPU, whose
    XLA cannot compile collectives)."""
    return not tf_runtime.fused_mode_emulated()


def step_facts(strategy, model=None, steps: Optional[int] = None) -> StepFacts:
    """The `StepFacts` of `model` under `strategy` (a custom loop's step: no model, a jit step, one step)."""
    plan = getattr(strategy, "plan", None)
    return StepFacts(
        replicas=strategy.num_replicas_in_sync, all_gpu=fused_allreduce_possible(strategy),
        workers=tf_runtime.worker_count(strategy), xla_allreduce=getattr(strategy, "xla_allreduce", "split"),
        compiled_execution=None if plan is None else bool(getattr(plan, "compiled_execution", True)),
        jit_compile=True if model is None else bool(model.jit_compile),
        run_eagerly=False if model is None else bool(model.run_eagerly),
        steps_per_execution=(1 if model is None else model.steps_per_execution) if steps is None else steps)


def execution_mode(model, steps: Optional[int] = None) -> ExecutionMode:
    """How `model`'s train/test steps run under its strategy, at its `steps_per_execution` or at `steps` (what the
    step doctor asks before advising one)."""
    return execution.decide_execution(step_facts(model.distribute_strategy, model, steps))


def all_reduces_in_program(strategy) -> bool:
    """Whether a per-replica step's all-reduces run inside each replica's XLA program (fused mode, or one GPU).

    Example:
        >>> all_reduces_in_program(tf_nvlink.strategy())     # 2 GPUs, fused
        True
    """
    return execution.all_reduces_in_program(step_facts(strategy))
