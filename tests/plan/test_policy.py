"""tf_nvlink.plan.policy: what the policy chooses on every fake machine, and how it refuses bad requests."""

import itertools

import pytest

import fake_nvml
from fake_nvml import FakeNvml
from tf_nvlink.machine import nvml

from tf_nvlink.plan import policy
ALL8 = tuple(range(8))

# What the current rules choose: (machine, gpus) -> (GPUs, cross_device_ops, num_packs).
# Edit this table when the rules change (docs/results.md records the measurements behind them).
CHOICES = {
    ("h200_x2", "all"): ((0, 1), "nccl", 1),
    ("h200_x2", "auto"): ((0, 1), "nccl", 1),
    ("h100_hgx_x8", "all"): (ALL8, "nccl", 1),
    ("h100_hgx_x8", "auto"): (ALL8, "nccl", 1),
    ("dgx1_v100_x8", "all"): (ALL8, "hierarchical", 1),
    ("dgx1_v100_x8", "auto"): (ALL8, "hierarchical", 1),
    ("rtx3090_x2_bridge", "all"): ((0, 1), "nccl", 1),
    ("rtx3090_x2_bridge", "auto"): ((0, 1), "nccl", 1),
    ("pcie_x4", "all"): ((0, 1, 2, 3), "nccl", 1),
    ("pcie_x4", "auto"): ((0,), "reduce_to_one", None),  # no NVLink group larger than one GPU
    ("bridged_pairs_x4", "all"): ((0, 1, 2, 3), "nccl", 1),
    ("bridged_pairs_x4", "auto"): ((0, 1), "nccl", 1),  # the largest NVLink group; ties to the lower ids
    ("no_driver", "all"): ((), "reduce_to_one", None),
    ("no_driver", "auto"): ((), "reduce_to_one", None),
}
SHAPES = {"h200_x2": "nvswitch", "h100_hgx_x8": "nvswitch", "dgx1_v100_x8": "nvlink-partial",
          "rtx3090_x2_bridge": "nvlink-all", "pcie_x4": "pcie", "bridged_pairs_x4": "nvlink-partial",
          "no_driver": "none"}


def topo_of(name):
    return nvml.probe(FakeNvml(fake_nvml.MACHINES[name]()))


def test_table_covers_every_machine():
    assert {name for name, _ in CHOICES} == set(fake_nvml.MACHINES)


@pytest.mark.parametrize("name, gpus", sorted(CHOICES))
def test_choices(name, gpus):
    topo = topo_of(name)
    plan = policy.make_plan(topo, gpus, "auto")
    assert (plan.gpus, plan.cross_device_ops, plan.num_packs) == CHOICES[(name, gpus)]
    assert plan.fingerprint == topo.fingerprint()
    assert plan.on_cpu is (not plan.gpus)
    assert plan.reason and plan.reason != "requested by the caller"
    assert plan.requested == (gpus, "auto", None)
    if gpus == "all":
        assert plan.shape == SHAPES[name]
    summary = plan.summary()
    assert summary.startswith("tf_nvlink plan: ") and plan.cross_device_ops in summary
    assert topo.fingerprint() in summary
    record = plan.to_dict()
    assert record["gpus"] == list(plan.gpus) and record["tensorflow_class"] == policy.OPS[plan.cross_device_ops]


def test_visible_limits_all_and_auto():
    topo = topo_of("h100_hgx_x8")
    assert policy.make_plan(topo, "all", visible=[5, 2]).gpus == (5, 2)
    assert policy.make_plan(topo, "auto", visible=[5, 2]).gpus == (2, 5)
    cpu = policy.make_plan(topo, "all", visible=[])
    assert cpu.gpus == () and cpu.cross_device_ops == "reduce_to_one"


def test_explicit_ops_and_packs_are_kept():
    topo = topo_of("h200_x2")
    plan = policy.make_plan(topo, "all", "hierarchical", num_packs=4)
    assert (plan.cross_device_ops, plan.num_packs, plan.reason) == ("hierarchical", 4, "requested by the caller")
    assert policy.make_plan(topo, "all", "reduce_to_one").num_packs is None
    assert policy.make_plan(topo, "all", "nccl").num_packs == 1
    assert policy.make_plan(topo, "0,1", "auto", num_packs=0).num_packs == 0


