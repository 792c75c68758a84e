#!/usr/bin/env bash
# Download (here, with network) the Python 3.12 x86-64 wheels the GPU check needs and a bare GPU machine
# lacks, into .whl/ at the repository root; bench/gpu_check.sh installs them there without network.
#
# The lent H200 image already has numpy, scipy, h5py, scikit-learn, CuPy (cupy-cuda13x), cuda-bindings,
# cuda-core, nvidia-ml-py, pytest and the small pure-Python helpers (click, cloudpickle, fsspec, toolz,
# msgpack, psutil, pyyaml, jinja2, sortedcontainers, ...): see /work/.library/device/KINDS.md. Missing:
# Dask + distributed (pinned to what dask-cuda 26.10 expects), anndata, zarr, numcodecs, pandas < 3 (anndata
# 0.12 needs it), dask-cuda and RMM for CUDA 13 (so both presets are checked for real), igraph, leidenalg,
# umap-learn and pynndescent (the graph stages' CPU side; numba and scikit-learn are there), and small deps.
# Not carried: UCX (libucx alone is 43 MB), so the performance preset is checked over TCP there.
#
# Usage: bench/fetch_gpu_wheels.sh            (prints the bundle size; fails above MAX_MIB, default 55)
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_MIB="${MAX_MIB:-55}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi

WHEELS=(
    # Dask (dask-cuda 26.10 pins dask/distributed 2026.7.1 through rapids-dask-dependency)
    dask==2026.7.1 distributed==2026.7.1 partd==1.4.2 locket==1.0.0 tblib==3.2.2 tornado==6.6.1 zict==3.0.0
    # AnnData + Zarr
    anndata==0.12.19 array-api-compat==1.16.0 legacy-api-wrap==1.5 natsort==8.4.0 scverse-misc==0.0.3
    session-info2==0.4.1 zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
    # pandas as in CI (anndata 0.12 refuses pandas 3)
    pandas==2.3.3 pytz==2026.6 tzdata==2026.6
    # the GPU cluster presets: dask-cuda + RMM (CUDA 13, as the machine's CuPy)
    dask-cuda==26.10.0 rapids-dask-dependency==26.10.0 rmm-cu13==26.10.0 librmm-cu13==26.10.0 rapids-logger==0.3.0
    # the graph stages' CPU side (connectivities, and Leiden/UMAP where cuGraph/cuML are not carried)
    igraph==1.0.0 texttable==1.7.2 leidenalg==0.12.0 umap-learn==0.5.12 pynndescent==0.6.0
)

rm -rf .whl
mkdir -p .whl
grep -qxF '.whl/' .gitignore 2>/dev/null || echo '.whl/' >> .gitignore
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d .whl "${WHEELS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

n=$(ls .whl/*.whl | wc -l)
if [ "$n" -ne "${#WHEELS[@]}" ]; then
    echo "fetch_gpu_wheels: expected ${#WHEELS[@]} wheels, got $n (a version changed its name?)" >&2
    exit 1
fi
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "fetch_gpu_wheels: $n wheels, ${mib} MiB in .whl/ (limit ${MAX_MIB} MiB; the travelling tree must stay < 64 MiB)"
if [ "$mib" -gt "$MAX_MIB" ]; then
    echo "fetch_gpu_wheels: the wheels take ${mib} MiB, more than ${MAX_MIB} MiB" >&2
    exit 1
fi
