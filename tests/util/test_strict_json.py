"""tf_nvlink.util.strict_json: strict JSON (no NaN, no infinities, no duplicate keys)."""

import pytest

from tf_nvlink.util.strict_json import strict_loads


STRICT_JSON = ["NaN", "[Infinity]", '{"a": -Infinity}', "1e999", '{"a": 1, "a": 2}']


@pytest.mark.parametrize("text", STRICT_JSON)
def test_strict_loads_refuses_nan_infinities_and_duplicate_keys(text):
    with pytest.raises(ValueError):
        strict_loads(text)
