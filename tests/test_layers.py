"""The package's layers (setup.cfg's [importlinter] contracts, checked by `lint-imports`), and which modules stay
free of TensorFlow at import time: `import tf_nvlink`, the machine facts and the pure decisions.

`lint-imports` runs in a subprocess: in-process it reconfigures logging. Imports inside functions count for it too.
"""

from __future__ import annotations

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "tf_nvlink"


def _lint_imports(cwd: pathlib.Path) -> subprocess.CompletedProcess:
    executable = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).with_name("lint-imports"))
    if not os.path.exists(executable):
        pytest.fail("lint-imports (import-linter) is not installed: pip install import-linter")
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run([executable, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_every_layer_imports_only_the_ones_below_it():
    proc = _lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in proc.stdout, proc.stdout[-2000:]


def test_an_upward_import_breaks_the_layers_contract(tmp_path):
    """The contract is real: distribute/ importing training/ (as it once did for the hooks) fails it."""
    shutil.copytree(PACKAGE, tmp_path / "tf_nvlink", ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "setup.cfg", tmp_path / "setup.cfg")
    upward = tmp_path / "tf_nvlink" / "distribute" / "upward.py"
    upward.write_text("from tf_nvlink.training import install\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "tf_nvlink.distribute.upward -> tf_nvlink.training.install" in proc.stdout, proc.stdout[-3000:]


def _module_level_imports(path: pathlib.Path) -> set[str]:
    """Top-level module names `path` imports when it is imported (not inside functions or classes' methods)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        for statement in ([node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node)):
            if isinstance(statement, ast.Import):
                found.update(alias.name for alias in statement.names)
            elif isinstance(statement, ast.ImportFrom) and not statement.level:
                found.add(statement.module or "")
    return found


LIGHT = [PACKAGE / "__init__.py", *sorted((PACKAGE / "machine").glob("*.py")),
         *sorted((PACKAGE / "plan").glob("*.py")), *sorted((PACKAGE / "util").glob("*.py"))]


@pytest.mark.parametrize("path", LIGHT, ids=lambda p: str(p.relative_to(ROOT)))
def test_light_modules_import_no_tensorflow_or_keras_at_module_level(path):
    heavy = {name for name in _module_level_imports(path)
             if name.split(".")[0] in ("tensorflow", "keras") or name.startswith("tf_nvlink.internals")
             or name.startswith(("tf_nvlink.distribute", "tf_nvlink.training", "tf_nvlink.tools"))}
    assert not heavy, f"{path.relative_to(ROOT)} imports {sorted(heavy)} when imported; import it inside a function"


def test_import_tf_nvlink_loads_no_tensorflow():
    code = ("import sys, tf_nvlink, tf_nvlink.machine.nvml, tf_nvlink.plan.policy, tf_nvlink.plan.tune_cache; "
            "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_building_a_strategy_imports_no_tool():
    """`tf_nvlink.strategy()` imports the layers it needs, not the tools (tune's autotune only when asked for)."""
    code = ("import sys, tf_nvlink; tf_nvlink.strategy(devices=['/cpu:0']); "
            "print(sorted(m for m in sys.modules if m.startswith('tf_nvlink.tools')))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def _facade_imports(source: str, name: str) -> list[str]:
    """The lines of `source` (the module `name`) that import the facade itself (`import tf_nvlink`,
    `from tf_nvlink import strategy`), anywhere, functions included; a subpackage (`from tf_nvlink import plan`)
    is not the facade."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import) and any(alias.name == "tf_nvlink" for alias in node.names):
            found.append(f"{name}:{node.lineno}: import tf_nvlink")
        elif isinstance(node, ast.ImportFrom) and node.module == "tf_nvlink" and not node.level:
            names = [a.name for a in node.names
                     if not (PACKAGE / a.name).is_dir() and not (PACKAGE / f"{a.name}.py").exists()]
            if names:
                found.append(f"{name}:{node.lineno}: from tf_nvlink import {', '.join(names)}")
    return found


def test_no_module_imports_the_facade_but_the_command_line():
    """The facade (`tf_nvlink/__init__.py`) sits above every layer: the tools build strategies through
    `training.install.build_strategy` and read the version from `util.version`; only `__main__` may use it."""
    offenders = [line for path in sorted(PACKAGE.rglob("*.py"))
                 if path not in (PACKAGE / "__init__.py", PACKAGE / "__main__.py")
                 for line in _facade_imports(path.read_text(), str(path.relative_to(ROOT)))]
    assert offenders == []


def test_the_facade_rule_sees_imports_inside_functions_and_lets_subpackages_pass():
    source = "from tf_nvlink import plan\ndef f():\n    import tf_nvlink\n    from tf_nvlink import probe, util\n"
    assert _facade_imports(source, "m.py") == ["m.py:3: import tf_nvlink", "m.py:4: from tf_nvlink import probe"]
