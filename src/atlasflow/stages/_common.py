"""Small helpers shared by stage modules: argument types and store facts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import zarr

from atlasflow.errors import ConfigError


def json_arg(text):
    """argparse type: a JSON value on the command line (dicts/lists from Snakemake pass through)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON: {text!r} ({exc.msg})") from exc


def optional_float(text):
    """argparse type: a float, or none/null for 'not set'."""
    if text is None or (isinstance(text, str) and text.lower() in ("none", "null", "")):
        return None
    return float(text)


def stored_row_nnz(store: str | Path, key: str = "X") -> np.ndarray:
    """Stored entries per row of a CSR element, from its indptr alone (no pass over the data)."""
    indptr = zarr.open_group(str(store), mode="r")[key]["indptr"][:]
    return np.diff(np.asarray(indptr, dtype=np.int64))


def shape_summary(before, after) -> dict:
    """cells/genes in and out for a stage's JSON summary."""
    return {
        "cells_in": int(before.n_obs), "genes_in": int(before.n_vars),
        "cells_out": int(after.n_obs), "genes_out": int(after.n_vars),
    }
