"""Moving row blocks to and from the GPU, GPU limits and errors, and a brute-force CuPy kNN.

Importing this module never imports CuPy: every function that needs it imports it when called, so CPU
installs (and CPU CI) can import and test the device-free parts (chunk limits, error messages, the
blocked kNN written against NumPy).

* :func:`to_device` maps a lazy X of SciPy CSR / NumPy row blocks to cupyx CSR / CuPy blocks (lazily;
  the conversion runs in the task that reads the block), after checking from the stored ``indptr`` that
  no block exceeds CuPy's sparse limit of 2^31 - 1 non-zeros.
* :func:`oom_guard` turns a CUDA out-of-memory error into a one-line :class:`GpuMemoryError`.
* :func:`knn_gpu` is an exact kNN on an in-memory embedding for the graph stages when cuML is absent.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging

import dask.array as da
import numpy as np
import scipy.sparse as sp

from atlasflow import sources
from atlasflow.backend import is_gpu, is_sparse_meta
from atlasflow.sources import source_of
from atlasflow.errors import AtlasflowError, ConfigError, InputError
from atlasflow.compat import named_layers

log = logging.getLogger(__name__)

#: Most non-zeros one cupyx sparse matrix can hold (its indices and indptr are int32).
NNZ_LIMIT = 2**31 - 1


class GpuUnavailableError(AtlasflowError):
    """The GPU backend was asked for but CuPy or a CUDA device is missing."""


class GpuLimitError(ConfigError):
    """A row block would not fit a CuPy sparse matrix (too many non-zeros)."""


class GpuMemoryError(AtlasflowError):
    """The GPU ran out of memory."""


# ------------------------------------------------------------------------------------------ availability


def import_cupy():
    """Import CuPy or fail with one line saying how to install it."""
    try:
        import cupy
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken CUDA install
        raise GpuUnavailableError(
            f"backend gpu needs CuPy ({type(exc).__name__}: {exc}); install the gpu-cuda12 or gpu-cuda13 "
            "extra (pip install 'atlasflow[gpu-cuda12]') or use backend: cpu"
        ) from exc
    return cupy


def device_count() -> int:
    """CUDA devices CuPy sees (0 without CuPy, driver or device)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001
        return 0


@functools.lru_cache(maxsize=None)
def cuml_available() -> bool:
    """True when cuML imports (GPU kNN/UMAP for the graph stages); False without it or without a GPU."""
    return _importable("cuml")


@functools.lru_cache(maxsize=None)
def cugraph_available() -> bool:
    """True when cuGraph imports (GPU Leiden/Louvain)."""
    return _importable("cugraph")


def _importable(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - installed but unusable (no driver, wrong CUDA): treat as absent
        return False
    return True


# ----------------------------------------------------------------------------------------- chunk limits


def block_nnz(indptr: np.ndarray, row_chunks) -> np.ndarray:
    """Non-zeros of each row block (``row_chunks``: rows per block, as ``x.chunks[0]``) from a CSR indptr."""
    indptr = np.asarray(indptr, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(np.asarray(row_chunks, dtype=np.int64))])
    if bounds[-1] != indptr.shape[0] - 1:
        raise ValueError(f"row chunks cover {bounds[-1]} rows, indptr describes {indptr.shape[0] - 1}")
    return np.diff(indptr[bounds])


def max_chunk_rows(indptr: np.ndarray, limit: int = NNZ_LIMIT) -> int:
    """Largest ``chunk_rows`` whose every block of consecutive rows holds at most ``limit`` non-zeros."""
    indptr = np.asarray(indptr, dtype=np.int64)
    n = indptr.shape[0] - 1
    if n <= 0:
        return 1

    def fits(r: int) -> bool:
        starts = np.arange(0, n, r)
        stops = np.minimum(starts + r, n)
        return bool((indptr[stops] - indptr[starts]).max() <= limit)

    if fits(n):
        return n
    lo, hi = 1, n  # fits(lo) holds (a row has fewer non-zeros than genes < 2^31), fits(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def check_block_nnz(indptr: np.ndarray, row_chunks, *, what: str = "X", limit: int = NNZ_LIMIT) -> None:
    """Raise :class:`GpuLimitError` if a row block would exceed CuPy's sparse limit (no pass over the data)."""
    nnz = block_nnz(indptr, row_chunks)
    if nnz.size == 0 or nnz.max() <= limit:
        return
    i = int(nnz.argmax())
    fit = max_chunk_rows(indptr, limit)
    raise GpuLimitError(
        f"{what}: row block {i} ({int(row_chunks[i])} rows) holds {int(nnz[i]):,} non-zeros, more than a CuPy "
        f"sparse matrix can hold ({limit:,}); use chunk_rows <= {fit} (e.g. --chunk-rows {fit})"
    )


