"""The layers import one way (kernels <- engine <- gateway -> cache, billing; tollgate.envs under all),
and gateway/ has no import cycle, counting imports inside functions too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tollgate", "kernels", "engine", "cache", "billing", "gateway")
# what each package may import of the project's own packages
ALLOWED = {
    "tollgate": set(),
    "kernels": {"tollgate"},
    "engine": {"tollgate", "kernels"},
    "cache": {"tollgate"},
    "billing": {"tollgate"},
    "gateway": {"tollgate", "kernels", "engine", "cache", "billing"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at its top or inside a function, resolved to a dotted name."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return out


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def test_packages_import_only_the_layers_below_them():
    bad = []
    for name, path in project_modules().items():
        top = name.split(".")[0]
        for imported in imports_of(path):
            target = imported.split(".")[0]
            if target in PACKAGES and target != top and target not in ALLOWED[top]:
                bad.append(f"{name} imports {imported}")
            if target == "ray" and not name.startswith("gateway.serving"):
                bad.append(f"{name} imports ray (only gateway.serving may)")
    assert not bad, "\n".join(sorted(bad))


def test_the_http_layer_never_imports_serving_or_the_cli():
    bad = [f"{name} imports {imported}" for name, path in project_modules().items()
           if name.startswith("gateway.") and not name.startswith(("gateway.serving", "gateway.cli"))
           for imported in imports_of(path) if imported.startswith(("gateway.serving", "gateway.cli"))]
    assert not bad, "\n".join(sorted(bad))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def gateway_graph() -> dict[str, set[str]]:
    modules = {n: p for n, p in project_modules().items() if n == "gateway" or n.startswith("gateway.")}
    graph = {}
    for name, path in modules.items():
        # importing gateway.a.b runs gateway/__init__ and gateway/a/__init__ first: edges to those too
        targets = set()
        for imported in imports_of(path):
            parts = imported.split(".")
            targets.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        graph[name] = {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def test_gateway_has_no_import_cycle():
    cycle = find_cycle(gateway_graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
