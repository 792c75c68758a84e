"""Simulated raw UMI counts with ground truth, written chunk by chunk: the workflow's built-in dataset.

Model (what the numbers are, honestly). Genes are grouped into *modules*: about one background module
per 100 genes (gene programs), one marker module per cell type, one ribosomal module (``RPL*``/``RPS*``)
and one mitochondrial module (13 ``MT-`` genes). Gene ``g`` of module ``m`` has a fixed within-module
weight ``q_g`` (log-normal, so gene means are heavy-tailed). Each cell type ``t`` has module shares
``pi[t, m]``: its own marker module gets ~8 % of the counts (1 % of that leaks into other types),
background modules are perturbed per type, ribosomal ~20 %, mitochondrial ~3.5 %. For cell ``c``::

    X[c, g] ~ Poisson(L_c * w[c, m(g)] * q_g),   w[c, m] = pi[t_c, m] * Gamma_cm / sum_m(...)

with ``L_c`` log-normal (library size, per-type offset), ``Gamma_cm`` a per-cell, per-module gamma factor
of mean 1 (shape 3 for gene programs, 10 for ribo/mito). Counts are therefore Poisson-gamma (negative
binomial-like) mixtures, overdispersed and correlated within a module; there is no gene-level dropout
beyond Poisson sampling. Special cells: *damaged* (mito share raised to 20-70 %, half the library),
*empty* droplets (ambient profile, ~2 % of the median library, few genes), *doublets* (average of two
types' profiles, summed libraries). Ground truth is kept in ``obs`` (``cell_type``, ``is_damaged``,
``is_empty``, ``is_doublet``) and ``var`` (``marker_of``, ``module``).

Sampling is per UMI, not per gene: module counts are Poisson draws (cells x modules), and each UMI lands
in a gene of its module by Walker's alias method (O(1) per UMI); ``np.bincount`` over ``cell * n_genes +
gene`` then gives sorted CSR rows. This is exactly the Poisson model above and costs ~library size draws
per cell instead of ``n_genes``. Randomness is seeded per fixed sub-block of ``SUBBLOCK`` cells
(``np.random.default_rng([seed, stream, subblock])``), so the output does not depend on chunk sizes,
threads or the order blocks are made in, and a smaller ``n_cells`` gives a prefix of the same cells.

Genes are stored grouped by module (background, markers, ribosomal, then ``MT-`` last as chrM is in 10x
references); symbols of ordinary genes are synthetic (``SIMG00001``...) so names do not give markers away.
"""

from __future__ import annotations

import collections
import functools
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scipy.sparse as sp
import zarr

from atlasflow.errors import ConfigError
from atlasflow import ownership
from atlasflow.store import META_KEY, atomic_dir, temporary_sibling, write_csr_blocks

#: Cells per independently seeded sub-block (1000 so that the usual chunk sizes align with it).
SUBBLOCK = 1000
#: Cells per sampling/counting batch inside a sub-block: keeps temporaries small and in cache. It does not
#: change the output (the batches draw consecutive uniforms from the sub-block's one stream).
BATCH = 25
#: Fewest genes a simulation can have (mito, ribo, markers and some background).
MIN_GENES = 100

MT_GENES = ["MT-ND1", "MT-ND2", "MT-CO1", "MT-CO2", "MT-ATP8", "MT-ATP6", "MT-CO3", "MT-ND3", "MT-ND4L",
            "MT-ND4", "MT-ND5", "MT-ND6", "MT-CYB"]
RIBO_GENES = [g for pair in zip([f"RPL{i}" for i in range(3, 42)], [f"RPS{i}" for i in range(2, 41)]) for g in pair]
HB_GENES = ["HBB", "HBA1", "HBA2"]

MARKER_SHARE, MARKER_LEAK, RIBO_SHARE, MT_SHARE = 0.08, 0.01, 0.20, 0.035
PROGRAM_SHAPE, HOUSEKEEPING_SHAPE = 3.0, 10.0
LIB_SIGMA, EMPTY_FRACTION_OF_MEDIAN = 0.45, 0.02