def _stored_indptr(x: da.Array) -> np.ndarray | None:
    """The indptr of the CSR element a lazy array was read from unchanged (None if computed or dense)."""
    src = source_of(x)
    if src is None:
        return None
    import zarr

    try:
        node = zarr.open_group(src[0], mode="r")[src[1]]
        if node.attrs.get("encoding-type") != "csr_matrix":
            return None
        return np.asarray(node["indptr"][:], dtype=np.int64)
    except Exception:  # noqa: BLE001 - the read tasks report damaged stores themselves
        return None


# ------------------------------------------------------------------------------------ moving row blocks


def block_to_device(block):
    """One block on the GPU: SciPy sparse -> cupyx CSR (int32 indices), NumPy -> CuPy; GPU blocks as they are."""
    if is_gpu(block):
        return block
    cupy = import_cupy()
    if sp.issparse(block):
        import cupyx.scipy.sparse as csp

        block = block.tocsr() if block.format != "csr" else block
        if block.nnz > NNZ_LIMIT:
            raise GpuLimitError(
                f"a row block of {block.shape[0]} rows holds {block.nnz:,} non-zeros, more than a CuPy sparse "
                f"matrix can hold ({NNZ_LIMIT:,}); use a smaller chunk_rows"
            )
        return csp.csr_matrix(
            (cupy.asarray(block.data), cupy.asarray(block.indices, dtype=cupy.int32),
             cupy.asarray(block.indptr, dtype=cupy.int32)),
            shape=block.shape,
        )
    return cupy.asarray(block)


def device_meta(x: da.Array):
    """A zero-size CuPy / cupyx CSR meta matching ``x``'s kind and dtype."""
    cupy = import_cupy()
    if is_sparse_meta(x):
        import cupyx.scipy.sparse as csp

        return csp.csr_matrix(sp.csr_matrix((0, 0), dtype=x.dtype))
    return cupy.empty((0,) * x.ndim, dtype=x.dtype)


def to_device(x: da.Array, *, indptr: np.ndarray | None = None) -> da.Array:
    """A lazy array of the same values with CuPy / cupyx CSR row blocks.

    Sparse blocks are checked against CuPy's 2^31 - 1 non-zero limit first, from ``indptr`` or the
    stored indptr of the element ``x`` was read from (nothing of X is read). An array read unchanged
    from a store stays linkable: writing it links the stored element instead of rewriting it.
    """
    if not isinstance(x, da.Array):
        raise InputError(f"to_device needs a lazy (Dask) matrix, got {type(x).__name__}; open stores with open_store")
    if is_gpu(x._meta):
        return x
    import_cupy()
    if device_count() == 0:
        raise GpuUnavailableError("backend gpu: CuPy sees no CUDA device (check the driver / CUDA_VISIBLE_DEVICES)")
    if is_sparse_meta(x):
        if indptr is None:
            indptr = _stored_indptr(x)
        if indptr is not None:
            check_block_nnz(indptr, x.chunks[0])
    y = x.map_blocks(block_to_device, dtype=x.dtype, meta=device_meta(x), name=f"to-gpu-{x.name}")
    sources.inherit(y, x)  # the same stored values: still linkable
    return y


def to_host(x: da.Array) -> da.Array:
    """A lazy array of the same values with NumPy / SciPy CSR blocks (host blocks pass unchanged).

    Maps every block whatever ``x._meta`` says: some stages declare a NumPy meta for CuPy blocks.
    """
    from atlasflow.backend import to_host as block_to_host

    meta = sp.csr_matrix((0, 0), dtype=x.dtype) if is_sparse_meta(x) else np.empty((0,) * x.ndim, dtype=x.dtype)
    return x.map_blocks(block_to_host, dtype=x.dtype, meta=meta, name=f"to-host-{x.name}")


# ------------------------------------------------------------------------------------------ out of memory


