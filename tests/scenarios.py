"""Many test cases in one subprocess per device layout.

TensorFlow fixes its device list at first use and tolerates one MirroredStrategy per process, so cases that need
their own layout run in a subprocess; starting TensorFlow costs seconds, so the cases of one layout share one.
A test module declares its scenario process at import:

    INSTALL = scenarios.Scenario("install", prelude=PRELUDE, cases={"fit": FIT_BODY, "auto jit": AUTO_BODY})

The prelude runs once (imports, the logical devices, the strategy); each case body then runs in its own copy of
the prelude's namespace and leaves its answer in `result` (anything JSON can hold). The process starts in the
background as soon as pytest has collected a test of that module (conftest.pytest_collection_finish), so it runs
while the in-process tests do; `INSTALL.result("fit")` waits for it and returns that case's `result`, or fails
with the case's own traceback. A scenario declared with `slow=True` starts in the background only when a selected
test of its module is marked slow (it still starts on first use).
"""

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_RUNNER = r'''
import json, sys, traceback
_cases = json.loads(sys.argv[1])
_prelude = {"__name__": "__scenario__"}
exec(compile(sys.argv[2], "<prelude>", "exec"), _prelude)
_answers = {}
for _name, _body in _cases.items():
    _namespace = dict(_prelude)
    try:
        exec(compile(_body, "<case " + _name + ">", "exec"), _namespace)
        _answers[_name] = {"result": _namespace.get("result")}
    except BaseException:
        _answers[_name] = {"error": traceback.format_exc()}
print("SCENARIO " + json.dumps(_answers))
'''
_DECLARED = []  # every Scenario, in import order
_LOCK = threading.Lock()


class Scenario:
    """One subprocess running `prelude` once, then every case of `cases` ({name: body}); see the module doc."""

    def __init__(self, name, prelude, cases, env=None, timeout=600, slow=False):
        self.name, self.prelude, self.cases = name, prelude, dict(cases)
        self.slow = slow  # started in the background only when a selected test of its module is marked slow
        self.env, self.timeout = dict(env or {}), timeout
        self.module = sys._getframe(1).f_globals.get("__file__")
        self._started, self._done, self._proc = False, threading.Event(), None
        self._answers, self._failure = None, None
        _DECLARED.append(self)

    def start(self):
        """Starts the process (once); returns at once. A background thread waits for it."""
        with _LOCK:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name=f"scenario {self.name}", daemon=True).start()

    def _run(self):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + str(ROOT / "tests") + os.pathsep
                   + os.environ.get("PYTHONPATH", ""))
        env.update(self.env)
        env.setdefault("TF_NVLINK_CACHE_DIR", tempfile.mkdtemp(prefix=f"tf_nvlink_scenario_{self.name}_"))
        began = time.monotonic()
        try:
            self._proc = subprocess.Popen([sys.executable, "-c", _RUNNER, json.dumps(self.cases), self.prelude],
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True)
            try:
                stdout, stderr = self._proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                stdout, stderr = self._proc.communicate()
            lines = [line for line in stdout.splitlines() if line.startswith("SCENARIO ")]
            if self._proc.returncode == 0 and lines:
                self._answers = json.loads(lines[-1][len("SCENARIO "):])
            else:
                self._failure = (f"scenario process {self.name!r} exited with {self._proc.returncode} after "
                                 f"{time.monotonic() - began:.0f} s (limit {self.timeout} s):\n{stdout[-3000:]}\n"
                                 f"{stderr[-5000:]}")
        except Exception as error:  # every case of it fails with this
            self._failure = f"scenario process {self.name!r}: {type(error).__name__}: {error}"
        finally:
            self._done.set()

    def answer(self, case):
        """{"result": ...} or {"error": traceback} of one case (starts the process if nothing did)."""
        assert case in self.cases, f"no case {case!r} in scenario {self.name!r}: {sorted(self.cases)}"
        self.start()
        self._done.wait()
        if self._failure:
            pytest.fail(self._failure, pytrace=False)
        return self._answers[case]

    def result(self, case):
        """The case's `result`; fails the test with the case's own traceback if the case raised."""
        answer = self.answer(case)
        if "error" in answer:
            pytest.fail(f"scenario {self.name!r}, case {case!r} raised:\n{answer['error']}", pytrace=False)
        return answer["result"]

    def error(self, case):
        """The traceback text of a case expected to raise (fails the test if it did not)."""
        answer = self.answer(case)
        if "error" not in answer:
            pytest.fail(f"scenario {self.name!r}, case {case!r} did not raise: result {answer['result']!r}",
                        pytrace=False)
        return answer["error"]


def start_for(items):
    """Starts the scenarios of the modules that `items` test in background threads, in declaration order, as many
    processes at a time as the machine has cores."""
    modules = {str(item.fspath) for item in items}
    with_slow = {str(item.fspath) for item in items if item.get_closest_marker("slow")}
    wanted = [scenario for scenario in _DECLARED
              if scenario.module in (with_slow if scenario.slow else modules)]

    queue = list(wanted)

    def run_in_turn():  # each runner starts the next scenario not yet started (a test may have started it)
        while True:
            with _LOCK:
                if not queue:
                    return
                scenario = queue.pop(0)
            scenario.start()
            scenario._done.wait()

    # As many scenario processes at once as there are cores: the tests that wait for them mostly sleep.
    for index in range(min(len(queue), max(1, os.cpu_count() or 1))):
        threading.Thread(target=run_in_turn, name=f"scenarios {index}", daemon=True).start()


def stop_all():
    """Kills the scenario processes still running (the session ends before their tests ran, e.g. -x)."""
    for scenario in _DECLARED:
        if scenario._proc is not None and scenario._proc.poll() is None:
            scenario._proc.kill()
