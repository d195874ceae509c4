"""How a global batch splits over replicas, for the examples' log lines. Pure: no TensorFlow.

Example:
    >>> from tf_nvlink.util.replica_split import replica_split
    >>> replica_split(7, 2)
    '4 + 3'
"""


def replica_split(global_batch: int, num_replicas: int) -> str:
    """How the global batch splits over the replicas, e.g. "4 + 3" or "32 per replica" (tf.distribute gives the
    first replicas one example more). Any split trains as one device would under a tf_nvlink strategy: each
    replica's loss counts by its share of the examples.

    Example:
        >>> replica_split(64, 2)
        '32 per replica'
    """
    base, extra = divmod(global_batch, num_replicas)
    if not extra:
        return f"{base} per replica"
    return " + ".join(str(base + 1 if replica < extra else base) for replica in range(num_replicas))