@dataclass(frozen=True)
class SimParams:
    """Everything that determines a simulated dataset (same parameters, same data)."""

    n_cells: int = 5000
    n_genes: int = 10000
    n_cell_types: int = 8
    seed: int = 0
    median_counts: float = 4000.0
    frac_damaged: float = 0.04
    frac_empty: float = 0.02
    frac_doublets: float = 0.015

    def validate(self) -> SimParams:
        """Raise ConfigError (one line) for values the simulator cannot honour."""
        checks = [
            (1 <= self.n_cells <= 2**31 - 1, f"n_cells must be between 1 and 2^31-1, got {self.n_cells}"),
            (self.n_genes >= MIN_GENES, f"n_genes must be >= {MIN_GENES}, got {self.n_genes}"),
            (1 <= self.n_cell_types <= 200, f"n_cell_types must be between 1 and 200, got {self.n_cell_types}"),
            (self.seed >= 0, f"seed must be >= 0, got {self.seed}"),
            (self.median_counts >= 50, f"median_counts must be >= 50, got {self.median_counts}"),
        ]
        for name in ("frac_damaged", "frac_empty", "frac_doublets"):
            value = getattr(self, name)
            checks.append((0 <= value < 1, f"{name} must be in [0, 1), got {value}"))
        checks.append((self.frac_damaged + self.frac_empty + self.frac_doublets < 1,
                       "frac_damaged + frac_empty + frac_doublets must be < 1"))
        for ok, message in checks:
            if not ok:
                raise ConfigError(f"simulate: {message}")
        n_fixed = len(MT_GENES) + _n_ribo(self.n_genes) + self.n_cell_types * _n_markers(self.n_genes)
        if self.n_genes - n_fixed < 20:
            raise ConfigError(f"simulate: n_genes={self.n_genes} leaves too few background genes for "
                              f"{self.n_cell_types} cell types; use more genes or fewer types")
        return self


