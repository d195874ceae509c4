"""Every private Keras/TensorFlow touch of tf_nvlink (`keras.src`, `tensorflow.python`, private attributes), in
this one package: one module per Keras/TensorFlow subsystem, each definition a seam (it touches a private name) or
the registry of what was patched.

- `registry`: what was patched and its original (`REGISTRY.restore()` puts Keras back).
- `trainer`: Keras' TensorFlow trainer (fit's functions, the model build, epochs, `*_on_batch`).
- `optimizer`: Keras' optimizers (`apply`, the clip, the gradient all-reduce).
- `losses`: the per-replica loss scale, weighted reductions, per-output loss metrics.
- `layers`: BatchNormalization's moments, nested layers, variable writes, replica-local copies.
- `callbacks`: batch-end dispatch, BackupAndRestore's steps, the TensorBoard callback beside ours.
- `tf_runtime`: TensorFlow's XLA contexts, merge_call switch, devices, eager context and profiler format.

A patch finds its attribute, keeps the original in the registry, and calls a rule passed in from
`tf_nvlink.training` (`training.install.KERAS_RULES`); no tf_nvlink rule, thread-local or training log line lives
here. Each module states the Keras and TensorFlow versions it was checked against, and tests/internals/ pins the
Keras and TensorFlow source each relies on. Nothing else in tf_nvlink/ may touch a private name
(tests/test_private_api.py checks it).
"""
