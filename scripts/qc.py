#!/usr/bin/env python
"""Stage script: see `python scripts/qc.py --help`; the work is in atlasflow.stages.qc."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import qc

if __name__ == "__main__":
    sys.exit(stage_main(qc, snakemake=globals().get("snakemake")))
