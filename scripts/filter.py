#!/usr/bin/env python
"""Stage script: see `python scripts/filter.py --help`; the work is in atlasflow.stages.filter."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import filter

if __name__ == "__main__":
    sys.exit(stage_main(filter, snakemake=globals().get("snakemake")))
