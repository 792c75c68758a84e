"""Which scanpy the oracle tests compare against, and how far scanpy 1.12 moved from the numerics we keep.

atlasflow reproduces scanpy 1.11's arithmetic bit for bit (float32 sums where 1.11 sums in float32, sums of
squares for variances). scanpy 1.12 changed three computations; against it the oracle tests use the tolerances
below, each measured on pbmc3k with scanpy 1.12.4 and each the same distance that separates scanpy 1.11.5 from
scanpy 1.12.4 themselves.
"""

from __future__ import annotations

from importlib.metadata import version

import numpy as np
from packaging.version import Version

SCANPY_1_12 = Version(version("scanpy")) >= Version("1.12")

#: rank_genes_groups t-test: 1.12 takes group means/variances from Welford's algorithm in float64, 1.11 squares
#: float32 values. t is well conditioned (scores agree to 1e-5), its tail p-value is not: measured 1.5e-4 at most.
TTEST_RTOL = 5e-4 if SCANPY_1_12 else 1e-5

#: score_genes: 1.12 averages each cell's genes in float64, 1.11 sums them in float32 (scipy's sum of a float32
#: matrix). Measured 2.5e-7 at most (scores are O(1)).
SCORE_ATOL = 1e-6


def assert_scores_equal(got, want, err_msg: str = "") -> None:
    """Bitwise on scanpy 1.11; within ``SCORE_ATOL`` on scanpy 1.12 (see above)."""
    got, want = np.asarray(got), np.asarray(want)
    if SCANPY_1_12:
        np.testing.assert_allclose(got, want, rtol=0, atol=SCORE_ATOL, err_msg=err_msg)
    else:
        np.testing.assert_array_equal(got, want, err_msg=err_msg)
