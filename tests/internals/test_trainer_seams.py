"""Pins of the Keras trainer internals tf_nvlink.internals.trainer relies on (Keras 3.12 to 3.15, and the next
minor's pre-releases); a Keras upgrade that changes these fails here first."""

import inspect

from packaging.version import Version


def _original(owner, name):
    """Keras' own method, also when an earlier test in this process patched it."""
    from tf_nvlink.internals.registry import REGISTRY

    return REGISTRY.original(owner, name, getattr(owner, name))


def test_keras_version_is_in_the_tested_range_or_the_next_pre_release():
    import keras

    from tf_nvlink.internals import trainer

    assert trainer.check_keras_support() is None
    version = tuple(int(p) for p in keras.__version__.split(".")[:2])
    # A pre-release of the next minor (a nightly, a release candidate) is checked against these pins before the
    # declared range widens; its final release fails here until TESTED_KERAS does.
    next_minor = (trainer.TESTED_KERAS[1][0], trainer.TESTED_KERAS[1][1] + 1)
    assert trainer.TESTED_KERAS[0] <= version <= trainer.TESTED_KERAS[1] or (
        version == next_minor and Version(keras.__version__).is_prerelease), keras.__version__


def test_make_function_resolve_jit_and_symbolic_build():
    from tf_nvlink.internals import trainer

    TensorFlowTrainer = trainer.keras_trainer_class()  # renamed Trainer in Keras 3.16
    make_function = inspect.getsource(_original(TensorFlowTrainer, "_make_function"))
    assert "self.distribute_strategy.run(step_function" in make_function
    assert "jit_compile=self.jit_compile" in make_function
    assert "self._make_function(self.train_step)" in inspect.getsource(TensorFlowTrainer.make_train_function)
    assert "self._make_function(self.test_step)" in inspect.getsource(TensorFlowTrainer.make_test_function)
    assert "Disable XLA with tf.distribute" in inspect.getsource(
        _original(TensorFlowTrainer, "_resolve_auto_jit_compile"))
    assert "jit_compile=True" in inspect.getsource(TensorFlowTrainer.make_predict_function)
    symbolic_build = inspect.getsource(_original(TensorFlowTrainer, "_maybe_symbolic_build"))
    assert "self._symbolic_build(data_batch=data_batch)" in symbolic_build
    assert "for _, _, it in iterator:" in symbolic_build  # input_staging.build_from_input reads it the same way
    # what fully_built() mirrors: Trainer._symbolic_build (3.12 to 3.15), BaseTrainer._get_unbuilt_components (3.16)
    base_trainer = TensorFlowTrainer.__mro__[1]
    checks = inspect.getsource(getattr(base_trainer, "_get_unbuilt_components", base_trainer._symbolic_build))
    for built in ("layer.built for layer in self._flatten_layers()", "self._compile_metrics.built",
                  "self._compile_loss.built", "self.optimizer.built"):
        assert built in checks, built
    fit = inspect.getsource(TensorFlowTrainer.fit)
    assert fit.index("self._maybe_symbolic_build(iterator=epoch_iterator)") < fit.index("epoch_iterator.reset()")
    from keras.src.backend.tensorflow import trainer as tf_trainer
    assert "def reduce_per_replica(values, strategy, reduction)" in inspect.getsource(tf_trainer.reduce_per_replica)


def test_every_out_of_range_error_of_a_step_is_the_end_of_the_input_to_keras():
    """What `trainer._patch_input_end` stands between: Keras' TensorFlow epoch iterator turns any OutOfRangeError of
    the steps, or of its wait for them, into StopIteration (the end of the input), and its base ends the epoch."""
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.trainers.epoch_iterator import EpochIterator

    catch = inspect.getsource(_original(tf_trainer.TFEpochIterator, "catch_stop_iteration"))
    assert "with super().catch_stop_iteration():" in catch
    assert catch.index("yield") < catch.index("self.tf_sync()") < catch.index("except tf.errors.OutOfRangeError:")
    assert "raise StopIteration" in catch
    base = inspect.getsource(EpochIterator.catch_stop_iteration)
    assert "except StopIteration:" in base and "self._interrupted_warning()" in base
    assert "tf_context.async_wait()" in inspect.getsource(tf_trainer.TFEpochIterator.tf_sync)


def test_epochs_and_the_distributed_input():
    from keras.src.backend.tensorflow import trainer as tf_trainer
    from keras.src.trainers.data_adapters import tf_dataset_adapter
    from keras.src.trainers.epoch_iterator import EpochIterator

    enumerate_source = inspect.getsource(_original(EpochIterator, "_enumerate_iterator"))
    assert "steps_per_epoch = self.steps_per_epoch or self._num_batches or -1" in enumerate_source
    assert "self._steps_seen += self.steps_per_execution" in enumerate_source
    assert "step + self.steps_per_execution - 1" in enumerate_source
    epoch_iterator_init = inspect.getsource(tf_trainer.TFEpochIterator.__init__)
    assert "self._distributed_dataset = dataset" in epoch_iterator_init
    assert "experimental_distribute_dataset(" in epoch_iterator_init
    # restage_input keeps a user's tf.data dataset staged: Keras' adapter hands that very dataset back
    assert "self._dataset = dataset" in inspect.getsource(tf_dataset_adapter.TFDatasetAdapter.__init__)
    assert "return self._dataset" in inspect.getsource(tf_dataset_adapter.TFDatasetAdapter.get_tf_dataset)
