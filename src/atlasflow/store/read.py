"""Reading stores lazily: ``open_store`` (X and layers as Dask arrays of row blocks, small elements in memory),
the registry of what was read unchanged (so ``write_store`` can link it), chunk checks and provenance."""

from __future__ import annotations

import functools
import os
import weakref
from pathlib import Path

import anndata as ad
import dask.array as da
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr
import zarr.core.array
from dask.base import tokenize

from atlasflow import integrity, kernels, passes, sources
from atlasflow.backend import is_sparse_meta
from atlasflow.sources import source_of
from atlasflow.errors import StoreError
from atlasflow.store import block_plan
from atlasflow.store.format import META_KEY


#: Backend a stage script asked for (atlasflow.cli sets it); "gpu" puts opened matrices on the device.
DEFAULT_BACKEND = "cpu"


def open_store(path: str | os.PathLike, *, chunk_rows: int | None = None, backend: str | None = None,
               obs_columns: bool = True, skip: tuple[str, ...] = ()) -> ad.AnnData:
    """Open an AnnData Zarr store lazily: X and layers as Dask arrays of row chunks, the rest in memory.

    With ``backend="gpu"`` (default: the stage's ``--backend``) the row blocks become CuPy chunks. With
    ``obs_columns=False`` obs holds only the cell names (for stages that never look at obs: reading and
    fingerprinting a QC'd obs costs ~0.2 s at 100k cells); written unchanged it is linked whole, and
    ``write_store`` refuses to write it changed (that would drop the columns it never read).

    ``skip`` names obsm/varm/obsp/varp elements not to read, a whole axis (``"obsm"``) or one entry
    (``"obsp/distances"``): a stage that never looks at them saves their memory (X_pca and the kNN
    distances are ~360 MB at 1M cells). ``load_element`` reads one later; ``write_store`` links every
    skipped entry the stage did not replace into its output, as it links unchanged ones.
    """
    path = Path(path)
    if not path.exists():
        raise StoreError(f"store {path} does not exist")
    try:
        root = zarr.open_group(str(path), mode="r")
    except Exception as exc:  # noqa: BLE001 - zarr raises several types for a broken group
        raise StoreError(f"{path} is not a readable Zarr store ({exc})") from exc
    if root.metadata.zarr_format != 3:  # its elements, linked into a v3 output, would be invisible there
        raise StoreError(f"{path} is a Zarr v{root.metadata.zarr_format} store; the stages read the Zarr v3 "
                         "stores atlasflow writes: convert it with the ingest stage (--input it)")
    integrity.verify_store(path)  # every array's chunk files and shapes: Zarr would read zeros
    chunk_rows, store_id = _chunking_and_id(root, path, chunk_rows)

    def small(key):
        return _read_element(root, key, path) if key in root else None

    obs = small("obs") if obs_columns else _names_only(root, "obs", path)
    var = small("var")
    if obs is None or var is None:
        raise StoreError(f"{path} has no obs/var: not an AnnData store")
    X = lazy_elem(path, "X", chunk_rows=chunk_rows, store_id=store_id) if "X" in root else None
    layers = {}
    if "layers" in root:
        for key in root["layers"]:
            layers[key] = lazy_elem(path, f"layers/{key}", chunk_rows=chunk_rows, store_id=store_id)
    aligned, unread = {}, []
    for axis in ("obsm", "varm", "obsp", "varp"):
        names = list(root[axis]) if axis in root else []
        wanted = [k for k in names if axis not in skip and f"{axis}/{k}" not in skip]
        unread += [f"{axis}/{k}" for k in names if k not in wanted]
        aligned[axis] = small(axis) if len(wanted) == len(names) else {k: small(f"{axis}/{k}") for k in wanted}
    adata = ad.AnnData(X=X, obs=obs, var=var, layers=layers or None, uns=small("uns"), **aligned)
    remember_read(adata, path, partial_obs=not obs_columns)
    if unread:
        _UNREAD[id(adata)] = (weakref.ref(adata, functools.partial(_forget_unread, id(adata))), str(path), unread)
    from atlasflow.gpu import to_backend

    return to_backend(adata, backend or DEFAULT_BACKEND)


