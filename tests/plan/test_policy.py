"""tf_nvlink.plan.policy: what the policy chooses on every fake machine, and how it refuses bad requests."""

import itertools
import dataclasses

import pytest

import fake_nvml
from fake_nvml import FakeNvml
from error_messages import raises_naming
from tf_nvlink.machine import nvml

from tf_nvlink.plan import policy
from tf_nvlink.plan import cube_mesh
from tf_nvlink.plan import gpu_request
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
                assert cube_mesh.is_dgx1_like(topo, subset)


def test_is_dgx1_like():
    assert cube_mesh.is_dgx1_like(topo_of("dgx1_v100_x8"), ALL8)
    assert not cube_mesh.is_dgx1_like(topo_of("dgx1_v100_x8"), ALL8[:4])
    assert not cube_mesh.is_dgx1_like(topo_of("h100_hgx_x8"), ALL8)  # NVSwitch: everyone reaches 7, not 4


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
        gpu_request.parse_gpus(spec, topo)
    message = str(info.value)
    assert f"gpus={spec!r}" in message  # the value as given
    assert valid in message  # the valid choices


def test_parse_gpus_hidden_gpu_says_so():
    with pytest.raises(ValueError, match=r"hidden from TensorFlow by CUDA_VISIBLE_DEVICES.*\[1\]"):
        gpu_request.parse_gpus("0", topo_of("h200_x2"), visible=[1])


@pytest.mark.parametrize("spec, expected", [
    ("all", (0, 1)), ("ALL", (0, 1)), (" auto ", (0, 1)), ("1,0", (1, 0)), ("1", (1,)), (1, (1,)),
    ([1, 0], (1, 0)), ((0,), (0,)), (["1", "0"], (1, 0)),
])
def test_parse_gpus_accepts(spec, expected):
    assert gpu_request.parse_gpus(spec, topo_of("h200_x2")) == expected


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


# ---------------------------------------------------------------- bad requests refused, one line naming them
H200 = "h200_x2"
GPUS_CASES = [  # (gpus, what the message must contain besides the value: the valid choices)
    ("0,0", "[0, 1]"), ("7", "[0, 1]"), ("-1", "[0, 1]"), (-1, "[0, 1]"), ("abc", "[0, 1]"), ("", "'all', 'auto'"),
    ([], "[0, 1]"), ([0, "x"], "[0, 1]"), ("0,,1", "[0, 1]"), ([0, 1.0], "[0, 1]"), (None, "'all', 'auto'"),
    (1.5, "'all', 'auto'"), (True, "'all', 'auto'"),
]


@pytest.mark.parametrize("gpus, choices", GPUS_CASES, ids=[repr(c[0]) for c in GPUS_CASES])
def test_bad_gpus_on_a_two_gpu_machine(gpus, choices):
    raises_naming(lambda: policy.make_plan(topo_of(H200), gpus), f"gpus={gpus!r}", choices)


@pytest.mark.parametrize("gpus", ["0,0", "-1", "abc", "", [], [0, "x"], None, 1.5],
                         ids=lambda v: repr(v))
def test_bad_gpus_without_any_gpu_are_still_refused(gpus):
    """A malformed request fails on a laptop too, not first on the GPU machine (well-formed ones name the reason)."""
    raises_naming(lambda: policy.make_plan(topo_of("no_driver"), gpus), f"gpus={gpus!r}")
    assert policy.make_plan(topo_of("no_driver"), "all").gpus == ()  # "all" falls back to the CPU
    # (well-formed indices raise without a usable GPU: test_explicit_gpus_without_a_usable_gpu_raise_all_and_auto_fall_back)


OPS_CASES = ["NCCL", "ring", "", None, "hierarchical_copy", 42]


@pytest.mark.parametrize("ops", OPS_CASES, ids=repr)
def test_unknown_cross_device_ops(ops):
    message = raises_naming(lambda: policy.make_plan(topo_of(H200), "all", ops), f"cross_device_ops={ops!r}")
    assert all(repr(choice) in message for choice in policy.OPS_CHOICES), message


@pytest.mark.parametrize("num_packs", [-1, -100, 1.5, "2", True, [1]], ids=repr)
def test_bad_num_packs(num_packs):
    raises_naming(lambda: policy.make_plan(topo_of(H200), "all", "nccl", num_packs=num_packs),
                   f"num_packs={num_packs!r}", "non-negative integer", "None")


POLICY_INPUTS = [  # (id, call, needles)
    ("num_packs with unpacked ops", lambda: policy.make_plan(topo_of(H200), "all", "collective", num_packs=2),
     ("num_packs=2", "['nccl', 'hierarchical']")),
    ("hierarchical on 3 GPUs", lambda: policy.make_plan(topo_of("h100_hgx_x8"), "0,1,2", "hierarchical"),
     ("'hierarchical' with 3 GPUs", "'nccl'")),
    ("nccl without GPUs", lambda: policy.make_plan(topo_of("no_driver"), "all", "nccl"),
     ("cross_device_ops='nccl'", "'reduce_to_one'")),
    ("xla_allreduce", lambda: policy.make_plan(topo_of(H200), "all", "auto", xla_allreduce="fast"),
     ("xla_allreduce='fast'", "['auto', 'fused', 'split']")),
    ("fused without GPUs", lambda: policy.make_plan(topo_of("no_driver"), "all", "auto", xla_allreduce="fused"),
     ("xla_allreduce='fused'", "'split'")),
    ("hidden GPU", lambda: policy.make_plan(topo_of(H200), "0", visible=[1]),
     ("GPU 0", "CUDA_VISIBLE_DEVICES", "[1]")),
]


