"""The command line a user meets first: `atlasflow --help`, an unknown stage, a stage's --help."""

from __future__ import annotations

import subprocess
import sys

from atlasflow.cli import main, stage_names


def test_help_lists_every_stage(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert {"qc", "normalize", "pca", "leiden", "final"} <= set(stage_names())
    for name in stage_names():
        assert f"  {name} " in out, name


def test_unknown_stage_is_one_line(capsys):
    assert main(["nomalize"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no stage 'nomalize'" in err[0] and "did you mean 'normalize'" in err[0]


def test_stage_help_says_what_is_required_and_no_empty_defaults():
    out = subprocess.run([sys.executable, "scripts/normalize.py", "--help"], text=True, capture_output=True,
                         check=True).stdout
    assert "(default: None)" not in out and "(default: False)" not in out
    assert "input AnnData Zarr store (required)" in out
    assert "(default: cpu)" in out and "(default: 0.05)" in out  # a default that says something is still shown


def test_stage_by_hand_shows_its_own_lines_not_the_cluster_chatter(tmp_path):
    """A stage run by hand with its own local cluster prints atlasflow's lines, not distributed's INFO logs."""
    import anndata as ad
    import numpy as np
    import pandas as pd
    import scipy.sparse as sp

    x = sp.csr_matrix(np.random.default_rng(0).poisson(1, (40, 12)).astype(np.float32))
    ad.AnnData(X=x, obs=pd.DataFrame(index=[f"c{i}" for i in range(40)]),
               var=pd.DataFrame(index=[f"g{j}" for j in range(12)])).write_zarr(tmp_path / "in.zarr")
    proc = subprocess.run([sys.executable, "scripts/normalize.py", "--input", str(tmp_path / "in.zarr"),
                           "--output", str(tmp_path / "out.zarr"), "--n-workers", "1"], text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "normalize done" in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if " distributed." in line], proc.stderr
