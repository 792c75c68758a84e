#!/usr/bin/env python
"""Stage script: see `python scripts/pca.py --help`; the work is in atlasflow.stages.pca."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import pca

if __name__ == "__main__":
    sys.exit(stage_main(pca, snakemake=globals().get("snakemake")))
