#!/usr/bin/env python
"""Stage script: see `python scripts/plots.py --help`; the work is in atlasflow.stages.plots."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import plots

if __name__ == "__main__":
    sys.exit(stage_main(plots, snakemake=globals().get("snakemake")))
