"""tf_nvlink: a TensorFlow MirroredStrategy chosen from the machine's real GPU interconnect.

    import tf_nvlink
    with tf_nvlink.strategy().scope():
        model = build_model()
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", jit_compile=True)
    model.fit(dataset, epochs=10)

`import tf_nvlink` is light: TensorFlow is imported only when a strategy is built or the report asks for it,
so `tf-nvlink report --no-tf` answers instantly.
"""

__version__ = "0.1.0"

from tf_nvlink import nvml as _nvml  # light: NVML is loaded when probe() runs  # noqa: E402

__all__ = ["strategy", "current_plan", "probe", "__version__"]


def strategy(gpus="all", cross_device_ops="auto", num_packs=None, **kwargs):
    """The tf.distribute strategy for this machine; see `tf_nvlink.strategies.strategy` for every argument.

    Example:
        >>> import tf_nvlink
        >>> with tf_nvlink.strategy(gpus="auto").scope():
        ...     model = build_model()
    """
    from tf_nvlink import strategies  # TensorFlow is imported here, not at `import tf_nvlink`

    return strategies.strategy(gpus=gpus, cross_device_ops=cross_device_ops, num_packs=num_packs, **kwargs)


def current_plan():
    """The `Plan` of the strategy this process built with `strategy()`, or None before the first call."""
    from tf_nvlink import strategies

    return strategies.current_plan()


def probe(nvml=None):
    """NVML's view of this machine's GPUs and links as a `Topology` (instant; no TensorFlow)."""
    return _nvml.probe(nvml)
