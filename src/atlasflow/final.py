"""The final AnnData of a run: one store scanpy/cellxgene open, assembled from the stage stores.

* X: the log-normalised full-gene matrix of the log1p store, and layer ``counts``: the filtered raw
  counts (X of the filter store). Both are lazy arrays read unchanged, so ``write_store`` hard-links
  their chunk files: nothing is copied.
* obs: of the embedding store (QC metrics, ...) plus the columns only other stores have: the clusters
  store's labels (e.g. leiden; the umap stage reads the graph, not the labels, so a new resolution does
  not re-run umap), the markers store's.
* var: of the hvg store (every gene, with highly_variable, means, dispersions, QC columns).
* obsm / obsp / uns: of the embedding store (X_pca, X_umap, the graph, pca/neighbors/umap), plus the
  clusters store's uns entries (``uns['leiden']``), ``uns['rank_genes_groups']`` of the markers store and
  ``<key>_colors`` for categorical obs columns.
* varm PCs: computed on the HVG subset; expanded to all genes with zero rows elsewhere, as scanpy does
  with ``mask_var``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import scipy.sparse as sp

from atlasflow import ownership, passes
from atlasflow.errors import InputError
from atlasflow.plots import add_missing_columns, palette, read_slots
from atlasflow.store import copy_by_chunk, index_dtype, open_store
from atlasflow.compat import named_layers

log = logging.getLogger(__name__)


def _aligned(frame: pd.DataFrame, index: pd.Index, what: str, path) -> pd.DataFrame:
    if frame.index.equals(index):
        return frame
    if len(frame.index) != len(index) or not frame.index.isin(index).all():
        raise InputError(f"{path}: its {what} names do not match the log1p store's")
    return frame.reindex(index)


def expand_varm(varm: dict, src_var: pd.Index, var_names: pd.Index) -> dict:
    """varm arrays of a gene subset as full-gene arrays (zero rows for the genes left out)."""
    out = {}
    rows = var_names.get_indexer(src_var)
    if (rows < 0).any():
        raise InputError("varm genes are not a subset of the final store's genes")
    for key, value in varm.items():
        value = np.asarray(value)
        full = np.zeros((len(var_names), *value.shape[1:]), dtype=value.dtype)
        full[rows] = value
        out[key] = full
    return out


def add_colors(adata: ad.AnnData, max_categories: int = 100) -> list[str]:
    """Set ``uns[<key>_colors]`` for categorical obs columns that lack a fitting one; returns the keys set."""
    added = []
    for key in adata.obs.columns:
        col = adata.obs[key]
        if not isinstance(col.dtype, pd.CategoricalDtype):
            continue
        n = len(col.cat.categories)
        have = adata.uns.get(f"{key}_colors")
        if n == 0 or n > max_categories or (have is not None and len(have) >= n):
            continue
        adata.uns[f"{key}_colors"] = np.array(palette(n), dtype=object)
        added.append(key)
    return added


def assemble(log1p, counts=None, hvg=None, embedding=None, clusters=None, markers=None,
             chunk_rows=None) -> ad.AnnData:
    """The final AnnData (lazy X and counts layer) from the stores' paths; only small slots are loaded."""
    adata = open_store(log1p, chunk_rows=chunk_rows)
    if counts:
        raw = open_store(counts, chunk_rows=chunk_rows)
        if raw.shape != adata.shape or not raw.obs_names.equals(adata.obs_names) \
                or not raw.var_names.equals(adata.var_names):
            raise InputError(f"{counts} (counts) does not have the cells and genes of {log1p}")
        adata.layers["counts"] = raw.X
    if hvg:
        var = read_slots(hvg, "var")
        adata.var = _aligned(var, adata.var_names, "gene", hvg)
    uns = dict(adata.uns)
    if embedding:
        obs, obsm, obsp, emb_uns, varm, emb_var = read_slots(embedding, "obs", "obsm", "obsp", "uns", "varm", "var")
        adata.obs = add_missing_columns(_aligned(obs, adata.obs_names, "cell", embedding), adata.obs)
        for key, value in (obsm or {}).items():
            adata.obsm[key] = value
        for key, value in (obsp or {}).items():
            adata.obsp[key] = value
        uns.update(emb_uns or {})
        if varm:
            adata.varm.update(expand_varm(varm, emb_var.index, adata.var_names))
    if clusters:
        for key, value in _add_obs_of(adata, clusters).items():
            uns.setdefault(key, value)
    if markers:
        for key, value in _add_obs_of(adata, markers).items():
            if key not in uns or key.startswith("rank_genes_groups"):
                uns[key] = value
    adata.uns = uns
    add_colors(adata)
    return adata


