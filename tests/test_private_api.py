"""Every private Keras/TensorFlow touch lives in the tf_nvlink/internals/ package, and nowhere else in tf_nvlink/.

Flagged anywhere else: an import or mention of `keras.src`, `tensorflow.python`, `tensorflow.tsl` or
`tensorflow.compiler`, and an access of a private
attribute (`obj._name`, or `getattr(obj, "_name")` and its kin) that tf_nvlink itself does not define. `self._x`/`cls._x` count as our own only when a
class of ours assigns them in a method, and `_x` names as our own only when a module or class of ours defines
them (nested functions that take a Keras method's name do not count).
"""

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "tf_nvlink"
INTERNALS = PACKAGE / "internals"
PRIVATE_MODULES = re.compile(r"\b(keras\.src|tensorflow\.python|tensorflow\.tsl|tensorflow\.compiler)\b")
# Private names of the standard library that tf_nvlink may use (NamedTuple's documented API).
STANDARD_PRIVATE = {"_asdict", "_replace", "_fields", "_make"}


def _own_private_names(trees) -> set[str]:
    """`_x` names tf_nvlink defines: module- and class-level definitions, attributes a class's methods set on self."""
    names = set(STANDARD_PRIVATE)
    for tree in trees:
        for node in tree.body:
            names.update(_defined_at(node))
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for item in cls.body:
                names.update(_defined_at(item))
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(item):
                        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                            names.add(node.attr)
    return names


def _defined_at(node) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {t.id for target in node.targets for t in ast.walk(target) if isinstance(t, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return set()


def private_touches(package: pathlib.Path, exempt: pathlib.Path) -> list[str]:
    """"file:line: what" for every private Keras/TensorFlow touch under `package` outside `exempt` (a module or a
    package)."""
    files = sorted(p for p in package.rglob("*.py") if exempt != p and exempt not in p.parents)
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    own = _own_private_names(trees.values())
    problems = []
    for path, tree in trees.items():
        where = path.relative_to(package.parent)
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE_MODULES.search(line):
                problems.append(f"{where}:{number}: names {PRIVATE_MODULES.search(line).group(1)}")
        for node in ast.walk(tree):
            name = _private_name_touched(node)
            if name is not None and name not in own:
                problems.append(f"{where}:{node.lineno}: touches private attribute .{name}")
    return problems


# Calls that read or replace the attribute their second argument names: Python's, and the seams' registry's.
NAMING_CALLS = {"getattr", "hasattr", "setattr", "delattr", "patch", "patched", "original", "restore"}


def _private_name_touched(node) -> str | None:
    """The private name `node` reads or writes: `obj._x`, `getattr`/`hasattr`/`setattr`/`delattr(obj, "_x")`, the
    registry's `patch(owner, "_x", ...)` and kin, or a private keyword argument `f(_x=...)`."""
    function = node.func if isinstance(node, ast.Call) else None
    called = function.id if isinstance(function, ast.Name) else function.attr if isinstance(function, ast.Attribute) \
        else None
    if isinstance(node, ast.Attribute):
        name = node.attr
    elif isinstance(node, ast.keyword) and node.arg:  # a private keyword argument: Trace(..., _r=1)
        name = node.arg
    elif called in NAMING_CALLS and len(node.args) >= 2 \
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
        name = node.args[1].value
    else:
        return None
    return name if name.startswith("_") and not name.startswith("__") else None


def test_only_internals_touches_private_keras_and_tensorflow():
    problems = private_touches(PACKAGE, INTERNALS)
    assert not problems, "move these into a seam module of tf_nvlink/internals/:\n" + "\n".join(problems)


@pytest.mark.parametrize("source, expected", [
    ("from keras.src.trainers import trainer\n", "names keras.src"),
    ("def f():\n    from tensorflow.python.eager import context\n", "names tensorflow.python"),
    ("def f(model):\n    return model._jit_compile\n", "touches private attribute ._jit_compile"),
    ("def f(optimizer):\n    optimizer._trainable_variables.clear()\n",
     "touches private attribute ._trainable_variables"),
    ("class Hook:\n    def run(self, model):\n        return self._distribute_strategy\n",
     "touches private attribute ._distribute_strategy"),
    # A nested function named like a Keras method is not a definition of ours.
    ("def install(trainer):\n    def _make_function(self):\n        pass\n    return trainer._make_function\n",
     "touches private attribute ._make_function"),
    ("def layers(model):\n    return getattr(model, '_flatten_layers', None)\n",
     "touches private attribute ._flatten_layers"),
    ("def workers(strategy):\n    return hasattr(strategy.extended, '_num_workers')\n",
     "touches private attribute ._num_workers"),
    ("def seam(registry, cls):\n    registry.patch(cls, '_moments', lambda original: original)\n",
     "touches private attribute ._moments"),
    ("def mark(tf, step):\n    return tf.profiler.experimental.Trace('train', step_num=step, _r=1)\n",
     "touches private attribute ._r"),
])
def test_a_touch_added_elsewhere_is_named_with_file_and_line(tmp_path, source, expected):
    package = tmp_path / "tf_nvlink"
    package.mkdir()
    (package / "internals.py").write_text("def f(model):\n    return model._jit_compile\n")
    (package / "ours.py").write_text(
        "class Ours:\n    def __init__(self):\n        self._count = 0\n\n"
        "    def bump(self, other):\n        other._count += 1\n        return _helper(self._count)\n\n"
        "def _helper(n):\n    return n\n")
    (package / "added.py").write_text(source)
    problems = private_touches(package, package / "internals.py")
    assert len(problems) == 1 and problems[0].startswith("tf_nvlink/added.py:") and problems[0].endswith(expected), \
        problems
