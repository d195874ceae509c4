import pytest


@pytest.fixture(autouse=True)
def _logical_cpus_first(tf):
    """The pins build layers and run functions: TensorFlow's CPU is split into logical devices first, as the
    strategy tests that may run after them in this process need (TensorFlow fixes its devices at first use)."""
    return tf
