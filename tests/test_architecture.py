"""The tree's shape, checked: no import circle, pure packages that read no clock and do no I/O,
the layer contracts of pyproject.toml, small modules and packages that say what they hold.

Imports are read from the source (the AST), so those inside functions and under
`TYPE_CHECKING` count as much as the ones at the top: a type-only back-reference is still a
design circle. The layers themselves are import-linter's contracts ([tool.importlinter] in
pyproject.toml), run here so that a new circle or an import of a higher layer fails the suite.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("epochmesh", "coordinator", "node_agent", "client")
GENERATED = ROOT / "epochmesh" / "v1"

# Pure packages: the rules of rounds, aggregation, verification, scheduling and accounting.
# They take the time as a parameter and do no network, database or metrics I/O.
PURE = (
    "coordinator.rounds",
    "coordinator.aggregation",
    "coordinator.verification",
    "coordinator.scheduling",
    "coordinator.accounting",
)
# What a pure module may not import: event loops, RPC, databases, metrics, and the clock or
# other sources of a value that is not a function of the arguments.
IMPURE = (
    "asyncio",
    "grpc",
    "aiosqlite",
    "prometheus_client",
    "socket",
    "subprocess",
    "time",
    "datetime",
    "uuid",
    "random",
    "secrets",
    "epochmesh.timeutil",
)
# The explicit allow-list, to shrink to nothing: (module, import) pairs that stay for now.
ALLOWED_IMPURE = {
    # The open round's bookkeeping: asyncio wake-ups and monotonic stamps of its parts.
    ("coordinator.rounds.round_state", "asyncio"),
    ("coordinator.rounds.round_state", "time"),
    ("coordinator.rounds.round_state", "epochmesh.timeutil"),
    # The planner's last-seen age of a node.
    ("coordinator.rounds.planner", "time"),
}
MAX_TOP_MODULES = 4
MAX_LINES = 1000


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if GENERATED in path.parents:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every module name `module` imports, anywhere in its source (relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            yield base
            for alias in node.names:
                yield f"{base}.{alias.name}"


def _internal(name: str) -> str | None:
    """The project module `name` is, or lies in (an imported class resolves to its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {_internal(name) for name in _imported(module, path)}
        # A package's __init__ is imported on the way to its modules: not an edge of design.
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle() -> None:
    assert _circles(_graph()) == []


def test_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_pure_packages_read_no_clock_and_do_no_io() -> None:
    found = []
    for module, path in MODULES.items():
        if not any(module == p or module.startswith(p + ".") for p in PURE):
            continue
        for name in set(_imported(module, path)):
            for banned in IMPURE:
                if (name == banned or name.startswith(banned + ".")) and (
                    module,
                    banned,
                ) not in ALLOWED_IMPURE:
                    found.append(f"{module} imports {name}")
    assert sorted(set(found)) == []


def test_the_allow_list_holds_only_what_is_still_there() -> None:
    """An exception that is gone must leave the list (so it only shrinks)."""
    stale = []
    for module, banned in sorted(ALLOWED_IMPURE):
        path = MODULES.get(module)
        names = set(_imported(module, path)) if path else set()
        if not any(n == banned or n.startswith(banned + ".") for n in names):
            stale.append((module, banned))
    assert stale == []


@pytest.mark.parametrize("app", ["coordinator", "node_agent"])
def test_few_modules_at_the_top_of_an_app(app: str) -> None:
    top = sorted(p.name for p in (ROOT / app).glob("*.py") if p.name != "__init__.py")
    assert len(top) <= MAX_TOP_MODULES, top


def test_no_library_module_over_the_size_limit() -> None:
    big = {
        module: n
        for module, path in MODULES.items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}


def test_every_package_says_what_it_holds_and_may_import() -> None:
    missing = []
    for module, path in MODULES.items():
        if path.name != "__init__.py" or module in PACKAGES or path.parent == GENERATED:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = doc.split("\n\n")[0]
        if "May import" not in first:
            missing.append(module)
    assert missing == []


@pytest.mark.timeout(300)
def test_layer_contracts() -> None:
    """import-linter's contracts of pyproject.toml, run on the source tree."""
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint, "import-linter is in the dev extras: pip install -e '.[dev]'"
    result = subprocess.run(
        [lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=280
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
