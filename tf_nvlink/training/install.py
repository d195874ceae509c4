"""XLA on every replica: `model.fit(jit_compile=True)` under a tf_nvlink strategy.

Why this exists: Keras 3 puts `jit_compile` on the function that wraps `strategy.run(...)`, so one XLA cluster
spans all replicas and TensorFlow fails with "Trying to access resource .../replica_1 located in device GPU:1
from device GPU:0" (and for `jit_compile="auto"` Keras simply turns XLA off under any strategy, which costs 4.6x
on ResNet-50). The fix has two parts:

1. `step_assembly.PerReplicaRunner` (attached to the strategy's `run`) gives each replica its own compiled copy (`PerReplicaCustomStep`) of any
   `jit_compile=True` tf.function passed to `strategy.run`: Keras' predict step, and custom training loops in
   the shape of TensorFlow's guide (a jit step calling `optimizer.apply_gradients`, passed to `strategy.run`
   inside a plain tf.function or eagerly), fused or split like fit below. A `tf.function(jit_compile=True)`
   around `strategy.run` itself cannot work (one XLA program would span the replicas): it raises a ValueError
   naming the supported shape.
2. A hook on Keras' `TensorFlowTrainer._make_function` (train and test steps) keeps XLA off the function that
   spans the replicas and instead runs `train_step`/`test_step` through `PerReplicaXlaStep`, one compiled
   function per replica, in one of two ways (`Plan.xla_allreduce`):
   - "fused" (GPUs only): the whole train step, optimizer and gradient all-reduce included, is one XLA
     computation per replica. On all-GPU MirroredStrategies TensorFlow skips `merge_call` under XLA and
     compiles the all-reduce (CollectiveAllReduce) into the program, where XLA can combine and overlap it.
   - "split" (any device, CPUs included): forward pass, loss, metrics and gradients are compiled; the optimizer
     step stays outside XLA, because there it all-reduces the gradients through the plan's cross-device ops (a
     `merge_call`, which XLA cannot hold): the gradients are caught at `optimizer.apply` inside the compiled
     function, returned from it, and applied right after.

The hook is installed once, on the first tf_nvlink strategy, and touches only models whose strategy is a
tf_nvlink one; every other model runs Keras' code unchanged. The Keras internals relied on are checked by
`internals.trainer.check_keras_support()` (and pinned by tests/internals/); on a Keras without them, a jit-compiled fit under
a multi-replica tf_nvlink strategy raises `UnsupportedKerasError` instead of failing deep inside TensorFlow.

Split mode cannot hold anything else that merges across replicas inside the step (SyncBatchNorm,
`replica_context.all_reduce`): that raises `CrossReplicaCallInXlaError`, which names the ways out.

The Keras/TensorFlow internals these hooks replace or read are all in the `tf_nvlink.internals` package, one module
per subsystem, each patch calling a rule of this package: `KERAS_RULES` below says which. How a step is assembled
from the parts is in `tf_nvlink.training.step_assembly`.

`install_training_hooks(strategy)` is what `tf_nvlink.strategy()` calls on every strategy it builds.

`jit_compile="auto"` under a tf_nvlink strategy means XLA when Keras' own rule would enable it without a
strategy (the model's layers support XLA and a GPU is present); on CPU-only machines it stays off, as in Keras.
"""

from __future__ import annotations

import logging
import types

import tensorflow as tf

from tf_nvlink.distribute import base
from tf_nvlink.internals import attention, callbacks, layers, losses, optimizer, trainer
from tf_nvlink.internals.registry import REGISTRY
from tf_nvlink.training import (exact_batches, fit_loop, fused_attention, gradient_allreduce, input_staging,
                                optimizer_rules, sharded_states)
from tf_nvlink.training.step_assembly import PerReplicaRunner, make_function

log = logging.getLogger("tf_nvlink")


def _auto_jit_compile(model) -> bool:
    """`jit_compile="auto"` under a tf_nvlink strategy: Keras' rule without a strategy (Keras turns it off under any
    strategy, "Disable XLA with tf.distribute"): XLA when the model supports it and a GPU is present."""
    if not tf.config.list_logical_devices("GPU"):
        return False  # Keras' rule: no XLA on CPU-only machines
    return trainer.model_supports_jit(model)


def _splits_batches(strategy) -> bool:
    return base.is_tf_nvlink_strategy(strategy) and strategy.num_replicas_in_sync > 1


