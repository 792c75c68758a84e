"""Per-chunk math and the two shapes of reduction every stage is built from.

* ``per_row(x, fn, ncols)``: ``fn(block) -> (rows, ncols)`` float64, concatenated over blocks
  (cell-level results such as QC metrics).
* ``over_blocks(x, fn, size)``: ``fn(block) -> (size,)`` float64 partials, summed over blocks
  (gene-level sums, counts, Gram matrices: everything is a sum of per-chunk partials).
* ``accumulate_blocks(x, fn, size)``: the same sum for partials too large to make one per block (PCA's
  Gram matrix): ``fn(block, out=buffer)`` adds each block into a buffer shared by a lane of blocks.

Kernels take one row block (CSR or dense, NumPy or CuPy) and use the block's own array module, so one
implementation serves CPU and GPU. They return host (NumPy) arrays: results are small.

The modules, by what they compute: ``reduce`` (the reduction framework above), ``stats`` (per-cell and
per-gene statistics, elementwise maps), ``features`` (feature selection: grouped moments, clipped sums,
NaN-aware sums), ``scaling`` (regression, scaling, the Gram matrix, projections), ``groups`` (per-group
moments, logistic regression), ``ranks`` (exact Wilcoxon), ``scatter`` (gene-major blocks from transposed
pieces). Every public name of those is re-exported here, so callers write ``kernels.row_sums``; a
module-level setting (``MAX_LANES``) is read from its own module.

The graph kernels work on whole in-memory arrays, not row blocks, and are imported from their modules where
they are used (each is numba, compiled on first use): ``ivf_knn`` (the kNN search above 300k cells),
``fuzzy_union`` (UMAP's symmetrised connectivities) and ``umap_epochs`` (UMAP's parallel epochs).
"""
from atlasflow.kernels.reduce import (  # noqa: F401
    per_row,
    over_blocks,
    accumulate_blocks,
)
from atlasflow.kernels.stats import (  # noqa: F401
    row_sums,
    row_nnz,
    row_sums_masked,
    top_n_fractions,
    row_ids,
    row_ids_of,
    col_sums_and_nnz,
    col_sums_sq,
    col_count_above,
    divide_values,
    log1p_values,
    select_rows,
    select_columns,
    as_float,
    square_native,
)
from atlasflow.kernels.features import (  # noqa: F401
    col_stats_grouped,
    col_clipped_sums_grouped,
    count_non_counts,
    expm1_block,
    col_sums_nan_sequential,
    row_sums_nan_sets,
    col_min_max,
)
from atlasflow.kernels.scaling import (  # noqa: F401
    design_t_x,
    regress_residuals,
    subtract_group_means,
    scale_block,
    scaled_values,
    gram_and_sums,
    scaled_gram_and_sums,
    scaled_zero,
    scaled_project_block,
    project_block,
)
from atlasflow.kernels.groups import (  # noqa: F401
    group_indicator,
    group_moments,
    logreg_loss_grad,
)
from atlasflow.kernels.ranks import (  # noqa: F401
    gene_block_ranks,
)
from atlasflow.kernels.scatter import (  # noqa: F401
    place_gene_runs,
)
