#!/usr/bin/env python
"""Stage script: see `python scripts/rank_genes_groups.py --help`; the work is in atlasflow.stages.rank_genes_groups."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import rank_genes_groups

if __name__ == "__main__":
    sys.exit(stage_main(rank_genes_groups, snakemake=globals().get("snakemake")))
