#!/usr/bin/env bash
# Run by Snakemake inside the new envs/cpu.yaml environment: install atlasflow from this checkout.
# Snakemake copies this script under .snakemake/conda/, so the checkout is found through ATLASFLOW_ROOT,
# which workflow/rules/common.smk sets to the repository holding the Snakefile.
set -euo pipefail
root="${ATLASFLOW_ROOT:-$PWD}"
if [ ! -f "$root/pyproject.toml" ] || ! grep -q '^name = "atlasflow"' "$root/pyproject.toml"; then
    echo "cpu.post-deploy.sh: $root is not the atlasflow checkout; set ATLASFLOW_ROOT" >&2
    exit 1
fi
# conda already installed the dependencies: no resolver run, no download of build tools
python -m pip install --no-deps --no-build-isolation -e "$root"
