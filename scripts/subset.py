#!/usr/bin/env python
"""Stage script: see `python scripts/subset.py --help`; the work is in atlasflow.stages.subset."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import subset

if __name__ == "__main__":
    sys.exit(stage_main(subset, snakemake=globals().get("snakemake")))
