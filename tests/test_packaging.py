"""The package's metadata, and the oldest Python it claims (setup.cfg python_requires) against the code and tests.

Everything here reads files only (no TensorFlow), so it runs on the oldest supported Python too.
"""

import ast
import configparser
import re
import sys

import pytest

from conftest import ROOT

# Every Python file shipped or run by the project: the package, the examples, the benchmarks and these tests.
PYTHON_FILES = sorted(path for folder in ("tf_nvlink", "examples", "benchmarks", "tests")
                      for path in (ROOT / folder).rglob("*.py"))
# Standard-library modules added after 3.10 (https://docs.python.org/3/py-modindex.html, "Added in version").
STDLIB_NEWER_THAN = {(3, 11): {"tomllib", "wsgiref.types"}, (3, 12): set(), (3, 13): set()}


def setup_cfg():
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def minimum_python():
    """(3, 10) from `python_requires = >=3.10`."""
    spec = setup_cfg()["options"]["python_requires"].strip()
    match = re.fullmatch(r">=\s*3\.(\d+)", spec)
    assert match, f"python_requires={spec!r} is not of the form '>=3.N'"
    return 3, int(match.group(1))


def test_python_requires_matches_the_oldest_classifier():
    minor = minimum_python()[1]
    versions = re.findall(r"Programming Language :: Python :: 3\.(\d+)", setup_cfg()["metadata"]["classifiers"])
    assert versions and min(int(v) for v in versions) == minor, versions


def test_this_interpreter_is_supported():
    assert sys.version_info[:2] >= minimum_python()


def test_every_file_parses_with_the_oldest_supported_grammar():
    """ast's feature_version refuses syntax newer than the given version (e.g. `except*` and PEP 695 generics)."""
    refused = []
    for path in PYTHON_FILES:
        try:
            ast.parse(path.read_text(), str(path), feature_version=minimum_python())
        except SyntaxError as error:
            refused.append(f"{path.relative_to(ROOT)}:{error.lineno}: {error.msg}")
    assert PYTHON_FILES and refused == [], refused


def _imported_modules(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module


def test_no_standard_library_module_newer_than_the_oldest_supported_python():
    minimum = minimum_python()
    too_new = {module for version, modules in STDLIB_NEWER_THAN.items() if version > minimum for module in modules}
    found = sorted(f"{path.relative_to(ROOT)}: {module}" for path in PYTHON_FILES
                   for module in _imported_modules(ast.parse(path.read_text(), str(path)))
                   if module in too_new or module.split(".")[0] in too_new)
    assert found == [], f"python_requires is >={minimum[0]}.{minimum[1]}, but these need a newer Python: {found}"


def test_the_checks_see_newer_syntax_and_modules():
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
    assert list(_imported_modules(ast.parse("import tomllib\nfrom wsgiref.types import StartResponse"))) == [
        "tomllib", "wsgiref.types"]


def test_license_pyproject_and_classifiers():
    license_text = (ROOT / "LICENSE").read_text()
    assert license_text.split()[:4] == ["Apache", "License", "Version", "2.0,"] and "END OF TERMS" in license_text
    # pyproject.toml holds only [build-system], in the INI-compatible subset of TOML that configparser reads.
    pyproject = configparser.ConfigParser()
    pyproject.read(ROOT / "pyproject.toml")
    build = pyproject["build-system"]
    assert build["build-backend"] == '"setuptools.build_meta"'
    assert re.match(r'\["setuptools[>=\d.]*"', build["requires"]), build["requires"]
    metadata = setup_cfg()["metadata"]
    assert metadata["license"] == "Apache-2.0" and metadata["license_files"].strip() == "LICENSE"
    assert "License :: OSI Approved :: Apache Software License" in metadata["classifiers"]
    assert "example.com" not in metadata.get("project_urls", "")  # no made-up URL
