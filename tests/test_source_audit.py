"""An audit of the library's and the examples' source: no shell, no string-built commands, and every file write
atomic (through tf_nvlink.util.atomic_files or TensorFlow's own atomic saves)."""

import ast
import textwrap

import pytest

from conftest import ROOT

# Library and example code this file audits (tests write scratch files freely).
SOURCES = sorted([*(ROOT / "tf_nvlink").rglob("*.py"), *(ROOT / "examples").glob("*.py")])


SHELL_CALLS = {"os.system", "os.popen", "subprocess.getoutput", "subprocess.getstatusoutput", "commands.getoutput"}
SUBPROCESS_CALLS = {"subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call",
                    "subprocess.check_output"}
WRITE_METHODS = {"save", "save_weights", "savefig", "write_text", "write_bytes", "tofile"}
WRITE_FUNCTIONS = {"json.dump", "np.save", "np.savez", "np.savez_compressed", "numpy.save", "pickle.dump",
                   "shutil.copy", "shutil.copyfile", "shutil.copy2"}
# Saves that are atomic by TensorFlow's own design: tf.train.CheckpointManager.save writes the shards under
# "<prefix>_temp/" and merges them into place (MergeV2Checkpoints), then rewrites the "checkpoint" state file with
# file_io.atomic_write_string_to_file; a kill leaves latest_checkpoint at the previous complete checkpoint.
ATOMIC_BY_TENSORFLOW = {("examples/custom_loop.py", "manager.save")}


def _name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = _name(node.value)
        return f"{inner}.{node.attr}" if inner else node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


class _Audit(ast.NodeVisitor):
    """Shell use, string-built commands, and file writes not inside `with ...atomic_path(...)` (or atomic_files.py's own
    atomic helpers)."""

    def __init__(self, relative):
        self.relative, self.atomic_depth, self.function = relative, 0, ""
        self.shell, self.writes = [], []

    def visit_FunctionDef(self, node):
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    def visit_With(self, node):
        atomic = any(_name(item.context_expr).endswith("atomic_path") for item in node.items)
        self.atomic_depth += atomic
        self.generic_visit(node)
        self.atomic_depth -= atomic

    def visit_Call(self, node):
        name, where = _name(node.func), f"{self.relative}:{node.lineno}"
        if name in SHELL_CALLS or name.startswith("os.exec") and name.endswith("p"):
            self.shell.append(f"{where} {name}")
        for keyword in node.keywords:
            if keyword.arg == "shell" and not (isinstance(keyword.value, ast.Constant) and not keyword.value.value):
                self.shell.append(f"{where} shell={ast.unparse(keyword.value)}")
        if name in SUBPROCESS_CALLS and node.args and isinstance(node.args[0], (ast.Constant, ast.JoinedStr,
                                                                                 ast.BinOp)):
            self.shell.append(f"{where} {name} with a string command {ast.unparse(node.args[0])[:60]}")
        kind = None
        if name == "open":
            mode = node.args[1] if len(node.args) > 1 else next(
                (k.value for k in node.keywords if k.arg == "mode"), ast.Constant("r"))
            if not isinstance(mode, ast.Constant) or set(str(mode.value)) & set("wax+"):
                kind = "open"
        elif name in WRITE_FUNCTIONS:
            kind = name
        elif isinstance(node.func, ast.Attribute) and node.func.attr in WRITE_METHODS \
                and (self.relative, name) not in ATOMIC_BY_TENSORFLOW:
            kind = node.func.attr
        atomic_helper = self.relative == "tf_nvlink/util/atomic_files.py" and self.function in ("write_atomic", "atomic_path")
        if kind and not self.atomic_depth and not atomic_helper:
            self.writes.append((self.relative, kind, where))
        self.generic_visit(node)


@pytest.fixture(scope="module")
def audit():
    shell, writes = [], []
    for path in SOURCES:
        visitor = _Audit(str(path.relative_to(ROOT)))
        visitor.visit(ast.parse(path.read_text(), str(path)))
        shell += visitor.shell
        writes += visitor.writes
    return shell, writes


def test_no_shell_and_no_string_built_commands(audit):
    shell, _ = audit
    assert shell == []


def test_every_file_write_is_atomic(audit):
    _, writes = audit
    assert writes == [], "non-atomic writes; use atomic_files.write_atomic or `with atomic_files.atomic_path(...)`: " + str(
        [where for _, _, where in writes])


def test_the_audit_sees_what_it_looks_for(tmp_path):
    source = textwrap.dedent("""
        import os, subprocess, json
        def f(path, cmd, data):
            subprocess.run(f"ls {cmd}", shell=True)
            subprocess.run("ls " + cmd)
            os.system(cmd)
            subprocess.run(["ls", cmd])  # fine
            with open(path, "w") as handle:
                json.dump(data, handle)
            with atomic_files.atomic_path(path) as partial:
                model.save(partial)  # fine
            open(path)  # a read: fine
        """)
    visitor = _Audit("x.py")
    visitor.visit(ast.parse(source))
    assert [entry.split(" ", 1)[1] for entry in visitor.shell] == [
        "shell=True", "subprocess.run with a string command f'ls {cmd}'",
        "subprocess.run with a string command 'ls ' + cmd", "os.system"]
    assert [kind for _, kind, _ in visitor.writes] == ["open", "json.dump"]
