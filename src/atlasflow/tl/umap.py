"""UMAP layout of the neighbourhood graph with scanpy's semantics (``scanpy.tl.umap``).

Like scanpy, the graph of ``neighbors`` is embedded directly with umap-learn's
``simplicial_set_embedding`` (no second kNN search); parameters, defaults, epochs (500 up to 10,000
cells, 200 above) and outputs (``obsm['X_umap']``, ``uns['umap']['params'] = {'a', 'b'}``) are scanpy's,
so the same graph and seed give scanpy's coordinates.
"""

from __future__ import annotations

import logging
import warnings

import anndata as ad
import numpy as np

from atlasflow.errors import ConfigError, InputError
from atlasflow.tl._jit_cache import import_with_cache
from atlasflow.tl.neighbors import graph_of, representation

log = logging.getLogger(__name__)

#: ``spectral`` (scanpy's default) runs ARPACK with sqrt(cells) Lanczos vectors below 2M cells (~7 GB at 1M);
#: ``random`` skips that step.
INIT_POS = ("spectral", "random")

#: Default of ``exact_spectral_max_cells``: above it the spectral start comes from LOBPCG (``tl._spectral``),
#: not umap-learn's ARPACK, whose sqrt(cells) Lanczos vectors take 1.2 GiB at 300k cells and 7.5 GiB at 1M.
EXACT_SPECTRAL_MAX_CELLS = 300_000

#: Default of ``exact_epochs_max_cells``: above it the epochs are atlasflow's deterministic parallel ones
#: (``kernels.umap_epochs``), not umap-learn's single-threaded ones (~1000 s at 1M cells on 2 cores).
EXACT_EPOCHS_MAX_CELLS = 300_000


