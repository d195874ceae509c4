"""tf_nvlink.util.replica_split: how a global batch splits over replicas, as tf.distribute splits it."""

from tf_nvlink.util.replica_split import replica_split


def test_even_and_uneven_splits():
    assert replica_split(64, 2) == "32 per replica"
    assert replica_split(7, 2) == "4 + 3"
    assert replica_split(10, 4) == "3 + 3 + 2 + 2"
    assert replica_split(1, 2) == "1 + 0"
