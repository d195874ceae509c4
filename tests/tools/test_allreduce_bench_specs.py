"""tf_nvlink.tools.allreduce_bench.specs: message sizes are bounded."""

import pytest

from tf_nvlink.tools import allreduce_bench
from tf_nvlink.tools.allreduce_bench import specs


@pytest.mark.parametrize("text", ["99999999999G", "17G", "20000000000"])
def test_message_sizes_are_bounded(text):
    with pytest.raises(specs.BenchError, match=r"at most 16G.*Received: '" + text):
        specs.parse_size(text)
    assert specs.parse_size("16G") == 16 * 2**30
