#!/usr/bin/env python
"""Stage script: see `python scripts/aggregate.py --help`; the work is in atlasflow.stages.aggregate."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import aggregate

if __name__ == "__main__":
    sys.exit(stage_main(aggregate, snakemake=globals().get("snakemake")))