def umap(
    adata: ad.AnnData,
    *,
    min_dist: float = 0.5,
    spread: float = 1.0,
    n_components: int = 2,
    maxiter: int | None = None,
    alpha: float = 1.0,
    gamma: float = 1.0,
    negative_sample_rate: int = 5,
    init_pos: str | np.ndarray | None = "spectral",
    random_state: int = 0,
    a: float | None = None,
    b: float | None = None,
    key_added: str | None = None,
    neighbors_key: str = "neighbors",
    parallel: bool = False,
    exact_spectral_max_cells: int | None = EXACT_SPECTRAL_MAX_CELLS,
    exact_epochs_max_cells: int | None = EXACT_EPOCHS_MAX_CELLS,
    backend: str = "cpu",
    copy: bool = False,
) -> ad.AnnData | None:
    """Embed the graph ``uns[neighbors_key]`` in ``n_components`` dimensions (scanpy.tl.umap).

    ``init_pos``: 'spectral', 'random', an ``obsm`` key or an array. ``parallel=True`` uses numba threads
    in the optimisation: faster on many cores but not reproducible (umap-learn's caveat), so off by default.
    ``exact_spectral_max_cells``: the 'spectral' start is umap-learn's (scanpy's coordinates) up to this many
    cells and LOBPCG's above (the same eigenvectors to 1e-4 in a fraction of the memory, a different layout
    of the same quality; logged); None: umap-learn's always.
    ``exact_epochs_max_cells``: the epochs are umap-learn's (scanpy's coordinates) up to this many cells and
    ``kernels.umap_epochs``' above (each cell moves through its own graph row, groups of cells in turn, the
    cells of a group in parallel: reproducible for any number of threads, 2-3x faster on 2 cores, not
    umap-learn's coordinates; logged); None: umap-learn's always.
    ``backend='gpu'``: cuML lays out the same graph where it is installed (reproducible for a seed, not
    umap-learn's coordinates), else umap-learn on the CPU (logged).
    """
    from atlasflow.tl import _gpu

    adata = adata.copy() if copy else adata
    backend = _gpu.resolve_backend(backend)
    key_obsm, key_uns = ("X_umap", "umap") if key_added is None else (key_added, key_added)
    neigh, conns_key = graph_of(adata, neighbors_key)
    if min_dist < 0 or spread <= 0 or min_dist > spread:
        raise ConfigError(f"need 0 <= min_dist <= spread and spread > 0 (min_dist={min_dist}, spread={spread})")
    if int(n_components) < 1:
        raise ConfigError(f"n_components must be at least 1, not {n_components}")
    if maxiter is not None and int(maxiter) < 0:
        raise ConfigError(f"maxiter must be >= 0, not {maxiter}")
    if int(negative_sample_rate) < 1:
        raise ConfigError(f"negative_sample_rate must be at least 1, not {negative_sample_rate}")
    params = neigh.get("params", {})
    if params.get("method") != "umap":
        log.warning("umap: obsp[%r] was not computed with method='umap'", conns_key)

    import_with_cache()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Tensorflow not installed")
        from umap.umap_ import find_ab_params, simplicial_set_embedding
    from sklearn.utils import check_array, check_random_state

    if a is None or b is None:
        a, b = find_ab_params(spread, min_dist)
    adata.uns[key_uns] = {"params": {"a": a, "b": b}}
    if isinstance(init_pos, str) and init_pos in adata.obsm:
        init = adata.obsm[init_pos]
    elif isinstance(init_pos, str):
        if init_pos not in INIT_POS:
            raise ConfigError(f"init_pos must be {', '.join(INIT_POS)} or an obsm key "
                              f"({', '.join(sorted(adata.obsm))}), not {init_pos!r}")
        init = init_pos
    else:
        init = "spectral" if init_pos is None else init_pos
    if hasattr(init, "dtype"):
        init = check_array(init, dtype=np.float32, accept_sparse=False)
        if init.shape != (adata.n_obs, int(n_components)):
            raise InputError(f"init_pos has shape {init.shape}, expected ({adata.n_obs}, {int(n_components)})")
    if random_state != 0:
        adata.uns[key_uns]["params"]["random_state"] = random_state
    # the embedding enters only through the connected components of the spectral initialisation
    x = representation(adata, params.get("use_rep"), params.get("n_pcs"))
    graph = adata.obsp[conns_key].tocoo(copy=True)  # umap-learn zeroes weak edges in place: not in obsp
    n_epochs = (500 if graph.shape[0] <= 10000 else 200) if maxiter is None else int(maxiter)
    log.info("umap: %d cells, %d epochs, init %s", graph.shape[0], n_epochs,
             init if isinstance(init, str) else "array")
    engine = _gpu.umap_engine(backend, n_epochs)
    if engine == "cuML":
        log.info("umap: layout on the GPU (cuML)")
        adata.obsm[key_obsm] = _gpu.umap_embedding(
            x, graph, n_components=int(n_components), initial_alpha=alpha, a=a, b=b, gamma=gamma,
            negative_sample_rate=int(negative_sample_rate), n_epochs=n_epochs, init=init,
            random_state=random_state, metric=params.get("metric", "euclidean"))
        return adata if copy else None
    if backend == "gpu":
        log.info("umap: layout on the CPU (umap-learn; %s)", "no epochs asked" if n_epochs == 0 else
                 "cuML is not installed")
    if isinstance(init, str) and init == "spectral" and exact_spectral_max_cells is not None \
            and graph.shape[0] > int(exact_spectral_max_cells):
        init = _large_spectral_start(graph, x, int(n_components), n_epochs, random_state, params)
    if exact_epochs_max_cells is not None and graph.shape[0] > int(exact_epochs_max_cells) and n_epochs > 0:
        adata.obsm[key_obsm] = _large_layout(graph, x, init, int(n_components), n_epochs, a, b, alpha, gamma,
                                             int(negative_sample_rate), random_state, params)
        return adata if copy else None
    emb, _ = simplicial_set_embedding(
        data=x, graph=graph, n_components=int(n_components), initial_alpha=alpha, a=a, b=b, gamma=gamma,
        negative_sample_rate=int(negative_sample_rate), n_epochs=n_epochs, init=init,
        random_state=check_random_state(random_state), metric=params.get("metric", "euclidean"),
        metric_kwds=params.get("metric_kwds", {}), densmap=False, densmap_kwds={}, output_dens=False,
        parallel=bool(parallel), verbose=False,
    )
    adata.obsm[key_obsm] = emb
    return adata if copy else None