def _add_obs_of(adata: ad.AnnData, store) -> dict:
    """Add the obs columns of ``store`` that ``adata`` lacks (aligned by cell); return the store's uns."""
    obs, uns = read_slots(store, "obs", "uns")
    adata.obs = add_missing_columns(adata.obs, _aligned(obs, adata.obs_names, "cell", store))
    return uns or {}


# ------------------------------------------------------------------------------------------ h5ad


def estimate_h5ad_bytes(adata: ad.AnnData, store: Path) -> int:
    """Rough size of an h5ad export: the stored matrices' non-zeros (value + column index) plus obsm/obsp."""
    import zarr

    total = 0
    root = zarr.open_group(str(store), mode="r")
    for key in ("X", *(f"layers/{k}" for k in named_layers(adata))):
        node = root[key]
        if node.attrs.get("encoding-type") == "csr_matrix":
            total += int(node["data"].shape[0]) * (node["data"].dtype.itemsize + 4) + int(node["indptr"].nbytes)
        else:
            total += int(node.nbytes)
    total += sum(np.asarray(v).nbytes for v in adata.obsm.values())
    total += sum(v.data.nbytes * 2 for v in adata.obsp.values() if sp.issparse(v))
    return total


def write_h5ad(adata: ad.AnnData, path: str | Path) -> Path:
    """Write an AnnData whose X/layers are lazy row blocks as .h5ad, one block in memory at a time."""
    import dask

    path = Path(path)
    ownership.check_replaceable(path, "file")
    tmp = path.with_name(f".{path.name}.tmp")
    skeleton = ad.AnnData(obs=adata.obs, var=adata.var, obsm=dict(adata.obsm), varm=dict(adata.varm),
                          obsp=dict(adata.obsp), uns=dict(adata.uns))
    skeleton.write_h5ad(tmp)
    with h5py.File(tmp, "a") as f:
        big = {"X": adata.X, **{f"layers/{k}": v for k, v in named_layers(adata).items()}}
        for key, x in big.items():
            if key in f:
                del f[key]
            _stream_csr(f, key, x, dask)
    ownership.replace_file(tmp, path)
    return path


def _stream_csr(f, key, x, dask):
    n, m = x.shape
    g = f.create_group(key)
    g.attrs.update({"encoding-type": "csr_matrix", "encoding-version": "0.1.0", "shape": np.array([n, m])})
    data = indices = None
    indptr = [np.zeros(1, dtype=np.int64)]
    nnz = 0
    passes.count(x)  # to_delayed optimises the graph: its read layers would be gone
    for block in x.to_delayed().ravel():
        (b,) = dask.compute(block, scheduler="threads")
        b = sp.csr_matrix(b.get() if hasattr(b, "get") and not sp.issparse(b) and not isinstance(b, np.ndarray) else b)
        if data is None:
            data = g.create_dataset("data", shape=(0,), maxshape=(None,), dtype=b.dtype, chunks=(1 << 16,))
            indices = g.create_dataset("indices", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(1 << 16,))
        data.resize((nnz + b.nnz,))
        indices.resize((nnz + b.nnz,))
        data[nnz:] = b.data
        indices[nnz:] = b.indices.astype(np.int32)
        indptr.append(b.indptr[1:].astype(np.int64) + nnz)
        nnz += b.nnz
    if data is None:
        g.create_dataset("data", shape=(0,), dtype=np.float32)
        indices = g.create_dataset("indices", shape=(0,), dtype=np.int32)
    idx = index_dtype(nnz, m)  # indptr and indices of one dtype, as scipy makes them
    if idx != indices.dtype:
        copy_by_chunk(indices, g.create_dataset(".indices.wide", shape=indices.shape, maxshape=indices.maxshape,
                                                dtype=idx, chunks=indices.chunks))  # resizable: chunks > shape
        del g["indices"]
        g.move(".indices.wide", "indices")
    g.create_dataset("indptr", data=np.concatenate(indptr).astype(idx))
