#!/usr/bin/env python
"""Stage script: see `python scripts/log1p.py --help`; the work is in atlasflow.stages.log1p."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import log1p

if __name__ == "__main__":
    sys.exit(stage_main(log1p, snakemake=globals().get("snakemake")))
