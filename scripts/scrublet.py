#!/usr/bin/env python
"""Stage script: see `python scripts/scrublet.py --help`; the work is in atlasflow.stages.scrublet."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import scrublet

if __name__ == "__main__":
    sys.exit(stage_main(scrublet, snakemake=globals().get("snakemake")))
