#!/usr/bin/env python
"""Stage script: see `python scripts/umap.py --help`; the work is in atlasflow.stages.umap."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import umap

if __name__ == "__main__":
    sys.exit(stage_main(umap, snakemake=globals().get("snakemake")))