def test_hierarchical_on_three_gpus_raises():
    with pytest.raises(ValueError, match="drop") as info:
        policy.make_plan(topo_of("h100_hgx_x8"), [0, 1, 2], "hierarchical")
    assert "3 GPUs" in str(info.value)


@pytest.mark.parametrize("name, visible", [("no_driver", None), ("h200_x2", [])])
def test_nccl_without_gpus_raises(name, visible):
    with pytest.raises(ValueError, match="nccl.*needs GPUs"):
        policy.make_plan(topo_of(name), "all", "nccl", visible=visible)


@pytest.mark.parametrize("name", sorted(fake_nvml.MACHINES))
def test_auto_never_picks_hierarchical_for_odd_counts_or_non_dgx1_shapes(name):
    topo = topo_of(name)
    for size in range(1, len(topo.gpus) + 1):
        for subset in itertools.combinations(topo.indices, size):
            plan = policy.make_plan(topo, list(subset), "auto")
            if plan.cross_device_ops == "hierarchical":
                assert name == "dgx1_v100_x8" and subset == ALL8, subset
                assert policy.is_dgx1_like(topo, subset)


def test_is_dgx1_like():
    assert policy.is_dgx1_like(topo_of("dgx1_v100_x8"), ALL8)
    assert not policy.is_dgx1_like(topo_of("dgx1_v100_x8"), ALL8[:4])
    assert not policy.is_dgx1_like(topo_of("h100_hgx_x8"), ALL8)  # NVSwitch: everyone reaches 7, not 4


# ---- bad requests: the message names the bad value and the valid choices -----------------------------------

@pytest.mark.parametrize("spec, valid", [
    ("0,0", "[0, 1]"),
    ("7", "[0, 1]"),
    (7, "[0, 1]"),
    ("-1", "[0, 1]"),
    ("abc", "[0, 1]"),
    ("", "'all', 'auto'"),
    ("  ", "'all', 'auto'"),
    ([], "[0, 1]"),
    ([0, "x"], "[0, 1]"),
    ([0, 1.0], "[0, 1]"),
    (True, "'all', 'auto'"),
    (None, "'all', 'auto'"),
    ({0: 1}, "'all', 'auto'"),
])
def test_parse_gpus_errors(spec, valid):
    topo = topo_of("h200_x2")
    with pytest.raises(ValueError) as info:
        policy.parse_gpus(spec, topo)
    message = str(info.value)
    assert f"gpus={spec!r}" in message  # the value as given
    assert valid in message  # the valid choices


def test_parse_gpus_hidden_gpu_says_so():
    with pytest.raises(ValueError, match=r"hidden from TensorFlow by CUDA_VISIBLE_DEVICES.*\[1\]"):
        policy.parse_gpus("0", topo_of("h200_x2"), visible=[1])


@pytest.mark.parametrize("spec, expected", [
    ("all", (0, 1)), ("ALL", (0, 1)), (" auto ", (0, 1)), ("1,0", (1, 0)), ("1", (1,)), (1, (1,)),
    ([1, 0], (1, 0)), ((0,), (0,)), (["1", "0"], (1, 0)),
])
def test_parse_gpus_accepts(spec, expected):
    assert policy.parse_gpus(spec, topo_of("h200_x2")) == expected


@pytest.mark.parametrize("ops", ["NCCL", "ring", "", None, "hierarchical_copy"])
def test_unknown_ops_name_raises(ops):
    with pytest.raises(ValueError) as info:
        policy.make_plan(topo_of("h200_x2"), "all", ops)
    message = str(info.value)
    assert f"cross_device_ops={ops!r}" in message
    assert all(repr(choice) in message for choice in policy.OPS_CHOICES)


@pytest.mark.parametrize("num_packs", [-1, 1.5, "2", True])
def test_bad_num_packs_raises(num_packs):
    with pytest.raises(ValueError) as info:
        policy.make_plan(topo_of("h200_x2"), "all", "auto", num_packs=num_packs)
    message = str(info.value)
    assert f"num_packs={num_packs!r}" in message
    assert "non-negative integer" in message and "None" in message


def test_num_packs_with_unpacked_ops_raises():
    with pytest.raises(ValueError, match=r"num_packs applies to cross_device_ops in \['nccl', 'hierarchical'\]"):
        policy.make_plan(topo_of("h200_x2"), "all", "reduce_to_one", num_packs=2)