# The rule each seam of tf_nvlink.internals calls, by the name the seam calls it by.
KERAS_RULES = types.SimpleNamespace(
    is_ours=base.is_tf_nvlink_strategy,
    # internals.trainer
    make_function=make_function, auto_jit_compile=_auto_jit_compile, symbolic_build=input_staging.symbolic_build,
    splits_batches=_splits_batches, split_batch=exact_batches.split_over_replicas,
    epoch_executions=fit_loop.epoch_executions, input_end_or_raise=fit_loop.input_end_or_raise,
    # internals.optimizer
    optimizer_apply=optimizer_rules.optimizer_apply, clip_gradients=optimizer_rules.clip_gradients,
    optimizer_slot=sharded_states.optimizer_slot, optimizer_update=sharded_states.optimizer_update,
    # internals.losses
    scale_loss=exact_batches.scale_loss, unscale_loss=exact_batches.unscale_loss,
    reduce_values=exact_batches.reduce_values, compile_loss_call=exact_batches.compile_loss_call,
    mean_update_state=exact_batches.mean_update_state,
    # internals.layers
    batch_norm_moments=exact_batches.batch_norm_moments,
    # internals.callbacks
    batch_end_dispatch=fit_loop.batch_end_dispatch,
    # internals.attention
    dot_product_attention=fused_attention.dot_product_attention,
    attention_mask_made=fused_attention.attention_mask_made,
)


def build_strategy(**kwargs):
    """`tf_nvlink.strategy(**kwargs)` for the layers below the facade (the tools' benchmark workers): the strategy
    built by `distribute.single_host.strategy`, with the training hooks installed.

    Example:
        >>> strategy = build_strategy(gpus="auto")
    """
    from tf_nvlink.distribute import single_host  # noqa: PLC0415

    built = single_host.strategy(**kwargs)
    install_training_hooks(built)
    return built


def install_training_hooks(strategy) -> None:
    """Everything tf_nvlink changes in Keras for `strategy` (a tf_nvlink strategy just built): the gradient
    all-reduce, the trainer hooks (per-replica XLA, BatchNorm statistics kept in sync) and the per-replica
    `strategy.run`. Calling it again for the same strategy changes nothing.

    Example:
        >>> built = single_host.strategy(devices=["/cpu:0", "/cpu:1"])
        >>> install_training_hooks(built)     # tf_nvlink.strategy() does both
    """
    gradient_allreduce.install_gradient_allreduce_hook()  # one replica: no all-reduce; bfloat16: cast around it
    enable_per_replica_xla()
    if base.runner_of(strategy) is None:
        base.attach_runner(strategy, PerReplicaRunner(strategy))


def install_keras_seams(rules=KERAS_RULES) -> str | None:
    """Patch Keras' trainer, optimizers, losses, layers and callbacks once, each patch calling its rule in `rules`;
    returns None when patched (or already), else why the trainer could not be (and nothing is changed).

    Example:
        >>> install_keras_seams() is None
        True
    """
    with REGISTRY.lock:
        problem = trainer.install_trainer_seams(rules)
        if problem:
            return problem
        optimizer.install_optimizer_seams(rules)
        optimizer.install_sharded_state_seams(rules)
        losses.install_loss_seams(rules)
        layers.install_batch_norm_seam(rules)
        callbacks.install_batch_end_dispatch_seam(rules)
        attention.install_attention_seam(rules)
        attention.install_attention_mask_seam(rules)
        return None


def enable_per_replica_xla() -> None:
    """Install the Keras seams for a tf_nvlink strategy being built; on a Keras without the internals they need,
    log why, and make a jit-compiled step under that strategy raise `UnsupportedKerasError`."""
    REGISTRY.problem = install_keras_seams()
    if REGISTRY.problem:
        log.warning("tf_nvlink: per-replica XLA unavailable: %s", REGISTRY.problem)


def reset_hooks_for_tests() -> None:
    """Restore Keras' and TensorFlow's own methods and forget any install problem, as in a fresh process (the
    fused-mode emulation of the tests stays)."""
    from tf_nvlink.internals import tf_runtime  # noqa: PLC0415

    emulated = tf_runtime.fused_mode_emulated()
    REGISTRY.restore()
    REGISTRY.problem = None
    if emulated:
        tf_runtime.emulate_fused_mode_on_cpu()
