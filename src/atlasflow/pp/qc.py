"""QC metrics as ``scanpy.pp.calculate_qc_metrics``, in one pass over X."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd

from atlasflow import gene_ids, kernels, progress
from atlasflow.backend import xp_of
from atlasflow.errors import ConfigError

log = logging.getLogger(__name__)


def gene_set_masks(var: pd.DataFrame, sets: Mapping[str, Mapping], species: str = "auto") -> dict[str, np.ndarray]:
    """Boolean gene masks for QC gene sets, each given by ``prefix`` (str or list), ``regex`` or ``genes_file``.

    Symbols are taken from ``var["gene_symbols"]`` when present (ingest keeps the original symbols there),
    else from the var names. When those are gene ids rather than symbols (Ensembl ids, as plate data and
    some references give only), a set's ``ids_file`` replaces its symbol rules (a prefix such as "MT-"
    cannot match an id). A set may hold a ``mouse`` spec of its own (e.g. ``{prefix: "mt-"}``): it replaces
    the set's rules when ``species`` is "mouse", or "auto" and var looks mouse (:func:`detect_species`).
    ERCC spike-ins, when present, form a set ``ercc`` unless one is configured. A set that matches no gene
    gives an all-False mask and a warning.
    """
    symbols = pd.Index(var["gene_symbols"] if "gene_symbols" in var else var.index).astype(str)
    ids_only = gene_ids.id_fraction(symbols) >= 0.9
    if species == "auto":
        species, why = detect_species(var, symbols)
        if species == "mouse" and any("mouse" in dict(s or {}) for s in sets.values()):
            log.info("QC gene sets: var looks mouse (%s): using the sets' mouse rules", why)
    elif species not in ("human", "mouse"):
        raise ConfigError(f"qc.species: {species!r} is not one of auto, human, mouse")
    masks = {}
    for name, spec in sets.items():
        spec = dict(spec or {})
        mouse = spec.pop("mouse", None)
        if species == "mouse" and mouse:
            spec = dict(mouse)
        if ids_only and spec.get("ids_file"):
            mask = _list_mask(var, symbols, name, spec["ids_file"], "ids_file")
            log.info("QC gene set %r: var holds gene ids, not symbols: %d genes by id from %s", name, mask.sum(),
                     spec["ids_file"])
        else:
            mask = _rule_mask(var, symbols, name, spec)
        if not mask.any():
            hint = ""
            if ids_only and gene_ids.ensembl_species(symbols) not in (None, "", "MUS"):
                hint = "; var holds non-human, non-mouse Ensembl ids: give the set an ids_file of that species"
            elif ids_only and not spec.get("ids_file"):
                hint = "; var holds gene ids, not symbols: give the set an ids_file"
            elif species == "mouse" and not mouse:
                hint = "; var looks mouse: give the set a mouse spec (e.g. mouse: {prefix: \"mt-\"})"
            log.warning("QC gene set %r matches no gene: pct_counts_%s will be 0%s", name, name, hint)
        masks[name] = mask
    if "ercc" not in masks:
        ercc = np.asarray(gene_ids.is_ercc(symbols)) | np.asarray(gene_ids.is_ercc(var.index))
        if "gene_ids" in var:
            ercc |= np.asarray(gene_ids.is_ercc(var["gene_ids"]))
        if ercc.any():
            log.info("QC gene set 'ercc': %d ERCC spike-ins (pct_counts_ercc)", ercc.sum())
            masks["ercc"] = ercc
    return masks


def detect_species(var: pd.DataFrame, symbols: pd.Index) -> tuple[str, str]:
    """("human" | "mouse", why) from what var holds: Ensembl ids (ENSMUSG is mouse) where there are any, else
    the case of the symbols (human HGNC symbols are upper case, mouse MGI symbols are not: MT-ND1 vs mt-Nd1)."""
    ids = var["gene_ids"] if "gene_ids" in var else symbols
    prefix = gene_ids.ensembl_species(ids)
    if prefix is None and "gene_ids" in var:
        prefix = gene_ids.ensembl_species(symbols)
    if prefix == "MUS":
        return "mouse", "Ensembl ids ENSMUSG"
    if prefix is not None:
        return "human", f"Ensembl ids ENS{prefix}G"
    lettered = symbols[symbols.str.contains("[A-Za-z]{2}", regex=True)]
    upper = float((lettered == lettered.str.upper()).mean()) if len(lettered) else 1.0
    if upper < 0.5:
        return "mouse", f"{1 - upper:.0%} of symbols not upper case"
    return "human", f"{upper:.0%} of symbols upper case"


def _rule_mask(var: pd.DataFrame, symbols: pd.Index, name: str, spec: dict) -> np.ndarray:
    """Genes matching a set's prefix, regex or genes_file rules (their union)."""
    mask = np.zeros(len(symbols), dtype=bool)
    if "prefix" in spec:
        prefixes = [spec["prefix"]] if isinstance(spec["prefix"], str) else list(spec["prefix"])
        mask |= np.asarray(symbols.str.startswith(tuple(prefixes)))
    if "regex" in spec:
        try:
            mask |= np.asarray(symbols.str.contains(spec["regex"], regex=True))
        except re.error as exc:
            raise ConfigError(f"qc.gene_sets.{name}.regex: invalid regular expression ({exc})") from exc
    if spec.get("genes_file"):
        mask |= _list_mask(var, symbols, name, spec["genes_file"], "genes_file")
    return mask


