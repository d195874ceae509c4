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
test of its module is marked slow (it still starts on first use). A process that is not a set of cases (a driver
script that prints its own result) is declared as a `Background` and started the same way.

The background processes start longest first (`expected_s`, the CPU seconds each took on a 2-core machine), one
more at a time than there are cores: a long process started last would end the run alone.

Importing TensorFlow costs seconds of CPU in every process, so the processes fork from one that imported it once
(`run_preloaded`; a scenario with its own `env`, or `preload=False`, starts a fresh interpreter instead). The
imported, never-used TensorFlow has fixed no device list: each forked process chooses its own layout as a fresh
interpreter does.
"""

import json
import os
import shutil
import signal
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

# The process the preloaded ones fork from: imports TensorFlow (using nothing of it), then per request line
# (JSON: code, argv, env, and the paths of stdout, stderr, pid and exit status) forks a child in its own process
# group that runs `code` as `python -c` would; it writes each child's exit status once the child is gone.
_FORK_SERVER = r"""
import json, os, select, signal, sys, traceback
import tensorflow  # noqa: F401 - the import every child shares
children = {}
def reap():
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        with open(children.pop(pid) + ".tmp", "w") as out:
            out.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(out.name, out.name[:-4])
pending, ended = b"", False
while not ended:
    requests = []
    if select.select([0], [], [], 0.1)[0]:
        chunk = os.read(0, 1 << 20)
        ended = not chunk
        pending += chunk
        *lines, pending = pending.split(b"\n")
        requests = [json.loads(line) for line in lines if line]
    for request in requests:
        pid = os.fork()
        if pid == 0:
            os.setsid()
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.environ.clear()
            os.environ.update(request["env"])
            sys.argv = ["-c", *request["argv"]]
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            code = 0
            try:
                exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        children[pid] = request["status"]
        with open(request["pid"], "w") as out:
            out.write(str(pid))
    reap()
for pid in children:  # pytest has gone: nothing waits for these
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""
_FORK_SERVER_LOCK = threading.Lock()
_fork_server = None


def _environment(env=None):
    """The environment of a test process: the repository and tests/ importable, then `env`."""
    environment = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + str(ROOT / "tests") + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    environment.update(env or {})
    return environment


def _start_fork_server():
    """Starts the process that preloaded ones fork from, unless it runs (hold _FORK_SERVER_LOCK)."""
    global _fork_server
    if _fork_server is None or _fork_server.poll() is not None:
        log = tempfile.NamedTemporaryFile("w", prefix="tf_nvlink_fork_server_", delete=False)
        _fork_server = subprocess.Popen([sys.executable, "-c", _FORK_SERVER], env=_environment(), cwd=ROOT,
                                        stdin=subprocess.PIPE, stdout=log, stderr=log, text=True)
        _fork_server.log = log.name


class Preloaded:
    """`python -c code argv...` run in a process forked from one that imported TensorFlow: `start_preloaded`
    returns it at once, `wait()` gives the CompletedProcess."""

    def __init__(self, code, argv, env, timeout):
        self.timeout, self.args = timeout, ["python", "-c", "...", *argv]
        self.folder = tempfile.mkdtemp(prefix="tf_nvlink_preloaded_")
        paths = {name: os.path.join(self.folder, name) for name in ("stdout", "stderr", "pid", "status")}
        self.paths, self.began = paths, time.monotonic()
        with _FORK_SERVER_LOCK:
            _start_fork_server()
            _fork_server.stdin.write(json.dumps({"code": code, "argv": list(argv), "env": _environment(env),
                                                 **paths}) + "\n")
            _fork_server.stdin.flush()
            self.server = _fork_server

    def _read(self, name):
        try:
            with open(self.paths[name], errors="replace") as handle:  # TensorFlow may log raw bytes
                return handle.read()
        except FileNotFoundError:
            return ""

    def kill(self):
        pid = self._read("pid")
        if pid and not os.path.exists(self.paths["status"]):
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait(self):
        """The CompletedProcess (killed after `timeout` seconds: returncode -9); its files are then removed."""
        while not os.path.exists(self.paths["status"]):
            if self.server.poll() is not None:
                with open(self.server.log) as log:
                    raise RuntimeError(f"the preloaded-TensorFlow process exited with {self.server.returncode}: "
                                       f"{log.read()[-3000:]}")
            if time.monotonic() - self.began > self.timeout:
                self.kill()
            time.sleep(0.05)
        done = subprocess.CompletedProcess(self.args, int(self._read("status")), self._read("stdout"),
                                           self._read("stderr"))
        shutil.rmtree(self.folder, ignore_errors=True)
        return done


