"""What the product imports is installed by `make up` (the runtime dependencies), not only by `make test` (the test
extra): a module the gateway imports that only the tests install passes every test and breaks `make up`."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("engine", "kernels", "gateway", "cache", "billing", "tollgate")
# imported only where present, each behind a guard: triton comes with CUDA builds of torch (CPU runs the references),
# pynvml is read if the host has it (gateway/metrics.py)
OPTIONAL = {"triton", "pynvml"}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imported_modules() -> dict[str, str]:
    """Top-level module -> a file importing it, over every import in the product's code (in functions too)."""
    found: dict[str, str] = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                         else [])
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def test_every_module_the_product_imports_is_a_runtime_dependency() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for module, where in sorted(_imported_modules().items()):
        if module in sys.stdlib_module_names or module in PRODUCT or module in OPTIONAL or module == "__future__":
            continue
        dists = {d.lower().replace("_", "-") for d in distributions.get(module, [])}
        if not dists & runtime:
            missing.append(f"{module} (imported by {where}; installed by {sorted(dists) or 'nothing'})")
    assert not missing, "not in [project] dependencies: " + "; ".join(missing)


def test_readme_says_how_to_install_the_openai_client_before_it_first_uses_it() -> None:
    """`openai` is only in the test extra (the product never imports it), so `make up` does not install it: the
    README must say how, no later than where it first shows the client."""
    readme = (ROOT / "README.md").read_text()
    install = readme.find(".venv/bin/pip install openai")
    first_use = min(i for i in (readme.find("OpenAI SDK"), readme.find("client.")) if i >= 0)
    assert 0 <= install < first_use
