"""The house rules that code review alone would miss: light imports, no import circles, and
each list of choices written once."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import get_args

import pytest

from rapid_integrations import config
from rapid_integrations.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("rapid_integrations", "langchain_rapid", "llamaindex_rapid")


def _loaded_after_imports(modules: tuple[str, ...], watched: tuple[str, ...]) -> list[list[str]]:
    """The `watched` modules loaded after importing each of `modules` in turn, in one fresh
    interpreter. Each list is what that import and the earlier ones loaded: while the earlier
    lists are empty, the same as a fresh interpreter importing that module alone (one startup
    instead of one per module)."""
    code = (
        "import importlib, sys\n"
        f"for module in {modules!r}:\n"
        "    importlib.import_module(module)\n"
        f"    print(' '.join(m for m in {watched!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return [line.split() for line in done.stdout.splitlines()]


def test_importing_the_task_builder_loads_neither_torch_nor_the_cli():
    heavy = (
        "torch",
        "transformers",
        "rapid_integrations.cli",
        "rapid_integrations.demo",
        "rapid_integrations.engine.rapid_engine",
    )
    dataset, suite, cli = _loaded_after_imports(
        (
            "rapid_integrations.bench.dataset",
            "rapid_integrations.bench.suite",
            "rapid_integrations.cli",
        ),
        heavy,
    )
    assert dataset == [] and suite == []
    # The check itself sees a watched import. The CLI module, not the CLI's engine path
    # (bench.runner, which loads torch: 10 s of imports for the same proof).
    assert cli == ["rapid_integrations.cli"]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """The package modules `path` imports anywhere (lazy imports inside functions count)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (only names that are modules)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    return {name: _imports(path, name) & files.keys() - {name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path of module names, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circles():
    graph = import_graph()
    assert (
        "rapid_integrations.engine.rapid_engine" in graph["rapid_integrations.cli"]
    )  # lazy imports count
    assert find_cycle(graph) is None


def test_the_circle_finder_finds_a_circle():
    graph = import_graph()
    graph["rapid_integrations.config"].add("rapid_integrations.cli")  # planted: cli -> config
    assert find_cycle(graph) is not None


CHOICES = {
    "mode": config.Mode,
    "residual": config.Residual,
    "tail_guard": config.TailGuard,
    "truncation": config.Truncation,
    "retrieval_fallback": config.RetrievalFallback,
}


@pytest.mark.parametrize("field", CHOICES)
def test_each_choice_list_is_the_literal_and_checked_by_it(field):
    choices = get_args(CHOICES[field])
    if field != "mode":
        for value in choices:
            assert getattr(config.RapidConfig(**{field: value}), field) == value
        with pytest.raises(config.RapidConfigError, match=field):
            config.RapidConfig(**{field: "nope"})
    else:
        assert choices == config.MODES
        with pytest.raises(config.RapidConfigError, match="mode"):
            config.check_mode("nope")


def test_the_cli_offers_exactly_the_configs_choices():
    actions = {}
    for sub in build_parser()._subparsers._group_actions[0].choices.values():
        actions |= {a.dest: a for a in sub._actions}
    assert tuple(actions["mode"].choices) == config.MODES
    assert tuple(actions["truncation"].choices) == config.TRUNCATIONS
    assert all(name in actions["dtype"].help for name in config.DTYPES)