def _pruned(graph, n_epochs: int):
    """A CSR copy of ``graph`` without the edges umap-learn drops before its start and epochs: those below
    max weight / epochs (its default epochs when 10 or fewer are asked)."""
    g = graph.tocsr(copy=True)
    g.sum_duplicates()
    epochs = n_epochs if n_epochs > 10 else (500 if g.shape[0] <= 10000 else 200)
    g.data[g.data < g.data.max() / float(epochs)] = 0.0
    g.eliminate_zeros()
    return g


def _large_layout(graph, x, init, dim: int, n_epochs: int, a: float, b: float, alpha: float, gamma: float,
                  negative_sample_rate: int, random_state, params: dict) -> np.ndarray:
    """The layout of a graph above ``exact_epochs_max_cells``: umap-learn's start (or the one given), then
    ``kernels.umap_epochs``' deterministic parallel epochs instead of umap-learn's."""
    from sklearn.utils import check_random_state
    from umap.spectral import spectral_layout
    from umap.umap_ import noisy_scale_coords

    from atlasflow.kernels.umap_epochs import optimize_layout

    seed = 0 if random_state is None else int(random_state)
    rng = check_random_state(seed)
    if isinstance(init, str) and init == "random":
        start = rng.uniform(low=-10.0, high=10.0, size=(graph.shape[0], dim)).astype(np.float32)
    elif isinstance(init, str):  # 'spectral' below exact_spectral_max_cells: umap-learn's start, as it makes it
        g = _pruned(graph, n_epochs)
        start = noisy_scale_coords(spectral_layout(x, g, dim, rng, metric=params.get("metric", "euclidean"),
                                                   metric_kwds=params.get("metric_kwds", {})),
                                   rng, max_coord=10, noise=0.0001)
        del g
    else:
        start = np.array(init, dtype=np.float32)
    # umap-learn scales every start into [0, 10] before its epochs
    start = (10.0 * (start - start.min(0)) / (start.max(0) - start.min(0))).astype(np.float32)
    log.info("umap: %d cells > exact_epochs_max_cells: %d epochs by atlasflow's deterministic parallel kernel, "
             "not umap-learn's (the layout is not scanpy's coordinates)", graph.shape[0], n_epochs)
    step = max(n_epochs // 10, 1)

    def progress(epoch: int) -> None:
        if (epoch + 1) % step == 0:
            log.info("umap: epoch %d of %d", epoch + 1, n_epochs)

    return optimize_layout(start, graph, n_epochs, a=a, b=b, gamma=gamma, initial_alpha=alpha,
                           negative_sample_rate=negative_sample_rate, seed=seed, progress=progress)


def _large_spectral_start(graph, x, dim: int, n_epochs: int, random_state: int, params: dict) -> np.ndarray:
    """The spectral start of a large graph by LOBPCG (``tl._spectral``), on the graph umap-learn would start
    from (edges below max weight / epochs dropped, as ``simplicial_set_embedding`` does first) and scaled as
    umap-learn scales its own (``noisy_scale_coords``), ready to pass as ``init``."""
    from sklearn.utils import check_random_state
    from umap.umap_ import noisy_scale_coords

    from atlasflow.tl._spectral import spectral_start

    g = _pruned(graph, n_epochs)
    log.info("umap: %d cells > exact_spectral_max_cells: spectral start by LOBPCG, not umap-learn's ARPACK "
             "(same eigenvectors to 1e-4; the layout is not scanpy's coordinates)", g.shape[0])
    seed = 0 if random_state is None else int(random_state)
    start = spectral_start(g, dim, seed=seed, data=x, metric=params.get("metric", "euclidean"))
    return noisy_scale_coords(start, check_random_state(seed), max_coord=10, noise=0.0001)
