"""The layout's rules, checked on the source: no import cycles, no private names across modules,
imports point down the layers, and the runtime starts without torch or transformers."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("toolchain", "passes")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, ast.Module]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            out[_module_name(path)] = ast.parse(path.read_text(), str(path))
    return out


SOURCES = _sources()


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    is_pkg = (ROOT / Path(*base) / "__init__.py").exists()
    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.Module, top_level_only: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for each import; top_level_only skips imports
    inside functions (deferred ones, which run only when called)."""
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for n in ast.walk(block)}  # imports for annotations only never run
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    nodes = [n for n in nodes if id(n) not in typing_only]
    out = []
    for node in nodes:
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            names = [a.name for a in node.names]
            # `from pkg import mod` imports the module pkg.mod
            subs = [n for n in names if f"{target}.{n}" in SOURCES]
            out += [(f"{target}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest:
                out.append((target, rest, node.lineno))
    return out


def _ours(name: str) -> str | None:
    """The project module an import names (the longest known prefix), or None."""
    while name:
        if name in SOURCES:
            return name
        name = name.rpartition(".")[0]
    return None


def test_no_private_names_imported_from_another_module():
    bad = []
    for module, tree in SOURCES.items():
        for target, names, line in _imports(module, tree, top_level_only=False):
            if _ours(target) is None or target == module:
                continue
            bad += [f"{module}:{line} imports {n} from {target}" for n in names if n.startswith("_") and not n.endswith("__")]
            if any(part.startswith("_") and part != "__init__" for part in target.split(".")):
                bad.append(f"{module}:{line} imports the private module {target}")
    assert not bad, "\n".join(bad)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, tree in SOURCES.items():
        deps = {_ours(t) for t, _, _ in _imports(module, tree, top_level_only)}
        # a package's own __init__ importing its modules is how registries fill, not a cycle
        graph[module] = {d for d in deps if d and d != module and not d.startswith(module + ".")}
    return graph


def test_no_import_cycles_between_modules():
    """Counting deferred imports too: two modules that need each other are one module, or a
    third one is missing."""
    cycle = _cycle(_graph(top_level_only=False))
    assert cycle is None, " -> ".join(cycle)


# Imports point down: a module of a layer may import only its own layer and the ones listed.
LAYERS = {
    "toolchain.errors": set(),
    "toolchain.atomic": set(),  # the one whole-or-nothing file write, beside errors at the bottom
    "toolchain.artifact": {"toolchain.errors", "toolchain.atomic"},
    "toolchain.kernels": {"toolchain.errors"},  # C sources and their build: below everything that runs graphs
    "toolchain.runtime": {"toolchain.errors", "toolchain.atomic", "toolchain.artifact", "toolchain.cost",
                          "toolchain.qnn", "toolchain.kernels"},
    "toolchain.cost": {"toolchain.errors", "toolchain.artifact"},
    "toolchain.ir": {"toolchain.errors", "toolchain.artifact"},
    "passes": {"toolchain.errors", "toolchain.artifact", "toolchain.ir", "toolchain.kernels"},
}


def test_layers_import_only_downwards():
    bad = []
    for module, tree in SOURCES.items():
        layer = next((name for name in LAYERS if module == name or module.startswith(name + ".")), None)
        if layer is None:
            continue
        allowed = LAYERS[layer] | {layer}
        for target, _, line in _imports(module, tree, top_level_only=False):
            ours = _ours(target)
            if ours and not any(ours == a or ours.startswith(a + ".") for a in allowed):
                bad.append(f"{module}:{line} imports {ours}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["toolchain.runtime.model", "toolchain.runtime.policies",
                                    "toolchain.cli.main"])
def test_runtime_loads_without_torch_or_transformers(module):
    code = (f"import sys, {module}; "
            "print(','.join(m for m in ('torch', 'transformers', 'onnx_ir', 'onnxscript') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"
