"""UMAP's fuzzy union of a kNN graph's membership strengths, row by row (issue #21).

umap-learn (scanpy's path) symmetrises the directed strengths ``A`` as ``A + A.T - A * A.T`` with SciPy
sparse algebra: a COO matrix, its transpose, their elementwise product, a sum and a difference, each a
matrix of up to twice the kNN's edges, alive together (~1 GB at 1M cells). Here the same float32
arithmetic runs row by row: each cell's own strengths (its kNN row, sorted by neighbour) are merged with the
strengths of the cells that have it as a neighbour (the transpose's row, built by a counting sort), and
``w = (a + b) - a * b`` is computed in float32 as SciPy does (``a`` alone where there is no ``b`` and
the reverse), zeros dropped. The result is SciPy's matrix bit for bit: the same values, sorted indices,
int32 index arrays, in the memory of the result plus one transpose of the kNN.
"""

from __future__ import annotations

import numpy as np

_UNION = None


def _kernels():
    global _UNION
    if _UNION is None:
        import numba

        @numba.njit(cache=True)
        def transpose(cols, vals, n, k):
            """The strengths' transpose as CSR: for each cell, the cells that have it as a neighbour, ascending."""
            counts = np.zeros(n + 1, dtype=np.int64)
            for e in range(cols.shape[0]):
                if vals[e] != 0:
                    counts[cols[e] + 1] += 1
            for i in range(n):
                counts[i + 1] += counts[i]
            fill = counts[:-1].copy()
            src = np.empty(counts[n], dtype=np.int32)
            val = np.empty(counts[n], dtype=np.float32)
            for e in range(cols.shape[0]):
                if vals[e] != 0:
                    c = cols[e]
                    src[fill[c]] = e // k
                    val[fill[c]] = vals[e]
                    fill[c] += 1
            return counts, src, val

        @numba.njit(cache=True)
        def merge(cols, vals, k, r_ptr, r_src, r_val, out_ind, out_val, out_ptr, fill):
            """Row by row: the union of the row's own strengths and its transpose row; counts the non-zero
            results (``fill=False``) or writes them at ``out_ptr`` (``fill=True``)."""
            n = out_ptr.shape[0] - 1
            own_c = np.empty(k, dtype=np.int64)
            own_v = np.empty(k, dtype=np.float32)
            for i in range(n):
                m = 0
                for e in range(i * k, (i + 1) * k):  # the row's non-zero strengths, sorted by neighbour
                    if vals[e] != 0:
                        c = cols[e]
                        p = m
                        while p > 0 and own_c[p - 1] > c:
                            own_c[p] = own_c[p - 1]
                            own_v[p] = own_v[p - 1]
                            p -= 1
                        own_c[p] = c
                        own_v[p] = vals[e]
                        m += 1
                a_pos, b_pos, b_end = 0, r_ptr[i], r_ptr[i + 1]
                out = out_ptr[i] if fill else 0
                while a_pos < m or b_pos < b_end:
                    if b_pos >= b_end or (a_pos < m and own_c[a_pos] < r_src[b_pos]):
                        c, w = own_c[a_pos], own_v[a_pos]
                        a_pos += 1
                    elif a_pos >= m or r_src[b_pos] < own_c[a_pos]:
                        c, w = np.int64(r_src[b_pos]), r_val[b_pos]
                        b_pos += 1
                    else:
                        a, b = own_v[a_pos], r_val[b_pos]
                        c, w = own_c[a_pos], (a + b) - a * b  # float32 throughout, as SciPy's float32 matrices
                        a_pos += 1
                        b_pos += 1
                    if w != 0:
                        if fill:
                            out_ind[out] = c
                            out_val[out] = w
                        out += 1
                if not fill:
                    out_ptr[i + 1] = out
            if not fill:
                for i in range(n):
                    out_ptr[i + 1] += out_ptr[i]

        _UNION = (transpose, merge)
    return _UNION


def fuzzy_union(cols: np.ndarray, vals: np.ndarray, n: int, k: int):
    """CSR (float32 data, int32 indices) of ``A + A.T - A * A.T`` for the directed strengths ``A`` given as
    ``k`` entries per row (``cols``, ``vals``: umap-learn's ``compute_membership_strengths`` output, zero
    strengths and missing neighbours included as zeros), equal to umap-learn's union bit for bit."""
    import scipy.sparse as sp

    transpose, merge = _kernels()
    cols = np.ascontiguousarray(cols)
    vals = np.ascontiguousarray(vals, dtype=np.float32)
    r_ptr, r_src, r_val = transpose(cols, vals, n, k)
    ptr = np.zeros(n + 1, dtype=np.int64)
    merge(cols, vals, k, r_ptr, r_src, r_val, np.empty(0, np.int32), np.empty(0, np.float32), ptr, False)
    nnz = int(ptr[-1])
    index = np.int32 if nnz < np.iinfo(np.int32).max else np.int64
    ind, val = np.empty(nnz, dtype=index), np.empty(nnz, dtype=np.float32)
    merge(cols, vals, k, r_ptr, r_src, r_val, ind, val, ptr, True)
    del r_ptr, r_src, r_val
    out = sp.csr_matrix((val, ind, ptr.astype(index)), shape=(n, n))
    out.has_sorted_indices = True
    return out
