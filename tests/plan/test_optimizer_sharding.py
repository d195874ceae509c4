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
                                       "optimizer_states": 56 * 10**9, "total": 112 * 10**9, "fits": None}
        assert table["sharded"]["optimizer_states"] == pytest.approx(states_gb * 1e9, rel=1e-9)
        assert "sharded" in sharding.format_memory_table(table, replicas)


@pytest.mark.parametrize("value", ["sharded ", "zero", None, 1])
def test_an_unknown_choice_names_the_valid_ones(value):
    with pytest.raises(ValueError, match=r"optimizer_states should be one of \['replicated', 'sharded'\]"):
        sharding.validate_optimizer_states(value)
    assert sharding.validate_optimizer_states("sharded") == "sharded"


# ---- the memory rows ----------------------------------------------------------------------------------------

def test_adamw_in_float32_holds_16_bytes_a_parameter_replicated_and_its_two_slots_split_over_8():
    rows = sharding.memory_per_replica([1000] * 8, 4, 2, 8)  # 8 equal variables of 1000 parameters
    assert rows["replicated"] == {"weights": 32_000, "gradients": 32_000, "optimizer_states": 64_000,
                                  "total": 128_000, "fits": None}  # 16 bytes x 8000 parameters
    assert rows["sharded"] == {"weights": 32_000, "gradients": 32_000, "optimizer_states": 8_000,
                               "total": 72_000, "largest_share": 8_000, "fits": None}  # 8 + 8/8 bytes a parameter
    assert rows["replicas"] == 8 and rows["device_bytes"] is None and rows["sharding_lets_it_fit"] is None


def test_the_sharded_states_are_the_fullest_owners_share_under_assign_owners():
    # owners by the weights' bytes: 400 -> 0, 300 -> 1, 200 -> 1, 100 -> 0; the states follow their variable
    rows = sharding.memory_rows([400, 100, 300, 200], [800, 200, 600, 1000], 2, other_state_bytes=12)
    assert sharding.assign_owners([400, 100, 300, 200], 2) == (0, 0, 1, 1)
    assert rows["sharded"]["largest_share"] == 1600  # replica 1: 600 + 1000; replica 0: 800 + 200
    assert rows["sharded"]["optimizer_states"] == 1612 and rows["replicated"]["optimizer_states"] == 2612
    assert rows["sharded"]["total"] == 1000 + 1000 + 1612 and rows["replicated"]["total"] == 4612
    one = sharding.memory_rows([400, 100, 300, 200], [800, 200, 600, 1000], 1, other_state_bytes=12)
    assert one["sharded"]["optimizer_states"] == one["replicated"]["optimizer_states"] == 2612


@pytest.mark.parametrize("device_bytes, replicated, sharded, lets_fit, verdict", [
    (20_000, True, True, False, "fits replicated"),
    (19_999, False, True, True, "sharding lets this model fit"),
    (18_000, False, True, True, "sharding lets this model fit"),
    (17_999, False, False, False, "does not fit, even sharded"),
])
def test_fits_compares_each_total_with_one_gpu(device_bytes, replicated, sharded, lets_fit, verdict):
    rows = sharding.memory_rows([4000, 1000], [8000, 2000], 2, device_bytes=device_bytes)  # 20,000 and 18,000
    assert (rows["replicated"]["fits"], rows["sharded"]["fits"], rows["sharding_lets_it_fit"]) == (
        replicated, sharded, lets_fit)
    assert sharding.fit_verdict(rows) == (f"{verdict} (2 replicas: 18.00 KB sharded, 20.00 KB replicated, "
                                          f"{sharding.format_bytes(device_bytes)} per GPU)")


def test_no_device_size_no_verdict():
    assert sharding.fit_verdict(sharding.memory_rows([4], [8], 2)) is None


def test_a_7b_model_fits_an_h200_only_sharded_over_8():
    h200 = 141 * 10**9
    blocks = [7 * 10**9 // 32] * 32
    verdicts = {n: sharding.memory_per_replica(blocks, 4, 2, n, device_bytes=h200) for n in (2, 4, 8)}
    assert [verdicts[n]["sharded"]["total"] for n in (2, 4, 8)] == [84 * 10**9, 70 * 10**9, 63 * 10**9]
    assert all(rows["replicated"]["total"] == 112 * 10**9 and rows["replicated"]["fits"] for rows in
               verdicts.values())  # 112 GB fits 141 GB before activations
    small = sharding.memory_per_replica(blocks, 4, 2, 8, device_bytes=80 * 10**9)  # an 80 GB GPU
    assert small["sharding_lets_it_fit"] is True


def test_the_summary_line_and_the_units():
    rows = sharding.memory_per_replica([10**8] * 4, 4, 2, 4)
    assert sharding.summary_line(rows) == ("optimizer states: 3.20 GB per replica replicated, 0.80 GB sharded over "
                                           "4 replicas (largest share 0.80 GB)")
    assert [sharding.format_bytes(n) for n in (0, 999, 1000, 999_999, 10**6, 10**9, 141 * 10**9)] == [
        "0 B", "999 B", "1.00 KB", "1000.00 KB", "1.00 MB", "1.00 GB", "141.00 GB"]


def test_the_table_has_a_row_per_replica_count_and_mode_in_one_unit():
    lines = sharding.memory_table_lines(
        [sharding.memory_rows([4000, 1000], [8000, 2000], n, device_bytes=19_000) for n in (1, 2)])
    assert lines == ["# GPUs  states      weights  gradients  optimizer states  total  fits",
                     "#                      (KB)       (KB)              (KB)   (KB)",
                     "     1  replicated     5.00       5.00             10.00  20.00    no",
                     "     1  sharded        5.00       5.00             10.00  20.00    no",
                     "     2  replicated     5.00       5.00             10.00  20.00    no",
                     "     2  sharded        5.00       5.00              8.00  18.00   yes"]


def test_weights_and_states_name_every_variable_once():
    with pytest.raises(ValueError, match="one entry per variable. Received: 2 and 1 entries"):
        sharding.memory_rows([4, 4], [8], 2)
