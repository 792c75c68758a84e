"""QC gene sets on data named by gene id (Ensembl), ERCC spike-ins: the same genes whichever names var holds.

Oracles: on pbmc3k, the genes the shipped config selects by symbol (scanpy's tutorial rules, or the shipped
lists by symbol) against what it selects when var holds only the Ensembl ids; on a real CEL-seq2 plate
(ids only, with ERCC spike-ins), scanpy's calculate_qc_metrics with the same masks.
"""

from __future__ import annotations

import gzip
import logging
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import yaml

from atlasflow import pp
from atlasflow.cli import stage_main
from atlasflow.stages import ingest
from atlasflow.stages import qc as qc_stage

ROOT = Path(__file__).resolve().parents[1]
MIXOLOGY = ROOT.parent / "shared" / "data" / "mixology_5cl"


def shipped_gene_sets() -> dict:
    """qc.gene_sets of config/config.yaml, files resolved in the repository (as the Snakefile does)."""
    sets = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())["qc"]["gene_sets"]

    def resolved(spec):
        return {k: (str(ROOT / v) if k.endswith("_file") else resolved(v) if k == "mouse" else v)
                for k, v in spec.items()}

    return {name: resolved(spec) for name, spec in sets.items()}


def list_genes(name: str) -> pd.DataFrame:
    """(symbol, gene_id) rows of a shipped gene list."""
    rows = [line.split() for line in (ROOT / "resources" / "gene_lists" / name).read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    return pd.DataFrame(rows, columns=["symbol", "gene_id"])


@pytest.fixture(scope="module")
def pbmc3k_var(pbmc3k_dir) -> pd.DataFrame:
    with gzip.open(pbmc3k_dir / "features.tsv.gz", "rt") as fh:
        table = pd.read_csv(fh, sep="\t", header=None, dtype=str)
    return pd.DataFrame({"gene_ids": table[0].to_numpy(), "gene_symbols": table[1].to_numpy()},
                        index=ad.utils.make_index_unique(pd.Index(table[1])))


def test_same_genes_by_symbol_or_by_id_on_pbmc3k(pbmc3k_var, caplog):
    sets = shipped_gene_sets()
    by_symbol = pp.gene_set_masks(pbmc3k_var, sets)
    # scanpy's tutorial rules on the symbols
    symbols = pbmc3k_var["gene_symbols"]
    np.testing.assert_array_equal(by_symbol["mt"], symbols.str.startswith("MT-"))
    np.testing.assert_array_equal(by_symbol["ribo"], symbols.str.startswith(("RPS", "RPL")))
    assert by_symbol["mt"].sum() == 13
    # the same data named by id only: the lists' ids select the genes the lists' symbols select
    ids_only = pd.DataFrame({"gene_ids": pbmc3k_var["gene_ids"].to_numpy(),
                             "gene_symbols": pbmc3k_var["gene_ids"].to_numpy()},
                            index=pbmc3k_var["gene_ids"].to_numpy())
    with caplog.at_level(logging.INFO, logger="atlasflow.pp.qc"):
        by_id = pp.gene_set_masks(ids_only, sets)
    assert "var holds gene ids, not symbols" in caplog.text
    by_list = pp.gene_set_masks(pbmc3k_var, {n: {"genes_file": s["ids_file"]} for n, s in sets.items()})
    for name in ("mt", "hb"):
        np.testing.assert_array_equal(by_id[name], by_list[name], err_msg=name)
    np.testing.assert_array_equal(by_id["mt"], by_symbol["mt"])  # every MT- gene of the reference has its id
    # ids change between Ensembl releases: pbmc3k's reference (Ensembl 84) still names RPS17 and RPS4Y2 by ids
    # that Ensembl 2022 (the lists' source) retired, so by id the set misses those two and nothing else
    assert not (by_id["ribo"] & ~by_list["ribo"]).any()
    missed = pbmc3k_var.loc[by_list["ribo"] & ~by_id["ribo"], "gene_symbols"]
    assert sorted(missed) == ["RPS17", "RPS4Y2"], list(missed)
    assert "ercc" not in by_id  # no spike-ins in 10x data


def test_ercc_spike_ins_form_their_own_set(caplog):
    var = pd.DataFrame({"gene_symbols": ["MT-ND1", "ACTB", "ERCC-00002", "ERCC-00130", "ERCCX"]},
                       index=["a", "b", "c", "d", "e"])
    masks = pp.gene_set_masks(var, {"mt": {"prefix": "MT-"}})
    np.testing.assert_array_equal(masks["ercc"], [False, False, True, True, False])
    own = pp.gene_set_masks(var, {"ercc": {"prefix": "ERCC-00002"}})  # a configured set named ercc wins
    np.testing.assert_array_equal(own["ercc"], [False, False, True, False, False])


def test_mouse_ids_with_human_lists_only_warn_with_the_fix(caplog):
    var = pd.DataFrame({"gene_ids": [f"ENSMUSG{i:011d}" for i in range(50)]})
    var["gene_symbols"] = var["gene_ids"]
    human_only = {n: {k: v for k, v in s.items() if k != "mouse"} for n, s in shipped_gene_sets().items()}
    with caplog.at_level(logging.WARNING, logger="atlasflow.pp.qc"):
        masks = pp.gene_set_masks(var, human_only)
    assert not masks["mt"].any()
    assert "matches no gene" in caplog.text and "var looks mouse: give the set a mouse spec" in caplog.text


@pytest.fixture(scope="module")
def mouse_var() -> pd.DataFrame:
    """A mouse var (MGI symbols, Ensembl ids): the genes of the three mouse lists among genes the prefix and
    regex rules must tell apart from them (kinases Rps6ka1/Rps6kb1, Hbegf, Hbp1, Hbs1l, a human-case MT-ND1)."""
    genes = pd.concat([list_genes(f"mouse_{n}.txt") for n in ("mito", "ribo", "hb")], ignore_index=True)
    others = pd.DataFrame({"symbol": ["Xkr4", "Gm26206", "Actb", "Rps6ka1", "Rps6kb1", "Mrpl15", "Hbegf", "Hbp1",
                                      "Hbs1l", "4933401J01Rik"],
                           "gene_id": [f"ENSMUSG{90_000_000_000 + i:011d}" for i in range(10)]})
    genes = pd.concat([others.iloc[:5], genes, others.iloc[5:]], ignore_index=True)
    return pd.DataFrame({"gene_ids": genes["gene_id"].to_numpy(), "gene_symbols": genes["symbol"].to_numpy()},
                        index=genes["symbol"].to_numpy())


def test_mouse_data_gets_the_mouse_rules_by_symbol_and_by_id(mouse_var, caplog):
    sets = shipped_gene_sets()
    symbols = mouse_var["gene_symbols"]
    with caplog.at_level(logging.INFO, logger="atlasflow.pp.qc"):
        by_symbol = pp.gene_set_masks(mouse_var, sets)
    assert "var looks mouse (Ensembl ids ENSMUSG)" in caplog.text
    np.testing.assert_array_equal(by_symbol["mt"], symbols.str.startswith("mt-"))
    np.testing.assert_array_equal(by_symbol["ribo"], symbols.str.startswith(("Rps", "Rpl")))
    in_list = {n: symbols.isin(list_genes(f"mouse_{n}.txt")["symbol"]).to_numpy() for n in ("mito", "ribo", "hb")}
    np.testing.assert_array_equal(by_symbol["hb"], in_list["hb"])  # the regex leaves out Hbegf, Hbp1, Hbs1l
    assert by_symbol["mt"].sum() == 37 and by_symbol["hb"].sum() == 10
    # symbols only (no ids): recognised as mouse by their case
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="atlasflow.pp.qc"):
        no_ids = pp.gene_set_masks(mouse_var.drop(columns="gene_ids"), sets)
    assert "var looks mouse (" in caplog.text and "of symbols not upper case" in caplog.text
    for name in ("mt", "ribo", "hb"):
        np.testing.assert_array_equal(no_ids[name], by_symbol[name], err_msg=name)
    # ids only: the mouse lists' ids select exactly the lists' genes
    ids_only = pd.DataFrame({"gene_ids": mouse_var["gene_ids"].to_numpy(),
                             "gene_symbols": mouse_var["gene_ids"].to_numpy()}, index=mouse_var["gene_ids"].to_numpy())
    by_id = pp.gene_set_masks(ids_only, sets)
    for name, file in (("mt", "mito"), ("ribo", "ribo"), ("hb", "hb")):
        np.testing.assert_array_equal(by_id[name], in_list[file], err_msg=name)
    # the human rules, when asked for, do not fit mouse symbols
    forced = pp.gene_set_masks(mouse_var.drop(columns="gene_ids"), sets, species="human")
    assert not forced["mt"].any()


