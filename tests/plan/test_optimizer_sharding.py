"""The partition of optimizer states over the replicas (plan/optimizer_sharding): whole variables, balanced by
size, deterministic; the memory table; the argument's check."""

import doctest

import pytest

from tf_nvlink.plan import optimizer_sharding as sharding


def test_the_examples_in_the_docstrings_hold():
    assert doctest.testmod(sharding).failed == 0


def test_largest_first_to_the_least_loaded_replica_ties_by_index():
    assert sharding.assign_owners([400, 100, 300, 200], 2) == (0, 0, 1, 1)
    assert sharding.assign_owners([5, 5, 5, 5], 4) == (0, 1, 2, 3)
    assert sharding.assign_owners([], 3) == ()
    assert sharding.assign_owners([7, 1, 1], 1) == (0, 0, 0)


@pytest.mark.parametrize("replicas", [2, 3, 4, 8])
def test_each_replica_holds_at_most_its_share_plus_one_largest_variable(replicas):
    import random

    rng = random.Random(replicas)
    for _ in range(50):
        sizes = [rng.choice([1, 8, 64, 4096, 10**6]) * rng.randint(1, 9) for _ in range(rng.randint(1, 40))]
        owners = sharding.assign_owners(sizes, replicas)
        assert owners == sharding.assign_owners(list(sizes), replicas)  # the same on every replica
        held = sharding.bytes_per_replica(sizes, owners, replicas)
        assert sum(held) == sum(sizes)
        assert max(held) <= sum(sizes) / replicas + max(sizes)


def test_the_memory_table_of_adamw_on_7b_parameters():
    layers = [7 * 10**9 // 32] * 32  # 32 equal blocks of 7B float32 parameters, two slots each
    for replicas, states_gb in ((2, 28.0), (4, 14.0), (8, 7.0)):
        table = sharding.memory_per_replica(layers, 4, 2, replicas)
        assert table["replicated"] == {"weights": 28 * 10**9, "gradients": 28 * 10**9,
                                       "optimizer_states": 56 * 10**9}
        assert table["sharded"]["optimizer_states"] == pytest.approx(states_gb * 1e9, rel=1e-9)
        assert "sharded" in sharding.format_memory_table(table, replicas)


@pytest.mark.parametrize("value", ["sharded ", "zero", None, 1])
def test_an_unknown_choice_names_the_valid_ones(value):
    with pytest.raises(ValueError, match=r"optimizer_states should be one of \['replicated', 'sharded'\]"):
        sharding.validate_optimizer_states(value)
    assert sharding.validate_optimizer_states("sharded") == "sharded"
