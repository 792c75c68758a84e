#!/usr/bin/env python
"""Stage script: see `python scripts/ingest.py --help`; the work is in atlasflow.stages.ingest."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import ingest

if __name__ == "__main__":
    sys.exit(stage_main(ingest, snakemake=globals().get("snakemake")))
