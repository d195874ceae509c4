"""The user docs agree with the tree and the code: every relative link and anchor resolves, the README stays
short, and its `strategy()` table lists exactly the arguments and defaults the code has. Source is read with
`ast`; nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BUILD_NOTES.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {github_anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def relative_links(path: Path) -> list[str]:
    return [target for target in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(doc):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target} (no heading with that anchor in {resolved.relative_to(ROOT)})")
    assert not broken, f"{doc.relative_to(ROOT)} has broken links: {broken}"


def test_github_anchor_follows_github_rules():
    assert github_anchor("One GPU with `steps_per_execution=8`") == "one-gpu-with-steps_per_execution8"
    assert github_anchor("All-reduce bandwidth through tf.distribute") == "all-reduce-bandwidth-through-tfdistribute"


def test_link_check_catches_a_missing_file_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title here\n[x](b.md) [y](#title-here) [z](#nothing)\n")
    assert relative_links(tmp_path / "a.md") == ["b.md", "#title-here", "#nothing"]
    assert anchors(tmp_path / "a.md") == {"title-here"}


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; at most {README_MAX_LINES}"


def function_def(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)


def facade_supplied_arguments() -> set[str]:
    """Keywords `tf_nvlink.strategy()` passes to `single_host.strategy` itself (not the caller's), through
    `training.install.build_strategy`."""
    facade = function_def(ROOT / "tf_nvlink" / "__init__.py", "strategy")
    own = {a.arg for a in facade.args.args + facade.args.kwonlyargs}
    calls = [node for node in ast.walk(facade) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "build_strategy"]
    assert calls, "tf_nvlink.strategy() no longer calls install.build_strategy; update this test"
    return {kw.arg for call in calls for kw in call.keywords
            if kw.arg and not (isinstance(kw.value, ast.Name) and kw.value.id in own)}


def strategy_signature() -> dict[str, str]:
    """Argument -> repr of its default, for what a caller of `tf_nvlink.strategy()` may pass: the parameters of
    `single_host.strategy`, less those the facade supplies."""
    func = function_def(ROOT / "tf_nvlink" / "distribute" / "single_host.py", "strategy")
    args = func.args
    positional = args.posonlyargs + args.args
    defaults = dict(zip([a.arg for a in positional[len(positional) - len(args.defaults):]], args.defaults))
    defaults.update({a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None})
    supplied = facade_supplied_arguments()
    return {name: repr(ast.literal_eval(node)) for name, node in defaults.items() if name not in supplied}


def readme_strategy_table() -> dict[str, str]:
    """Argument -> default, from the README's `tf_nvlink.strategy()` arguments table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## `tf_nvlink.strategy()` arguments", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = cells[1].strip("`")
    return rows


def test_readme_strategy_table_lists_every_argument_with_its_default():
    code = strategy_signature()
    table = readme_strategy_table()
    assert set(table) == set(code), (f"README's strategy() table and the code differ: only in README "
                                     f"{sorted(set(table) - set(code))}, only in code {sorted(set(code) - set(table))}")
    wrong = {name: (table[name], code[name]) for name in code
             if ast.literal_eval(table[name]) != ast.literal_eval(code[name])}
    assert not wrong, f"README defaults differ from the code (README, code): {wrong}"