# id of an in-memory element ``open_store`` read -> (weak reference, store path, element key, fingerprint):
# lets ``write_store`` link obs, var, obsm, varm, obsp and varp elements a stage left as they were.
_READ: dict[int, tuple] = {}

# id of an AnnData ``open_store`` opened with ``skip`` -> (weak reference, store path, element keys not read)
_UNREAD: dict[int, tuple] = {}


def unread_elements(adata: ad.AnnData) -> list[tuple[str, Path]]:
    """(key, source path) of the aligned elements ``open_store`` did not read for ``adata`` (``skip``) and
    that ``adata`` still has no element of the same name for: ``write_store`` links them."""
    entry = _UNREAD.get(id(adata))
    if entry is None or entry[0]() is not adata:
        return []
    _, path, keys = entry
    out = []
    for key in keys:
        axis, name = key.split("/", 1)
        if name not in getattr(adata, axis):
            out.append((key, Path(path) / key))
    return out


def load_element(adata: ad.AnnData, key: str):
    """Read the aligned element ``key`` (e.g. ``"obsp/distances"``) that ``open_store`` skipped into ``adata``
    (read-only, linked on write as if read at first) and return it; already there: return it."""
    axis, name = key.split("/", 1)
    if name in getattr(adata, axis):
        return getattr(adata, axis)[name]
    entry = _UNREAD.get(id(adata))
    if entry is None or entry[0]() is not adata or key not in entry[2]:
        raise StoreError(f"{key} is not in the store this AnnData was opened from")
    path = Path(entry[1])
    value = _read_element(zarr.open_group(str(path), mode="r"), key, path)
    getattr(adata, axis)[name] = value
    if _freeze(value):
        ref = weakref.ref(value, functools.partial(_forget, id(value)))
        _READ[id(value)] = (ref, str(path), key, None, False)
    return value


def _read_element(root, key: str, path: Path):
    """``root[key]`` read into memory by anndata, or a one-line StoreError naming the stage to re-run."""
    try:
        return ad.io.read_elem(root[key])
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"cannot read {key!r} of {path} ({type(exc).__name__}: {exc}); the store is damaged: "
                         f"delete it and re-run {writer_of(path)}") from exc


def _forget_unread(obj_id: int, ref) -> None:
    entry = _UNREAD.get(obj_id)
    if entry is not None and entry[0] is ref:
        del _UNREAD[obj_id]


def _chunking_and_id(root, path: Path, chunk_rows: int | None) -> tuple[int, str]:
    """The row chunk to read a store with (``chunk_rows``, else the store's own, else 10,000) and its id."""
    meta = dict(root.attrs.get(META_KEY, {}))
    if chunk_rows is None:
        chunk_rows = int(meta.get("chunk_rows", 10_000))
    return chunk_rows, meta.get("store_id", str(path.resolve()))


def _names_only(root, axis: str, path: Path) -> pd.DataFrame | None:
    """obs (or var) as a frame of its index alone, read without its columns."""
    if axis not in root:
        return None
    try:
        group = root[axis]
        return pd.DataFrame(index=pd.Index(ad.io.read_elem(group[group.attrs["_index"]]), name=None))
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"cannot read {axis} names of {path}: {exc}") from exc


def remember_read(adata: ad.AnnData, path: Path, partial_obs: bool = False) -> None:
    """Record the in-memory elements just read from ``path``, so an unchanged one is linked when written.

    obs and var are fingerprinted (a stage often adds columns in place); obsm/varm/obsp/varp arrays and
    CSR/CSC matrices are made read-only instead (free; changing one in place raises), so the same object
    means the same values. ``partial_obs``: obs was read without its columns.
    """
    entries = [("obs", adata.obs, _frame_fingerprint(adata.obs), partial_obs),
               ("var", adata.var, _frame_fingerprint(adata.var), False)]
    for axis in ("obsm", "varm", "obsp", "varp"):
        entries += [(f"{axis}/{k}", v, None, False) for k, v in getattr(adata, axis).items() if _freeze(v)]
    for key, obj, fingerprint, partial in entries:
        ref = weakref.ref(obj, functools.partial(_forget, id(obj)))
        _READ[id(obj)] = (ref, str(path), key, fingerprint, partial)


