"""Pins of the Keras layer and variable internals tf_nvlink.internals.layers relies on (Keras 3.12 to 3.16.dev)."""

import inspect


def test_keras_writes_batch_norm_statistics_through_the_seam():
    """Keras writes BatchNorm statistics with `.assign`, which reaches the TF backend's `_direct_assign`, and
    creates them non-trainable with aggregation "none"."""
    import keras

    from tf_nvlink.internals import layers
    from tf_nvlink.training import replica_sync

    Variable = layers.keras_variable_class()  # moved to keras.src.backend.tensorflow.ops.core in Keras 3.16
    layers.report_variable_writes(replica_sync._note_write)  # what replica_sync installs (once per process)

    original = layers.keras_variable_write_original()
    assert "self._value.assign" in inspect.getsource(original)
    assert "self._direct_assign(value)" in inspect.getsource(keras.src.backend.common.variables.Variable.assign)
    assert Variable._direct_assign is not original  # the recorder is in place
    assert "self.moving_mean.assign(" in inspect.getsource(keras.layers.BatchNormalization.call)
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3))
    model = keras.Sequential([keras.Input((3,)), layer, keras.layers.Dropout(0.1)])
    assert [v.path for v in replica_sync.state_variables(model)] == [layer.moving_mean.path, layer.moving_variance.path]
    assert {v.aggregation for v in replica_sync.state_variables(model)} == {"none"}


def test_batch_norm_moments_and_nested_layers():
    """The batch moments' seam (a replica without examples) and the walk over nested layers."""
    import keras
    from keras.src.layers.normalization.batch_normalization import BatchNormalization

    from tf_nvlink.internals import layers
    from tf_nvlink.internals.registry import REGISTRY

    moments = inspect.getsource(REGISTRY.original(BatchNormalization, "_moments", BatchNormalization._moments))
    assert "def _moments(self, inputs, mask):" in moments and "synchronized=self.synchronized" in moments
    assert "mean, variance = self._moments(inputs, mask)" in inspect.getsource(BatchNormalization.call)
    inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="inner_dense")], name="inner")
    outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1, name="top")])
    names = [layer.name for layer in layers.nested_layers(outer)]  # input layers included, as Keras walks them
    assert [name for name in names if not name.startswith("input_layer")] == ["inner", "inner_dense", "top"]
