#!/bin/bash
# Memory of the shared cluster's processes after each early stage (see results/jit_warm.md).
# usage: bench/shared_cluster_memory.sh TAG   (stores under $MEM_DIR, default /tmp/mem; delete src/atlasflow/__pycache__/*.nb? for a cold cache)
set -e
cd "$(dirname "$0")/.."; PY=.venv/bin/python; D=${MEM_DIR:-/tmp/mem}; mkdir -p "$D"; T=$1; SF=$D/sched_$T.json
rss() { # MiB of every distributed process on the machine (run alone)
   ps -eo rss,args | grep -E "distributed.cli|multiprocessing" | grep -v grep | awk '{s+=$1; printf "%d ", $1/1024} END {printf "= %d", s/1024}'; echo; }
.venv/bin/atlasflow cluster start --scheduler-file $SF --n-workers 2 --memory-limit 1.5GB >$D/cl_$T.log 2>&1 &
sleep 25; echo "start: $(rss)"
[ -e $D/raw.zarr ] || $PY scripts/simulate.py --output $D/raw.zarr --n-cells 20000 --n-genes 20000 --chunk-rows 5000 --scheduler-file $SF >/dev/null 2>&1
echo "simulate: $(rss)"
$PY scripts/qc.py --input $D/raw.zarr --output $D/qc_$T.zarr --scheduler-file $SF --gene-sets '{"mt": {"prefix": "MT-"}}' --percent-top 50 100 200 500 >/dev/null 2>&1; echo "qc: $(rss)"
$PY scripts/filter.py --input $D/qc_$T.zarr --output $D/filter_$T.zarr --scheduler-file $SF >/dev/null 2>&1; echo "filter: $(rss)"
$PY scripts/normalize.py --input $D/filter_$T.zarr --output $D/norm_$T.zarr --scheduler-file $SF >/dev/null 2>&1; echo "normalize: $(rss)"
$PY scripts/log1p.py --input $D/norm_$T.zarr --output $D/log_$T.zarr --scheduler-file $SF >/dev/null 2>&1; echo "log1p: $(rss)"
$PY scripts/hvg.py --input $D/log_$T.zarr --output $D/hvg_$T.zarr --scheduler-file $SF >/dev/null 2>&1; echo "hvg: $(rss)"
.venv/bin/atlasflow cluster stop --scheduler-file $SF >/dev/null 2>&1 || true
sleep 3