def test_species_is_detected_from_ids_first_then_symbol_case():
    from atlasflow.pp.qc import detect_species

    def species(**columns):
        var = pd.DataFrame(columns)
        symbols = pd.Index(var["gene_symbols"] if "gene_symbols" in var else var.index).astype(str)
        return detect_species(var, symbols)[0]

    assert species(gene_symbols=["MT-ND1", "ACTB", "AL627309.1", "RP11-34P13.3"]) == "human"
    assert species(gene_symbols=["mt-Nd1", "Actb", "Gm26206", "4933401J01Rik"]) == "mouse"
    # ids decide over symbols: human ids with a few odd symbols, mouse ids with upper-case symbols
    assert species(gene_ids=["ENSG00000198888", "ENSG00000075624"], gene_symbols=["Mt-nd1", "Actb"]) == "human"
    assert species(gene_ids=["ENSMUSG00000064341", "ENSMUSG00000029580"], gene_symbols=["MT-ND1", "ACTB"]) == "mouse"
    with pytest.raises(Exception, match="qc.species"):
        pp.gene_set_masks(pd.DataFrame(index=["a"]), {}, species="rat")


@pytest.mark.skipif(not MIXOLOGY.is_dir(), reason="needs ../shared/data/mixology_5cl beside the repository")
def test_qc_stage_on_a_plate_named_by_id_equals_scanpy(tmp_path, capsys):
    sc = pytest.importorskip("scanpy")
    import json

    plate = MIXOLOGY / "sc_celseq2_5cl_p1.count.csv.gz"
    raw = tmp_path / "ingest.zarr"
    ingest.ingest(plate, raw)
    out = tmp_path / "qc.zarr"
    argv = ["--input", raw, "--output", out, "--gene-sets", json.dumps(shipped_gene_sets())]
    assert stage_main(qc_stage, argv=[str(a) for a in argv]) == 0
    assert "var holds gene ids, not symbols" in capsys.readouterr().err
    ours = ad.read_zarr(out)
    assert int(ours.var["mt"].sum()) == 13 and int(ours.var["ercc"].sum()) == 34  # the README's 34 ERCC rows
    ref = ad.read_zarr(raw)
    ref.X = ref.X.toarray()
    for name in ("mt", "ribo", "hb", "ercc"):
        ref.var[name] = ours.var[name].to_numpy()
    sc.pp.calculate_qc_metrics(ref, qc_vars=["mt", "ribo", "hb", "ercc"], percent_top=[50, 100, 200, 500],
                               inplace=True)
    for col in ("pct_counts_mt", "pct_counts_ercc", "pct_counts_ribo", "total_counts", "n_genes_by_counts"):
        np.testing.assert_allclose(ours.obs[col].to_numpy(float), ref.obs[col].to_numpy(float), rtol=1e-6,
                                   err_msg=col)
    assert (ours.obs["pct_counts_mt"] > 0).all()  # every well has mitochondrial reads: found by id


