"""A tiny synthetic set of stage stores (qc, filter, log1p, hvg, leiden, umap, umap_uncorrected, rank_genes_groups)
for plots/final tests, laid out as the workflow's: the labels in the leiden store, the umap stores without them
(umap_uncorrected: the same cells, the two samples laid out apart, as before a batch correction).

Built directly with scanpy in memory and written with ``write_store``; no atlasflow stage runs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import scanpy as sc
import scipy.sparse as sp

from atlasflow.store import open_store, write_store

N_CELLS, N_GENES, N_HVG, CHUNK = 240, 60, 20, 100


def build(root):
    """Write the stores under ``root``; returns {stage: path}."""
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(3), N_CELLS // 3)
    rates = rng.gamma(1.0, 1.0, size=(3, N_GENES))
    rates[:, :3] *= 4  # MT- genes, highly expressed
    for g in range(3):
        rates[g, 10 + 5 * g: 15 + 5 * g] *= 8  # markers per group
    counts = rng.poisson(rates[groups]).astype(np.float32)
    var_names = [f"MT-{i}" for i in range(3)] + [f"G{i}" for i in range(3, N_GENES)]
    obs = pd.DataFrame({"sample": pd.Categorical(np.where(np.arange(N_CELLS) % 2, "s1", "s2"))},
                       index=[f"c{i}" for i in range(N_CELLS)])
    a = sc.AnnData(sp.csr_matrix(counts), obs=obs, var=pd.DataFrame(index=var_names))
    a.var["mt"] = a.var_names.str.startswith("MT-")
    sc.pp.calculate_qc_metrics(a, qc_vars=["mt"], percent_top=None, inplace=True)
    paths = {s: root / f"{s}.zarr" for s in ("qc", "filter", "log1p", "hvg", "leiden", "umap", "umap_uncorrected",
                                                   "rank_genes_groups")}
    write_store(a, paths["qc"], chunk_rows=CHUNK)
    write_store(a, paths["filter"], chunk_rows=CHUNK)
    b = a.copy()
    sc.pp.normalize_total(b, target_sum=1e4)
    sc.pp.log1p(b)
    write_store(b, paths["log1p"], chunk_rows=CHUNK)
    sc.pp.highly_variable_genes(b, n_top_genes=N_HVG, flavor="seurat")
    lazy = open_store(paths["log1p"])
    lazy.var = b.var.copy()
    write_store(lazy, paths["hvg"])  # X linked from log1p
    h = b[:, b.var["highly_variable"]].copy()
    sc.pp.scale(h)
    sc.pp.pca(h, n_comps=10)
    h.obsm["X_umap"] = h.obsm["X_pca"][:, :2] + rng.normal(scale=0.1, size=(N_CELLS, 2))
    h.obs["leiden"] = pd.Categorical(groups.astype(str))
    knn = sp.random(N_CELLS, N_CELLS, density=0.05, format="csr", random_state=0, dtype=np.float32)
    h.obsp["distances"], h.obsp["connectivities"] = knn, ((knn + knn.T) > 0).astype(np.float32).tocsr()
    h.uns["neighbors"] = {"connectivities_key": "connectivities", "distances_key": "distances",
                          "params": {"n_neighbors": 12, "method": "umap"}}
    h.uns["leiden"] = {"params": {"resolution": 1.0}}
    write_store(h, paths["leiden"], chunk_rows=CHUNK)
    u = h.copy()
    del u.obs["leiden"], u.uns["leiden"]
    u.uns["umap"] = {"params": {"a": 1.0, "b": 1.0}}
    write_store(u, paths["umap"], chunk_rows=CHUNK)
    u.obsm["X_umap"] = u.obsm["X_umap"] + np.where(u.obs["sample"].to_numpy() == "s1", 10.0, 0.0)[:, None]
    write_store(u, paths["umap_uncorrected"], chunk_rows=CHUNK)
    b.obs["leiden"] = h.obs["leiden"]
    sc.tl.rank_genes_groups(b, "leiden", method="t-test")
    lazy = open_store(paths["log1p"])
    lazy.obs["leiden"] = h.obs["leiden"]
    lazy.uns["rank_genes_groups"] = b.uns["rank_genes_groups"]
    write_store(lazy, paths["rank_genes_groups"])
    return paths, b
