"""api/'s layout, measured from its imports: its folders show the architecture.

- No chain of imports inside api/ is longer than :data:`MAX_DEPTH` modules: ``main`` → ``app`` → a protocol's
  routes → the pipeline → the request model → a leaf.
- No module of one protocol package imports another protocol package: what two protocols share lives beside
  them (``api/tgi_format.py``, ``api/vllm_fields.py``), and the app wires them together.
- No api module imports torch, transformers or the worker: an API pod never loads them.

Read with :mod:`ast`, so every import counts, a function's too; ``from api import x`` is the module ``api.x``
when there is one.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_DEPTH = 6
PROTOCOLS = ("api.tgi", "api.openai", "api.kserve", "api.mindie")
FORBIDDEN = ("torch", "transformers", "worker")


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module(path): path for path in sorted((REPO / "api").rglob("*.py"))}


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module a ``from`` import names, a relative one resolved from ``module``."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


@cache
def imports(module: str) -> frozenset[str]:
    """Every module ``module`` imports, anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, node)
            names.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else source
                         for alias in node.names)
    return frozenset(names)


@cache
def longest_chain(module: str) -> tuple[str, ...]:
    """The longest chain of imports inside api/ that starts at ``module`` (an import cycle would recurse
    without end, and fail the test)."""
    below = [longest_chain(name) for name in sorted(imports(module)) if name in MODULES and name != module]
    return (module, *max(below, key=len, default=()))


def _protocol(name: str) -> str | None:
    return next((package for package in PROTOCOLS if name == package or name.startswith(package + ".")), None)


def test_the_imports_are_read() -> None:
    """The reader sees the modules and their imports (a form it misses would pass the tests below unchecked)."""
    assert {"api.main", "api.app", *PROTOCOLS, "api.tgi.routes"} <= MODULES.keys()
    assert "api.app" in imports("api.main") and "api.tgi.routes" in imports("api.app")
    assert len(longest_chain("api.main")) > 3


def test_api_is_at_most_six_imports_deep() -> None:
    chain = max((longest_chain(module) for module in MODULES), key=len)
    assert len(chain) <= MAX_DEPTH, f"{len(chain)} modules deep: {' → '.join(chain)}"


def test_no_protocol_imports_another() -> None:
    crossings = [f"{module} imports {name}" for module in MODULES if (own := _protocol(module)) is not None
                 for name in sorted(imports(module)) if _protocol(name) not in (None, own)]
    assert crossings == []


def test_no_api_module_imports_torch_or_the_worker() -> None:
    found = [f"{module} imports {name}" for module in MODULES for name in sorted(imports(module))
             if name.split(".")[0] in FORBIDDEN]
    assert found == []
