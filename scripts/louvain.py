#!/usr/bin/env python
"""Stage script: see `python scripts/louvain.py --help`; the work is in atlasflow.stages.louvain."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import louvain

if __name__ == "__main__":
    sys.exit(stage_main(louvain, snakemake=globals().get("snakemake")))
