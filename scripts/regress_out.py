#!/usr/bin/env python
"""Stage script: see `python scripts/regress_out.py --help`; the work is in atlasflow.stages.regress_out."""

import sys

from atlasflow.cli import stage_main
from atlasflow.stages import regress_out

if __name__ == "__main__":
    sys.exit(stage_main(regress_out, snakemake=globals().get("snakemake")))
