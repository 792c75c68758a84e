#!/usr/bin/env python
"""Stage script: see `python scripts/hvg.py --help`; the work is in atlasflow.stages.hvg."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import hvg

if __name__ == "__main__":
    sys.exit(stage_main(hvg, snakemake=globals().get("snakemake")))
