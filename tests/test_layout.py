"""The package layout holds: imports only go down the layers that docs/index.md documents, no module
imports itself back through a circle, and no folder holds more than 15% of the package's lines (issue: a
layout that shows the architecture; issue 44: no room that everything grows into)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "stapo"


def documented_layers(index_md: Path) -> list[list[str]]:
    """The rows of the ``<!-- layout -->`` block in docs/index.md, top row first."""
    text = index_md.read_text(encoding="utf-8")
    block = re.search(r"<!-- layout -->\n```\n(.*?)```", text, re.S)
    assert block, f"{index_md} has no <!-- layout --> code block"
    rows = []
    for line in block.group(1).splitlines():
        units = re.split(r"\s{2,}", line.strip())[0]
        rows.append([u.strip() for u in units.split("·")])
    return rows


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, package: Path) -> set[str]:
    """Every ``stapo...`` module a file imports, at the top or inside a function (both are dependencies)."""
    found = set()
    modules = {module_name(p, package) for p in package.rglob("*.py")}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # `from stapo.trainer import components` imports a submodule
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
    root = package.name
    return {m for m in found if m == root or m.startswith(root + ".")}


def unit(module: str) -> str:
    """The top-level folder (or module) of ``stapo.x.y``: ``x``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_violations(package: Path, layers: list[list[str]]) -> list[str]:
    rank = {u: i for i, row in enumerate(layers) for u in row}
    problems = []
    for path in sorted(package.rglob("*.py")):
        src = module_name(path, package)
        here = unit(src)
        if here == "":  # the package's own __init__: the public API re-exports anything
            continue
        if here not in rank:
            problems.append(f"{src}: folder {here!r} is not in docs/index.md's layout table")
            continue
        for target in sorted(imports_of(path, package)):
            there = unit(target)
            if there == here:
                continue
            if there not in rank:
                problems.append(f"{src} imports {target}: {there or 'the package root'!r} is not a layer")
            elif rank[there] <= rank[here]:
                how = "a row above" if rank[there] < rank[here] else "the same row"
                problems.append(f"{src} imports {target} from {how} ({there!r} vs {here!r})")
    return problems


def import_cycles(package: Path) -> list[list[str]]:
    """Strongly connected components (> 1 module) of the module import graph (Tarjan)."""
    graph = {module_name(p, package): imports_of(p, package) for p in package.rglob("*.py")}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


MAX_SHARE = 0.15


def oversized_units(package: Path, max_share: float = MAX_SHARE) -> list[str]:
    """The top-level folders (or modules) holding more than ``max_share`` of the package's ``.py`` lines."""
    lines: dict[str, int] = {}
    for path in package.rglob("*.py"):
        name = unit(module_name(path, package)) or path.stem
        lines[name] = lines.get(name, 0) + len(path.read_text(encoding="utf-8").splitlines())
    total = sum(lines.values())
    return [f"{name}: {n} of {total} lines ({n / total:.1%} > {max_share:.0%})"
            for name, n in sorted(lines.items()) if n > max_share * total]


def _is_package_init_edge(cycle: list[str]) -> bool:
    """A package ``__init__`` re-exporting its own submodules, which import each other's package
    (``stapo.losses`` ↔ ``stapo.losses.masks``), is how Python packages work, not a circle of jobs."""
    roots = {".".join(m.split(".")[:2]) for m in cycle}
    return len(roots) == 1 and any(m in roots for m in cycle)


def test_imports_only_go_down_the_documented_layers():
    problems = layer_violations(PACKAGE, documented_layers(ROOT / "docs" / "index.md"))
    assert not problems, "layout broken:\n" + "\n".join(problems)


def test_no_import_circles_between_modules():
    cycles = [c for c in import_cycles(PACKAGE) if not _is_package_init_edge(c)]
    assert not cycles, "import circles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_folder_holds_more_than_15_percent_of_the_lines():
    big = oversized_units(PACKAGE)
    assert not big, "split these folders by job:\n" + "\n".join(big)


def test_every_folder_docstring_says_its_job_and_what_it_may_import():
    for row in documented_layers(ROOT / "docs" / "index.md"):
        for name in row:
            init = PACKAGE / name / "__init__.py"
            if init.exists():
                doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""
                assert "May import" in doc, f"{init}: the docstring must say what the folder may import"


def _fake_package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "stapo"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


LAYERS = [["trainer"], ["sync", "telemetry"], ["distributed"]]


@pytest.mark.parametrize("files, expected", [
    ({"distributed/a.py": "from stapo.sync.b import x\n", "sync/b.py": ""}, "a row above"),
    ({"sync/b.py": "def f():\n    from stapo.telemetry import c\n", "telemetry/c.py": ""}, "the same row"),
    ({"trainer/t.py": "import stapo.newroom.x\n", "newroom/x.py": ""}, "not in docs/index.md's layout"),
])
def test_the_check_fails_when_an_upward_or_sideways_import_is_added(tmp_path, files, expected):
    files = {"__init__.py": "", **{f"{d}/__init__.py": "" for d in ("trainer", "sync", "telemetry", "distributed")},
             **files}
    problems = layer_violations(_fake_package(tmp_path, files), LAYERS)
    assert any(expected in p for p in problems), problems


def test_the_check_finds_a_circle(tmp_path):
    pkg = _fake_package(tmp_path, {"__init__.py": "", "trainer/__init__.py": "",
                                   "trainer/a.py": "from stapo.trainer.b import x\n",
                                   "trainer/b.py": "def f():\n    from stapo.trainer.a import y\n"})
    assert import_cycles(pkg) == [["stapo.trainer.a", "stapo.trainer.b"]]


def test_the_check_finds_an_oversized_folder(tmp_path):
    files = {"__init__.py": "", "big/__init__.py": "x = 1\n" * 20,
             **{f"small{i}/__init__.py": "x = 1\n" * 10 for i in range(8)}}
    assert [p.split(":")[0] for p in oversized_units(_fake_package(tmp_path, files))] == ["big"]
