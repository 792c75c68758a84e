"""scrublet stage: doublet scores per sample (scanpy.pp.scrublet) on the raw counts of the qc store.

It runs between qc and filter: Scrublet simulates doublets from raw counts, which every later stage has
changed, and scores each sample on its own; filter can then drop the predicted doublets
(``filter.drop_doublets``) in the same pass that drops low-quality cells. X is linked, not copied.
"""

from __future__ import annotations

import logging

from atlasflow import pp
from atlasflow.stages._common import Choice, Number, shape_summary
from atlasflow.store import open_store, write_store
from atlasflow.tl.neighbors import KNN_METHODS

DESCRIPTION = ("Score doublets per sample with Scrublet (scanpy.pp.scrublet) on raw counts: obs doublet_score, "
               "predicted_doublet; uns scrublet.")
log = logging.getLogger(__name__)

ratio = Number(gt=0)
rate = Number(gt=0, le=0.5)
deviation = Number(ge=0)
components = Number(integer=True, ge=2)
neighbours = Number(integer=True, ge=1, nullable=True)
cutoff = Number(nullable=True)
seed = Number(integer=True, ge=0)
cells = Number(integer=True, ge=1)
knn_choice = Choice(KNN_METHODS)


def add_arguments(p):
    p.add_argument("--batch-key", dest="batch_key", default="sample",
                   help="obs column of the samples, each scored on its own; 'none': all cells as one sample")
    p.add_argument("--sim-doublet-ratio", dest="sim_doublet_ratio", type=ratio.named("sim_doublet_ratio"),
                   default=2.0, help="doublets simulated per observed cell")
    p.add_argument("--expected-doublet-rate", dest="expected_doublet_rate", default=0.05,
                   type=rate.named("expected_doublet_rate"), help="expected fraction of doublets, in (0, 0.5]")
    p.add_argument("--stdev-doublet-rate", dest="stdev_doublet_rate", default=0.02,
                   type=deviation.named("stdev_doublet_rate"), help="uncertainty of the expected doublet rate")
    p.add_argument("--n-prin-comps", dest="n_prin_comps", type=components.named("n_prin_comps"), default=30,
                   help="principal components of the embedding the neighbours are found in")
    p.add_argument("--n-neighbors", dest="n_neighbors", type=neighbours.named("n_neighbors"), default=None,
                   help="neighbours of observed cells (none: round(0.5 * sqrt(cells)) per sample)")
    p.add_argument("--threshold", type=cutoff.named("threshold"), default=None,
                   help="doublet score above which a cell is called a doublet (none: per sample, the minimum between "
                        "the two modes of the simulated doublets' scores)")
    p.add_argument("--random-state", dest="random_state", type=seed.named("random_state"), default=0,
                   help="seed of the doublet simulation (and of pynndescent), the same for every sample as scanpy")
    p.add_argument("--knn-method", dest="knn_method", type=knn_choice.named("knn_method"), default="auto",
                   metavar="{" + ",".join(KNN_METHODS) + "}",
                   help="neighbour search: auto (exact below 8192 points, as scanpy), exact or pynndescent")
    p.add_argument("--min-cells", dest="min_cells", type=cells.named("min_cells"), default=100,
                   help="a sample with fewer cells is skipped with a warning (no score, not called)")


def run(args, client) -> dict:
    batch_key = None if str(args.batch_key).lower() in ("none", "null", "") else args.batch_key
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    per_sample = pp.scrublet(
        adata, batch_key=batch_key, sim_doublet_ratio=ratio(args.sim_doublet_ratio, "sim_doublet_ratio"),
        expected_doublet_rate=rate(args.expected_doublet_rate, "expected_doublet_rate"),
        stdev_doublet_rate=deviation(args.stdev_doublet_rate, "stdev_doublet_rate"),
        n_prin_comps=components(args.n_prin_comps, "n_prin_comps"),
        n_neighbors=neighbours(args.n_neighbors, "n_neighbors"), threshold=cutoff(args.threshold, "threshold"),
        random_state=seed(args.random_state, "random_state"), knn_method=knn_choice(args.knn_method, "knn_method"),
        min_cells=cells(args.min_cells, "min_cells"),
    )
    called = int(adata.obs["predicted_doublet"].sum())
    log.info("scrublet: %d of %d cells called doublets over %d samples", called, adata.n_obs, len(per_sample))
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "scrublet",
                                                                             "batch_key": batch_key})
    return {**shape_summary(adata, adata), "batch_key": batch_key, "doublets": called,
            "samples_skipped": sorted(str(k) for k, v in per_sample.items() if v.get("skipped")),
            "per_sample": {str(k): v for k, v in per_sample.items()}}
