#!/usr/bin/env python
"""Stage script: see `python scripts/neighbors.py --help`; the work is in atlasflow.stages.neighbors."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import neighbors

if __name__ == "__main__":
    sys.exit(stage_main(neighbors, snakemake=globals().get("snakemake")))
