"""Reading row blocks whose edges fall inside Zarr chunks: the same matrix, every chunk decoded once per pass.

``store.block_plan`` gives a chunk that several blocks touch a read task of its own; these tests check the plan
on its own (every stored unit in exactly one segment, every chunk decoded once) and on real stores, counting
the chunk files Zarr reads during a pass.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import dask
import numpy as np
import pytest
import scipy.sparse as sp
import zarr

from atlasflow import passes
from atlasflow.store import block_plan


def _decodes(edges, chunk, shared, segments) -> Counter:
    """How often each chunk is decoded: once per own segment that overlaps it, once per shared chunk task."""
    out = Counter(shared)
    for segs in segments:
        for seg in segs:
            if seg[0] == "own":
                out.update(range(seg[1] // chunk, (seg[2] - 1) // chunk + 1))
    return out


def _covered(segs, chunk) -> list[tuple[int, int]]:
    return [(s[1], s[2]) if s[0] == "own" else (s[1] * chunk + s[2], s[1] * chunk + s[3]) for s in segs]


def test_plan_of_blocks_straddling_chunks():
    shared, segments = block_plan.plan([0, 5, 10, 15], 4)
    assert shared == [1, 2]
    assert segments == [
        [("own", 0, 4), ("shared", 1, 0, 1)],
        [("shared", 1, 1, 4), ("shared", 2, 0, 2)],
        [("shared", 2, 2, 4), ("own", 12, 15)],
    ]
    # aligned blocks share nothing: each reads its own chunks, as before
    assert block_plan.plan([0, 8, 16, 20], 4) == ([], [[("own", 0, 8)], [("own", 8, 16)], [("own", 16, 20)]])


@pytest.mark.parametrize("seed", range(30))
def test_plan_covers_every_unit_once_and_decodes_every_chunk_once(seed):
    rng = np.random.default_rng(seed)
    chunk = int(rng.integers(1, 40))
    sizes = rng.integers(0, 3 * chunk, size=int(rng.integers(1, 25)))  # empty blocks and blocks within a chunk
    edges = np.concatenate([[0], np.cumsum(sizes)])
    shared, segments = block_plan.plan(edges, chunk)
    for (a, b), segs in zip(zip(edges[:-1], edges[1:]), segments, strict=True):
        pieces = _covered(segs, chunk)
        assert all(lo < hi for lo, hi in pieces)
        assert [u for lo, hi in pieces for u in range(lo, hi)] == list(range(a, b))
    total = int(edges[-1])
    decodes = _decodes(edges, chunk, shared, segments)
    assert decodes == Counter(range(-(-total // chunk))), (edges, chunk)


@contextlib.contextmanager
def chunk_reads():
    """Chunk files Zarr reads from local stores in this process, by full path."""
    from zarr.storage import LocalStore

    orig = LocalStore.get
    counts: Counter = Counter()

    async def counting(self, key, *args, **kwargs):
        if "/c/" in f"/{key}" or key.startswith("c/"):
            counts[str(self.root / key)] += 1
        return await orig(self, key, *args, **kwargs)

    LocalStore.get = counting
    try:
        yield counts
    finally:
        LocalStore.get = orig


def _counts(n, m, seed=0):
    rng = np.random.default_rng(seed)
    x = sp.random(n, m, density=0.3, format="csr", random_state=rng, dtype=np.float32)
    x.data = np.ceil(x.data * 10)
    x.data[x.indptr[7] : x.indptr[8]] = 0  # an empty row
    x.eliminate_zeros()
    return x


def _write(x, path, chunk_rows, monkeypatch, flat_chunk):
    import anndata as ad
    import dask.array as da

    from atlasflow.store import write, write_store

    monkeypatch.setattr(write, "FLAT_CHUNK", flat_chunk)
    X = da.from_array(x, chunks=(chunk_rows, x.shape[1]), asarray=False)
    return write_store(ad.AnnData(X=X), path, chunk_rows=chunk_rows)


@pytest.mark.parametrize(("chunk_rows", "flat_chunk"), [(37, 500), (11, 900), (200, 600), (90, 4000)])
def test_csr_pass_decodes_every_chunk_once(tmp_path, monkeypatch, chunk_rows, flat_chunk):
    from atlasflow.store import open_store
    from atlasflow.store.read import stored_row_sums

    x = _counts(400, 60)
    path = _write(x, tmp_path / "s.zarr", 50, monkeypatch, flat_chunk)
    data = zarr.open_group(str(path), mode="r")["X"]["data"]
    assert data.chunks[0] == min(flat_chunk, x.nnz)
    n_chunks = -(-x.nnz // data.chunks[0])
    a = open_store(path, chunk_rows=chunk_rows)
    with dask.config.set(scheduler="sync"), chunk_reads() as reads:
        got = a.X.map_blocks(sp.csr_matrix, dtype=a.X.dtype).compute()
    assert (got != x).nnz == 0 and got.dtype == x.dtype
    for part in ("data", "indices"):
        per_chunk = Counter(v for k, v in reads.items() if f"/X/{part}/c/" in k)
        assert per_chunk == Counter({1: n_chunks}), part
    # stored row sums (values only, indices unread) decode each chunk of data once too
    with dask.config.set(scheduler="sync"), chunk_reads() as reads:
        sums = stored_row_sums(a.X).compute()
    np.testing.assert_array_equal(sums, np.asarray(x.sum(axis=1), dtype=np.float64).ravel())
    assert not [k for k in reads if "/X/indices/c/" in k]
    assert Counter(v for k, v in reads.items() if "/X/data/c/" in k) == Counter({1: n_chunks})


def test_blocks_of_many_chunks_read_their_edge_chunks_themselves(tmp_path, monkeypatch):
    """~56 chunks per block: no chunk tasks, so every block read is a root task (distributed's scheduler queues
    those as workers free up); only the chunks that straddle a block edge are decoded twice."""
    from atlasflow.store import open_store

    x = _counts(400, 60)
    path = _write(x, tmp_path / "w.zarr", 50, monkeypatch, 64)
    a = open_store(path, chunk_rows=200)
    assert not block_plan.shares_chunks([0, x.indptr[200], x.nnz], 64)
    graph = dict(a.X.__dask_graph__())
    assert set(graph) == set(dask.core.flatten(a.X.__dask_keys__()))
    assert not any(dask.core.get_dependencies(graph, k) for k in graph)
    with dask.config.set(scheduler="sync"), chunk_reads() as reads:
        got = a.X.map_blocks(sp.csr_matrix, dtype=a.X.dtype).compute()
    assert (got != x).nnz == 0
    edge = x.indptr[200]  # the one block edge, in values
    for part in ("data", "indices"):
        twice = sorted(int(k.rsplit("/", 1)[1]) for k, v in reads.items() if f"/X/{part}/c/" in k and v == 2)
        assert twice == ([edge // 64] if edge % 64 else []), part
        assert all(v <= 2 for v in reads.values())


def test_dense_read_with_other_rows_than_written_decodes_every_chunk_once(tmp_path, monkeypatch):
    from atlasflow.store import open_store

    x = np.arange(230 * 7, dtype=np.float32).reshape(230, 7)
    path = _write(x, tmp_path / "d.zarr", 40, monkeypatch, 1 << 20)
    a = open_store(path, chunk_rows=25)
    with dask.config.set(scheduler="sync"), chunk_reads() as reads:
        got = a.X.compute()
    np.testing.assert_array_equal(got, x)
    assert sorted(reads.values()) == [1] * 6  # 230 rows in chunks of 40


def test_passes_count_the_block_reads_a_computation_needs(tmp_path, monkeypatch):
    from atlasflow import progress
    from atlasflow.store import open_store

    x = _counts(300, 20)
    path = _write(x, tmp_path / "p.zarr", 50, monkeypatch, 700)
    passes.PASSES.clear()
    a = open_store(path, chunk_rows=60)
    def per_row(fn):
        return a.X.map_blocks(lambda b: fn(b).reshape(-1, 1), dtype=np.float64, chunks=(a.X.chunks[0], (1,)))

    sums = per_row(lambda b: np.asarray(b.sum(axis=1), dtype=np.float64))
    counts = per_row(lambda b: np.diff(b.indptr).astype(np.float64))
    with dask.config.set(scheduler="sync"):
        progress.compute(sums)
        progress.compute(sums, counts)  # one graph: the blocks are read once
        progress.compute(sums.blocks[1])
    assert passes.summary() == {"p/X": round(2 + 1 / 5, 2)}
