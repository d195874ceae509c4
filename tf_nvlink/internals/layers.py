"""Seams in Keras' layers and variables: BatchNormalization's batch moments, the walk over nested layers, every
write of a variable, and a mirrored variable's replica-local copy.

Checked against Keras 3.12 to 3.15.1 and keras-nightly 3.16.0.dev2026102704 (the Variable class moved under
`backend/tensorflow/ops/` there; `keras_variable_class` finds either), TensorFlow 2.21; pinned in
tests/internals/test_layers_seams.py.

Example:
    >>> from tf_nvlink.internals import layers
    >>> [layer.name for layer in layers.nested_layers(model)]     # nested layers included
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Callable

from tf_nvlink.internals.registry import REGISTRY


def _keras_batch_norm_class():
    from keras.src.layers.normalization.batch_normalization import BatchNormalization  # noqa: PLC0415

    return BatchNormalization


def install_batch_norm_seam(rules) -> None:
    """Patch `BatchNormalization._moments(inputs, mask)` once -> `rules.batch_norm_moments(layer, inputs, mask,
    keras_moments)`: the batch mean and variance every BatchNormalization computes in training."""
    def patch(original):
        def _moments(self, inputs, mask):
            return rules.batch_norm_moments(self, inputs, mask, lambda: original(self, inputs, mask))

        return _moments

    REGISTRY.patch(_keras_batch_norm_class(), "_moments", patch)


def nested_layers(model) -> list:
    """Every layer inside `model`, nested ones included, not the model itself (Keras' `Layer._flatten_layers`; no
    public accessor walks nested layers), or its `layers` where it has no such method."""
    walk = getattr(model, "_flatten_layers", None)
    return list(walk(include_self=False, recursive=True)) if walk else list(getattr(model, "layers", []))


def keras_variable_class():
    """Keras' TensorFlow-backend Variable class: `keras.src.backend.tensorflow.core.Variable` (Keras 3.12 to 3.15.1),
    `keras.src.backend.tensorflow.ops.core.Variable` in Keras 3.16 (keras-nightly 3.16.0.dev2026102704 checked)."""
    for module in ("keras.src.backend.tensorflow.core", "keras.src.backend.tensorflow.ops.core"):
        try:
            return importlib.import_module(module).Variable
        except ImportError:
            continue
    raise ImportError("no Variable in keras.src.backend.tensorflow.core or keras.src.backend.tensorflow.ops.core")


def report_variable_writes(on_write: Callable[[object], None]) -> bool:
    """Call `on_write(variable)` before every write of a Keras variable's value; returns False when installed
    already. Patches `Variable._direct_assign`, which every `assign`/`assign_add`/`assign_sub` of Keras' TensorFlow
    backend reaches (BatchNormalization's moving statistics included); Keras has no public write hook."""
    def patch(original):
        def _direct_assign(self, value):
            on_write(self)
            return original(self, value)

        return _direct_assign

    return REGISTRY.patch(keras_variable_class(), "_direct_assign", patch)


def keras_variable_write_original() -> Callable | None:
    """Keras' own `Variable._direct_assign` while `report_variable_writes` is installed (tests read its source)."""
    return REGISTRY.original(keras_variable_class(), "_direct_assign")


@contextlib.contextmanager
def replica_local(variables):
    """While the block runs, point each of `variables` (Keras variables over MirroredVariables) at the calling
    replica's own copy: the Keras variable's private `_value` swapped for the MirroredVariable's
    `_get_on_device_or_primary()` (TensorFlow 2.21), then swapped back."""
    swapped = []
    try:
        for variable in variables:
            mirrored = getattr(variable, "_value", None)
            local = getattr(mirrored, "_get_on_device_or_primary", None)
            if local is not None:
                swapped.append((variable, mirrored))
                variable._value = local()  # noqa: SLF001
        yield
    finally:
        for variable, mirrored in swapped:
            variable._value = mirrored  # noqa: SLF001
