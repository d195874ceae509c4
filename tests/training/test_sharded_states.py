"""Sharded optimizer states (`tf_nvlink.strategy(optimizer_states="sharded")`, tf_nvlink.training.sharded_states)
against one device: float32 weights within 1e-5 after 2 epochs of uneven batches (25 examples: 13 + 12 on 2
replicas, 7 + 6 + 6 + 6 on 4), every replica's copy the same bit for bit, the slots on their owner's device only,
checkpoints whole, and the optimizers and options not made exact refused.

`sharded_states_cases.py` trains every case in one process per layout. The default run: fused mode (the GPU path,
emulated on CPU replicas) on 2 replicas with the main optimizers per step and in the compiled execution, the
checkpoints and the refusals; split mode on 4 replicas with the main optimizers. The slow tier: every case on
fused 2 and 4, split 2 and 4 and plain 2 replicas (RMSprop, Adagrad, Lion, LAMB, Adamax, Adadelta, Ftrl, Nadam,
clipnorm, clipvalue, gradient accumulation, a LossScaleOptimizer, synchronized BatchNorm).
"""

from pathlib import Path

import numpy as np
import pytest

import scenarios

_CASES = str(Path(__file__).resolve().parent / "sharded_states_cases.py")
MAIN = ["sgd_momentum", "adam", "adamw", "adamw_global_clipnorm", "sgd_momentum_spe3", "adam_spe3",
        "adamw_global_clipnorm_spe3"]
REST = ["rmsprop", "adagrad", "lion", "lamb", "adamax", "adadelta", "ftrl", "nadam", "nadam_accumulate_spe3",
        "clipnorm", "clipvalue", "accumulate", "accumulate_spe3", "loss_scale", "loss_scale_accumulate",
        "batchnorm", "batchnorm_spe3"]
CHECKS = ["memory", "memory_log", "save", "resume", "save_weights", "request_key", "refused_adafactor", "refused_subclass",
          "refused_ema"]
SPLIT_MAIN = ["adam", "adamw_global_clipnorm", "sgd_momentum_spe3"]


def _scenario(name, layout, cases, slow, expected_s=1.0):
    body = (f"import runpy, sys\n"
            f"sys.argv = [{_CASES!r}, {layout!r}, {','.join(cases)!r}]\n"
            f"result = runpy.run_path({_CASES!r}, run_name='__main__')['results']\n")
    return scenarios.Scenario(name, prelude="", cases={"all": body}, timeout=900, slow=slow,
                              expected_s=expected_s)


SINGLE = _scenario("sharded_states_single", "single", MAIN, slow=False, expected_s=3)
FUSED2 = _scenario("sharded_states_fused2", "fused2", MAIN + CHECKS, slow=False, expected_s=25)
SPLIT4 = _scenario("sharded_states_split4", "split4", SPLIT_MAIN + ["memory", "memory_log"], slow=False,
                   expected_s=17)
ONE = _scenario("sharded_states_plain1", "plain1", ["adam", "slot_kinds"], slow=False)
BATCHNORM = ["batchnorm", "batchnorm_spe3"]  # synchronized BatchNorm: fused and plain (split mode refuses it)


def _slow_cases(layout):
    cases = (REST if layout == "fused2" else MAIN + REST) + ["memory"]
    return [case for case in cases if not (layout.startswith("split") and case in BATCHNORM)]


SLOW = {"single": _scenario("sharded_states_single_slow", "single", REST, slow=True),
        **{layout: _scenario(f"sharded_states_{layout}_slow", layout, _slow_cases(layout), slow=True)
           for layout in ("fused2", "fused4", "split2", "split4", "plain2")}}


def _reference(case):
    return (SINGLE if case in MAIN else SLOW["single"]).result("all")[case]


def _assert_as_one_device(case, got):
    assert got["agree"], f"{case}: the replicas' copies of the weights differ"
    assert got["iterations"] == _reference(case)["iterations"], case
    for a, b in zip(_reference(case)["weights"], got["weights"]):
        np.testing.assert_allclose(np.array(b), np.array(a), rtol=1e-5, atol=1e-6, err_msg=case)


