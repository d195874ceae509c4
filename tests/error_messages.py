"""The assertion every bad-input test makes: a one-line error naming the bad value and the valid choices."""

import pytest


def raises_naming(fn, *needles, error=ValueError):
    """Call fn(), expect `error` whose message holds every needle on one line; returns the message.

    Example: raises_naming(lambda: policy.make_plan(topology, "7"), "gpus='7'", "[0, 1]")
    """
    with pytest.raises(error) as info:
        fn()
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert "\n" not in message.strip(), message
    return message