def read_unchanged(obj) -> Path | None:
    """Where ``obj`` was read from, if it is an element ``open_store`` read and it has not changed since."""
    entry = _read_entry(obj)
    if entry is None:
        return None
    ref, path, key, fingerprint, _ = entry
    same = _frame_fingerprint(obj) == fingerprint if fingerprint is not None else _is_frozen(obj)
    src = Path(path) / key
    return src if same and src.exists() else None


def read_partial(obj) -> bool:
    """Whether ``obj`` is a frame ``open_store`` read without its columns (``obs_columns=False``)."""
    entry = _read_entry(obj)
    return entry is not None and entry[4]


def _read_entry(obj) -> tuple | None:
    entry = _READ.get(id(obj))
    return entry if entry is not None and entry[0]() is obj else None


def _forget(obj_id: int, ref) -> None:
    entry = _READ.get(obj_id)
    if entry is not None and entry[0] is ref:
        del _READ[obj_id]


def _frame_fingerprint(df: pd.DataFrame) -> bytes:
    """A digest of a DataFrame's values, index, column names and dtypes (categories included)."""
    import hashlib

    h = hashlib.blake2b(digest_size=20)
    h.update(pd.util.hash_pandas_object(df, index=True).to_numpy().tobytes())
    h.update(repr([(c, str(t), list(t.categories) if isinstance(t, pd.CategoricalDtype) else None)
                   for c, t in df.dtypes.items()]).encode())
    h.update(repr((df.index.name, str(df.index.dtype), df.shape)).encode())
    return h.digest()


def _sparse_parts(v) -> list[np.ndarray] | None:
    return [v.data, v.indices, v.indptr] if sp.issparse(v) and v.format in ("csr", "csc") else None


def _freeze(v) -> bool:
    """Make an ndarray or a CSR/CSC matrix read-only; False for other kinds (they are not tracked)."""
    parts = [v] if isinstance(v, np.ndarray) else _sparse_parts(v)
    if parts is None:
        return False
    for a in parts:
        a.flags.writeable = False
    return True


def _is_frozen(v) -> bool:
    parts = [v] if isinstance(v, np.ndarray) else _sparse_parts(v)
    return parts is not None and not any(a.flags.writeable for a in parts)


def open_matrix(path: str | os.PathLike, key: str = "X", *,
                chunk_rows: int | None = None) -> tuple[da.Array, pd.Index, pd.Index]:
    """One matrix of a store (lazy, as ``open_store`` gives it) with the obs and var names, without reading
    obs, var or anything else (each column read costs a few ms): for a stage that only borrows a matrix."""
    path = Path(path)
    try:
        root = zarr.open_group(str(path), mode="r")
        if key not in root:
            raise StoreError(f"{path} has no {key}")
        integrity.verify_store(path, keys=(key,))
        names = [_names_only(root, axis, path).index for axis in ("obs", "var")]
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - zarr/anndata raise several types for a broken store
        raise StoreError(f"{path} is not a readable AnnData store ({exc})") from exc
    chunk_rows, store_id = _chunking_and_id(root, path, chunk_rows)
    return lazy_elem(path, key, chunk_rows=chunk_rows, store_id=store_id), names[0], names[1]


