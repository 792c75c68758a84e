"""The package's shape (src/atlasflow/README.md): modules in layers without import cycles, none too long, the
dispatch module a leaf, no reaching into another module's private names. Read from the source (every import,
including those inside functions), so it needs nothing installed."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "src" / "atlasflow"
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PKG.rglob("*.py")}


def imports_of(name: str) -> list[tuple[str, list[str]]]:
    """(module, names) for every import in a module that resolves to an atlasflow module."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name in MODULES]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if not base.startswith("atlasflow"):
                continue
            for a in node.names:  # `from pkg import submodule` is an import of the submodule
                sub = f"{base}.{a.name}"
                found.append((sub, []) if sub in MODULES else (base, [a.name]))
    return found


def graph() -> dict[str, set[str]]:
    return {m: {t for t, _ in imports_of(m) if t != m} for m in MODULES}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_checks_see_a_cycle():
    """The cycle finder itself finds one (so an empty answer below means something)."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "atlasflow.store.read" in graph()["atlasflow.store.write"]


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_module_over_the_line_limit():
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these modules (over {MAX_LINES} lines): {long}"


def test_dispatch_modules_are_leaves():
    """backend (NumPy/CuPy dispatch), sources, passes and allocation import no atlasflow module."""
    for leaf in ("atlasflow.backend", "atlasflow.sources", "atlasflow.passes", "atlasflow.allocation",
                 "atlasflow.errors"):
        assert graph()[leaf] == set(), leaf


def test_no_private_name_of_another_module():
    """Names used across modules are public: no `from atlasflow.x import _y`, no `x._y` on an atlasflow module."""
    found = []
    for name, path in MODULES.items():
        aliases = {}
        tree = ast.parse(path.read_text())
        for target, names in imports_of(name):
            found += [f"{name} imports {target}.{n}" for n in names if n.startswith("_")]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("atlasflow"):
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in MODULES})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in MODULES})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")
                    and aliases[node.value.id] != name):
                found.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert found == []


def test_argparse_types_are_defined_once():
    """The shared argparse number types live in stages/_common.py only."""
    defined = {}
    for name, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            names = [node.name] if isinstance(node, ast.FunctionDef | ast.ClassDef) else \
                [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else []
            for n in names:
                if n.startswith(("optional_", "positive_", "non_negative_")):
                    defined.setdefault(n, []).append(name)
    twice = {n: m for n, m in defined.items() if len(m) > 1}
    assert twice == {}
    assert {m for ms in defined.values() for m in ms} <= {"atlasflow.stages._common"}, defined
