"""The project's own modules (pipeline/, components/) import one another one way: no import loop,
and no import of a project module hidden inside a function (the way a loop is usually hidden).

Read from the source (ast), nothing is imported: an import at module level and one inside a function
are both edges of the graph. Importing `a.b.c` from outside package `a.b` also runs `a.b`'s
__init__ (an edge to it too); from inside it, that package is already being imported.

The test modules share code through tests/helpers.py and tests/toy.py (and fixtures through
conftest.py): none imports another test module or conftest."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "components")

# function-level imports of project modules that stay, (module, imported module) -> why. None today:
# where an entry point must import a heavy optional stack late, its entry names the reason.
ALLOWED_LAZY: dict[tuple[str, str], str] = {}


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """(node, inside a function) for every import that runs (not under `if TYPE_CHECKING:`)."""
    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    yield from walk(ast.Module(body=[sub], type_ignores=[]), in_function)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                yield child, in_function
            yield from walk(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from walk(tree, False)


def _targets(module: str, is_package: bool, node, modules: dict[str, Path]) -> list[tuple[str, bool]]:
    """The project modules an import statement loads, each with whether the statement names it (not
    a package run on the way to it)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            here = here[:len(here) - node.level + 1]
            base = ".".join([*here, *([base] if base else [])])
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        if name.split(".")[0] not in PACKAGES:
            continue
        while name and name not in modules:  # `import a.b.attr`-like forms: the longest module prefix
            name = name.rpartition(".")[0]
        parts = name.split(".")
        for k in range(1, len(parts) + 1):  # the packages it runs on the way, unless `module` is inside them
            pkg = ".".join(parts[:k])
            if pkg in modules and not (module == pkg or module.startswith(pkg + ".")):
                out.append((pkg, k == len(parts)))
    return out


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[tuple[str, str, int]]]:
    """module -> the project modules it imports; and every function-level project import as
    (module, imported module, where: file and line)."""
    modules = project_modules(root)
    graph, lazy = {m: set() for m in modules}, []
    for m, f in modules.items():
        for node, in_function in _imports(ast.parse(f.read_text(), str(f))):
            for t, named in _targets(m, f.name == "__init__.py", node, modules):
                if t != m:
                    graph[m].add(t)
                if in_function and named:
                    lazy.append((m, t, f"{f.relative_to(root)}:{node.lineno}"))
    return graph, lazy


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def imported_test_modules(path: Path) -> list[str]:
    """The test modules and conftest that a file imports, anywhere in it, each as `line: name`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            names = [base, *(f"{base}.{a.name}" if base else a.name for a in node.names)]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "tests":
                parts = parts[1:]
            if parts and (parts[0] == "conftest" or parts[0].startswith("test_")):
                out.append(f"{node.lineno}: {parts[0]}")
    return sorted(set(out), key=lambda x: int(x.split(":")[0]))


def test_no_test_module_imports_another_or_conftest():
    found = {f.name: imported_test_modules(f) for f in sorted((ROOT / "tests").glob("test_*.py"))}
    assert len(found) > 10, "the test modules were not found"
    bad = [f"tests/{name}:{hit}" for name, hits in found.items() for hit in hits]
    assert not bad, "share code through tests/helpers.py (fixtures through conftest.py), not by importing " \
        "a test module or conftest:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, found", [
    ("from test_decode import decoder_for\n", ["1: test_decode"]),
    ("import json\n\ndef f():\n    from tests.conftest import REPO_ROOT\n", ["4: conftest"]),
    ("from tests import test_beam\n", ["1: test_beam"]),
    ("import tests.test_kv as kv\n", ["1: test_kv"]),
    ("from helpers import compose_config\nfrom toy import PerSequence\nimport pytest\n", []),
])
def test_a_test_module_import_is_found(tmp_path, source, found):
    path = tmp_path / "test_x.py"
    path.write_text(source)
    assert imported_test_modules(path) == found


def test_no_import_cycle_among_project_modules():
    graph, _ = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_level_import_of_a_project_module():
    _, lazy = import_graph()
    hidden = sorted({f"{where} imports {t}" for m, t, where in lazy if (m, t) not in ALLOWED_LAZY})
    assert not hidden, "import project modules at module level (or add an ALLOWED_LAZY entry with its reason):\n" + \
        "\n".join(hidden)


def test_the_allow_list_is_current():
    _, lazy = import_graph()
    used = {(m, t) for m, t, _ in lazy}
    assert not set(ALLOWED_LAZY) - used, f"ALLOWED_LAZY entries no longer needed: {sorted(set(ALLOWED_LAZY) - used)}"


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


@pytest.mark.parametrize("files, cycle", [
    ({"pipeline/a.py": "from pipeline.b import f\n", "pipeline/b.py": "def f():\n    from pipeline import a\n"},
     ["pipeline.a", "pipeline.b", "pipeline.a"]),
    ({"pipeline/a.py": "from . import b\n", "pipeline/b.py": "import components.c\n",
      "components/c.py": "from pipeline.a import x\n"},
     ["components.c", "pipeline.a", "pipeline.b", "components.c"]),
    ({"pipeline/core/__init__.py": "from pipeline.core.x import X\nimport pipeline.core.y\n",
      "pipeline/core/x.py": "X = 1\n", "pipeline/core/y.py": "import components.k\n",
      "components/k.py": "from pipeline.core.x import X\n"},
     ["components.k", "pipeline.core", "pipeline.core.y", "components.k"]),
])
def test_a_loop_is_found(tmp_path, files, cycle):
    """The walk finds a loop hidden in a function, one through a relative import, and one through
    a package's __init__ (components.k imports only pipeline.core.x, but that runs
    pipeline/core/__init__.py, which imports pipeline.core.y)."""
    graph, _ = import_graph(_tree(tmp_path, files))
    assert find_cycle(graph) == cycle


def test_a_package_importing_its_own_modules_is_no_loop(tmp_path):
    graph, lazy = import_graph(_tree(tmp_path, {
        "pipeline/core/__init__.py": "from pipeline.core.a import A\nfrom pipeline.core.b import B\n",
        "pipeline/core/a.py": "A = 1\n", "pipeline/core/b.py": "from pipeline.core.a import A\nB = A\n",
        "pipeline/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.d import D\n",
        "pipeline/d.py": "from pipeline.c import x\n"}))
    assert find_cycle(graph) is None and lazy == []