def lazy_elem(path: Path, key: str, *, chunk_rows: int, store_id: str) -> da.Array:
    """One matrix element of a store as a Dask array of ``chunk_rows`` row blocks."""
    root = zarr.open_group(str(path), mode="r")
    node = root[key]
    enc = node.attrs.get("encoding-type", "array")
    for sub in ("data", "indices", "indptr") if enc == "csr_matrix" else ("",):
        check_complete(path, f"{key}/{sub}".rstrip("/"))
    if enc == "csr_matrix":
        return _lazy_csr(path, key, node, chunk_rows, store_id)
    if enc == "array":
        arr = zarr.open_array(str(path / key), mode="r")
        name = f"read-{tokenize(store_id, key, chunk_rows)}"
        bounds = row_bounds(arr.shape[0], chunk_rows)
        dsk = _block_tasks(name, [s for s, _ in bounds] + [arr.shape[0]], arr.chunks[0], arr.shape[0],
                           lambda k_lo, k_hi: (_read_dense_rows, str(path), key, k_lo, k_hi),
                           lambda i, segs, shared: (_read_dense_block, str(path), key, *bounds[i], segs, *shared))
        if not bounds:
            dsk = {(name, 0, 0): (np.zeros, (0, arr.shape[1]), arr.dtype)}
        chunks = (tuple(e - s for s, e in bounds) or (0,), (arr.shape[1],))
        x = da.Array(dsk, name, chunks=chunks, meta=np.empty((0, 0), dtype=arr.dtype))
        sources.remember(x, path, key)
        passes.register(x, path, key)
        return x
    raise StoreError(f"{path}/{key}: encoding {enc!r} is not supported (need csr_matrix or dense array)")


