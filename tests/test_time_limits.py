"""Every test runs under a time limit (pytest-timeout), so a hang fails in minutes with a stack, not at CI's end."""

import configparser

import pytest

from conftest import ROOT, SLOW_TIMEOUT_S, run_python


def pytest_ini():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def test_default_limit_is_configured_and_pytest_timeout_is_in_the_test_extra(request):
    config = pytest_ini()
    limit = int(config["tool:pytest"]["timeout"])
    assert 60 <= limit <= 900, limit
    assert "pytest-timeout" in config["options.extras_require"]["test"]
    # the running session reads it: the plugin is loaded and the option has the configured value
    assert request.config.pluginmanager.hasplugin("timeout")
    assert int(request.config.getini("timeout")) == limit


def test_slow_and_gpu_tests_get_the_longer_limit(request):
    assert SLOW_TIMEOUT_S > int(pytest_ini()["tool:pytest"]["timeout"])
    marker = request.node.get_closest_marker("timeout")
    assert marker is None  # this default-tier test keeps the ini limit


@pytest.mark.slow
def test_a_slow_test_carries_the_slow_limit(request):
    assert request.node.get_closest_marker("timeout").args == (SLOW_TIMEOUT_S,)


def test_a_hanging_test_fails_with_a_stack(tmp_path):
    (tmp_path / "test_hang.py").write_text(
        "import time, pytest\n\n@pytest.mark.timeout(1)\ndef test_hang():\n    time.sleep(30)\n")
    result = run_python(["-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_hang.py")],
                        cwd=tmp_path, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "Timeout" in out and "time.sleep(30)" in out, out
