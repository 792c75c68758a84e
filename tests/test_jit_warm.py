"""``jit_warm``: a shared cluster's workers load the numba kernels from the cache instead of compiling them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

#: A fresh process calls the kernels as the qc, pca and Wilcoxon stages do, on stage-like data (float32 values,
#: int32 indices, thousands of rows), and prints each kernel's cache hits and misses. (The argsort ``ranks``
#: kernel serves other dtypes and NaN only: not warmed, compiled where it is needed.)
_STAGE_LIKE_CALLS = textwrap.dedent("""
    import numpy as np
    from scipy import sparse
    from atlasflow import kernels
    x = sparse.random(3000, 300, density=0.1, format="csr", dtype=np.float32, random_state=1)
    x.data = np.round(x.data * 20).astype(np.float32)
    kernels.top_n_fractions(x, [5, 10, 50])
    y = x.copy(); y.data = np.log1p(y.data)
    kernels.scaled_gram_and_sums(y, np.full(300, 0.3), np.full(300, 0.7), True, 10.0, np.float32)
    kernels.gene_block_ranks(y.T.tocsr(), np.arange(3000) % 4, 4, np.full(4, 750.0), [0, 1, 2, 3], None)
    steps = np.ones(y.nnz, np.uint16)
    kernels.place_gene_runs(y.data, steps, np.array([y.nnz], np.uint32), np.zeros(1, np.int64), 5000,
                            np.empty_like(y.data), np.empty(y.nnz, np.int32))
    for f in (kernels.stats._top_n_kernel(), kernels.scaling._scaled_entries_kernel(),
              kernels.scaling._sparse_gram_upper(), kernels.ranks._rest_ranks_kernels()[0],
              kernels.ranks._radix_ranks_kernel(), kernels.scatter._PLACE):
        print(f.__name__, sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
""")


def _run(code_args, cache_dir):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, *code_args], env=env, capture_output=True, text=True, check=True)


def test_warm_compiles_what_the_stages_then_load(tmp_path):
    cold = _run(["-c", _STAGE_LIKE_CALLS], tmp_path / "cold").stdout.splitlines()
    assert len(cold) == 6
    assert all(line.endswith(" 0 1") for line in cold), cold  # empty cache: each kernel compiled here

    _run(["-m", "atlasflow.jit_warm"], tmp_path / "warm")
    warmed = [line.split() for line in _run(["-c", _STAGE_LIKE_CALLS], tmp_path / "warm").stdout.splitlines()]
    assert len(warmed) == 6
    for name, hits, misses in warmed:
        assert (int(hits), int(misses)) == (1, 0), f"{name}: {hits} cache hits, {misses} compiled again"


def test_a_failed_warm_up_only_warns(monkeypatch, caplog):
    from atlasflow import jit_warm

    monkeypatch.setattr(jit_warm, "__name__", "atlasflow.no_such_module")
    with caplog.at_level("WARNING"):
        jit_warm.in_subprocess()
    assert "could not compile the numba kernels" in caplog.text