_OOM_TEXTS = ("Out of memory allocating", "cudaErrorMemoryAllocation", "CUDA_ERROR_OUT_OF_MEMORY")


def is_oom(exc: BaseException | None) -> bool:
    """True for CUDA/CuPy/RMM out-of-memory errors (also when wrapped as another exception's cause)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name, text = type(exc).__name__, str(exc)
        if name == "OutOfMemoryError" or any(t in text for t in _OOM_TEXTS):
            return True
        if isinstance(exc, MemoryError) and ("out_of_memory" in text or "RMM" in text or "bad_alloc" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


#: The way out of a GPU out-of-memory error in the graph stages, which hold the embedding and the graph
#: in one process (no chunks, no Dask cluster, no RMM preset).
IN_MEMORY_ADVICE = "fewer cells or n_pcs, or backend cpu for this stage (--backend cpu)"


def oom_message(exc: BaseException, *, chunk_rows: int | None = None, preset: str | None = None,
                advice: str | None = None) -> str:
    """One line: what ran out, and the ways out (``advice``, else smaller chunks and the capacity preset)."""
    detail = " ".join(str(exc).split())[:160]
    if advice:
        return f"GPU out of memory ({type(exc).__name__}: {detail}); use {advice}"
    smaller = f"a smaller chunk_rows (now {chunk_rows}, e.g. --chunk-rows {max(1, chunk_rows // 2)})" if chunk_rows \
        else "a smaller chunk_rows (--chunk-rows)"
    other = "" if preset == "capacity" else " or the capacity GPU preset (--gpu-preset capacity: RMM managed memory)"
    return f"GPU out of memory ({type(exc).__name__}: {detail}); use {smaller}{other}"


@contextlib.contextmanager
def oom_guard(*, chunk_rows: int | None = None, preset: str | None = None, advice: str | None = None):
    """Re-raise CUDA out-of-memory errors inside the block as a one-line :class:`GpuMemoryError`."""
    try:
        yield
    except AtlasflowError:
        raise
    except BaseException as exc:
        if is_oom(exc):
            raise GpuMemoryError(oom_message(exc, chunk_rows=chunk_rows, preset=preset, advice=advice)) from exc
        raise


# --------------------------------------------------------------------------------------------------- kNN

KNN_METRICS = ("euclidean", "sqeuclidean", "cosine")


def knn_gpu(x, k: int, metric: str = "euclidean", *, block_bytes: int | None = None):
    """Exact ``k`` nearest neighbours of every row of ``x`` among all rows, on the GPU with CuPy.

    Returns host ``(indices, distances)`` of shape (n, k), int64 and float64, sorted by distance then
    index; a point is its own first neighbour (distance ~0), as sklearn's ``kneighbors(x)`` on the
    fitted ``x``. Distances are sklearn's for ``metric`` (euclidean, sqeuclidean, cosine).
    """
    cupy = import_cupy()
    xd = cupy.asarray(x, dtype=cupy.float64)
    if block_bytes is None:
        free, _ = cupy.cuda.runtime.memGetInfo()
        block_bytes = int(min(4 * 2**30, free // 8))
    ind, dist = knn_blocked(xd, k, metric, block_bytes=block_bytes)
    return cupy.asnumpy(ind), cupy.asnumpy(dist)


def knn_blocked(x, k: int, metric: str = "euclidean", *, block_bytes: int = 2**28, probe: int | None = None):
    """Blocked brute-force kNN written against the array module of ``x`` (NumPy or CuPy).

    Per block of query rows: the distance matrix to all rows (one GEMM), a per-row threshold from the
    k-th smallest distance to a fixed spread of ``probe`` columns (an upper bound of the true k-th),
    candidates at or under it (a few times ``n * k / probe`` per row), and a sort of the candidates
    only. Final distances of the k chosen are recomputed directly (no cancellation error).
    """
    from atlasflow.backend import xp_of

    xp = xp_of(x)
    if metric not in KNN_METRICS:
        raise ConfigError(f"knn: metric {metric!r} is not supported on the GPU (supported: {', '.join(KNN_METRICS)})")
    n = int(x.shape[0])
    k = int(k)
    if not 1 <= k <= n:
        raise ConfigError(f"knn: k={k} must be between 1 and the number of points ({n})")
    x = x.astype(xp.float64)
    if metric == "cosine":
        norm = xp.sqrt((x * x).sum(axis=1))
        x = x / xp.where(norm == 0, 1.0, norm)[:, None]
    sq = (x * x).sum(axis=1)
    probe = min(n, max(probe or 4096, 8 * k))
    probe_cols = xp.asarray(np.linspace(0, n - 1, probe).round().astype(np.int64))
    rows_per_block = int(max(1, min(n, block_bytes // max(1, n * 8 * 3))))
    ind = xp.empty((n, k), dtype=xp.int64)
    dist = xp.empty((n, k), dtype=xp.float64)
    for start in range(0, n, rows_per_block):
        stop = min(n, start + rows_per_block)
        q = x[start:stop]
        d = q @ x.T
        if metric == "cosine":
            d = 1.0 - d
        else:
            d = xp.maximum(sq[start:stop, None] + sq[None, :] - 2.0 * d, 0.0)
        ind[start:stop] = _select_k(d, k, probe_cols, xp)
        dist[start:stop] = _exact_distances(q, x, ind[start:stop], metric, xp)
    order = lexsort_rows(dist, ind, xp)
    ind = xp.take_along_axis(ind, order, axis=1)
    dist = xp.take_along_axis(dist, order, axis=1)
    return ind, dist


def _select_k(d, k: int, probe_cols, xp):
    """Column indices of the k smallest entries of each row of ``d`` (ties: smaller index first)."""
    b, n = d.shape
    if n <= max(2048, 4 * k):
        order = lexsort_rows(d, xp.broadcast_to(xp.arange(n), d.shape), xp)
        return order[:, :k]
    thr = xp.sort(d[:, probe_cols], axis=1)[:, k - 1]
    rows, cols = xp.nonzero(d <= thr[:, None])
    vals = d[rows, cols]
    order = xp.lexsort(xp.stack([cols.astype(xp.float64), vals, rows.astype(xp.float64)]))
    rows, cols = rows[order], cols[order]
    counts = xp.bincount(rows, minlength=b)
    starts = xp.cumsum(counts) - counts
    pos = xp.arange(rows.shape[0]) - starts[rows]
    keep = pos < k
    out = xp.empty((b, k), dtype=xp.int64)
    out[rows[keep], pos[keep]] = cols[keep]
    return out


def _exact_distances(q, x, idx, metric: str, xp):
    """Distances of each query row to its chosen rows, computed from the differences."""
    nb = x[idx]  # (b, k, dims)
    if metric == "cosine":
        return 1.0 - (q[:, None, :] * nb).sum(axis=2)
    diff = q[:, None, :] - nb
    d2 = (diff * diff).sum(axis=2)
    return d2 if metric == "sqeuclidean" else xp.sqrt(d2)


def lexsort_rows(values, index, xp):
    """Per-row argsort of ``values``, ties broken by ``index`` (2-D, same shape)."""
    b, m = values.shape
    rows = xp.repeat(xp.arange(b, dtype=xp.float64), m)
    order = xp.lexsort(xp.stack([xp.asarray(index, dtype=xp.float64).ravel(), values.ravel(), rows]))
    return (order.reshape(b, m) - (xp.arange(b) * m)[:, None]).astype(xp.int64)


# ------------------------------------------------------------------------------------ choosing a backend


def validate_backend(backend: str) -> str:
    """Resolve ``auto`` to ``gpu`` when CuPy sees a device, else ``cpu``."""
    if backend not in ("auto", "cpu", "gpu"):
        raise ConfigError(f"backend: {backend!r} is not one of auto, cpu, gpu")
    if backend == "auto":
        try:
            import cupy

            return "gpu" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
        except Exception:  # noqa: BLE001 - no CuPy or no driver: CPU
            return "cpu"
    return backend


def to_backend(adata, backend: str):
    """Put a lazily opened AnnData's X and layers on the backend's device, in place; returns ``adata``.

    ``backend`` is ``cpu`` (nothing changes), ``gpu`` (row blocks become CuPy / cupyx CSR, see
    :func:`to_device`) or ``auto``. Stages call it right after ``open_store``; kernels then run
    unchanged and writes bring blocks back to host memory.
    """
    if backend == "auto":
        backend = validate_backend(backend)
    if backend != "gpu":
        return adata
    if adata.X is not None:
        adata.X = to_device(adata.X)
    for key in list(named_layers(adata)):
        adata.layers[key] = to_device(adata.layers[key])
    return adata
