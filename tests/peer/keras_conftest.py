"""What the conftest.py at the root of Keras' repository gives Keras' tests and the Keras wheel does not ship:
`skip_if_backend`, which some test modules import (`from conftest import skip_if_backend`), and Keras' markers.
`keras_plugin` installs this module as `conftest` in the peer runs.

    from conftest import skip_if_backend

    @skip_if_backend("openvino", "Not supported operation by openvino backend")
    def test_it(): ...
"""

import pytest

MARKERS = {"requires_trainable_backend": "mark test for trainable backend only (TensorFlow trains)",
           "multi_device": "mark test for running with multiple devices only"}


def skip_if_backend(given_backend, reason):
    """A skip mark for the tests of one Keras backend, as Keras' conftest makes it.

    Example:
        >>> skip_if_backend("openvino", "not supported").args
        (False,)
    """
    from keras.src.backend import backend

    return pytest.mark.skipif(backend() == given_backend, reason=reason)
