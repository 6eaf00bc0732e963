"""The package map in docs/ARCHITECTURE.md is the import rule: a module imports only from its own package or from
packages below it in the map (function-level imports too), and no module imports itself back through others."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def map_layers(doc: Path = ROOT / "docs" / "ARCHITECTURE.md") -> dict[str, int]:
    """Package -> height (0 = bottom) from the architecture page's map block (first column, top row highest)."""
    block = doc.read_text().split("## Package map", 1)[1].split("```", 2)[1]
    rows = [ln for ln in block.splitlines()[2:] if ln and not ln.startswith(" ")]
    names = [re.split(r"\s{2,}", ln)[0].split(", ") for ln in rows]
    return {n: len(names) - 1 - i for i, group in enumerate(names) for n in group}


def _module(f: Path, root: Path) -> str:
    parts = list(f.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(pkg: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its body (relative imports resolved;
    `from a.b import c` counts as a.b.c when c is a module, else as a.b)."""
    root = pkg.parent
    files = {_module(f, root): f for f in pkg.rglob("*.py")}
    graph = {}
    for mod, f in files.items():
        here = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                subs = {f"{base}.{a.name}" for a in node.names} & files.keys()
                deps |= subs or ({base} & files.keys())
        graph[mod] = deps - {mod}
    return graph


def package(mod: str) -> str:
    """bpcompile.runtime.model -> runtime; bpcompile.cli -> cli; bpcompile -> ''."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(pkg: Path, layers: dict[str, int]) -> list[str]:
    out = []
    for mod, deps in sorted(import_graph(pkg).items()):
        for dep in sorted(deps):
            mine, theirs = package(mod), package(dep)
            if theirs and layers[theirs] > layers[mine]:  # one row of the map is one layer
                out.append(f"{mod} ({mine}) imports {dep} ({theirs})")
    return out


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among modules (packages' __init__ left out: they hold no imports here), or None."""
    graph = {m: {d for d in ds if d in graph} for m, ds in graph.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_map_covers_every_package():
    layers = map_layers()
    pkg = ROOT / "bpcompile"
    present = {package(m) for m in import_graph(pkg)} - {""}
    assert present <= set(layers), f"packages missing from the map: {sorted(present - set(layers))}"
    assert {"core", "kernels", "runtime", "serving", "compiler", "eval", "cli"} <= set(layers)
    assert layers["core"] == 0 and layers["runtime"] < layers["serving"] < layers["compiler"] < layers["cli"]


def test_imports_follow_the_map():
    bad = violations(ROOT / "bpcompile", map_layers())
    assert not bad, "imports against the package map:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycle(import_graph(ROOT / "bpcompile"))
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_checks_have_teeth(tmp_path):
    """On a small made-up package: a lazy upward import and a cycle are both reported."""
    pkg = tmp_path / "bpcompile"
    for d in ("core", "runtime"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from bpcompile.runtime import b\n")
    (pkg / "runtime" / "b.py").write_text("from ..core.a import f\n")
    layers = {"runtime": 1, "core": 0}
    assert violations(pkg, layers) == ["bpcompile.core.a (core) imports bpcompile.runtime.b (runtime)"]
    assert cycle(import_graph(pkg)) == ["bpcompile.core.a", "bpcompile.runtime.b", "bpcompile.core.a"]
