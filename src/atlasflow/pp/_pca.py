"""PCA out of core: the Gram matrix ``XᵀX`` and column sums from one pass, ``eigh`` of the small covariance.

This is scikit-learn's ``PCA(svd_solver='covariance_eigh')`` (what ``scanpy.pp.pca(...,
svd_solver='covariance_eigh')`` runs) built from per-block float64 partials: covariance
``(XᵀX - n μμᵀ) / (n - 1)``, its ``n_comps`` largest eigenpairs (negative eigenvalues from rounding set to 0,
variance ratios over the trace), signs fixed as sklearn's ``svd_flip`` does (the largest-magnitude loading of
each component is positive). A second pass projects each block, ``X @ V - μ @ V``; a matrix small
enough is kept on the workers between the two passes (``cache.kept``). The Gram partials are summed in
fixed lanes of blocks (``kernels.accumulate_blocks``): the same bits whatever the cluster. ``zero_center=False``
gives the truncated SVD (top eigenvectors of ``XᵀX``) with TruncatedSVD's variance definitions.

Scaled data are dense, but the matrix they were scaled from usually is not: given ``scaled_from`` (the
sparse matrix and the scale stage's means, deviations and clip), both passes read that instead and scale
on the fly (``kernels.scaled_gram_and_sums``): the same values, a fraction of the bytes and products.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import anndata as ad
import dask.array as da
import numpy as np

from atlasflow import cache, kernels, progress
from atlasflow.errors import ConfigError, InputError
from atlasflow.pp._utils import get_matrix, shared

log = logging.getLogger(__name__)

N_PCS = 50
#: default cap on the Gram matrix (float64) a PCA may accumulate, in MiB (~16,000 genes)
MAX_GRAM_MIB = 2048
#: ``mask_var`` not given: scanpy's default (highly_variable when var has it)
MASK_DEFAULT = object()


@dataclass(frozen=True)
class ScaledFrom:
    """What a scaled X was computed from: ``X == kernels.scale_block(source, mean, std, zero_center, ...)``."""

    source: da.Array
    mean: np.ndarray
    std: np.ndarray
    zero_center: bool
    max_value: float | None
    dtype: np.dtype

    def scaling(self) -> tuple:
        """The arguments of ``kernels.scale_block`` after the block."""
        return (shared(self.mean), shared(self.std), self.zero_center, self.max_value, np.dtype(self.dtype))


def pca(
    adata: ad.AnnData,
    n_comps: int | None = None,
    *,
    layer: str | None = None,
    zero_center: bool = True,
    svd_solver: str | None = None,
    random_state=0,
    mask_var=MASK_DEFAULT,
    use_highly_variable: bool | None = None,
    dtype="float32",
    key_added: str | None = None,
    copy: bool = False,
    max_gram_mib: float = MAX_GRAM_MIB,
    scaled_from: ScaledFrom | None = None,
):
    """Principal components with scanpy's outputs: ``obsm['X_pca']``, ``varm['PCs']``, ``uns['pca']``.

    ``mask_var`` (default: ``'highly_variable'`` when that var column exists) restricts the genes; varm rows
    of the other genes are 0. ``n_comps`` defaults to 50 (or one less than the smaller dimension). A gene
    count whose Gram matrix exceeds ``max_gram_mib`` is refused: subset to highly variable genes first.
    ``svd_solver`` and ``random_state`` are accepted for scanpy compatibility; the result is the exact
    covariance eigendecomposition, deterministic. ``scaled_from`` (X only, not a layer) computes from the
    sparse matrix X was scaled from.
    """
    adata = adata.copy() if copy else adata
    if svd_solver not in (None, "covariance_eigh", "auto"):
        log.info("pca: svd_solver=%r is computed as 'covariance_eigh' (the exact out-of-core solver)", svd_solver)
    mask_param, mask = _mask(adata, mask_var, use_highly_variable)
    X = get_matrix(adata, layer, "pca")
    if scaled_from is not None:
        if layer is not None or scaled_from.source.shape != X.shape:
            raise ConfigError("pca: scaled_from must describe X and have its shape")
        X = scaled_from.source
    n = X.shape[0]
    col_idx = None if mask is None else np.flatnonzero(mask)
    m = X.shape[1] if col_idx is None else len(col_idx)
    min_dim = min(n, m)
    if n_comps is None:
        n_comps = min_dim - 1 if min_dim <= N_PCS else N_PCS
    n_comps = int(n_comps)
    if n_comps < 1 or n_comps >= min_dim:
        raise ConfigError(f"pca: n_comps={n_comps} must be between 1 and min(cells, genes) - 1 = {min_dim - 1}")
    gram_mib = m * m * 8 / 2**20
    if gram_mib > max_gram_mib:
        raise ConfigError(
            f"pca: {m} genes need a {gram_mib:,.0f} MiB Gram matrix (max_gram_mib={max_gram_mib:g}); "
            "subset to highly variable genes first (hvg + subset stages) or raise max_gram_mib"
        )
    with cache.kept(X, label="pca") as X:
        variance, variance_ratio, comps, x_pca = _fit_and_project(X, n, m, n_comps, zero_center, col_idx,
                                                                  scaled_from)
    x_pca = x_pca.astype(dtype, copy=False)
    key_obsm, key_varm, key_uns = ("X_pca", "PCs", "pca") if key_added is None else (key_added,) * 3
    adata.obsm[key_obsm] = x_pca
    loadings = comps.T
    if mask is not None:
        loadings = np.zeros((adata.n_vars, n_comps))
        loadings[mask] = comps.T
    adata.varm[key_varm] = loadings
    params = {"zero_center": bool(zero_center), "use_highly_variable": mask_param == "highly_variable"}
    if isinstance(mask_param, str):
        params["mask_var"] = mask_param
    if layer is not None:
        params["layer"] = layer
    adata.uns[key_uns] = {"params": params, "variance": variance, "variance_ratio": variance_ratio}
    log.info("pca: %d components of %d cells x %d genes; variance ratio of PC1 %.4f", n_comps, n, m,
             variance_ratio[0])
    return adata if copy else None


def _fit_and_project(X, n: int, m: int, n_comps: int, zero_center: bool, col_idx, scaled_from):
    """The two passes over X: Gram matrix and sums, eigendecomposition, then the projection of every block.

    Returns (variance, variance_ratio, components as rows, X_pca in float64).
    """
    idx_arg = None if col_idx is None else shared(col_idx)
    if scaled_from is None:
        gram_parts = kernels.accumulate_blocks(X, kernels.gram_and_sums, m * m + m, idx_arg)
        project, proj_args = kernels.project_block, ()
    else:
        log.info("pca: Gram matrix and projection from the sparse matrix X was scaled from")
        scaling = scaled_from.scaling()
        gram_parts = kernels.accumulate_blocks(X, kernels.scaled_gram_and_sums, m * m + m, *scaling, idx_arg)
        project, proj_args = kernels.scaled_project_block, scaling
    (parts,) = progress.compute(gram_parts, label="pca: Gram matrix")
    gram, sums = parts[: m * m].reshape(m, m), parts[m * m :]
    if scaled_from is not None:
        gram = gram + np.triu(gram, 1).T  # the kernel fills the upper triangle
        gram, sums = _add_scaled_zero(gram, sums, scaled_from, col_idx, n)
    mu = sums / n
    if zero_center:
        cov = gram - n * np.outer(mu, mu)
        cov /= n - 1
        evals, comps = _top_eigh(cov, n_comps)
        evals = np.where(evals < 0, 0.0, evals)
        variance = evals
        variance_ratio = variance / np.trace(cov)
        offset = mu @ comps.T
    else:
        _, comps = _top_eigh(gram, n_comps)
        cov_biased = gram / n - np.outer(mu, mu)
        variance = np.einsum("ij,jk,ik->i", comps, cov_biased, comps)
        variance_ratio = variance / np.trace(cov_biased)
        offset = np.zeros(n_comps)
    proj = X.map_blocks(project, *proj_args, shared(comps.T.copy()), offset, idx_arg,
                        chunks=(X.chunks[0], (n_comps,)), dtype=np.float64, meta=np.empty((0, 0)))
    (x_pca,) = progress.compute(proj, label="pca: projection")
    return variance, variance_ratio, comps, x_pca


def _add_scaled_zero(gram, ysums, scaled_from: ScaledFrom, col_idx, n: int):
    """Gram matrix and sums of ``Z = Y + 1z0ᵀ`` from ``YᵀY`` (added to in place) and the sums of ``Y``."""
    mean, std = scaled_from.mean, scaled_from.std
    if col_idx is not None:
        mean, std = mean[col_idx], std[col_idx]
    z0 = kernels.scaled_zero(mean, std, scaled_from.zero_center, scaled_from.max_value, scaled_from.dtype)
    cross = np.outer(z0, ysums)
    gram += n * np.outer(z0, z0)
    gram += cross
    gram += cross.T
    return gram, n * z0 + ysums


def _top_eigh(sym: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest eigenvalues (decreasing) and their eigenvectors as sign-fixed rows.

    Only the top of the spectrum is solved for (LAPACK ``syevr`` on an index range), much cheaper than a full
    decomposition for thousands of genes; the total variance for the ratios is the trace.

    LAPACK runs on one thread: with more, the last bits of the result depend on the thread count, so the
    same data would give (slightly) different PCs on a laptop, in a SLURM job or on a GPU node.
    """
    import scipy.linalg
    from threadpoolctl import threadpool_limits

    m = sym.shape[0]
    with threadpool_limits(limits=1, user_api="blas"):
        evals, evecs = scipy.linalg.eigh(sym, subset_by_index=[m - k, m - 1], driver="evr")
    return evals[::-1].copy(), _flip_signs(evecs[:, ::-1].T.copy())


