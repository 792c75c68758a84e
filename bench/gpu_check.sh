#!/usr/bin/env bash
# The whole GPU check in one short run on a machine with GPUs and no network (see bench/README.md):
# install the wheels carried in .whl/ (bench/fetch_gpu_wheels.sh), print the GPU, run tests/gpu, run the
# GPU vs CPU benchmark. Writes into OUTDIR (at most 7 files):
#   env.txt (nvidia-smi, versions), tests.log, junit.xml, bench.log, bench.md, bench.json, summary.md
# Time: at most ~7.5 min (install ~15 s, tests <= TEST_TIMEOUT, benchmark <= BENCH_TIMEOUT); typically less.
#
# Usage: bench/gpu_check.sh OUTDIR [N_CELLS]      (N_CELLS of the GPU-only benchmark run, default 1000000)
set -uo pipefail
OUTDIR="${1:?usage: bench/gpu_check.sh OUTDIR [N_CELLS]}"
CELLS="${2:-1000000}"
TEST_TIMEOUT="${TEST_TIMEOUT:-220}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-200}"
cd "$(dirname "$0")/.."
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
t0=$(date +%s)

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: installing .whl/ failed" | tee "$OUTDIR/summary.md"; exit 1; }
    export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "gpu_check: no .whl/ (run bench/fetch_gpu_wheels.sh where there is network); using installed packages"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    echo "## nvidia-smi"; nvidia-smi 2>&1 || echo "(nvidia-smi failed)"
    echo "## versions"
    "$PY" - <<'EOF' 2>&1
import importlib, platform
print("python", platform.python_version())
for name in ["numpy", "scipy", "pandas", "cupy", "dask", "distributed", "anndata", "zarr", "numcodecs", "sklearn",
             "dask_cuda", "rmm", "cuml", "cugraph", "distributed_ucxx", "atlasflow"]:
    try:
        m = importlib.import_module(name)
        print(f"{name:18s} {getattr(m, '__version__', '?')}  {getattr(m, '__file__', '')}")
    except Exception as exc:  # noqa: BLE001
        print(f"{name:18s} -  ({type(exc).__name__}: {str(exc)[:100]})")
try:
    import cupy
    n = cupy.cuda.runtime.getDeviceCount()
    print("CUDA devices:", n, [cupy.cuda.runtime.getDeviceProperties(i)["name"] for i in range(n)])
    print("CUDA runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
except Exception as exc:  # noqa: BLE001
    print("CuPy/CUDA:", type(exc).__name__, exc)
EOF
} > "$OUTDIR/env.txt" 2>&1
cat "$OUTDIR/env.txt"

echo "## tests/gpu (timeout ${TEST_TIMEOUT}s)"
# the preprocessing chain first (if the time runs out, the stages after PCA are what is lost); a hung test
# is stopped after 120 s where pytest-timeout is installed (the H200 image has it); one process, in order
# (-o addopts= drops pyproject's pytest-xdist options: the carried wheels have no xdist)
per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest tests/gpu/test_cupy_api.py tests/gpu/test_gpu_stages.py tests/gpu/test_gpu_graph_markers.py \
    -o addopts= -v -rfEs --tb=short --durations=12 -p no:cacheprovider "${per_test[@]}" \
    -W ignore::FutureWarning -W ignore::DeprecationWarning -o faulthandler_timeout=150 \
    --junitxml="$OUTDIR/junit.xml" 2>&1 | tee "$OUTDIR/tests.log"
test_rc=${PIPESTATUS[0]}
t1=$(date +%s)

echo "## benchmark (timeout ${BENCH_TIMEOUT}s)"
timeout -k 10 "$BENCH_TIMEOUT" "$PY" bench/gpu_bench.py --cells "$CELLS" --outdir "$OUTDIR" \
    --budget-s $((BENCH_TIMEOUT - 50)) 2>&1 | tee "$OUTDIR/bench.log"
bench_rc=${PIPESTATUS[0]}
t2=$(date +%s)

{
    echo "# GPU check $(date '+%Y-%m-%d %H:%M')"
    echo
    echo "- tests/gpu: exit $test_rc ($((t1 - t0)) s, install included): $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUTDIR/tests.log" | tail -1)"
    echo "- benchmark: exit $bench_rc ($((t2 - t1)) s)$([ "$bench_rc" = 124 ] && echo ': stopped at its time limit; bench.md holds what it measured')"
    echo "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | paste -sd ';')"
    echo
    [ -f "$OUTDIR/bench.md" ] && cat "$OUTDIR/bench.md"
} > "$OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
[ "$test_rc" = 0 ] && [ "$bench_rc" = 0 ]
