"""The smoke version of the whole-pipeline benchmark: it runs every mode and writes its table and plot.

Timings are not checked (benchmarks are not timed tests); what is checked is that the staged Snakemake
run, the fused run and scanpy each completed every step, scanpy with Dask every step it supports (the
others are listed with the reason), and that the report says so.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def test_workdir_of_a_user_is_refused_and_kept(tmp_path):
    """The benchmarks delete their --workdir whole before a run: a folder that holds files and no benchmark
    mark (a user's folder given by mistake) is refused and left as it was; a new, empty or marked folder is
    emptied and marked."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_foundation import MARK, fresh_workdir

    user = tmp_path / "analysis"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not a benchmark's scratch folder"):
        fresh_workdir(user)
    assert (user / "notes.txt").read_text() == "mine"
    for path in (tmp_path / "new" / "1000", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert sorted(p.name for p in fresh_workdir(path).iterdir()) == [MARK]
    (tmp_path / "empty" / "old.zarr").mkdir()
    assert sorted(p.name for p in fresh_workdir(tmp_path / "empty").iterdir()) == [MARK]  # marked: emptied


def test_ab_compares_two_stores_in_slices(tmp_path):
    """bench_ab's output comparison reads the stores in slices (two 1M-cell outputs read whole ran the
    machine out of memory) and still names the element that differs, NaN equal to NaN."""
    import anndata as ad
    import numpy as np
    import scipy.sparse as sp
    import zarr

    sys.path.insert(0, str(ROOT / "bench"))
    from bench_ab import same_store

    x = sp.random(300, 40, density=0.2, format="csr", random_state=0, dtype=np.float32)
    a = ad.AnnData(x, obs={"score": np.r_[np.nan, np.arange(299.0)]}, uns={"v": np.arange(5)})
    for name in ("a.zarr", "b.zarr"):
        a.write_zarr(tmp_path / name)
    assert same_store(tmp_path / "a.zarr", tmp_path / "b.zarr", step_bytes=256) == "identical"
    data = zarr.open_array(tmp_path / "b.zarr" / "X" / "data", mode="r+")
    data[data.shape[0] - 1] = data[data.shape[0] - 1] + 1
    assert same_store(tmp_path / "a.zarr", tmp_path / "b.zarr", step_bytes=256).startswith("/X/data differs (in rows")
    ad.AnnData(x, obs={"score": np.arange(300.0)}, uns={"v": np.arange(5)}).write_zarr(tmp_path / "c.zarr")
    verdict = same_store(tmp_path / "a.zarr", tmp_path / "c.zarr", step_bytes=256)
    assert verdict == "/obs/score differs (in rows 0..31)"  # 256 bytes: 32 float64 rows a slice


@pytest.mark.slow
@pytest.mark.workflow
def test_pipeline_bench_smoke_runs_every_mode_and_writes_its_report(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from bench_pipeline import STEPS

    results = tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_pipeline.py"), "--smoke", "--results", str(results),
         "--workdir", str(tmp_path / "work")],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((results / "pipeline_smoke.json").read_text())
    run = data["sizes"]["2000"]
    for mode in ("staged", "fused", "scanpy"):
        assert set(STEPS) <= set(run[mode]["steps"]), (mode, sorted(run[mode]["steps"]))
        assert run[mode]["peak"] > 50 * 2**20, mode  # at least a Python process was sampled
    dask_steps = set(STEPS) - {"markers_ttest", "markers_wilcoxon"}  # scanpy 1.11 ranks genes in memory only
    assert dask_steps <= set(run["scanpy_dask"]["steps"]), sorted(run["scanpy_dask"]["steps"])
    assert set(run["scanpy_dask"].get("skipped", {})) | set(run["scanpy_dask"]["steps"]) >= set(STEPS)
    staged = run["staged"]["steps"]
    assert all(staged[s]["seconds"] > 0 and staged[s]["peak"] > 0 for s in STEPS)  # each job was seen running
    assert staged["qc"]["io"][0] > 0 and staged["markers_wilcoxon"]["io"][1] > 0  # read X; wrote the copy
    table = (results / "pipeline_smoke.md").read_text()
    assert all(f"| {s} |" in table for s in STEPS) and "| **all steps** |" in table
    assert (results / "pipeline_smoke.png").stat().st_size > 10_000
    assert not (tmp_path / "work" / "2000").exists()  # stores removed without --keep
