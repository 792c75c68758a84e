"""Row blocks read from Zarr chunks that do not line up with them, with every chunk decoded once per pass.

A row block of a stored CSR matrix is the value range ``indptr[start]:indptr[stop]`` of ``data`` and
``indices``, cut into Zarr chunks of a fixed number of values; a dense matrix read with another row count
than it was written with is cut the same way in rows. A block's edges fall inside chunks, and a chunk that
holds the end of one block and the start of the next would be decoded by both: ~1.5x the chunks of a pass
when a block spans two or three chunks, as in a store of highly variable genes. Here a chunk that several
blocks touch is read by a task of its own, and each block takes its part of it; the chunks inside a block
are read by the block itself.

That pays only where blocks span few chunks (``shares_chunks``). A block task that depends on a chunk task is
no longer a root task to Dask's distributed scheduler, which then stops queueing block reads as workers free
up (root-task queuing) and hands every block to the workers at once. With blocks of ~18 chunks (1M cells x
20k genes, 10k-cell blocks, 2 workers of 1.5 GB) qc wrote 8.7 GiB of spilled blocks and took 1.12x as long,
to save one decoded chunk in 18 (``bench/results/ab_qc_1000000_edge_chunks.md``). Such blocks read their edge
chunks themselves, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: a block's piece: ("own", start, stop) read by the block itself, in stored units (values or rows), or
#: ("shared", chunk, start, stop), a slice of a chunk that other blocks touch too (offsets in the chunk)
Segment = tuple


#: blocks spanning this many chunks or more (on average) read their edge chunks themselves: at most 1/8 of
#: a pass is decoded twice, and the block reads stay root tasks
SHARE_BELOW_SPAN = 8


def shares_chunks(edges: Sequence[int], chunk: int, below: float = SHARE_BELOW_SPAN) -> bool:
    """Whether blocks bounded by ``edges`` (stored units) are small enough, against the chunk length, for
    shared chunk tasks: their average span is under ``below`` chunks."""
    n_blocks = max(len(edges) - 1, 1)
    return (int(edges[-1]) - int(edges[0])) / n_blocks < below * max(int(chunk), 1)


def plan(edges: Sequence[int], chunk: int) -> tuple[list[int], list[list[Segment]]]:
    """The chunks that more than one block touches, and every block's segments in stored order.

    ``edges`` are the blocks' boundaries in stored units (n_blocks + 1 of them, non-decreasing), ``chunk`` the
    Zarr chunk length in those units. Only a block's first and last chunk can be shared: the ones between lie
    inside it.
    """
    edges = [int(e) for e in edges]
    chunk = max(int(chunk), 1)
    spans = [(a // chunk, (b - 1) // chunk) if b > a else None for a, b in zip(edges[:-1], edges[1:])]
    touched: dict[int, int] = {}
    for span in spans:
        if span is not None:
            for k in {span[0], span[1]}:
                touched[k] = touched.get(k, 0) + 1
    shared = {k for k, n in touched.items() if n > 1}
    blocks = []
    for (a, b), span in zip(zip(edges[:-1], edges[1:]), spans):
        segments: list[Segment] = []
        if span is not None:
            first, last = span
            lo = a
            if first in shared:
                hi = min(b, (first + 1) * chunk)
                segments.append(("shared", first, a - first * chunk, hi - first * chunk))
                lo = hi
            own_stop = last * chunk if last != first and last in shared else b
            if own_stop > lo:
                segments.append(("own", lo, own_stop))
            if last != first and last in shared:
                segments.append(("shared", last, 0, b - last * chunk))
        blocks.append(segments)
    return sorted(shared), blocks


def shared_keys(name: str, segments: list[Segment]) -> list[tuple]:
    """The task keys of the shared chunks a block's segments take from, in segment order."""
    return [(name, seg[1]) for seg in segments if seg[0] == "shared"]


def gather(segments: list[Segment], read_own, shared: Sequence) -> list:
    """A block's pieces in stored order: ``read_own(start, stop)`` for its own ranges, slices of the shared
    chunks' results (in segment order) for the rest. Each result is a list of arrays (one per stored part)."""
    pieces, taken = [], iter(shared)
    for seg in segments:
        if seg[0] == "own":
            pieces.append(read_own(seg[1], seg[2]))
        else:
            parts = next(taken)
            pieces.append([p[seg[2] : seg[3]] for p in parts])
    return pieces


def concat(pieces: list) -> list[np.ndarray]:
    """Join the (non-empty list of) pieces part by part (a block made of one piece is not copied)."""
    if len(pieces) == 1:
        return list(pieces[0])
    return [np.concatenate([piece[j] for piece in pieces]) for j in range(len(pieces[0]))]
