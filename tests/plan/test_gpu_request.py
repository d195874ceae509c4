"""tf_nvlink.plan.gpu_request: parsing the `gpus=` request."""

import pytest

from tf_nvlink.plan import gpu_request


@pytest.mark.parametrize("gpus", [[-1], "-1", (0, -2)], ids=repr)
def test_gpu_indices_refuses_negative_indices(gpus):
    with pytest.raises(ValueError, match=r"Received: .* in gpus="):
        gpu_request.gpu_indices(gpus, (0, 1))
