#!/usr/bin/env python
"""Stage script: see `python scripts/score_genes.py --help`; the work is in atlasflow.stages.score_genes."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import score_genes

if __name__ == "__main__":
    sys.exit(stage_main(score_genes, snakemake=globals().get("snakemake")))
