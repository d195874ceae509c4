"""tests/scenarios.py, the shared scenario processes: answers per case, each failure with its own traceback."""

import types

import pytest

import scenarios

PLAIN = scenarios.Scenario("plain python", prelude="import os\nbase = 21\n", cases={
    "doubles": "result = {'value': base * 2, 'pid': os.getpid()}",
    "raises": "raise ValueError('this case is broken')",
    "after a failure": "result = {'value': base, 'pid': os.getpid()}",
    "isolated": "base = 0\nresult = base",
    "sees the prelude again": "result = base",
})


def test_each_case_answers_from_one_process():
    doubled, later = PLAIN.result("doubles"), PLAIN.result("after a failure")
    assert doubled["value"] == 42 and later["value"] == 21 and doubled["pid"] == later["pid"]


def test_a_raising_case_fails_its_own_test_with_its_traceback():
    error = PLAIN.error("raises")
    assert "ValueError: this case is broken" in error and '"<case raises>"' in error, error
    with pytest.raises(pytest.fail.Exception, match="case 'raises' raised:(.|\n)*this case is broken"):
        PLAIN.result("raises")
    with pytest.raises(pytest.fail.Exception, match="did not raise"):
        PLAIN.error("doubles")


def test_a_case_changing_a_prelude_name_does_not_change_it_for_the_next():
    assert PLAIN.result("isolated") == 0 and PLAIN.result("sees the prelude again") == 21


def test_an_unknown_case_is_named():
    with pytest.raises(AssertionError, match="no case 'nope' in scenario 'plain python'"):
        PLAIN.result("nope")


def test_a_crashing_process_fails_every_case_with_its_output():
    crashing = scenarios.Scenario("crashing", prelude="import sys\nprint('prelude ran')\nsys.exit(3)\n",
                                  cases={"any": "result = 1"})
    with pytest.raises(pytest.fail.Exception, match="exited with 3(.|\n)*prelude ran"):
        crashing.result("any")


def test_a_preloaded_process_has_tensorflow_imported_and_its_device_list_still_open():
    code = ("import sys, tensorflow as tf\n"
            "imported = 'tensorflow' in sys.modules\n"
            "cpu = tf.config.list_physical_devices('CPU')[0]\n"
            "tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 3)\n"
            "print(imported, len(tf.config.list_logical_devices('CPU')), sys.argv[1:])\n")
    first, second = scenarios.start_preloaded(code, argv=["a", "b"]), scenarios.start_preloaded(code)
    assert first.wait().stdout == "True 3 ['a', 'b']\n" and second.wait().stdout == "True 3 []\n"


def test_a_preloaded_process_exits_as_python_does_and_is_killed_past_its_timeout():
    assert scenarios.run_preloaded("import sys; print('out'); sys.exit(3)").returncode == 3
    raised = scenarios.run_preloaded("raise KeyError('broken')")
    assert raised.returncode == 1 and "KeyError: 'broken'" in raised.stderr
    assert scenarios.run_preloaded("import os; print(os.environ['X'])", env={"X": "seen"}).stdout == "seen\n"
    assert scenarios.run_preloaded("import time; time.sleep(60)", timeout=1).returncode == -9


SCRIPT = scenarios.Background("a script with arguments", [str(scenarios.ROOT / "tests" / "echo_argv.py"), "a", "b"],
                              env={"ECHO_PREFIX": "argv:"}, expected_s=0.5)


def test_a_background_process_runs_its_script_once_with_its_arguments_and_environment():
    done = SCRIPT.wait()
    assert (done.returncode, done.stdout) == (0, "argv: ['a', 'b']\n")
    assert SCRIPT.wait() is done


def test_background_processes_start_longest_first_and_slow_ones_only_for_slow_tests():
    module = "/repo/tests/test_x.py"
    item = types.SimpleNamespace(fspath=module, get_closest_marker=lambda name: None)
    slow_item = types.SimpleNamespace(fspath=module, get_closest_marker=lambda name: name == "slow")
    made = [scenarios.Background(name, "pass", expected_s=seconds, slow=slow, _module=module)
            for name, seconds, slow in (("short", 1, False), ("long", 30, False), ("slow", 60, True),
                                        ("middle", 10, False), ("short too", 1, False))]
    scenarios._DECLARED[-len(made):] = []  # never started: these only test the order
    assert [p.name for p in scenarios.start_order([item], made)] == ["long", "middle", "short", "short too"]
    assert [p.name for p in scenarios.start_order([slow_item], made)] == ["slow", "long", "middle", "short",
                                                                          "short too"]
    assert scenarios.start_order([types.SimpleNamespace(fspath="/elsewhere.py",
                                                        get_closest_marker=lambda name: None)], made) == []
