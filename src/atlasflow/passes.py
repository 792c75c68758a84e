"""Passes over stored matrices: how often a stage read each stored element, in whole passes.

Counted from the task graphs a stage computes, before Dask optimises them: every row-block read task of an
element (``store.read`` registers their layers) that a computation needs counts as 1/blocks of a pass. A
stage that reads X for a mean and again for a projection reports 2.0; one that holds X in the workers'
memory after its first pass reports 1.0. The stage's JSON summary carries the numbers (``passes``).

Where Dask optimises a graph before it is computed (``da.store``, ``to_delayed()``) the read layers are no
longer visible, and the code that does it counts the pass itself (``count`` on the array beforehand, or
``add`` for a pass that reads stored chunks without the read layer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dask.base import is_dask_collection
from dask.core import flatten
from dask.highlevelgraph import HighLevelGraph

#: read layer name -> ("<store>/<element>", blocks of the layer)
LAYERS: dict[str, tuple[str, int]] = {}
#: "<store>/<element>" -> passes so far (a store read with two block sizes adds both)
PASSES: Counter = Counter()
#: read layers whose blocks are persisted on the workers for now
HELD: set[str] = set()


def _label(path, key: str) -> str:
    return f"{Path(path).stem}/{key}"


def register(x, path, key: str) -> None:
    """The lazy array ``x`` reads ``path``/``key`` block by block in its layer ``x.name``."""
    LAYERS[x.name] = (_label(path, key), x.numblocks[0])


def add(path, key: str, n: float = 1.0) -> None:
    """``n`` passes over ``path``/``key`` made without its read layer (e.g. rewriting its values chunk by chunk)."""
    PASSES[_label(path, key)] += n


def count(*collections) -> None:
    """Add the block reads that computing ``collections`` takes (call it once per compute or persist)."""
    collections = [c for c in collections if is_dask_collection(c)]
    if not collections or not LAYERS:
        return
    graph = HighLevelGraph.merge(*[c.__dask_graph__() for c in collections])
    if not isinstance(graph, HighLevelGraph):
        return
    wanted = {name for name in LAYERS.keys() & graph.layers.keys() if name not in HELD}
    graph = graph.cull(set(flatten([c.__dask_keys__() for c in collections])))
    for layer_name, layer in graph.layers.items():  # newer Dask renames culled layers '<name>-<token>'
        name = next((n for n in wanted if layer_name == n or layer_name.startswith(f"{n}-")), None)
        if name is not None:
            label, blocks = LAYERS[name]
            reads = sum(1 for key in layer if isinstance(key, tuple) and key[0] == name)
            PASSES[label] += reads / max(blocks, 1)


@contextmanager
def held(x) -> Iterator[None]:
    """While inside, computations on the persisted ``x`` (which keeps its read layer's name) read no store."""
    HELD.add(x.name)
    try:
        yield
    finally:
        HELD.discard(x.name)


def summary() -> dict[str, float]:
    """Passes per stored element read so far, e.g. ``{"subset/X": 2.0}``."""
    return {label: round(n, 2) for label, n in sorted(PASSES.items()) if n}
