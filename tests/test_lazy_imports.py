"""Imports inside a function (lazy imports) stay only for heavy or optional packages, and each says
why in a comment. Everything else is imported at module level, where a reader looks for it.

Read from the source (ast and tokenize), nothing is imported. Covered: the project's code
(pipeline/, components/), its scripts and its Hydra plugins; tests/ is not. A lazy import "says
why" with a comment on its own line or on the line above it; the imports after it in the same
function share its reason."""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("pipeline", "components", "scripts", "hydra_plugins")

# what may be imported inside a function anywhere (a module and its submodules) -> why it may
LAZY = {
    "lightning": "seconds to import: training only",
    "matplotlib": "slow to import: drawing only",
    "transformers": "slow to import: tokenizers, HF configs and the transformers peer only",
    "wandb": "optional (logger=wandb) and slow to import",
    "xgrammar": "installed by `make setup`, not pip, and slow to import: constraints only",
    "vllm": "installed in .venv-vllm only",
    "llama_cpp": "an optional extra (`make peers`)",
    "optuna": "seconds to import: the Optuna sweeps only",
    "hydra_plugins.hydra_optuna_sweeper._impl": "imports optuna",
    "torch.utils.cpp_extension": "imports setuptools: building the native kernels only",
}
# (file, module) -> why that file imports it inside a function (the project's own modules)
LAZY_HERE = {
    ("hydra_plugins/decode_sweepers/sweepers.py", "pipeline"):
        "Hydra imports its plugins in every app it starts: the pipeline (and torch) only when a sweep uses them",
    ("scripts/diverse_beam_reference.py", "components"):
        "its `generate` runs in a transformers-4 environment without the project's dependencies",
    ("scripts/diverse_beam_reference.py", "pipeline"):
        "its `generate` runs in a transformers-4 environment without the project's dependencies",
}


def _within(module: str, names) -> str | None:
    return next((n for n in names if module == n or module.startswith(n + ".")), None)


def lazy_imports(source: str, name: str) -> list[tuple[int, str, bool]]:
    """(line, imported module, says why) for every import statement inside a function."""
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    out = []

    def walk(node, in_function: bool, said: bool) -> bool:
        """said: whether an import before this point, in the same function, gave the reason."""
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                walk(child, True, False)  # a function of its own: its own reason
            elif in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                said = said or bool(set(range(child.lineno - 1, child.end_lineno + 1)) & comments)
                modules = [a.name for a in child.names] if isinstance(child, ast.Import) else \
                    ["." * child.level + (child.module or "")]
                out.extend((child.lineno, m, said) for m in modules)
            else:  # try/if/with/class bodies: the reason given before them still holds
                said = walk(child, in_function, said)
        return said

    walk(ast.parse(source, name), False, False)
    return sorted(out)


def problems(root: Path = ROOT, folders=FOLDERS, lazy=LAZY, lazy_here=LAZY_HERE) -> list[str]:
    out = []
    for folder in folders:
        for f in sorted((root / folder).rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            for line, module, said in lazy_imports(f.read_text(), rel):
                allowed = _within(module, lazy) or _within(module, {m for r, m in lazy_here if r == rel})
                if allowed is None:
                    out.append(f"{rel}:{line}: `{module}` is imported inside a function: import it at module level")
                elif not said:
                    out.append(f"{rel}:{line}: the lazy import of `{module}` does not say why (a short comment)")
    return out


def test_lazy_imports_are_heavy_or_optional_packages_and_say_why():
    found = problems()
    assert not found, "\n".join(found)


def test_every_allowed_lazy_import_is_used():
    used = {(f.relative_to(ROOT).as_posix(), m) for folder in FOLDERS for f in (ROOT / folder).rglob("*.py")
            for _, m, _ in lazy_imports(f.read_text(), str(f))}
    unused = sorted(set(LAZY) - {_within(m, LAZY) for _, m in used})
    unused += sorted(f"{r}: {m}" for r, m in LAZY_HERE if not any(f == r and _within(x, {m}) for f, x in used))
    assert not unused, f"allowed lazy imports no longer used: {unused}"


@pytest.mark.parametrize("source, found", [
    ("import os\n", []),  # module level
    ("def f():\n    import os\n", ["pipeline/a.py:2: `os` is imported inside a function: import it at module level"]),
    ("def f():\n    from pipeline import b\n", ["pipeline/a.py:2: `pipeline` is imported inside a function: "
                                                "import it at module level"]),
    ("def f():\n    import wandb\n", ["pipeline/a.py:2: the lazy import of `wandb` does not say why (a short comment)"]),
    ("def f():\n    import wandb  # optional\n", []),
    ("def f():\n    # optional, slow\n    import wandb\n    from wandb import sdk\n", []),
    ("def f():\n    try:  # optional\n        import wandb\n    except ImportError:\n        from wandb import sdk\n", []),
    ("def f():\n    import wandb  # optional\n\ndef g():\n    import wandb\n",
     ["pipeline/a.py:5: the lazy import of `wandb` does not say why (a short comment)"]),
    ("def f():\n    from torch.utils.cpp_extension import include_paths  # setuptools\n", []),
    ("def f():\n    from torch.utils import data  # why\n",
     ["pipeline/a.py:2: `torch.utils` is imported inside a function: import it at module level"]),
    ("class A:\n    def f(self):\n        def g():\n            import heapq\n",
     ["pipeline/a.py:4: `heapq` is imported inside a function: import it at module level"]),
])
def test_the_check_fails_where_it_should(tmp_path, source, found):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "a.py").write_text(source)
    assert problems(tmp_path, ("pipeline",)) == found
