"""A store written under one scverse stack opens and extends under the other (anndata 0.12 <-> 0.13), and both
write the same on-disk layout (issue #23).

The other stack is a second virtualenv with atlasflow installed from this checkout; ``.ci/run`` builds one and
names its interpreter in ``ATLASFLOW_OTHER_PYTHON``. Stages run as the user runs them (the ``atlasflow`` CLI of
each environment), alternating between the two stacks along one pipeline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scipy.sparse as sp

OTHER = os.environ.get("ATLASFLOW_OTHER_PYTHON")
pytestmark = pytest.mark.skipif(
    not OTHER, reason="needs a second stack: set ATLASFLOW_OTHER_PYTHON to its python (.ci/run does)")

VERSIONS = "from importlib.metadata import version as v; print(v('anndata'), v('zarr'), v('pandas'))"


def _versions(python: str) -> str:
    return subprocess.run([python, "-c", VERSIONS], check=True, text=True, capture_output=True).stdout.strip()


def _stage(python: str, stage: str, *args) -> None:
    cli = Path(python).parent / "atlasflow"
    proc = subprocess.run([str(cli), stage, "--n-workers", "1", *map(str, args)], text=True, capture_output=True)
    assert proc.returncode == 0, f"{stage} under {python} failed:\n{proc.stderr[-3000:]}"


def _read_back(python: str, store: Path) -> dict:
    """anndata.read_zarr of a whole store in the given stack: shape, X checksum, obs/var columns, uns keys."""
    code = ("import sys, json, anndata as ad, numpy as np, scipy.sparse as sp\n"
            "a = ad.read_zarr(sys.argv[1]); x = a.X.toarray() if sp.issparse(a.X) else np.asarray(a.X)\n"
            "print(json.dumps({'shape': list(a.shape), 'x_sum': float(x.astype(np.float64).sum()),"
            " 'obs': sorted(map(str, a.obs.columns)), 'var': sorted(map(str, a.var.columns)),"
            " 'layers': sorted(str(k) for k in a.layers.keys() if k is not None),"  # 0.13 lists X as layers[None]
            " 'uns': sorted(a.uns.keys())}))")
    out = subprocess.run([python, "-c", code, str(store)], text=True, capture_output=True)
    assert out.returncode == 0, f"read_zarr of {store.name} under {python} failed:\n{out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _layout(store: Path) -> dict:
    """Every file of a store and, for each array, the metadata that fixes its bytes on disk (codecs, chunks,
    dtype, shape), without attribute values (versions, bookkeeping) that may differ between writers."""
    out = {}
    for p in sorted(store.rglob("*")):
        if not p.is_file():
            continue
        rel = str(p.relative_to(store))
        if p.name == "zarr.json":
            meta = json.loads(p.read_text())
            out[rel] = {k: meta.get(k) for k in ("node_type", "shape", "data_type", "chunk_grid", "codecs",
                                                  "fill_value", "chunk_key_encoding")}
            out[rel]["encoding"] = {k: (meta.get("attributes") or {}).get(k)
                                    for k in ("encoding-type", "encoding-version")}
        else:
            out[rel] = "chunk"
    return out


@pytest.fixture(scope="module")
def stacks():
    this, other = sys.executable, OTHER
    assert _versions(this) != _versions(other), "ATLASFLOW_OTHER_PYTHON is the same stack as this one"
    return this, other


def test_stores_move_between_stacks_in_both_directions(stacks, tmp_path):
    this, other = stacks
    raw = tmp_path / "raw.zarr"
    _stage(other, "simulate", "--output", raw, "--n-cells", 900, "--n-genes", 600, "--chunk-rows", 300,
           "--seed", 3)
    # qc by each stack from the same input: the same files, codecs and chunking either way
    _stage(other, "qc", "--input", raw, "--output", tmp_path / "qc_other.zarr")
    _stage(this, "qc", "--input", raw, "--output", tmp_path / "qc.zarr")
    assert _layout(tmp_path / "qc.zarr") == _layout(tmp_path / "qc_other.zarr")
    a, b = ad.read_zarr(tmp_path / "qc.zarr"), ad.read_zarr(tmp_path / "qc_other.zarr")
    assert (a.X != b.X).nnz == 0
    for frame in ("obs", "var"):
        left, right = getattr(a, frame), getattr(b, frame)
        assert list(left.columns) == list(right.columns) and list(left.index) == list(right.index)
        for col in left.columns:
            np.testing.assert_array_equal(np.asarray(left[col]), np.asarray(right[col]), err_msg=col)

    # this stack extends the other's store, the other extends this one's, and so on down the pipeline
    steps = [(this, "filter", "qc.zarr", "filter.zarr", ["--min-genes", 5, "--min-cells", 3]),
             (other, "normalize", "filter.zarr", "normalize.zarr", []),
             (this, "log1p", "normalize.zarr", "log1p.zarr", []),
             (other, "hvg", "log1p.zarr", "hvg.zarr", ["--n-top-genes", 100])]
    for python, stage, src, dst, extra in steps:
        _stage(python, stage, "--input", tmp_path / src, "--output", tmp_path / dst, *extra)

    # both stacks read every store whole, and see the same thing
    for name in ("qc.zarr", "qc_other.zarr", "filter.zarr", "normalize.zarr", "log1p.zarr", "hvg.zarr"):
        assert _read_back(this, tmp_path / name) == _read_back(other, tmp_path / name), name
    hvg = ad.read_zarr(tmp_path / "hvg.zarr")
    assert hvg.var["highly_variable"].sum() == 100
    # the values made along the way equal the same steps done in memory on the raw counts
    x = ad.read_zarr(tmp_path / "filter.zarr").X
    norm = sp.diags(np.median(np.asarray(x.sum(axis=1)).ravel()) / np.asarray(x.sum(axis=1)).ravel()) @ x
    np.testing.assert_allclose(hvg.X.toarray(), np.log1p(norm.toarray()), rtol=1e-5, atol=1e-6)
