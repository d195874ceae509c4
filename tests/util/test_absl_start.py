"""tf_nvlink.util.absl_start: a function run when absl's app.run starts, before its flags and init callbacks."""

import sys

import pytest
from absl import app

from tf_nvlink.util import absl_start


@pytest.fixture
def calls(monkeypatch):
    """absl's app.run replaced by one that records its call (restored after the test); no callback registered."""
    recorded = []

    def run(main, argv=None, **kwargs):
        recorded.append(("run", main, argv, kwargs))
        return "ran"

    monkeypatch.setattr(app, "run", run)
    monkeypatch.setattr(absl_start, "_CALLBACKS", [])
    return recorded


def test_the_callback_runs_before_app_run_and_the_call_passes_through(calls):
    assert absl_start.before_app_run(lambda: calls.append("callback"))
    assert app.run(print, ["prog"], flags_parser=len) == "ran"
    assert calls == ["callback", ("run", print, ["prog"], {"flags_parser": len})]


def test_a_callback_registered_twice_runs_once_and_run_is_wrapped_once(calls):
    def callback():
        calls.append("callback")

    absl_start.before_app_run(callback)
    wrapped = app.run
    absl_start.before_app_run(callback)
    assert app.run is wrapped
    app.run(print)
    assert calls == ["callback", ("run", print, None, {})]


def test_without_absl_imported_nothing_is_set_up(calls, monkeypatch):
    monkeypatch.delitem(sys.modules, "absl.app")
    assert absl_start.before_app_run(lambda: calls.append("callback")) is False
    assert absl_start._CALLBACKS == []


def test_a_callback_must_be_callable(calls):
    with pytest.raises(TypeError, match=r"a function of no arguments\. Received: 'not a function'"):
        absl_start.before_app_run("not a function")
