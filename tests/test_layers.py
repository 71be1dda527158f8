"""The package's import graph: every ppolm module's imports of other ppolm modules (those inside
functions, the package's lazy names and the CLI's "module:name" command table included) must run
one way (no cycle), and a function-level import is only for a heavy third-party library, never for
a ppolm module. Parsed with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import ppolm

ROOT = Path(ppolm.__file__).parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imported(node: ast.Import | ast.ImportFrom, here: str, is_package: bool) -> list[str]:
    """The ppolm modules an import statement loads (``from ppolm import x`` loads ppolm.x when x is
    a module, else ppolm itself)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = here.split(".") if is_package else here.split(".")[:-1]
            base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name and name != here:
            found.append(name)
    return found


def lazy_api(tree: ast.Module) -> list[str]:
    """The modules the package's ``__getattr__`` loads on first use (its ``_API`` table's values)."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_API" for t in node.targets):
            return sorted({v.value for v in node.value.values if isinstance(v, ast.Constant)})
    return []


def graph() -> tuple[dict[str, dict[str, int]], list[str]]:
    """(module -> {imported module: line}, the function-level imports of ppolm modules)."""
    edges: dict[str, dict[str, int]] = {m: {} for m in MODULES}
    lazy = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = imported(node, name, path.name == "__init__.py")
                for t in targets:
                    edges[name].setdefault(t, node.lineno)
                if targets and id(node) not in top:
                    lazy.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {ast.unparse(node)}")
            # "ppolm.module:name" strings: what the CLI's command table loads with importlib
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
                target = node.value.partition(":")[0]
                if target in MODULES and target != name:
                    edges[name].setdefault(target, node.lineno)
        if path.name == "__init__.py":
            for t in lazy_api(tree):
                edges[name].setdefault(t, 0)
    return edges, lazy


def find_cycle(edges: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    edges, _ = graph()
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} (line {edges[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_no_ppolm_module_is_imported_inside_a_function():
    _, lazy = graph()
    assert not lazy, "function-level imports of ppolm modules (import them at the top):\n" + "\n".join(lazy)


def test_the_cycle_finder_finds_one():
    edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) is None


def test_the_core_maths_imports_only_torch():
    tree = ast.parse(MODULES["ppolm.core"].read_text(encoding="utf-8"))
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert roots <= {"torch", "math", "__future__", "dataclasses", "typing", "collections"}, roots


def test_the_public_api_loads_on_first_use():
    import subprocess
    import sys

    code = ("import sys, ppolm; light = 'torch' not in sys.modules; "
            "from ppolm import PPOConfig, train_ppo, SFTConfig, train_sft, RewardTrainConfig, train_reward, "
            "DPOConfig, train_dpo; print(light, PPOConfig.__module__, train_ppo.__module__, train_dpo.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent).stdout.split()
    assert out == ["True", "ppolm.ppo_config", "ppolm.ppo", "ppolm.dpo"]
