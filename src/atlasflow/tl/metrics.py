"""Integration metrics on the neighbourhood graph: batch mixing (iLISI), label separation (cLISI), and the
agreement of clusters with known labels (ARI, NMI).

The LISI here is the graph form (as scib's graph iLISI/cLISI): per cell, the inverse Simpson index of the
labels among the cell and its kNN neighbours (``obsp['distances']``), equal weights. 1 means every
neighbourhood holds one label; the number of labels means they are perfectly mixed. It reads the graph the
clustering used, never X, so it costs O(cells x neighbours) at any size.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import scipy.sparse as sp


def graph_lisi(graph: sp.spmatrix, labels) -> np.ndarray:
    """Per cell: 1 / sum_l p_l^2, p_l the share of label l among the cell and its neighbours in ``graph``
    (any stored entry of its row is a neighbour). Cells with a missing label count as no label."""
    g = sp.csr_matrix(graph)
    n = g.shape[0]
    codes = pd.Categorical(pd.Series(labels, copy=False).astype(object)).codes.astype(np.int64)
    n_labels = int(codes.max()) + 1 if codes.size and codes.max() >= 0 else 1
    rows = np.repeat(np.arange(n), np.diff(g.indptr))
    rows, cols = np.concatenate([rows, np.arange(n)]), np.concatenate([g.indices, np.arange(n)])  # itself too
    lab = codes[cols]
    ok = lab >= 0
    counts = np.bincount(rows[ok] * n_labels + lab[ok], minlength=n * n_labels).reshape(n, n_labels)
    totals = counts.sum(axis=1, keepdims=True)
    shares = np.divide(counts, totals, out=np.zeros(counts.shape), where=totals > 0)
    simpson = (shares**2).sum(axis=1)
    return np.divide(1.0, simpson, out=np.full(n, np.nan), where=simpson > 0)


def integration_table(obs: pd.DataFrame, graph: sp.spmatrix, *, batch_keys=(), label_key: str | None = None,
                      cluster_key: str | None = None) -> pd.DataFrame:
    """One row per metric: median graph iLISI of each batch key (with its number of batches), median graph cLISI
    of ``label_key``, and the ARI and NMI of ``cluster_key`` against ``label_key``.

    Columns: metric, key, value, best (the value of a perfect result), n_labels."""
    from sklearn.metrics import adjusted_rand_score, normalized_mutual_info_score

    rows = []
    for key in batch_keys:
        n = int(obs[key].nunique())
        rows.append(("iLISI (graph, median)", key, float(np.nanmedian(graph_lisi(graph, obs[key]))), float(n), n))
    if label_key is not None:
        n = int(obs[label_key].nunique())
        rows.append(("cLISI (graph, median)", label_key, float(np.nanmedian(graph_lisi(graph, obs[label_key]))),
                     1.0, n))
        if cluster_key is not None:
            known = obs[label_key].notna().to_numpy()
            truth, found = obs[label_key][known].astype(str), obs[cluster_key][known].astype(str)
            rows.append((f"ARI ({cluster_key} vs labels)", label_key, float(adjusted_rand_score(truth, found)), 1.0, n))
            rows.append((f"NMI ({cluster_key} vs labels)", label_key,
                         float(normalized_mutual_info_score(truth, found)), 1.0, n))
    table = pd.DataFrame(rows, columns=["metric", "key", "value", "best", "n_labels"]).astype(
        {"metric": str, "key": str, "value": np.float64, "best": np.float64, "n_labels": np.int64})
    table["value"] = table["value"].round(4)
    return table
