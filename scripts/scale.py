#!/usr/bin/env python
"""Stage script: see `python scripts/scale.py --help`; the work is in atlasflow.stages.scale."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import scale

if __name__ == "__main__":
    sys.exit(stage_main(scale, snakemake=globals().get("snakemake")))
