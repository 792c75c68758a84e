#!/usr/bin/env python
"""Stage script: see `python scripts/leiden.py --help`; the work is in atlasflow.stages.leiden."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import leiden

if __name__ == "__main__":
    sys.exit(stage_main(leiden, snakemake=globals().get("snakemake")))
