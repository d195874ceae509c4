"""What every tf_nvlink strategy shares (single-host and multi-worker): its plan, the one check that a strategy is
a tf_nvlink one, and the seam through which the training hooks take over `strategy.run`.

Example:
    >>> from tf_nvlink.distribute import base
    >>> base.is_tf_nvlink_strategy(tf_nvlink.strategy())
    True
    >>> base.is_tf_nvlink_strategy(tf.distribute.MirroredStrategy())
    False
"""

from __future__ import annotations

from typing import Callable, Optional

import tensorflow as tf


class TfNvlinkStrategyMixin:
    """Put before a tf.distribute strategy class: the strategy then carries a plan (`attach_plan`) and runs
    `strategy.run` through the runner the training hooks attach (`attach_runner`), or the strategy's own."""

    _tf_nvlink_plan = None
    _tf_nvlink_runner: Optional[Callable] = None
    _tf_nvlink_optimizer_states = "replicated"
    _tf_nvlink_fused_attention = "auto"

    @property
    def plan(self):
        """The plan this strategy was built from (`policy.Plan`, or `MultiWorkerPlan`); None until attached."""
        return self._tf_nvlink_plan

    @property
    def optimizer_states(self) -> str:
        """"replicated" (every replica holds every optimizer state) or "sharded" (each holds its share;
        `tf_nvlink.training.sharded_states` says how)."""
        return self._tf_nvlink_optimizer_states

    @property
    def fused_attention(self) -> str:
        """"auto", the default (Keras' attention runs as cuDNN's fused attention where it applies;
        `tf_nvlink.training.fused_attention` says where), or "off"."""
        return self._tf_nvlink_fused_attention

    @property
    def xla_allreduce(self) -> str:
        """"fused" or "split": how jit_compile=True models all-reduce (tf_nvlink.training.install says how)."""
        return self._tf_nvlink_plan.xla_allreduce if self._tf_nvlink_plan is not None else "split"

    @tf.autograph.experimental.do_not_convert  # plain Python; AutoGraph would garble the runner's errors
    def run(self, fn, args=(), kwargs=None, options=None):
        runner = self._tf_nvlink_runner
        if runner is None:
            return super().run(fn, args=args, kwargs=kwargs, options=options)
        return runner(super().run, fn, args, kwargs, options)


def is_tf_nvlink_strategy(strategy) -> bool:
    """True for a strategy tf_nvlink built (with or without its plan attached yet), False for anything else.

    Example:
        >>> is_tf_nvlink_strategy(model.distribute_strategy)
    """
    return isinstance(strategy, TfNvlinkStrategyMixin)


def _checked(strategy, what: str):
    if not is_tf_nvlink_strategy(strategy):
        raise TypeError(f"{what} needs a tf_nvlink strategy (tf_nvlink.strategy() builds one). "
                        f"Received: {type(strategy).__name__}")
    return strategy


def attach_plan(strategy, plan) -> None:
    """Record the plan a tf_nvlink strategy was built from (its builder does this once).

    Example:
        >>> attach_plan(built, plan); built.plan is plan
        True
    """
    _checked(strategy, "attach_plan")._tf_nvlink_plan = plan


def attach_optimizer_states(strategy, optimizer_states: str) -> None:
    """Record how a tf_nvlink strategy keeps its optimizers' states ("replicated" or "sharded"; its builder does this).

    Example:
        >>> attach_optimizer_states(built, "sharded"); built.optimizer_states
        'sharded'
    """
    _checked(strategy, "attach_optimizer_states")._tf_nvlink_optimizer_states = optimizer_states


def attach_fused_attention(strategy, fused_attention: str) -> None:
    """Record whether a tf_nvlink strategy runs Keras' attention as cuDNN's fused attention where it applies
    ("auto") or keeps Keras' own ("off"); its builder does this, and the setting is read when a step is traced.

    Example:
        >>> attach_fused_attention(built, "off"); fused_attention_of(built)
        'off'
    """
    _checked(strategy, "attach_fused_attention")._tf_nvlink_fused_attention = fused_attention


def fused_attention_of(strategy) -> str:
    """"auto" or "off" for a tf_nvlink strategy (`attach_fused_attention`); "off" for any other.

    Example:
        >>> fused_attention_of(tf.distribute.get_strategy())
        'off'
    """
    return strategy.fused_attention if is_tf_nvlink_strategy(strategy) else "off"


def shards_optimizer_states(strategy) -> bool:
    """Whether `strategy` is a tf_nvlink strategy asked for sharded optimizer states with 2+ local replicas (one
    replica: the replicated path, at no cost).

    Example:
        >>> shards_optimizer_states(tf.distribute.get_strategy())
        False
    """
    return (is_tf_nvlink_strategy(strategy) and strategy.optimizer_states == "sharded"
            and len(strategy.extended.worker_devices) > 1)


def plan_of(strategy):
    """The plan of a tf_nvlink strategy, or None (not a tf_nvlink strategy, or no plan attached yet).

    Example:
        >>> plan_of(optimizer_strategy) is None    # stock MirroredStrategy
        True
    """
    return strategy.plan if is_tf_nvlink_strategy(strategy) else None


def attach_runner(strategy, runner: Callable) -> None:
    """Make `strategy.run(fn, args, kwargs, options)` call `runner(strategy_run, fn, args, kwargs, options)`,
    where `strategy_run` is TensorFlow's own `run` (tf_nvlink.training.install attaches its per-replica runner).

    Example:
        >>> attach_runner(built, lambda run, fn, args, kwargs, options: run(fn, args=args, kwargs=kwargs))
    """
    _checked(strategy, "attach_runner")._tf_nvlink_runner = runner


def runner_of(strategy) -> Optional[Callable]:
    """The runner `attach_runner` gave a tf_nvlink strategy, or None."""
    return _checked(strategy, "runner_of")._tf_nvlink_runner
