"""README's commands and examples, run as written in a copy of the repository's tracked files (a fresh clone).

The one liberty taken: the quick start's environment steps (``python3 -m venv .venv && . .venv/bin/activate &&
pip install -e .``) are checked to be exactly that and not re-run (``.ci/run`` runs them on every CI run); the
commands after them run with this test's environment activated (its ``bin`` first on PATH).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ENV_STEPS = ["python3 -m venv .venv", ". .venv/bin/activate"]

pytestmark = [pytest.mark.workflow, pytest.mark.slow]


def blocks(lang: str) -> list[str]:
    """The README's fenced code blocks of one language, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.M | re.S)


def block_with(lang: str, text: str) -> list[str]:
    """The command lines (comment lines dropped) of the one block of that language containing ``text``."""
    found = [b for b in blocks(lang) if text in b]
    assert len(found) == 1, f"README has {len(found)} {lang} blocks with {text!r}"
    return [line for line in found[0].splitlines() if line.strip() and not line.lstrip().startswith("#")]


def activated() -> dict:
    """This environment, as `. .venv/bin/activate` gives it (its bin first on PATH), attached to no cluster."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("ATLASFLOW_SCHEDULER_FILE", None)
    return env


def run(clone: Path, command: str, timeout: float = 600) -> str:
    """One README line through bash in the clone, this environment activated; its output (must succeed)."""
    proc = subprocess.run(["bash", "-ec", command], cwd=clone, env=activated(), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, f"{command}\n{proc.stdout[-4000:]}"
    return proc.stdout


def rules_run(output: str) -> list[str]:
    return re.findall(r"^\s*(?:local)?rule (\w+):", output, re.M)


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """The tracked files of this checkout, as a fresh clone has them, with the quick start's workflow run."""
    try:
        files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, stdout=subprocess.PIPE).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot tell a fresh clone's files")
    dest = tmp_path_factory.mktemp("clone") / "atlasflow"
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    first = block_with("bash", "run the whole workflow")[0]
    steps = first.split(" && ")
    assert steps[:2] == ENV_STEPS and steps[2] == "pip install -e .", first
    out = run(dest, " && ".join(steps[3:]), timeout=900)
    assert "steps (100%) done" in out, out[-3000:]
    return dest


def test_quick_start_runs_the_whole_workflow(clone):
    import anndata as ad

    final = ad.read_zarr(clone / "results" / "demo" / "final.zarr")
    assert {"X_pca", "X_umap"} <= set(final.obsm) and "leiden" in final.obs and "counts" in final.layers
    # what README says a scanpy user does with it
    import matplotlib

    matplotlib.use("Agg")
    import scanpy as sc

    sc.pl.umap(final, color="leiden", show=False)
    test_line = block_with("bash", "run the whole workflow")[-1].split(" && ")
    assert test_line[:2] == ENV_STEPS and test_line[2:] == ['pip install -e ".[test]"', "pytest"], test_line
    assert "pytest\n" in (ROOT / ".ci" / "run").read_text()  # CI runs that test command


def test_rerunning_block_does_what_its_comments_say(clone):
    target, rebuild, by_hand = block_with("bash", "results/demo/normalize.zarr")
    assert "Nothing to be done" in run(clone, target)  # built already: nothing to resume
    out = run(clone, rebuild)
    ran = rules_run(out)
    assert ran[0] == "log1p" and {"hvg", "pca", "neighbors", "leiden", "umap", "final"} <= set(ran), ran
    assert not {"simulate", "qc", "filter", "normalize"} & set(ran), ran
    run(clone, by_hand)
    out = clone / by_hand.split("--output ")[1].split()[0]
    assert (out / "obs").is_dir() and (clone / "results" / "demo" / "qc.zarr").is_dir()


def test_cluster_block_runs_as_written(clone):
    lines = block_with("bash", "atlasflow cluster start")
    try:
        out = run(clone, " && ".join(lines), timeout=300)
    finally:
        subprocess.run(["bash", "-c", lines[-1]], cwd=clone, capture_output=True, timeout=60, env=activated())
    assert "Nothing to be done" in out, out[-3000:]


def test_python_api_example_runs_as_written(clone):
    import anndata as ad

    (example,) = blocks("python")
    proc = subprocess.run([sys.executable, "-c", example], cwd=clone, text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = ad.read_zarr(clone / "my_log1p.zarr")
    assert written.shape == ad.read_zarr(clone / "results" / "demo" / "filter.zarr").shape
    assert written.uns["log1p"] is not None
