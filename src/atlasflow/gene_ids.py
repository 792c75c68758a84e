"""What gene names look like: Ensembl gene ids and ERCC spike-ins, recognised wherever names are read."""

from __future__ import annotations

import re

import pandas as pd

#: An Ensembl gene id of any species (ENSG human, ENSMUSG mouse, ...), with an optional version suffix.
ENSEMBL_ID = re.compile(r"^ENS([A-Z]*)G\d{6,}(\.\d+)?$")
#: An ERCC spike-in (ERCC-00002 ...), as 10x, CEL-seq2 and Smart-seq2 references name them.
ERCC_ID = re.compile(r"^ERCC-\d{5}$")


def id_fraction(names) -> float:
    """Fraction of ``names`` that are Ensembl gene ids or ERCC spike-ins."""
    names = pd.Index(names).astype(str)
    if not len(names):
        return 0.0
    return float((names.str.match(ENSEMBL_ID.pattern) | names.str.match(ERCC_ID.pattern)).mean())


def ensembl_species(names) -> str | None:
    """The species prefix most ids carry ("" for human ENSG, "MUS" for mouse ENSMUSG), None without ids."""
    prefixes = pd.Index(names).astype(str).str.extract(ENSEMBL_ID.pattern)[0].dropna()
    return None if prefixes.empty else str(prefixes.value_counts().index[0])


def is_ercc(names) -> pd.Index:
    """Boolean mask of ERCC spike-ins among ``names``."""
    return pd.Index(names).astype(str).str.match(ERCC_ID.pattern)