def _n_ribo(n_genes: int) -> int:
    return min(len(RIBO_GENES), max(4, n_genes // 250))


def _n_markers(n_genes: int) -> int:
    return int(np.clip(n_genes // 400, 3, 50))


# ---------------------------------------------------------------------------------------------- design


@dataclass(frozen=True)
class Design:
    """The fixed (seed-level) part of a simulation: genes, modules, type profiles, sampling tables."""

    var: pd.DataFrame
    type_names: list
    type_prob: np.ndarray  # (T,) cell-type proportions
    type_scale: np.ndarray  # (T,) library-size factor per type
    shares: np.ndarray  # (T, M) module shares per type, rows sum to 1
    ambient: np.ndarray  # (M,) module shares of empty droplets
    shape: np.ndarray  # (M,) gamma shape of the per-cell module factor
    mod_start: np.ndarray  # (M,) first gene of each module
    mod_size: np.ndarray  # (M,) genes per module
    alias_prob: np.ndarray  # (G,) Walker alias tables within modules
    alias_idx: np.ndarray  # (G,)
    mt_module: int


@functools.lru_cache(maxsize=4)
def make_design(params: SimParams) -> Design:
    """Build the seed-level design (deterministic in ``params``; cached per process)."""
    rng = np.random.default_rng([params.seed, 0])
    G, T = params.n_genes, params.n_cell_types
    n_mt, n_ribo, n_mark = len(MT_GENES), _n_ribo(G), _n_markers(G)
    n_bg = G - n_mt - n_ribo - T * n_mark
    bg_sizes = _even_split(n_bg, max(1, round(n_bg / 100)))
    sizes = np.array(list(bg_sizes) + [n_mark] * T + [n_ribo, n_mt], dtype=np.int64)
    B = len(bg_sizes)
    M = len(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    q = np.concatenate([rng.lognormal(0.0, 1.3, n_bg + T * n_mark), rng.lognormal(0.0, 0.5, n_ribo),
                        rng.lognormal(0.0, 0.8, n_mt)])
    prob, alias = _alias_tables(q, starts, sizes)

    type_prob = rng.lognormal(0.0, 0.6, T)
    type_prob /= type_prob.sum()
    type_scale = rng.lognormal(0.0, 0.2, T)
    shares = np.zeros((T, M))
    bg_base = bg_sizes * rng.lognormal(0.0, 0.6, B)
    shares[:, :B] = bg_base * rng.lognormal(0.0, 0.5, (T, B))
    shares[:, B:B + T] = MARKER_SHARE * (MARKER_LEAK + (1 - MARKER_LEAK) * np.eye(T))
    shares[:, B + T] = RIBO_SHARE * rng.lognormal(0.0, 0.25, T)
    shares[:, B + T + 1] = MT_SHARE * rng.lognormal(0.0, 0.2, T)
    rest = 1.0 - shares[:, B:].sum(axis=1)
    shares[:, :B] *= (rest / shares[:, :B].sum(axis=1))[:, None]
    shape = np.full(M, PROGRAM_SHAPE)
    shape[B + T:] = HOUSEKEEPING_SHAPE

    var = _gene_table(rng, G, sizes, n_bg, T, n_mark, n_ribo)
    names = [f"celltype_{i:02d}" for i in range(T)]
    var["marker_of"] = pd.Categorical([names[m - B] if B <= m < B + T else "" for m in var["module"]])
    return Design(var=var, type_names=names, type_prob=type_prob, type_scale=type_scale, shares=shares,
                  ambient=type_prob @ shares, shape=shape, mod_start=starts, mod_size=sizes,
                  alias_prob=prob, alias_idx=alias, mt_module=M - 1)


def _even_split(total: int, parts: int) -> np.ndarray:
    return np.array([len(a) for a in np.array_split(np.arange(total), parts)], dtype=np.int64)


def _gene_table(rng, G, sizes, n_bg, T, n_mark, n_ribo) -> pd.DataFrame:
    """var: ENSG-like ids, unique symbols (synthetic, ribosomal, hemoglobin, MT-) and the module of each gene."""
    symbols = np.array([f"SIMG{i + 1:05d}" for i in range(G)], dtype=object)
    symbols[n_bg + T * n_mark: n_bg + T * n_mark + n_ribo] = RIBO_GENES[:n_ribo]
    symbols[G - len(MT_GENES):] = MT_GENES
    if n_bg >= 10 * len(HB_GENES):  # a few hemoglobin genes among the background, as in blood samples
        symbols[np.sort(rng.choice(n_bg, len(HB_GENES), replace=False))] = HB_GENES
    module = np.repeat(np.arange(len(sizes)), sizes)
    var = pd.DataFrame({
        "gene_ids": [f"ENSG{i + 1:011d}" for i in range(G)],
        "gene_symbols": symbols,
        "module": module.astype(np.int32),
    }, index=pd.Index(symbols, name=None))
    return var


def _alias_tables(q: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker alias tables (Vose's construction) for sampling a gene within each module in O(1)."""
    prob = np.ones(len(q))
    alias = np.arange(len(q), dtype=np.int64)
    for s, n in zip(starts.tolist(), sizes.tolist()):
        p = q[s:s + n] * (n / q[s:s + n].sum())
        small = [i for i in range(n) if p[i] < 1.0]
        large = [i for i in range(n) if p[i] >= 1.0]
        while small and large:
            lo, hi = small.pop(), large.pop()
            prob[s + lo], alias[s + lo] = p[lo], s + hi
            p[hi] -= 1.0 - p[lo]
            (small if p[hi] < 1.0 else large).append(hi)
    return prob, alias


# ---------------------------------------------------------------------------------------------- cells


def _cells(params: SimParams, design: Design, b: int) -> dict:
    """Cell-level draws of sub-block ``b``: kind, type(s), library size, damage (stream 1)."""
    n = min(params.n_cells - b * SUBBLOCK, SUBBLOCK)
    T = len(design.type_names)
    rng = np.random.default_rng([params.seed, 1, b])
    # always SUBBLOCK draws, cut to n: a smaller n_cells gives a prefix of the same cells
    kind, u_type = rng.random(SUBBLOCK)[:n], rng.random(SUBBLOCK)[:n]
    t1 = np.minimum(np.searchsorted(np.cumsum(design.type_prob), u_type, side="right"), T - 1)
    t2 = (t1 + 1 + rng.integers(0, max(T - 1, 1), SUBBLOCK)[:n]) % T
    z1, z2, z3 = (rng.standard_normal(SUBBLOCK)[:n] for _ in range(3))
    mt_share = rng.uniform(0.2, 0.7, SUBBLOCK)[:n]
    empty = kind < params.frac_empty
    damaged = ~empty & (kind < params.frac_empty + params.frac_damaged)
    doublet = ~empty & ~damaged & (kind < params.frac_empty + params.frac_damaged + params.frac_doublets)
    med = params.median_counts
    lib = med * design.type_scale[t1] * np.exp(LIB_SIGMA * z1)
    lib = np.where(doublet, lib + med * design.type_scale[t2] * np.exp(LIB_SIGMA * z2), lib)
    lib = np.where(damaged, 0.5 * lib, lib)
    lib = np.where(empty, np.maximum(20.0, EMPTY_FRACTION_OF_MEDIAN * med * np.exp(0.5 * z3)), lib)
    return {"t1": t1, "t2": t2, "lib": lib, "mt_share": mt_share,
            "empty": empty, "damaged": damaged, "doublet": doublet}


def cell_obs(params: SimParams, start: int = 0, stop: int | None = None) -> pd.DataFrame:
    """obs (barcodes, ground truth) of cells ``start:stop``, without drawing any counts."""
    params = params.validate()
    design = make_design(params)
    stop = params.n_cells if stop is None else stop
    parts = []
    for b in range(start // SUBBLOCK, -(-stop // SUBBLOCK)):
        lo = b * SUBBLOCK
        c = _cells(params, design, b)
        sl = slice(max(start - lo, 0), min(stop - lo, len(c["t1"])))
        part = {k: c[k][sl] for k in ("t1", "empty", "damaged", "doublet")}
        part["barcode"] = barcodes(np.arange(lo + sl.start, lo + sl.stop), params.seed)
        parts.append(part)
    col = {k: np.concatenate([p[k] for p in parts]) if parts else np.array([], dtype=np.int64)
           for k in ("t1", "empty", "damaged", "doublet", "barcode")}
    return pd.DataFrame({
        "cell_type": pd.Categorical.from_codes(col["t1"].astype(np.int64), categories=design.type_names),
        "is_damaged": col["damaged"].astype(bool),
        "is_empty": col["empty"].astype(bool),
        "is_doublet": col["doublet"].astype(bool),
    }, index=pd.Index(col["barcode"].astype(object)))


def barcodes(idx: np.ndarray, seed: int = 0) -> np.ndarray:
    """Unique 10x-style barcodes (16 nt + ``-1``) for cell numbers below 2^32, scrambled by a 32-bit bijection."""
    x = (idx.astype(np.uint64) + np.uint64((0x9E3779B9 + seed * 0x2545F491) % 2**32)) & np.uint64(0xFFFFFFFF)
    for shift, mult in ((16, 0x7FEB352D), (15, 0x846CA68B)):  # xor-shift-multiply rounds: invertible mod 2^32
        x ^= x >> np.uint64(shift)
        x = (x * np.uint64(mult)) & np.uint64(0xFFFFFFFF)
    x ^= x >> np.uint64(16)
    digits = (x[:, None] >> (np.uint64(2) * np.arange(15, -1, -1, dtype=np.uint64))) & np.uint64(3)
    letters = np.frombuffer(b"ACGT", dtype=np.uint8)[digits.astype(np.intp)]
    text = letters.reshape(-1).view("S16") if len(idx) else np.array([], dtype="S16")
    return np.char.add(text.astype(str), "-1").astype(object)


# ---------------------------------------------------------------------------------------------- counts


def _module_counts(design: Design, cells: dict, b: int, seed: int) -> np.ndarray:
    """UMIs per (cell, module): Poisson with the cell's gamma-perturbed module shares (int64, cells x M).

    Gamma factors and Poisson counts come from streams 2 and 3 of the sub-block, each consumed cell
    after cell, so that fewer cells give a prefix of the same draws.
    """
    w = design.shares[cells["t1"]]
    dbl = cells["doublet"]
    w[dbl] = 0.5 * (w[dbl] + design.shares[cells["t2"][dbl]])
    w[cells["empty"]] = design.ambient
    w *= np.random.default_rng([seed, 2, b]).gamma(design.shape, 1.0 / design.shape, size=w.shape)
    mt = design.mt_module
    dmg = cells["damaged"]
    s = cells["mt_share"][dmg]
    w[dmg, mt] = s / (1 - s) * (w[dmg].sum(axis=1) - w[dmg, mt])
    w *= (cells["lib"] / w.sum(axis=1))[:, None]
    return np.random.default_rng([seed, 3, b]).poisson(w)


class _Workspace(threading.local):
    """Per-thread scratch arrays reused across batches and sub-blocks.

    Fresh large temporaries per batch cost page faults (expensive on VMs, and on every allocation where
    glibc's trim threshold is pinned, as in Dask workers); reused buffers also stay in cache.
    """

    def get(self, n: int) -> dict:
        bufs = getattr(self, "bufs", None)
        if bufs is None or len(bufs["x"]) < n:
            cap = max(n, int(getattr(self, "cap", 0) * 1.25))
            self.cap = cap
            self.bufs = bufs = {"x": np.empty(cap), "f": np.empty(cap), "j": np.empty(cap, np.int64),
                                "g": np.empty(cap, np.int64), "m": np.empty(cap, bool)}
        return {k: v[:n] for k, v in bufs.items()}


_WORKSPACE = _Workspace()


def _step_fill(out: np.ndarray, pos: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Fill ``out`` with ``values[k]`` from ``pos[k]`` up to ``pos[k+1]`` (np.repeat without allocating)."""
    out[:] = 0
    out[pos] = np.diff(values, prepend=values.dtype.type(0))
    return np.cumsum(out, out=out)


def _sample_batch(design: Design, counts: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distribute the module counts of a few cells over genes; (row, gene, count) sorted by row then gene.

    One uniform per UMI picks its gene by the alias method (integer part: slot, fraction: keep or alias).
    Counting is one ``bincount`` over ``cell * n_genes + gene``, which also sorts.
    """
    n_cells, M = counts.shape
    G = len(design.alias_prob)
    flat = counts.ravel()
    seg = np.flatnonzero(flat)
    seg_pos = np.cumsum(flat[seg]) - flat[seg]
    per_cell = counts.sum(axis=1)
    cells = np.flatnonzero(per_cell)
    cell_pos = np.cumsum(per_cell[cells]) - per_cell[cells]
    w = _WORKSPACE.get(int(flat.sum()))
    x, f, j, g, m = w["x"], w["f"], w["j"], w["g"], w["m"]
    rng.random(out=x)
    x *= _step_fill(f, seg_pos, design.mod_size[seg % M].astype(np.float64))
    np.copyto(j, x, casting="unsafe")  # truncation = floor for x >= 0
    x -= j
    j += _step_fill(g, seg_pos, design.mod_start[seg % M])
    np.less(x, np.take(design.alias_prob, j, out=f), out=m)
    np.take(design.alias_idx, j, out=g)
    np.copyto(g, j, where=m)
    g += _step_fill(j, cell_pos, cells.astype(np.int64) * G)
    tally = np.bincount(g, minlength=n_cells * G)
    key = np.flatnonzero(tally)
    row = key // G
    return row, key - row * G, tally[key]


def simulate_subblock(params: SimParams, b: int) -> sp.csr_matrix:
    """Counts of sub-block ``b`` (cells ``b*SUBBLOCK`` onwards) as float32 CSR with sorted indices."""
    design = make_design(params)
    cells = _cells(params, design, b)
    counts = _module_counts(design, cells, b, params.seed)
    rng = np.random.default_rng([params.seed, 4, b])  # the UMIs' stream
    n, G = counts.shape[0], params.n_genes
    rows, cols, vals = [], [], []
    for lo in range(0, n, BATCH):
        r, c, v = _sample_batch(design, counts[lo:lo + BATCH], rng)
        rows.append(r + lo)
        cols.append(c)
        vals.append(v)
    row = np.concatenate(rows)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(row, minlength=n))])
    data = np.concatenate(vals).astype(np.float32)
    indices = np.concatenate(cols).astype(np.int32)
    return sp.csr_matrix((data, indices, indptr), shape=(n, G))


def simulate_rows(params: SimParams, start: int, stop: int) -> sp.csr_matrix:
    """Counts of cells ``start:stop`` (any range; sub-blocks are cut as needed, so chunks never matter)."""
    blocks = []
    for b in range(start // SUBBLOCK, -(-stop // SUBBLOCK)):
        lo = b * SUBBLOCK
        block = simulate_subblock(params, b)
        blocks.append(block[max(start - lo, 0): min(stop - lo, block.shape[0])])
    if not blocks:
        return sp.csr_matrix((0, params.n_genes), dtype=np.float32)
    return sp.vstack(blocks, format="csr") if len(blocks) > 1 else blocks[0]


def n_subblocks(params: SimParams) -> int:
    """Sub-blocks covering all cells."""
    return -(-params.n_cells // SUBBLOCK)


# ---------------------------------------------------------------------------------------------- outputs


def simulate_anndata(params: SimParams) -> ad.AnnData:
    """The whole simulation in memory (small datasets, notebooks and tests)."""
    params = params.validate()
    X = simulate_rows(params, 0, params.n_cells)
    return ad.AnnData(X=X, obs=cell_obs(params), var=make_design(params).var.copy(), uns={"simulate": asdict(params)})


def iter_blocks(params: SimParams, threads: int = 1):
    """Sub-block CSR matrices in order, made by ``threads`` threads with a few sub-blocks in flight.

    NumPy releases the GIL in the heavy steps (drawing, gathers, counting), so threads share the
    work without copying results between processes.
    """
    nb = n_subblocks(params)
    if threads <= 1:
        for b in range(nb):
            yield simulate_subblock(params, b)
        return
    with ThreadPoolExecutor(threads) as pool:
        pending: collections.deque = collections.deque()
        for b in range(nb):
            pending.append(pool.submit(simulate_subblock, params, b))
            if len(pending) > 2 * threads:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def write_simulated(path, params: SimParams, *, chunk_rows: int = 10_000, threads: int = 1) -> dict:
    """Write the simulation as an AnnData Zarr store at ``path`` (atomically); returns ``nnz`` and ``obs``.

    Sub-blocks are made in order by ``threads`` threads and streamed into X by
    :func:`atlasflow.store.write_csr_blocks`, so memory is bounded by a few sub-blocks whatever
    ``n_cells`` is. ``chunk_rows`` is only recorded, for the stages that read the store.

    Why not the Dask workers: measured on 20k cells x 20k genes (2 cores), generating on two workers
    and streaming to the client cost 12.5 CPU-s (pickling 16 MB per sub-block, and page faults under
    the workers' ``MALLOC_TRIM_THRESHOLD_``) against 6.9 CPU-s in one process; the Zarr writer is one
    sequential stream either way.
    """
    params = params.validate()
    design = make_design(params)
    obs = cell_obs(params)
    var = design.var.copy()
    with atomic_dir(path) as tmp:
        ad.AnnData(obs=obs, var=var, uns={"simulate": asdict(params)}).write_zarr(tmp)
        nnz = write_csr_blocks(Path(tmp), "X", iter_blocks(params, threads), (params.n_cells, params.n_genes))
        root = zarr.open_group(str(tmp), mode="r+")
        root.attrs[META_KEY] = {"store_id": uuid.uuid4().hex, "chunk_rows": int(chunk_rows),
                                "provenance": {"stage": "simulate", "params": asdict(params)}}
        zarr.consolidate_metadata(str(tmp))
    return {"nnz": int(nnz), "obs": obs}


def write_tenx_h5(path, params: SimParams, *, threads: int = 1, compression: str | None = "gzip") -> int:
    """Write the simulation as a Cell Ranger v3 ``filtered_feature_bc_matrix.h5``, streaming; returns nnz.

    Same counts as :func:`write_simulated` (for benchmarking and testing readers of 10x files on any
    size): ``/matrix`` holds CSC by cell (= CSR of cells x genes) with int32 data, int64 indices and
    indptr, ``shape = [genes, cells]`` and ``features/{id,name,feature_type,genome}``.
    """
    import h5py

    params = params.validate()
    var = make_design(params).var
    obs = cell_obs(params)
    path = Path(path)
    tmp = temporary_sibling(path)
    opts = {"compression": compression, "shuffle": True} if compression else {}
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs.update({"filetype": "matrix", "version": 2, "chemistry_description": "simulated"})
            m = f.create_group("matrix")
            m.create_dataset("barcodes", data=np.asarray(obs.index, dtype="S"))
            m.create_dataset("shape", data=np.array([params.n_genes, params.n_cells], dtype=np.int32))
            feats = m.create_group("features")
            for key, values in {"id": var["gene_ids"], "name": var["gene_symbols"],
                                "feature_type": ["Gene Expression"] * len(var), "genome": ["GRCh38"] * len(var)}.items():
                feats.create_dataset(key, data=np.asarray(values, dtype="S"))
            feats.create_dataset("_all_tag_keys", data=np.array([b"genome"]))
            data = m.create_dataset("data", shape=(0,), maxshape=(None,), dtype=np.int32, chunks=(1 << 18,), **opts)
            indices = m.create_dataset("indices", shape=(0,), maxshape=(None,), dtype=np.int64, chunks=(1 << 18,), **opts)
            indptr, nnz = [np.zeros(1, dtype=np.int64)], 0
            for block in iter_blocks(params, threads):
                data.resize((nnz + block.nnz,))
                indices.resize((nnz + block.nnz,))
                data[nnz:] = block.data.astype(np.int32)
                indices[nnz:] = block.indices
                indptr.append(block.indptr[1:].astype(np.int64) + nnz)
                nnz += block.nnz
            m.create_dataset("indptr", data=np.concatenate(indptr))
        ownership.replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return nnz
