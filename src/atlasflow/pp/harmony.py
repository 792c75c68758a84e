"""Harmony batch integration of an embedding (``scanpy.external.pp.harmony_integrate``), by harmonypy 2.x.

Harmony works on the cells x PCs embedding (1M cells x 50 PCs is 400 MB in float64), never on X, so it runs
in memory on the stage's process; harmonypy's C++ backend is the maintained implementation (the R package's
algorithm step by step), deterministic for a given ``random_state`` whatever its thread count.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anndata as ad
import numpy as np

from atlasflow.errors import ConfigError, InputError

log = logging.getLogger(__name__)


def harmony_integrate(
    adata: ad.AnnData,
    key: str | Sequence[str],
    *,
    basis: str = "X_pca",
    adjusted_basis: str = "X_pca_harmony",
    theta: float | Sequence[float] | None = None,
    max_iter_harmony: int = 10,
    random_state: int = 0,
    n_jobs: int = 0,
    **kwargs,
) -> dict:
    """``obsm[adjusted_basis]``: ``obsm[basis]`` corrected for the batches of obs ``key`` (one or more columns).

    A key with a single batch leaves nothing to correct: the embedding is copied and the skip logged.
    Returns a small summary (batches per key, iterations run, whether it converged).
    """
    keys = [key] if isinstance(key, str) else list(key)
    if not keys:
        raise ConfigError("harmony.key: give at least one obs column")
    missing = [k for k in keys if k not in adata.obs]
    if missing:
        raise InputError(f"harmony.key: {', '.join(missing)} not in obs (has: {', '.join(map(str, adata.obs))})")
    if basis not in adata.obsm:
        raise InputError(f"harmony: obsm[{basis!r}] missing (has: {', '.join(adata.obsm) or 'none'}); run pca first")
    emb = np.asarray(adata.obsm[basis], dtype=np.float64)
    meta = adata.obs[keys].copy()
    for k in keys:
        if meta[k].isna().any():
            raise InputError(f"harmony.key: obs[{k!r}] has {int(meta[k].isna().sum())} missing values")
        meta[k] = meta[k].astype(str)
    batches = {k: int(meta[k].nunique()) for k in keys}
    used = [k for k in keys if batches[k] > 1]
    summary = {"basis": basis, "adjusted_basis": adjusted_basis, "keys": keys, "batches": batches}
    if not used:
        log.warning("harmony: %s has a single batch: nothing to correct, obsm[%r] is a copy of obsm[%r]",
                    ", ".join(keys), adjusted_basis, basis)
        adata.obsm[adjusted_basis] = emb.astype(np.float32)
        return {**summary, "skipped": True}
    if len(used) < len(keys):
        log.warning("harmony: %s with a single batch left out", ", ".join(k for k in keys if k not in used))
    try:
        import harmonypy
    except ImportError:
        raise ConfigError("harmony needs harmonypy (GPL-3, optional): pip install 'atlasflow[integration]'") from None

    log.info("harmony: %d cells x %d dims, batches %s", emb.shape[0], emb.shape[1],
             {k: batches[k] for k in used})
    ho = harmonypy.run_harmony(emb, meta, used, theta=theta, max_iter_harmony=max_iter_harmony,
                               random_state=random_state, ncores=n_jobs, verbose=False, **kwargs)
    corrected = np.asarray(ho.Z_corr, dtype=np.float64)
    if corrected.shape != emb.shape:  # harmonypy 0.x returned dims x cells
        corrected = corrected.T
    adata.obsm[adjusted_basis] = corrected.astype(np.float32)
    rounds = len(getattr(ho, "objective_harmony", ()))
    return {**summary, "skipped": False, "objective_rounds": rounds}


def lisi_medians(adata: ad.AnnData, bases: Sequence[str], keys: Sequence[str], *, max_cells: int = 20_000,
                 perplexity: float = 30, seed: int = 0) -> dict:
    """Median LISI of each obs key in each embedding: {basis: {key: median}} (harmonypy's compute_lisi).

    For batch keys it is iLISI (1 = every cell's neighbourhood holds one batch; up to the number of batches
    when they mix), for known labels cLISI (1 = labels apart, as they should stay). Computed on a seeded sample
    of at most ``max_cells`` cells (neighbourhoods searched within the sample), so its cost does not grow with
    the atlas."""
    import harmonypy

    n = adata.n_obs
    rows = np.sort(np.random.default_rng(seed).choice(n, max_cells, replace=False)) if n > max_cells else np.arange(n)
    obs = adata.obs.iloc[rows][list(keys)].astype(str)
    out = {}
    for basis in bases:
        emb = np.asarray(adata.obsm[basis], dtype=np.float64)[rows]
        scores = harmonypy.compute_lisi(emb, obs, list(keys), perplexity=min(perplexity, (len(rows) - 1) / 3))
        out[basis] = {k: round(float(np.median(scores[:, i])), 4) for i, k in enumerate(keys)}
    return out

