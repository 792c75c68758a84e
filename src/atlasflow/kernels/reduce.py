"""The block-reduction framework: per-row results concatenated, per-block partials summed (in a tree or
in lanes of blocks sharing one buffer)."""

from __future__ import annotations

import dask.array as da
import numpy as np

from atlasflow.backend import to_host


def per_row(x: da.Array, fn, ncols: int, *args) -> da.Array:
    """Row-aligned results of ``fn`` on each block, as a lazy (n_rows, ncols) float64 array."""
    return x.map_blocks(
        lambda b, *a: np.asarray(to_host(fn(b, *a)), dtype=np.float64).reshape(b.shape[0], ncols),
        *args,
        chunks=(x.chunks[0], (ncols,)),
        dtype=np.float64,
        meta=np.empty((0, 0), np.float64),
    )


#: Partials added per task of ``over_blocks``' reduction tree.
SUM_FAN_IN = 4


def over_blocks(x: da.Array, fn, size: int, *args) -> da.Array:
    """Sum over row blocks of ``fn(block) -> (size,)`` float64 partials, as a lazy (size,) array.

    The partials are added in a fixed tree (``SUM_FAN_IN`` per task, the same order whatever the scheduling),
    each task adding into one buffer. Dask's generic sum stacks its inputs first, a copy of every partial:
    with Gram-matrix partials (32 MB for 2,000 genes) that was a fifth of PCA's pass.
    """
    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    parts = x.map_blocks(
        lambda b, *a: np.asarray(to_host(fn(b, *a)), dtype=np.float64).reshape(1, size),
        *args,
        chunks=((1,) * x.numblocks[0], (size,)),
        dtype=np.float64,
        meta=np.empty((0, 0), np.float64),
    )
    return _summed(list(parts.to_delayed(optimize_graph=False).ravel()), size)  # keys shared with X's results


def _summed(level: list, size: int) -> da.Array:
    """The sum of delayed (size,) partials in a fixed tree (``SUM_FAN_IN`` per task), as a lazy array."""
    import dask

    while True:
        level = [dask.delayed(_add_partials, pure=True)(*level[i : i + SUM_FAN_IN])
                 for i in range(0, len(level), SUM_FAN_IN)]
        if len(level) == 1:
            return da.from_delayed(level[0], shape=(size,), dtype=np.float64, meta=np.empty((0,), np.float64))


#: Consecutive row blocks per lane of ``accumulate_blocks`` (fewer when that would leave more than MAX_LANES).
LANE_BLOCKS = 4
#: Most lanes (buffers alive at once) of ``accumulate_blocks``: bounds its memory whatever the number of cells.
MAX_LANES = 16


def accumulate_blocks(x: da.Array, fn, size: int, *args) -> da.Array:
    """Sum over row blocks of ``fn(block, *args, out=buffer)``, which adds a block's (size,) float64 partial
    into ``buffer`` in place, as a lazy (size,) array.

    The blocks are split into lanes of consecutive blocks; each lane is a chain of tasks filling one buffer,
    and the lanes' buffers are added at the end (``over_blocks``' fixed tree). With 32 MB partials (a Gram
    matrix of 2,000 genes), a partial per block meant allocating, moving between workers and adding one per
    block: a third of PCA's first pass. The lanes depend only on the number of blocks (``LANE_BLOCKS``,
    ``MAX_LANES``), so the bits of the result do not depend on the cluster. A chain's task may add into its
    input: only that task uses it, and a lost worker recomputes the lane from its start.
    """
    import dask

    if x.numblocks[1] != 1:
        x = x.rechunk({1: -1})
    blocks = list(x.to_delayed(optimize_graph=False).ravel())  # keys shared with other results of X
    n_lanes = max(1, min(MAX_LANES, -(-len(blocks) // LANE_BLOCKS)))
    lanes = []
    for lane in np.array_split(np.arange(len(blocks)), n_lanes):
        acc = None
        for i in lane:
            acc = dask.delayed(_lane_step, pure=True)(acc, blocks[i], fn, size, *args)
        lanes.append(acc)
    return _summed(lanes, size)


def _lane_step(out, block, fn, size: int, *args) -> np.ndarray:
    """One block of a lane: ``fn`` adds into the lane's buffer (a new zero buffer for the first block)."""
    if out is None:
        out = np.zeros(size, dtype=np.float64)
    fn(block, *args, out=out)
    return out


def _add_partials(*parts: np.ndarray) -> np.ndarray:
    """The sum of same-sized partials as a flat float64 array, added in order into one new buffer."""
    out = np.array(parts[0], dtype=np.float64).ravel()
    for part in parts[1:]:
        out += part.ravel()
    return out
