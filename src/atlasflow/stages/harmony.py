"""harmony stage: batch-corrected embedding (scanpy.external.pp.harmony_integrate); X and X_pca are linked."""

from __future__ import annotations

import logging

from atlasflow import pp
from atlasflow.errors import InputError
from atlasflow.stages._common import Number, shape_summary
from atlasflow.store import open_store, write_store

NEEDS_CLUSTER = False  # the embedding is in memory; X is linked, not read
DESCRIPTION = ("Integrate batches with Harmony (harmonypy) on obsm[basis] (X_pca): writes "
               "obsm['X_pca_harmony'], which neighbors then uses.")

#: threads of harmonypy: 0 = one per physical core
n_jobs_type = Number(integer=True, ge=0)
log = logging.getLogger(__name__)
theta_type = Number(ge=0, nullable=True)
iterations = Number(integer=True, ge=1)
seed = Number(integer=True, ge=0)


def add_arguments(p):
    p.add_argument("--key", nargs="+", default=["sample"], help="obs column(s) holding the batches")
    p.add_argument("--basis", default="X_pca", help="obsm key of the embedding to correct")
    p.add_argument("--adjusted-basis", dest="adjusted_basis", default="X_pca_harmony",
                   help="obsm key of the corrected embedding")
    p.add_argument("--theta", type=theta_type.named("theta"), default=None,
                   help="diversity penalty, >= 0 (none: harmonypy's 2)")
    p.add_argument("--max-iter-harmony", dest="max_iter_harmony", type=iterations.named("max_iter_harmony"),
                   default=10, help="Harmony iterations at most")
    p.add_argument("--random-state", dest="random_state", type=seed.named("random_state"), default=0,
                   help="seed (harmonypy's results do not depend on its thread count)")
    p.add_argument("--label-key", dest="label_key", default=None,
                   help="obs column of known labels (cell types, lines): its cLISI is reported beside the batches' "
                        "iLISI, before and after")
    p.add_argument("--n-jobs", dest="n_jobs", type=n_jobs_type.named("n_jobs"), default=0,
                   help="threads; 0: one per physical core")


def run(args, client) -> dict:
    keys = [args.key] if isinstance(args.key, str) else list(args.key)
    adata = open_store(args.input, chunk_rows=args.chunk_rows)
    if args.label_key is not None and args.label_key not in adata.obs:
        raise InputError(f"harmony.label_key: {args.label_key} not in obs (has: {', '.join(map(str, adata.obs))})")
    summary = pp.harmony_integrate(
        adata, keys, basis=args.basis, adjusted_basis=args.adjusted_basis,
        theta=theta_type(args.theta, "theta"), max_iter_harmony=iterations(args.max_iter_harmony, "max_iter_harmony"),
        random_state=seed(args.random_state, "random_state"), n_jobs=n_jobs_type(args.n_jobs, "n_jobs"),
    )
    metrics = {}
    if not summary["skipped"]:
        labels = [args.label_key] if args.label_key else []
        metrics = pp.lisi_medians(adata, [args.basis, args.adjusted_basis], [*keys, *labels])
        for key in [*keys, *labels]:
            what = "cLISI" if key in labels else "iLISI"
            log.info("harmony: median %s of %s %.2f before, %.2f after", what, key, metrics[args.basis][key],
                     metrics[args.adjusted_basis][key])
    write_store(adata, args.output, chunk_rows=args.chunk_rows, provenance={"stage": "harmony", "keys": keys})
    return {**shape_summary(adata, adata), **summary, "lisi_median": metrics}
