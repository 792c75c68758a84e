#!/usr/bin/env python
"""Stage script: see `python scripts/simulate.py --help`; the work is in atlasflow.stages.simulate."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import simulate

if __name__ == "__main__":
    sys.exit(stage_main(simulate, snakemake=globals().get("snakemake")))
