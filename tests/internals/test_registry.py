"""The private-API home holds seams only: every definition touches a private name (or is the registry), no
thread-local lives there, no module is long; and the registry puts back what it patched."""

import ast
import pathlib

import pytest

from test_private_api import PRIVATE_MODULES, _private_name_touched

HOME = pathlib.Path(__file__).resolve().parents[2] / "tf_nvlink" / "internals"
SEAM_MODULES = sorted(p for p in HOME.glob("*.py") if p.name not in ("__init__.py", "registry.py"))


def _touches_private(node, source: str) -> bool:
    text = ast.get_source_segment(source, node) or ""
    return bool(PRIVATE_MODULES.search(text)) or any(
        _private_name_touched(inner) is not None for inner in ast.walk(node))


@pytest.mark.parametrize("path", SEAM_MODULES, ids=lambda p: p.name)
def test_every_definition_in_a_seam_module_touches_a_private_name(path):
    source = path.read_text()
    bare = [node.name for node in ast.parse(source).body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and not _touches_private(node, source)]
    assert not bare, f"{path.name}: {bare} touch no private Keras/TensorFlow name; move them to tf_nvlink/training/"


@pytest.mark.parametrize("path", sorted(HOME.glob("*.py")), ids=lambda p: p.name)
def test_no_thread_local_and_no_long_module(path):
    source = path.read_text()
    assert "threading.local" not in source, f"{path.name} holds a thread-local: state belongs to training/"
    assert len(source.splitlines()) <= 350, f"{path.name} has {len(source.splitlines())} lines"


def test_the_registry_patches_once_and_restores_own_and_inherited_attributes():
    from tf_nvlink.internals.registry import Registry

    class Base:
        def greet(self):
            return "base"

    class Child(Base):
        def own(self):
            return "own"

    registry = Registry()
    assert registry.patch(Child, "own", lambda original: lambda self: original(self) + "+")
    assert not registry.patch(Child, "own", lambda original: lambda self: "twice")
    assert registry.patch(Child, "greet", lambda original: lambda self: "child " + original(self))
    assert (Child().own(), Child().greet(), Base().greet()) == ("own+", "child base", "base")
    assert registry.patched(Child, "greet") and registry.original(Child, "own")(Child()) == "own"
    registry.restore(Child, "own")
    assert Child().own() == "own" and registry.patched(Child, "greet")
    registry.restore()
    assert Child().greet() == "base" and "greet" not in vars(Child) and not registry.patched(Child, "greet")
