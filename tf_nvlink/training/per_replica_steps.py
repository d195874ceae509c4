"""The per-replica compiled steps: `PerReplicaXlaStep` (model.fit's train/test step) and `PerReplicaCustomStep`
(a jit function passed to `strategy.run`); fused or split as the package doc says."""

from __future__ import annotations

import contextlib
from typing import Callable

import tensorflow as tf

from tf_nvlink.internals import optimizer as optimizer_seams
from tf_nvlink.internals.registry import UnsupportedKerasError
from tf_nvlink.training.exact_batches import (batch_opened, loss_share_while_tracing, replica_shares,
                                              weighted_by_examples)
from tf_nvlink.training.execution_mode import all_reduces_in_program
from tf_nvlink.training.optimizer_rules import (OptimizerNotBuiltWhileTracing, build_optimizer, optimizer_calls,
                                                replica_local_counters)
from tf_nvlink.training.replica_programs import PerReplicaFunctions, replica_id


class PerReplicaXlaStep:
    """Stands in for `model.train_step`/`test_step` inside `strategy.run`: XLA per replica, optimizer outside.

    Example (what the Keras hook does for you):
        >>> step = PerReplicaXlaStep(model, model.train_step, "train")
        >>> strategy.run(step, args=(batch,))
    """

    def __init__(self, model, step_function: Callable, kind: str):
        self.model = model
        self.step_function = step_function
        self.kind = kind
        self.compiled = PerReplicaFunctions(self.body_for, reduce_retracing=True, autograph=False)  # per replica
        self._updates: dict[int, list] = {}  # replica -> [(optimizer, variables)] of the caught updates

    @property
    def _all_reduces_in_program(self) -> bool:
        return all_reduces_in_program(self.model.distribute_strategy)

    @property
    def fused(self) -> bool:
        """Whole train step in XLA, all-reduce included; a test step is always one program per replica."""
        return self.kind != "train" or self._all_reduces_in_program

    def _fused_body(self) -> Callable:
        optimizer = self.model.optimizer
        step_function = self.step_function

        def body(data):
            shares = replica_shares(data)  # in this replica's XLA program, as the gradients' all-reduce
            with replica_local_counters(optimizer), loss_share_while_tracing(*shares):
                return step_function(data)  # the apply hook agrees on finite

        return body

    def _test_body(self) -> Callable:
        # The replica's share of the step's examples weights its per-output loss metrics (evaluate's 1 + 0 last
        # batch counts once, as on one device); split mode all-reduces it outside XLA and passes it in.
        if self._all_reduces_in_program:
            return weighted_by_examples(self.step_function)
        step_function = self.step_function

        def body(data, shares):
            with loss_share_while_tracing(*shares):
                return step_function(data)

        return body

    def body_for(self, replica_id: int) -> Callable:
        """The Python step one replica's program compiles: the whole step (test steps, fused train steps), or
        split mode's gradients with the update caught."""
        if self.kind != "train":
            body = self._test_body()
        else:
            body = self._fused_body() if self.fused else self._train_body(replica_id)
        model = self.model

        def checked(data, *args):
            with batch_opened(data) as opened:
                result = body(opened, *args)
            refuse_metrics_outside_scope(model)  # built by now: the step's first trace creates them
            return result

        return checked

    def _train_body(self, replica_id: int) -> Callable:
        def body(data, shares):
            with optimizer_calls("catch") as caught, loss_share_while_tracing(*shares):
                logs = self.step_function(data)  # the apply hook records the update instead of running it
            if not caught:
                raise UnsupportedKerasError(
                    "tf_nvlink's per-replica XLA needs train_step to update weights through "
                    "self.optimizer.apply_gradients() or self.optimizer.apply(); this train_step does neither. "
                    "Compile with jit_compile=False, or call the optimizer in train_step.")
            updates, grads = [], []
            for optimizer, call_grads, variables in caught:
                variables = list(variables if variables is not None
                                 else optimizer_seams.optimizer_trainable_variables(optimizer))
                kept = [i for i, g in enumerate(call_grads) if g is not None]
                updates.append((optimizer, [variables[i] for i in kept]))
                grads.append([call_grads[i] for i in kept])
            self._updates[replica_id] = updates
            return logs, grads

        return body

    def __call__(self, data):
        replica = replica_id()
        compiled = self.compiled(replica)
        if self.kind != "train" and not self._all_reduces_in_program:
            return compiled(data, replica_shares(data))  # the shares' all-reduce outside XLA (merge_call)
        if self.fused:
            return compiled(data)
        shares = replica_shares(data)  # outside XLA: split mode all-reduces through merge_call
        with merge_call_explained():
            logs, grads = compiled(data, shares)
        for (optimizer, variables), call_grads in zip(self._updates[replica], grads):
            if variables:
                # Outside XLA: all-reduce through the strategy's cross-device ops, then the update.
                optimizer.apply(call_grads, variables)
        return logs


def refuse_metrics_outside_scope(model) -> None:
    """Raise a ValueError naming the model's metrics whose variables were created outside the strategy's scope
    (several replicas only): such a variable lives on one device, and another replica's XLA program cannot read
    it (TensorFlow fails with "Trying to access resource ... located in device ..."; a fused step may hang).

    Example:
        >>> refuse_metrics_outside_scope(model)  # after the step's first trace built the compiled metrics
    """
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync < 2:
        return
    outside = sorted({variable.path.split("/")[0] for variable in model.metrics_variables
                      if not strategy.extended.variable_created_in_scope(getattr(variable, "value", variable))})
    if outside:
        raise ValueError(
            f"The metric(s) {', '.join(map(repr, outside))} were created outside strategy.scope(): their variables "
            f"live on one device, which the other {strategy.num_replicas_in_sync - 1} replica(s)' XLA programs "
            "cannot read. Create them inside `with strategy.scope():` (as the model), or pass their names as "
            "strings (e.g. metrics=[\"auc\"]); jit_compile=False also runs them as stock MirroredStrategy does.")


