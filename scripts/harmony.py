#!/usr/bin/env python
"""Stage script: see `python scripts/harmony.py --help`; the work is in atlasflow.stages.harmony."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import harmony

if __name__ == "__main__":
    sys.exit(stage_main(harmony, snakemake=globals().get("snakemake")))