@pytest.mark.parametrize("call, needles", [c[1:] for c in POLICY_INPUTS], ids=[c[0] for c in POLICY_INPUTS])
def test_other_bad_plan_requests(call, needles):
    raises_naming(call, *needles)


# ---------------------------------------------------------------- hierarchical only on real NVLink quads
DGX1 = "dgx1_v100_x8"
QUADS_FIRST = [0, 1, 2, 3, 4, 5, 6, 7]  # DGX-1: quads 0-3 and 4-7, i <-> i+4 linked


@pytest.mark.parametrize("request_kind, gpus, visible", [
    ("gpus interleaved", "0,4,1,5,2,6,3,7", None),
    ("gpus reversed", [7, 6, 5, 4, 3, 2, 1, 0], None),
    ("CUDA_VISIBLE_DEVICES interleaved, gpus=all", "all", [0, 4, 1, 5, 2, 6, 3, 7]),
    ("CUDA_VISIBLE_DEVICES shuffled, gpus=auto", "auto", [3, 6, 0, 5, 7, 1, 4, 2]),
    ("hierarchical asked, interleaved", "0,4,1,5,2,6,3,7", None),
])
def test_hierarchical_halves_are_the_nvlink_quads_whatever_the_request_order(request_kind, gpus, visible):
    topo = topo_of(DGX1)
    ops = "hierarchical" if "asked" in request_kind else "auto"
    plan = policy.make_plan(topo, gpus, ops, visible=visible)
    assert plan.cross_device_ops == "hierarchical"
    first, second = plan.gpus[:4], plan.gpus[4:]
    for half in (first, second):  # each half (what HierarchicalCopyAllReduce reduces within) is a quad
        assert all(topo.pair(a, b).direct_links for a in half for b in half if a < b), plan.gpus
    for k in range(4):  # position k copies to position k + 4: a direct link
        assert topo.pair(first[k], second[k]).direct_links, plan.gpus
    assert sorted(plan.gpus) == QUADS_FIRST


def test_summary_of_a_plan_on_unmapped_gpus_names_the_tensorflow_devices():
    plan = policy.make_plan(topo_of("h200_x2"), "all", visible=[])
    on_mig = dataclasses.replace(plan, devices=("/device:GPU:0",), reason="MIG instance(s) ['MIG-x']")
    assert "TensorFlow devices ['/device:GPU:0']" in on_mig.summary() and "CPU" not in on_mig.summary()


@pytest.mark.parametrize("machine, gpus, needle", [
    ("no_driver", "0", "Driver Not Loaded"), ("no_driver", [0], "Driver Not Loaded"), ("no_driver", 0, "NVML"),
    ("h200_x2", "0,1", "CUDA_VISIBLE_DEVICES hides every GPU"),
])
def test_explicit_gpus_without_a_usable_gpu_raise_all_and_auto_fall_back(machine, gpus, needle):
    visible = [] if machine == "h200_x2" else None
    with pytest.raises(ValueError) as info:
        policy.make_plan(topo_of(machine), gpus, visible=visible)
    message = str(info.value)
    assert f"gpus={gpus!r}" in message and needle in message and "'all' or 'auto'" in message, message
    for fallback in ("all", "auto"):  # only these fall back to the CPU
        assert policy.make_plan(topo_of(machine), fallback, visible=visible).gpus == ()


def test_no_gpu_reason_given_by_the_caller_is_named():
    with pytest.raises(ValueError, match="built without CUDA"):
        policy.make_plan(topo_of("h200_x2"), "0", visible=[], no_gpu_reason="TensorFlow is built without CUDA")


def test_decide_plans_mig_and_names_why_explicit_gpus_cannot_be_honoured():
    """policy.decide, the pure function strategy() and the report call: the MIG plan and the no-GPU reasons."""
    mig = "MIG-4f1c0e2a-aaaa-bbbb-cccc-000000000000"
    on_mig = policy.Facts(topo_of("h200_x2"), visible=(), tf_gpu_count=1, mig=(mig,))
    plan, warnings = policy.decide(on_mig, "all")
    assert plan.gpus == () and plan.cross_device_ops == "reduce_to_one" and "no NVLink plan" in plan.reason
    assert len(warnings) == 1 and mig in warnings[0] and "no NVLink" in warnings[0], warnings
    assert policy.decide(dataclasses.replace(on_mig, tf_gpu_count=2), "auto")[0].cross_device_ops == "collective"
    with pytest.raises(ValueError, match=r"gpus='0' names GPUs.*MIG instance.*gpus='all' mirrors over them"):
        policy.decide(on_mig, "0")
    tf_sees_none = policy.Facts(topo_of("h200_x2"), visible=(0, 1), tf_gpu_count=0,
                                no_gpu_cause="this TensorFlow is built without CUDA")
    with pytest.raises(ValueError, match=r"gpus=\[0\].*TensorFlow sees none: this TensorFlow is built without CUDA"):
        policy.decide(tf_sees_none, [0])
    plan, warnings = policy.decide(tf_sees_none, "all")
    assert plan.gpus == () and len(warnings) == 1 and "falling back to the CPU" in warnings[0]