def check_complete(path: Path, key: str) -> None:
    """Fail if chunk files of an array are missing (Zarr would silently read them as zeros).

    A sharded array (anndata 0.13 writes them by default; our writers never do) has one file per shard, so
    missing shards are caught; inner chunks absent from a shard are a shard's normal way to store empty ones.
    """
    arr = zarr.open_array(str(path / key), mode="r")
    per_file = getattr(arr, "shards", None) or arr.chunks
    expected = int(np.prod([-(-s // c) for s, c in zip(arr.shape, per_file, strict=True)])) if arr.size else 0
    chunk_dir = path / key / "c"
    found = sum(len(files) for _, _, files in os.walk(chunk_dir)) if chunk_dir.exists() else 0
    if arr.metadata.zarr_format == 2:
        found = sum(1 for f in (path / key).iterdir() if not f.name.startswith("."))
    if found < expected:
        raise StoreError(
            f"{path} is damaged: {key} has {found} of {expected} chunk files; "
            f"delete it and re-run {writer_of(path)}"
        )


def provenance(path: str | os.PathLike) -> dict:
    """The provenance a stage recorded in its store (the stage and its parameters); {} when unreadable."""
    try:
        return dict(zarr.open_group(str(path), mode="r").attrs.get(META_KEY, {}).get("provenance", {}))
    except Exception:  # noqa: BLE001
        return {}


def writer_of(path: Path) -> str:
    """'the <stage> stage' that wrote a store, from its provenance (for error messages)."""
    stage = provenance(path).get("stage")
    return f"the {stage} stage" if stage else "the stage that wrote it"


def require(adata: ad.AnnData, store: str | os.PathLike, stage: str, **needed: list[str]) -> None:
    """Fail with one line listing every obs/var/obsm/obsp/uns key a stage needs but the store lacks."""
    missing = []
    for slot, keys in needed.items():
        have = getattr(adata, slot)
        have = have.columns if slot in ("obs", "var") else have.keys()
        missing += [f"{slot}[{k!r}]" for k in keys if k not in have]
    if missing:
        raise StoreError(f"{store} lacks {', '.join(missing)} needed by the {stage} stage")


def _lazy_csr(path: Path, key: str, node, chunk_rows: int, store_id: str) -> da.Array:
    n, m = (int(s) for s in node.attrs["shape"])
    try:
        indptr = np.asarray(node["indptr"][:], dtype=np.int64)
    except Exception as exc:  # noqa: BLE001
        raise StoreError(f"{path}/{key}/indptr is unreadable ({exc}); re-run {writer_of(path)}") from exc
    if indptr.shape[0] != n + 1:
        raise StoreError(f"{path}/{key}: indptr has {indptr.shape[0]} entries for {n} rows")
    nnz = int(node["data"].shape[0])
    if n and (int(indptr[-1]) != nnz or int(indptr[0]) != 0 or bool(np.any(np.diff(indptr) < 0))):
        raise StoreError(f"{path} is damaged: {key}/indptr does not describe its {nnz} stored values "
                         f"(ends at {int(indptr[-1])}); delete it and re-run {writer_of(path)}")
    dtype = node["data"].dtype
    bounds = row_bounds(n, chunk_rows)
    name = f"read-csr-{tokenize(store_id, key, chunk_rows)}"
    parts = ("data", "indices")
    dsk = _block_tasks(name, [indptr[s] for s, _ in bounds] + [nnz], _value_chunk(node, parts), nnz,
                       lambda k_lo, k_hi: (_read_stored, str(path), key, parts, k_lo, k_hi),
                       lambda i, segs, shared: (_read_csr_block, str(path), key,
                                                indptr[bounds[i][0] : bounds[i][1] + 1].copy(), m, segs, *shared))
    chunks = (tuple(e - s for s, e in bounds) or (0,), (m,))
    if not bounds:
        dsk = {(name, 0, 0): (sp.csr_matrix, (0, m), None, dtype)}
    x = da.Array(dsk, name, chunks=chunks, meta=sp.csr_matrix((0, 0), dtype=dtype))
    sources.remember(x, path, key)
    passes.register(x, path, key)
    return x


def _block_tasks(name: str, edges: list, chunk: int | None, total: int, chunk_task, block_task, *,
                 one_dim: bool = False) -> dict:
    """The row blocks' tasks, ``(name, i, 0)`` (``(name, i)`` when ``one_dim``), and those of the Zarr chunks
    that several blocks touch, ``(name + "-chunk", k)``, so that a pass decodes every chunk once (``block_plan``).
    Blocks that span many chunks (``block_plan.shares_chunks``) read their whole range themselves instead, and
    stay root tasks.

    ``edges`` bound the blocks in stored units (values of a CSR matrix, rows of a dense one), ``chunk`` is the
    Zarr chunk length in those units (None: blocks read their whole range themselves). ``chunk_task(start,
    stop)`` reads a chunk's range as a list of arrays; ``block_task(i, segments, shared_keys)`` builds block i.
    """
    if chunk is None or not block_plan.shares_chunks(edges, chunk):
        shared, segments = [], [[("own", a, b)] if b > a else [] for a, b in zip(edges[:-1], edges[1:])]
    else:
        shared, segments = block_plan.plan(edges, chunk)
    chunk_name = f"{name}-chunk"
    dsk = {(chunk_name, k): chunk_task(k * chunk, min((k + 1) * chunk, total)) for k in shared}
    for i, segs in enumerate(segments):
        dsk[(name, i) if one_dim else (name, i, 0)] = block_task(i, segs, block_plan.shared_keys(chunk_name, segs))
    return dsk


def _value_chunk(node, parts: tuple[str, ...]) -> int | None:
    """The Zarr chunk length (values) common to a CSR element's stored parts; None if they differ."""
    chunks = {node[part].chunks[0] for part in parts}
    return chunks.pop() if len(chunks) == 1 else None


def _planned(read, start: int, stop: int, segments, shared) -> list[np.ndarray]:
    """Entries ``start:stop`` of a stored element's parts from the block's own reads (``read(start, stop)``,
    a list of arrays) and its shared chunks; an empty block reads its empty range for the parts' dtypes."""
    if not segments:
        return read(start, stop)
    return block_plan.concat(block_plan.gather(segments, read, shared))


def _read_csr_block(path: str, key: str, indptr: np.ndarray, n_cols: int, segments=(), *shared) -> sp.csr_matrix:
    start, stop = int(indptr[0]), int(indptr[-1])
    data, indices = _planned(functools.partial(_read_stored, path, key, ("data", "indices")), start, stop,
                             segments, shared)
    return sp.csr_matrix((data, indices.astype(np.int32, copy=False), indptr - start), shape=(len(indptr) - 1, n_cols))


def _read_dense_block(path: str, key: str, start: int, stop: int, segments=(), *shared) -> np.ndarray:
    """Rows ``start:stop`` of a stored dense matrix, from its own chunks and the shared ones."""
    return _planned(functools.partial(_read_dense_rows, path, key), start, stop, segments, shared)[0]


def _read_dense_rows(path: str, key: str, start: int, stop: int) -> list[np.ndarray]:
    """Rows ``start:stop`` of a stored dense matrix (as a one-part list); a damaged chunk (checksum,
    truncation) is a StoreError."""
    try:
        return [zarr.open_array(str(Path(path) / key), mode="r")[start:stop]]
    except Exception as exc:  # noqa: BLE001 - zarr/numcodecs raise several types for a damaged chunk
        raise StoreError(
            f"cannot read rows {start}-{stop} of {path}/{key} ({type(exc).__name__}: {exc}); "
            f"the store is damaged: delete it and re-run {writer_of(Path(path))}"
        ) from exc


def stored_row_sums(x) -> da.Array | None:
    """Per-row float64 sums of a CSR matrix read unchanged from a store, from its stored values alone (the
    column indices, about half the bytes, are not read); None for any other array.

    The same numbers as ``kernels.row_sums`` on the blocks: each row's values added in stored order.
    """
    src = source_of(x)
    if src is None or not is_sparse_meta(x):
        return None
    path, key = src
    node = zarr.open_group(path, mode="r")[key]
    indptr = np.asarray(node["indptr"][:], dtype=np.int64)
    starts = np.cumsum((0,) + x.chunks[0])
    name = f"stored-row-sums-{tokenize(x.name)}"
    dsk = _block_tasks(name, [indptr[s] for s in starts], _value_chunk(node, ("data",)), int(indptr[-1]),
                       lambda k_lo, k_hi: (_read_stored, path, key, ("data",), k_lo, k_hi),
                       lambda i, segs, shared: (_row_sums_of_values, path, key,
                                                indptr[starts[i] : starts[i + 1] + 1].copy(), segs, *shared),
                       one_dim=True)
    return da.Array(dsk, name, chunks=(x.chunks[0],), dtype=np.float64, meta=np.empty((0,), np.float64))


def _row_sums_of_values(path: str, key: str, indptr: np.ndarray, segments=(), *shared) -> np.ndarray:
    (data,) = _planned(functools.partial(_read_stored, path, key, ("data",)), int(indptr[0]), int(indptr[-1]),
                       segments, shared)
    rows = kernels.row_ids_of(indptr - indptr[0], np)
    return np.bincount(rows, weights=data.astype(np.float64), minlength=indptr.shape[0] - 1)


def _read_stored(path: str, key: str, parts: tuple[str, ...], start: int, stop: int) -> list[np.ndarray]:
    """Entries ``start:stop`` of the given arrays of a stored CSR element; a damaged or truncated store is a
    StoreError that says which stage to re-run."""
    try:
        group = zarr.open_group(path, mode="r")[key]
        arrays = [group[part][start:stop] for part in parts]
    except Exception as exc:  # noqa: BLE001
        raise StoreError(
            f"cannot read rows of {path}/{key} ({type(exc).__name__}: {exc}); "
            f"the store is damaged: delete it and re-run {writer_of(Path(path))}"
        ) from exc
    if any(a.shape[0] != stop - start for a in arrays):
        raise StoreError(f"{path}/{key} is truncated; delete it and re-run {writer_of(Path(path))}")
    return arrays


def row_bounds(n_rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """Half-open row ranges of consecutive blocks of ``chunk_rows`` rows."""
    return [(s, min(s + chunk_rows, n_rows)) for s in range(0, n_rows, max(1, int(chunk_rows)))]