def start_preloaded(code_or_args, env=None, timeout=600, argv=()):
    """Starts `python -c code argv...` (str) or `python script args...` (list) with TensorFlow already imported;
    returns a `Preloaded` at once.

        process = scenarios.start_preloaded("import tensorflow as tf; print(tf.add(1, 2).numpy())")
        assert process.wait().stdout == "3\n"
    """
    code, argv = _code_and_argv(code_or_args, argv)
    return Preloaded(code, argv, env, timeout)


def _code_and_argv(code_or_args, argv=()):
    """`python -c code argv...` for code (str), or for a script and its arguments (list)."""
    if isinstance(code_or_args, str):
        return code_or_args, list(argv)
    script, *argv = [str(arg) for arg in code_or_args]
    return (f"import runpy, sys\nsys.argv[0] = {script!r}\nsys.path.insert(0, {os.path.dirname(script)!r})\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n"), argv


def run_preloaded(code_or_args, env=None, timeout=600, argv=()):
    """`start_preloaded(...).wait()`: the CompletedProcess, as conftest.run_python gives it, TensorFlow preloaded."""
    return start_preloaded(code_or_args, env, timeout, argv).wait()


def stop_fork_server():
    """Ends the preloaded-TensorFlow process (it kills the children still running)."""
    global _fork_server
    with _FORK_SERVER_LOCK:
        if _fork_server is not None and _fork_server.poll() is None:
            _fork_server.stdin.close()
            try:
                _fork_server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                _fork_server.kill()
        if _fork_server is not None:
            os.unlink(_fork_server.log)
        _fork_server = None


_DECLARED = []  # every Background process (scenarios included), in import order
_LOCK = threading.Lock()


