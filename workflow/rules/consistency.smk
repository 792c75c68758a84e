"""After any interruption, one plain run makes the results one consistent run again.

Snakemake does not rebuild a missing intermediate output while what depends on it is up to date (a killed
`--forcerun pca` leaves pca.zarr missing and neighbors.zarr from the earlier run: "Nothing to be done"). Every
stage records in its JSON summary the id of each atlasflow store it read (`input_stores`, atlasflow.cli). Here,
before Snakemake builds its DAG, an output whose recorded input store is missing or was rewritten since is
*stale*: its summary is moved aside (mark_stale_outputs), so Snakemake sees that stage's output missing and
rebuilds it, the missing input store and everything after it, and nothing else. A run with explicit
targets (`snakemake results/<ds>/pca.zarr`) still builds only what the targets need; the stale stages
after them are rebuilt by the next run that needs them.
"""

import json as _json
import shutil


def _store_id(path):
    """The atlasflow store_id of a store folder, None when it is missing or not atlasflow's."""
    for meta, key in (("zarr.json", "attributes"), (".zattrs", None)):
        try:
            doc = _json.loads((Path(path) / meta).read_text())
        except (OSError, ValueError):
            continue
        attrs = doc.get(key, {}) if key else doc
        own = attrs.get("atlasflow") if isinstance(attrs, dict) else None
        return own.get("store_id") if isinstance(own, dict) else None
    return None


def _summaries():
    """{summary path: its recorded input store paths and ids}, over every dataset's stage summaries on disk."""
    out = {}
    for name in DATASETS:
        for summary in sorted(Path("results", name).glob("*.json")):
            try:
                recorded = _json.loads(summary.read_text()).get("input_stores") or {}
            except (OSError, ValueError, AttributeError):
                continue
            out[summary] = [e for e in recorded.values() if isinstance(e, dict) and "path" in e]
    return out


def _same(a, b):
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def stale_outputs():
    """{summary of a stale output: why}: computed from a store that is missing or was rewritten since, or
    (transitively) from the store of a stale output."""
    summaries = _summaries()
    stale = {}
    for summary, inputs in summaries.items():
        for entry in inputs:
            if _store_id(entry["path"]) != entry.get("store_id"):
                why = "is missing" if not Path(entry["path"]).exists() else "was rewritten since"
                stale[summary] = f"computed from {entry['path']}, which {why}"
                break
    grew = True
    while grew:  # what was computed from a stale stage's store is stale too
        grew = False
        stores = {s.with_suffix(".zarr"): s for s in stale}
        for summary, inputs in summaries.items():
            if summary in stale:
                continue
            for entry in inputs:
                src = next((st for st in stores if _same(st, entry["path"])), None)
                if src is not None:
                    stale[summary] = f"computed from {src}, which will be rebuilt"
                    grew = True
                    break
    return stale


def stale_name(path):
    """Where a stale output is moved to: hidden, beside it (replaced by the next one; the stage removes it)."""
    return Path(path).with_name(f".{Path(path).name}.stale")


def mark_stale_outputs():
    """Move every stale stage's outputs aside, each stage with one log line (main process only).

    Snakemake rebuilds a missing output only for a job that must run: it does not rebuild a missing
    intermediate store while what depends on it is up to date, and its --forcerun cannot be set from here
    (the Snakefile is read before the run's DAG settings exist). So every output computed, directly or not,
    from the missing or rewritten store is moved aside (its store, summary, CSVs or plots folder: every
    entry named `<stage>` or `<stage>.*` of its results folder): the next run that needs them rebuilds them,
    the missing store first. Nothing is deleted here (`.<name>.stale`, removed when the stage writes its
    output again), and a dry run marks too, so that it shows the plan.
    """
    from snakemake.logging import logger

    if not workflow.is_main_process:
        return
    for summary, why in stale_outputs().items():
        stage = summary.stem
        logger.info(f"atlasflow: {summary} was {why}: the {stage} stage will be rebuilt (its outputs are "
                    f"moved aside to .{stage}.*.stale)")
        for entry in sorted(summary.parent.iterdir()):
            if entry.name == stage or entry.name.startswith(f"{stage}."):
                dest = stale_name(entry)
                if dest.is_dir() and not dest.is_symlink():
                    shutil.rmtree(dest)
                os.replace(entry, dest)