@pytest.mark.parametrize("case", MAIN)
def test_fused_two_replicas_train_as_one_device(case):
    got = FUSED2.result("all")[case]
    assert got["function"] == ("CompiledExecution" if case.endswith("_spe3") else "function"), case
    _assert_as_one_device(case, got)


@pytest.mark.parametrize("case", SPLIT_MAIN)
def test_split_four_replicas_train_as_one_device(case):
    _assert_as_one_device(case, SPLIT4.result("all")[case])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fused2", "fused4", "split2", "split4", "plain2"])
@pytest.mark.parametrize("case", MAIN + REST)
def test_every_case_trains_as_one_device(layout, case):
    if case in BATCHNORM and layout.startswith("split"):
        pytest.skip("split mode refuses synchronized BatchNorm; unsynchronized statistics are each replica's")
    results = SLOW[layout].result("all")
    if case not in results:
        pytest.skip(f"{case} runs on {layout} in the default tier")
    _assert_as_one_device(case, results[case])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fused2", "fused4", "split2", "split4", "plain2"])
def test_slots_sit_on_their_owners_device_in_every_layout(layout):
    _assert_memory_bound(SLOW[layout].result("all")["memory"], int(layout[-1]))


def test_backup_weights_restore_the_slots_of_a_sharded_run():
    restored = FUSED2.result("all")["save_weights"]
    assert restored["slots"] == 0.0 and restored["agree"] and restored["difference"] < 1e-6


def test_optimizer_states_is_part_of_the_strategy_request():
    key = FUSED2.result("all")["request_key"]
    assert key["same"] and "different request" in key["other"]


def test_one_replica_takes_the_replicated_path():
    results = ONE.result("all")
    assert results["slot_kinds"] == ["MirroredVariable"]  # Keras' own slots, no owner
    _assert_as_one_device("adam", results["adam"])


def _assert_memory_bound(memory, replicas):
    """Each replica's device holds at most 1/N of the replicated optimizer state plus one largest variable's."""
    assert len(memory["held"]) == replicas and sum(memory["held"]) == memory["replicated"]
    for held in memory["held"]:
        assert 0 < held <= memory["replicated"] / replicas + memory["largest"]
    # the table tf_nvlink computes (sharded_states.memory_table) says what the placement shows
    table = memory["table"]
    assert table["replicated"]["optimizer_states"] == memory["replicated"] + memory["counters"]
    assert table["sharded"]["optimizer_states"] == max(memory["held"]) + memory["counters"]
    assert table["sharded"]["weights"] == table["replicated"]["gradients"] == memory["replicated"] // 2  # Adam: 2 slots


def test_slots_sit_on_their_owners_device_only():
    _assert_memory_bound(FUSED2.result("all")["memory"], 2)
    _assert_memory_bound(SPLIT4.result("all")["memory"], 4)


@pytest.mark.parametrize("scenario, replicas", [(FUSED2, 2), (SPLIT4, 4)])
def test_a_sharded_optimizer_logs_its_memory_once(scenario, replicas):
    # 8-32-16-4 with Adam: 7,072 bytes of slots, the largest variable's 4,096, and 12 bytes of step counters
    line = (f"optimizer states: 7.08 KB per replica replicated, 4.11 KB sharded over {replicas} replicas "
            f"(largest share 4.10 KB)")
    assert scenario.result("all")["memory_log"] == [line, line]  # two optimizers, each fitted twice


def test_a_sharded_run_saves_whole_and_loads_on_one_device():
    saved = FUSED2.result("all")["save"]
    assert saved["slots"] == 12 and saved["difference"] == 0.0 and saved["weights"] == 0.0


def test_a_one_device_checkpoint_resumes_under_sharded_states():
    resumed = FUSED2.result("all")["resume"]
    assert resumed["agree"] and resumed["slot_devices"] == 2
    assert resumed["difference"] < 1e-5


@pytest.mark.parametrize("case, names", [("refused_adafactor", "Adafactor: its factored second moments"),
                                         ("refused_subclass", "MyAdam: its update with each replica"),
                                         ("refused_ema", "use_ema=True (Adam)")])
def test_what_is_not_exact_is_refused_naming_it_and_the_valid_choices(case, names):
    error = FUSED2.result("all")[case]["error"]
    assert error is not None and names in error and "optimizer_states='replicated'" in error, error