@pytest.mark.skipif(not MIXOLOGY.is_dir(), reason="needs ../shared/data/mixology_5cl beside the repository")
def test_spike_ins_stay_out_of_totals_and_hvg_and_in_the_counts(tmp_path):
    """On a real plate with 34 ERCC spike-ins: normalize leaves them out of the cell totals (oracle: the totals
    over the other genes), hvg selects among the other genes exactly as scanpy on that subset, and the
    counts keep every gene."""
    import json

    sc = pytest.importorskip("scanpy")
    from atlasflow.stages import hvg as hvg_stage
    from atlasflow.stages import log1p as log1p_stage
    from atlasflow.stages import normalize as normalize_stage

    def run(stage, *argv):
        assert stage_main(stage, argv=[str(a) for a in argv]) == 0

    raw = tmp_path / "ingest.zarr"
    ingest.ingest(MIXOLOGY / "sc_celseq2_5cl_p1.count.csv.gz", raw)
    run(qc_stage, "--input", raw, "--output", tmp_path / "qc.zarr", "--gene-sets", json.dumps(shipped_gene_sets()))
    run(normalize_stage, "--input", tmp_path / "qc.zarr", "--output", tmp_path / "norm.zarr", "--target-sum", 10000)
    run(log1p_stage, "--input", tmp_path / "norm.zarr", "--output", tmp_path / "log1p.zarr")
    run(hvg_stage, "--input", tmp_path / "log1p.zarr", "--output", tmp_path / "hvg.zarr", "--n-top-genes", 500)
    counts = ad.read_zarr(tmp_path / "qc.zarr")
    ercc = counts.var["ercc"].to_numpy(bool)
    assert ercc.sum() == 34 and counts.shape[1] == 15564  # the counts keep every gene, spike-ins included
    x = counts.X.toarray().astype(np.float64)
    totals = x[:, ~ercc].sum(axis=1, keepdims=True)
    assert (x[:, ercc].sum(axis=1) > 0).all()  # the spike-ins would have moved every total
    norm = ad.read_zarr(tmp_path / "norm.zarr")
    np.testing.assert_allclose(norm.X.toarray(), x / totals * 1e4, rtol=2e-6)
    assert json.loads((tmp_path / "norm.json").read_text())["genes_excluded_from_totals"] == 34
    ours = ad.read_zarr(tmp_path / "hvg.zarr").var
    ref = ad.read_zarr(tmp_path / "log1p.zarr")[:, ~ercc].copy()
    sc.pp.highly_variable_genes(ref, n_top_genes=500, flavor="seurat")
    assert not ours["highly_variable"][ercc].any() and ours["means"][ercc].isna().all()
    np.testing.assert_array_equal(ours["highly_variable"][~ercc].to_numpy(), ref.var["highly_variable"].to_numpy())
    np.testing.assert_allclose(ours["dispersions_norm"][~ercc].to_numpy(float),
                               ref.var["dispersions_norm"].to_numpy(float), rtol=1e-5)
    assert int(ours["highly_variable"].sum()) == 500
