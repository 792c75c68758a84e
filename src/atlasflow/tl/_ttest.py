"""Welch t-test of each group against the rest (or a reference) from per-group moments, as scanpy.

Everything comes from one pass over X (``_groups.group_moments``): per-group sums, sums of squares and
cell counts give each group's mean and unbiased variance (scanpy's E[x^2] - E[x]^2 formula, values
squared in the data's dtype), then ``scipy.stats.ttest_ind_from_stats`` with ``equal_var=False``.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from atlasflow.tl._groups import Design, GroupStats


def t_test(st: GroupStats, d: Design, method: str):
    """Yield ``(code, scores, pvals)`` per tested group.

    ``t-test_overestim_var`` uses the group's own size as the rest's n (scanpy's variance overestimate).
    """
    for code in d.tested:
        n_group = int(st.sizes[code])
        mean_g, var_g = st.mean_var(code)
        if d.reference is not None:
            mean_r, var_r = st.mean_var(d.reference)
            n_other = int(st.sizes[d.reference])
        else:
            mean_r, var_r = st.mean_var(rest_of=code)
            n_other = int(st.sizes.sum()) - n_group
        n_rest = n_other if method == "t-test" else n_group
        with np.errstate(invalid="ignore"):
            scores, pvals = stats.ttest_ind_from_stats(
                mean1=mean_g, std1=np.sqrt(var_g), nobs1=n_group,
                mean2=mean_r, std2=np.sqrt(var_r), nobs2=n_rest, equal_var=False,
            )
        scores = np.asarray(scores, dtype=np.float64)
        pvals = np.asarray(pvals, dtype=np.float64)
        scores[np.isnan(scores)] = 0
        pvals[np.isnan(pvals)] = 1
        yield code, scores, pvals