def _list_mask(var: pd.DataFrame, symbols: pd.Index, name: str, file, key: str) -> np.ndarray:
    """Genes named in a list file (any whitespace-separated word of a line: symbol or id), by symbol, var
    name or gene id."""
    path = Path(file)
    if not path.exists():
        raise ConfigError(f"qc.gene_sets.{name}.{key}: {path} does not exist")
    lines = (line.split("#", 1)[0] for line in path.read_text().splitlines())
    wanted = {word for line in lines for word in line.split()}
    mask = np.asarray(symbols.isin(wanted)) | np.asarray(var.index.isin(wanted))
    if "gene_ids" in var:
        mask |= np.asarray(var["gene_ids"].astype(str).isin(wanted))
    return mask


def calculate_qc_metrics(
    adata: ad.AnnData,
    *,
    qc_vars: Sequence[str] = (),
    percent_top: Sequence[int] | None = (50, 100, 200, 500),
    log1p: bool = True,
    inplace: bool = True,
):
    """Per-cell and per-gene QC metrics with scanpy's names, reading X once.

    ``qc_vars`` names boolean columns of ``adata.var`` (e.g. ``"mt"``). Adds to obs: n_genes_by_counts,
    total_counts, pct_counts_in_top_{n}_genes, total_counts_{qc}, pct_counts_{qc} (+ log1p_ variants);
    to var: n_cells_by_counts, mean_counts, pct_dropout_by_counts, total_counts (+ log1p_ variants).
    """
    X = adata.X
    n, m = X.shape
    qc_vars = [qc_vars] if isinstance(qc_vars, str) else list(qc_vars)
    for q in qc_vars:
        if q not in adata.var:
            raise ConfigError(f"qc_vars: {q!r} is not a column of var")
    tops = sorted({int(t) for t in percent_top or ()})
    if tops and (tops[0] < 1 or tops[-1] > m):  # scanpy raises IndexError("Positions outside range of features.")
        raise ConfigError(f"percent_top: every n must be between 1 and the {m} genes, not {tops}")
    masks = [np.asarray(adata.var[q], dtype=bool) for q in qc_vars]
    ncols = 2 + len(tops) + len(masks)

    def obs_block(block):
        cols = [kernels.row_nnz(block), kernels.row_sums(block)]
        if tops:
            fr = kernels.top_n_fractions(block, tops)
            cols += [fr[:, j] for j in range(len(tops))]
        cols += [kernels.row_sums_masked(block, mk) for mk in masks]
        xp = xp_of(block)
        return xp.stack([xp.asarray(c, dtype=xp.float64) for c in cols], axis=1)

    obs_parts = kernels.per_row(X, obs_block, ncols)
    var_parts = kernels.over_blocks(X, kernels.col_sums_and_nnz, 2 * m)
    obs_vals, var_vals = progress.compute(obs_parts, var_parts, label="qc metrics")

    obs = pd.DataFrame(index=adata.obs_names)
    obs["n_genes_by_counts"] = obs_vals[:, 0].astype(np.int64)
    if log1p:
        obs["log1p_n_genes_by_counts"] = np.log1p(obs["n_genes_by_counts"])
    total = obs_vals[:, 1].astype(np.float32)
    obs["total_counts"] = total
    if log1p:
        obs["log1p_total_counts"] = np.log1p(total)
    for j, t in enumerate(tops):
        obs[f"pct_counts_in_top_{t}_genes"] = obs_vals[:, 2 + j] * 100
    for j, q in enumerate(qc_vars):
        sub = obs_vals[:, 2 + len(tops) + j].astype(np.float32)
        obs[f"total_counts_{q}"] = sub
        if log1p:
            obs[f"log1p_total_counts_{q}"] = np.log1p(sub)
        with np.errstate(invalid="ignore", divide="ignore"):
            obs[f"pct_counts_{q}"] = sub / total * 100

    sums, nnz = var_vals[:m], var_vals[m:]
    var = pd.DataFrame(index=adata.var_names)
    var["n_cells_by_counts"] = nnz.astype(np.int64)
    var["mean_counts"] = sums / max(n, 1)
    if log1p:
        var["log1p_mean_counts"] = np.log1p(var["mean_counts"])
    var["pct_dropout_by_counts"] = (1 - var["n_cells_by_counts"] / max(n, 1)) * 100
    var["total_counts"] = sums.astype(np.float32)
    if log1p:
        var["log1p_total_counts"] = np.log1p(var["total_counts"])
    if not inplace:
        return obs, var
    for c in obs:
        adata.obs[c] = obs[c].to_numpy()
    for c in var:
        adata.var[c] = var[c].to_numpy()
    return None
