"""Every ``cupy.``, ``cupyx.`` and ``xp.`` name our code uses exists in the installed CuPy.

Kernels take their array module from the chunk (``xp = xp_of(block)``), so a NumPy-only function called
through ``xp`` works on the CPU and breaks only on the GPU. This reads the source (no device needed, so
it runs wherever CuPy is installed, GPU or not) and looks each attribute chain up in CuPy. Not marked
``gpu``: it needs CuPy, not a device, and skips with the reason where CuPy is missing (CPU CI).
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

cupy = pytest.importorskip("cupy")

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [*sorted((ROOT / "src").rglob("*.py")), ROOT / "bench" / "gpu_bench.py"]
#: Names that stand for CuPy in our code.
ALIASES = {"cupy": "cupy", "xp": "cupy", "cupyx": "cupyx"}


def _chains(tree: ast.AST):
    """Outermost attribute chains rooted at a CuPy alias, e.g. ``("xp", "linalg", "qr")``."""
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue
        parts, cur = [], node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in ALIASES:
            yield (cur.id, *reversed(parts))


def _resolve(chain: tuple[str, ...]) -> bool:
    obj = importlib.import_module(ALIASES[chain[0]])
    for part in chain[1:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            try:  # a submodule not imported by its package (cupyx.scipy.sparse)
                obj = importlib.import_module(f"{obj.__name__}.{part}")
            except (ImportError, AttributeError):
                return False
    return True


def test_every_cupy_name_we_use_exists():
    seen: dict[tuple[str, ...], str] = {}
    for path in SOURCES:
        for chain in _chains(ast.parse(path.read_text(), filename=str(path))):
            seen.setdefault(chain, str(path.relative_to(ROOT)))
    assert len(seen) > 20, f"the scan found too few names ({len(seen)}): is the source where the test expects it?"
    missing = {".".join(chain): where for chain, where in seen.items() if not _resolve(chain)}
    assert not missing, f"names missing from CuPy {cupy.__version__}: {missing}"