class PerReplicaCustomStep:
    """One replica's compiled copy of a `jit_compile=True` function passed to `strategy.run` (custom loops,
    Keras' predict step), so no XLA program spans two replicas.

    - "fused" (all-GPU replicas, plan `xla_allreduce="fused"`): the whole function, `optimizer.apply_gradients`
      and its gradient all-reduce included, is one XLA program per replica; the optimizer's step counters are
      kept per replica (as in fit's fused mode).
    - "split" (any device): the function is compiled with every `optimizer.apply`/`apply_gradients` call caught:
      the gradients leave XLA, and the calls run right after, in the same order, outside XLA, where the
      optimizer all-reduces through the plan's cross-device ops. Values the function computes after
      `apply_gradients` (rare) see the weights before that update.

    Example (what `strategy.run` does for a jit step under a tf_nvlink strategy):
        >>> step = PerReplicaCustomStep(train_step.python_function, "split")
        >>> strategy.run(step, args=(x, y))    # the mixin does this for you
    """

    def __init__(self, python_function: Callable, mode: str, autograph: bool = True):
        if mode not in ("fused", "split"):
            raise ValueError(f"mode should be 'fused' or 'split'. Received: mode={mode!r}")
        self.python_function = python_function
        self.mode = mode
        self.autograph = autograph
        self.compiled = PerReplicaFunctions(self._body, reduce_retracing=True, autograph=autograph)  # per replica
        self._updates: dict[int, list] = {}  # replica -> [(optimizer, variables or None)] of the traced calls
        self._unbuilt: dict[int, tuple] = {}  # replica -> (optimizer, variables) that stopped its last trace

    def _body(self, replica_id: int) -> Callable:
        python_function = self.python_function
        unbuilt = self._unbuilt

        def traced(mode, args, kwargs):
            try:
                with optimizer_calls(mode) as caught:
                    return python_function(*args, **kwargs), caught
            except OptimizerNotBuiltWhileTracing as error:  # the original: AutoGraph re-raises a copy
                unbuilt[replica_id] = (error.optimizer, error.variables)
                raise

        if self.mode == "fused":
            def fused(*args, **kwargs):
                return traced("replica_local", args, kwargs)[0]

            return fused

        def split(*args, **kwargs):
            outputs, caught = traced("catch", args, kwargs)
            updates, grads = [], []
            for optimizer, call_grads, variables in caught:
                variables = None if variables is None else list(variables)
                kept = [i for i, g in enumerate(call_grads) if g is not None]
                if variables is not None:
                    variables = [variables[i] for i in kept]
                elif len(kept) != len(call_grads):
                    raise ValueError("optimizer.apply(grads) without variables got None gradients; pass the "
                                     "variables too: optimizer.apply_gradients(zip(grads, variables)).")
                updates.append((optimizer, variables))
                grads.append([call_grads[i] for i in kept])
            previous = self._updates.get(replica_id)
            if previous is not None and not _same_updates(previous, updates):
                raise ValueError("A jit_compile=True step under a tf_nvlink strategy updated different optimizers "
                                 "or variables when traced again (new input shapes?); tf_nvlink's split mode needs "
                                 "the same optimizer calls on every trace. Use one step function per shape.")
            self._updates[replica_id] = updates
            return outputs, grads

        return split

    def __call__(self, *args, **kwargs):
        replica = replica_id()
        while True:
            compiled = self.compiled(replica)
            try:
                if self.mode == "fused":
                    return compiled(*args, **kwargs)
                with merge_call_explained():
                    outputs, grads = compiled(*args, **kwargs)
                break
            except OptimizerNotBuiltWhileTracing:  # build it here, outside the step, and trace again
                build_optimizer(*self._unbuilt.pop(replica))
                self.compiled.forget(replica)
        for (optimizer, variables), call_grads in zip(self._updates.get(replica, ()), grads):
            # Outside XLA: the optimizer all-reduces through the strategy's cross-device ops, then updates.
            optimizer.apply(call_grads, variables)
        return outputs


def _same_updates(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        oa is ob and (va is None) == (vb is None) and (va is None or [id(v) for v in va] == [id(v) for v in vb])
        for (oa, va), (ob, vb) in zip(a, b))


class CrossReplicaCallInXlaError(ValueError):
    """A split-mode step (XLA per replica, all-reduce outside) asked for a cross-replica merge inside XLA."""


@contextlib.contextmanager
def merge_call_explained():
    """TensorFlow's "merge_call called while defining a new graph" in a split-mode step, said in tf_nvlink's terms."""
    try:
        yield
    except RuntimeError as error:
        if "merge_call" not in str(error):
            raise
        raise CrossReplicaCallInXlaError(
            "A jit_compile=True step running in tf_nvlink's split mode (CPU replicas, or xla_allreduce='split') "
            "asked for a cross-replica merge inside XLA, which split mode cannot hold: "
            "keras.layers.BatchNormalization(synchronized=True), tf.distribute.get_replica_context().all_reduce() "
            "or merge_call() in the step. Use synchronized=False (or move the all-reduce out of the jit step), "
            "fused mode (all-GPU replicas: tf_nvlink.strategy(xla_allreduce='fused')), or jit_compile=False. "
            f"TensorFlow said: {error}") from error
