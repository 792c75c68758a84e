"""Sample sheets: a TSV with one row per input (``sample``, ``path``, optional metadata).

Other columns are per-sample metadata copied into obs, except the per-sample QC thresholds
(``min_genes``, ``max_genes``, ``min_counts``, ``max_counts``, ``max_pct_mt``), which the filter stage
reads from the same sheet. A relative ``path`` is looked up from the current directory first, then
from the sheet's own folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from atlasflow.errors import InputError
from atlasflow.pp.filter import CELL_THRESHOLDS

REQUIRED = ("sample", "path")
THRESHOLD_COLUMNS = tuple(CELL_THRESHOLDS)


@dataclass
class Sample:
    """One input of a sample sheet: its name, data path and metadata for obs."""

    name: str
    path: Path
    metadata: dict = field(default_factory=dict)


def _load(path: Path) -> pd.DataFrame:
    if not path.is_file():
        raise InputError(f"sample sheet {path} not found")
    try:
        table = pd.read_csv(path, sep="\t", dtype={"sample": str, "path": str})
    except pd.errors.EmptyDataError:
        raise InputError(f"sample sheet {path} is empty") from None
    except (pd.errors.ParserError, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"sample sheet {path} is not a readable TSV ({str(exc).splitlines()[0]})") from exc
    table.columns = [str(c).strip() for c in table.columns]
    missing = [c for c in REQUIRED if c not in table]
    if missing:
        raise InputError(f"sample sheet {path} lacks column(s) {', '.join(missing)} "
                         f"(has: {', '.join(table.columns)}; it must be tab-separated)")
    if table.empty:
        raise InputError(f"sample sheet {path} lists no samples")
    return table


def _resolve(entry: str, sheet: Path) -> Path | None:
    candidate = Path(entry).expanduser()
    if candidate.is_absolute():
        return candidate if candidate.exists() else None
    for base in (Path.cwd(), sheet.parent):
        if (base / candidate).exists():
            return base / candidate
    return None


def read_sample_sheet(path: str | Path) -> list[Sample]:
    """Validated samples of a sheet (InputError on missing columns, names, duplicates or files)."""
    path = Path(path)
    table = _load(path)
    names = table["sample"].fillna("").str.strip()
    paths = table["path"].fillna("").str.strip()
    blank = [str(i + 2) for i in range(len(table)) if not names.iloc[i] or not paths.iloc[i]]
    if blank:
        raise InputError(f"sample sheet {path}: line(s) {', '.join(blank)} lack a sample name or path")
    dups = sorted(names[names.duplicated()].unique())
    if dups:
        raise InputError(f"sample sheet {path}: duplicate sample name(s) {', '.join(dups)}")
    resolved = [_resolve(p, path) for p in paths]
    lost = [f"{n} ({p})" for n, p, r in zip(names, paths, resolved, strict=True) if r is None]
    if lost:
        raise InputError(f"sample sheet {path}: input not found for sample(s) {', '.join(lost)}")
    meta_cols = [c for c in table.columns if c not in REQUIRED and c not in THRESHOLD_COLUMNS]
    return [
        Sample(name=names.iloc[i], path=resolved[i], metadata={c: table[c].iloc[i] for c in meta_cols})
        for i in range(len(table))
    ]

