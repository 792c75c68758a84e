#!/usr/bin/env python
"""Stage script: see `python scripts/final.py --help`; the work is in atlasflow.stages.final."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import final

if __name__ == "__main__":
    sys.exit(stage_main(final, snakemake=globals().get("snakemake")))