class Background:
    """One process declared when its test module is imported and started in the background as soon as pytest has
    collected a test of that module (`start_for`), longest first: `wait()` gives its CompletedProcess.

        DRIVER = scenarios.Background("exact batches: fused", code, argv=["2"], expected_s=14)
        def test_it():
            assert DRIVER.wait().returncode == 0

    `code_or_args` runs as `python -c code argv...` (str) or `python script args...` (list) would, forked from the
    process that imported TensorFlow (a fresh interpreter where `env` must be there at import: `preload=False`, the
    default when `env` is given). `expected_s`
    is the CPU seconds it took on a 2-core machine: the longest start first, so that no long process starts last and
    ends the run alone. `slow=True`: started in the background only when a selected test of its module is marked
    slow (it still starts on first use)."""

    def __init__(self, name, code_or_args, argv=(), env=None, timeout=600, slow=False, preload=None, expected_s=1.0,
                 _module=None):
        self.name = name
        self.code, self.argv = _code_and_argv(code_or_args, argv)
        self.slow, self.expected_s = slow, expected_s
        self.env, self.timeout = dict(env or {}), timeout
        # Forked from the process that imported TensorFlow, unless its own environment must be there at import.
        self.preload = not self.env if preload is None else preload
        self.module = _module or sys._getframe(1).f_globals.get("__file__")
        self._started, self._done, self._proc, self._completed = False, threading.Event(), None, None
        self._error = None
        _DECLARED.append(self)
        if self.preload and not slow:  # TensorFlow's import in the process they fork from, while pytest collects
            with _FORK_SERVER_LOCK:
                _start_fork_server()

    def start(self):
        """Starts the process (once); returns at once. A background thread waits for it."""
        with _LOCK:
            if self._started:
                return
            self._started = True
        threading.Thread(target=self._run, name=f"background {self.name}", daemon=True).start()

    def _run(self):
        env = dict(self.env)
        env.setdefault("TF_NVLINK_CACHE_DIR", tempfile.mkdtemp(prefix="tf_nvlink_background_"))
        self.began = time.monotonic()
        try:
            if self.preload:
                self._proc = Preloaded(self.code, self.argv, env, self.timeout)
                self._completed = self._proc.wait()
            else:
                self._proc = subprocess.Popen([sys.executable, "-c", self.code, *self.argv], env=_environment(env),
                                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                try:
                    stdout, stderr = self._proc.communicate(timeout=self.timeout)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    stdout, stderr = self._proc.communicate()
                self._completed = subprocess.CompletedProcess(self._proc.args, self._proc.returncode, stdout, stderr)
        except Exception as error:  # every test of it fails with this
            self._error = f"{type(error).__name__}: {error}"
        finally:
            self._done.set()

    def wait(self):
        """The CompletedProcess (starts the process if nothing did; killed after `timeout` s: returncode -9)."""
        self.start()
        self._done.wait()
        if self._error:
            pytest.fail(f"background process {self.name!r}: {self._error}", pytrace=False)
        return self._completed

    def kill(self):
        """Kills the process if it still runs."""
        if isinstance(self._proc, subprocess.Popen) and self._proc.poll() is None:
            self._proc.kill()
        elif isinstance(self._proc, Preloaded):
            self._proc.kill()


class Scenario(Background):
    """One subprocess running `prelude` once, then every case of `cases` ({name: body}); see the module doc."""

    def __init__(self, name, prelude, cases, env=None, timeout=600, slow=False, preload=None, expected_s=1.0):
        self.prelude, self.cases = prelude, dict(cases)
        super().__init__(name, _RUNNER, [json.dumps(self.cases), prelude], env, timeout, slow, preload, expected_s,
                         _module=sys._getframe(1).f_globals.get("__file__"))
        self._answers, self._failure = None, None

    def answer(self, case):
        """{"result": ...} or {"error": traceback} of one case (starts the process if nothing did)."""
        assert case in self.cases, f"no case {case!r} in scenario {self.name!r}: {sorted(self.cases)}"
        done = self.wait()
        with _LOCK:
            if self._answers is None and self._failure is None:
                lines = [line for line in done.stdout.splitlines() if line.startswith("SCENARIO ")]
                if done.returncode == 0 and lines:
                    self._answers = json.loads(lines[-1][len("SCENARIO "):])
                else:
                    self._failure = (f"scenario process {self.name!r} exited with {done.returncode} after "
                                     f"{time.monotonic() - self.began:.0f} s (limit {self.timeout} s):\n"
                                     f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
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


def start_order(items, declared=None):
    """The background processes (of `declared`, else every one) that the tests `items` use, longest first."""
    modules = {str(item.fspath) for item in items}
    with_slow = {str(item.fspath) for item in items if item.get_closest_marker("slow")}
    wanted = [process for process in (_DECLARED if declared is None else declared)
              if process.module in (with_slow if process.slow else modules)]
    return sorted(wanted, key=lambda process: -process.expected_s)  # stable: declaration order otherwise


def start_for(items):
    """Starts the background processes of the modules that `items` test, the longest (`expected_s`) first, one more
    at a time than the machine has cores."""
    queue = start_order(items)

    def run_in_turn():  # each runner starts the next process not yet started (a test may have started it)
        while True:
            with _LOCK:
                if not queue:
                    return
                process = queue.pop(0)
            process.start()
            process._done.wait()

    # One more at once than there are cores: the tests that wait for them mostly sleep, and a TensorFlow process
    # leaves its core idle at times (one thread compiling, replicas waiting for each other).
    for index in range(min(len(queue), (os.cpu_count() or 1) + 1)):
        threading.Thread(target=run_in_turn, name=f"background {index}", daemon=True).start()


def stop_all():
    """Kills the background processes still running (the session ends before their tests ran, e.g. -x)."""
    for process in _DECLARED:
        process.kill()
    stop_fork_server()
