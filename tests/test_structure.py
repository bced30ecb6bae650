"""The package's shape, as the developers' guide and issue 35 fix it: imports flow one way with no
circle (inside a folder either), no file over 400 lines or function over 60, at most three
LLMCTL_* environment variables, and nothing below commands/ imports Typer or Rich."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "llmctl"
# Each folder's floor: imports go to a lower floor, or within the folder; leaf modules (errors,
# cache_dir) import nothing of llmctl. The four peers on floor 4 import none of each other.
FLOORS = {
    "kernels": 0,
    "models": 1,
    "engine": 2,
    "runtime": 3,
    "batch": 4,
    "compress": 4,
    "profiling": 4,
    "train": 4,
    "llm": 5,
    "ray_data": 5,
    "__init__": 9,  # llmctl itself: the public face (LLM, SamplingParams), imported by no module
    "pipelines": 6,
    "recipes": 6,
    "commands": 7,
    "cli": 8,
}
LEAVES = ("errors", "cache_dir")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, name: str, modules: dict) -> set[str]:
    """The llmctl modules `path` imports, at any depth of its code (lazy imports too)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            if t in modules and t.startswith("llmctl.") and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        targets = _imports(path, name, modules)
        # `from llmctl.x import y` where y is a module names llmctl.x.y: drop the package llmctl.x
        # itself when one of its modules is the import.
        graph[name] = {t for t in targets if not any(u.startswith(t + ".") for u in targets)}
    return graph


def _top(name: str) -> str:
    return name.split(".")[1] if name.count(".") else "__init__"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle_anywhere():
    assert _cycle(_graph()) is None, " -> ".join(_cycle(_graph()) or [])


def test_imports_flow_down_the_floors():
    bad = []
    for name, targets in _graph().items():
        top = _top(name)
        for t in targets:
            other = _top(t)
            if other == top:
                continue
            if top in LEAVES:
                bad.append(f"{name} -> {t} (a leaf imports nothing of llmctl)")
            elif other not in LEAVES and FLOORS[other] >= FLOORS[top]:
                bad.append(f"{name} -> {t}")
    assert not bad, "\n".join(sorted(bad))


def test_nothing_below_commands_imports_typer_or_rich():
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).parts
        if rel[0] in ("commands", "cli.py"):
            continue
        tree = ast.parse(path.read_text())
        names = {
            a.name.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
        }
        names |= {
            (n.module or "").split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and not n.level
        }
        assert not names & {"typer", "rich"}, path


def test_no_file_over_400_lines_or_function_over_60():
    long = []
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > 400:
            long.append(f"{path}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > 60:
                    long.append(f"{path}:{node.lineno} {node.name}")
    assert not long, "\n".join(long)


def test_at_most_three_environment_variables():
    names = set()
    for path in PACKAGE.rglob("*"):
        if path.suffix in (".py", ".c", ".h"):
            names |= set(re.findall(r"(?<![A-Za-z0-9])LLMCTL_[A-Z0-9_]+", path.read_text()))
    names -= {n for n in names if n.endswith("_H")}  # C include guards
    assert names <= {"LLMCTL_DEBUG", "LLMCTL_CACHE_DIR", "LLMCTL_KERNELS"}, names
