"""Gene-major CSR blocks filled from transposed pieces (``atlasflow.transpose``, pass 2).

A piece is one row block's values of a run of genes, gene after gene, with each value's cell stored as the
step from the previous cell of the same gene (the first as it is). Placing a piece appends each gene's
values and cells (shifted to the whole matrix's cell numbers) at the next free slot of that gene's row.
CPU only: the pieces come from files.
"""

from __future__ import annotations

import numpy as np

_PLACE = None


def place_gene_runs(values, steps, counts, fill, row_start: int, data, indices) -> None:
    """Append a piece (``values``, cell ``steps``, values per gene ``counts``) to ``data``/``indices`` at the
    slots ``fill`` (one per gene, advanced in place); cells are numbered from ``row_start``."""
    global _PLACE
    if _PLACE is None:
        import numba

        @numba.njit(cache=True, nogil=True)
        def place(values, steps, counts, fill, row_start, data, indices):
            k = 0
            for g in range(counts.shape[0]):
                cell = row_start
                dst = fill[g]
                for q in range(counts[g]):
                    cell += steps[k]
                    data[dst + q] = values[k]
                    indices[dst + q] = cell
                    k += 1
                fill[g] = dst + counts[g]

        _PLACE = place
    _PLACE(values, steps, counts, fill, np.int64(row_start), data, indices)