def _flip_signs(components: np.ndarray) -> np.ndarray:
    """sklearn's ``svd_flip(u_based_decision=False)``: each row's largest-magnitude entry made positive."""
    pick = np.argmax(np.abs(components), axis=1)
    signs = np.sign(components[np.arange(components.shape[0]), pick])
    signs[signs == 0] = 1
    return components * signs[:, None]


def _mask(adata, mask_var, use_highly_variable):
    """scanpy's resolution of ``mask_var`` / ``use_highly_variable`` to (parameter, boolean mask or None)."""
    if use_highly_variable is not None and mask_var is not MASK_DEFAULT:
        raise ConfigError("pca: pass either mask_var or use_highly_variable, not both")
    if use_highly_variable or (use_highly_variable is None and mask_var is MASK_DEFAULT
                               and "highly_variable" in adata.var.columns):
        mask_var = "highly_variable"
    if mask_var is MASK_DEFAULT or mask_var is None:
        return None, None
    if isinstance(mask_var, str):
        if mask_var not in adata.var:
            raise InputError(f"pca: mask_var={mask_var!r} is not a column of var")
        mask = adata.var[mask_var].to_numpy()
    else:
        mask = np.asarray(mask_var)
    if mask.dtype != bool or mask.shape != (adata.n_vars,):
        raise InputError(f"pca: mask_var must be a boolean mask of the {adata.n_vars} genes")
    if not mask.any():
        raise InputError("pca: mask_var selects no gene")
    return mask_var, (None if mask.all() else mask)
