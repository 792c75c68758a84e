#!/usr/bin/env python
"""Stage script: see `python scripts/normalize.py --help`; the work is in atlasflow.stages.normalize."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import normalize

if __name__ == "__main__":
    sys.exit(stage_main(normalize, snakemake=globals().get("snakemake")))
