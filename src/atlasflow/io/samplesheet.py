"""Sample sheets: a TSV with one row per input (``sample``, ``path``, optional metadata).

Other columns are per-sample metadata copied into obs, except the per-sample QC thresholds
(``min_genes``, ``max_genes``, ``min_counts``, ``max_counts``, ``max_pct_mt``), which the filter stage
reads from the same sheet. A relative ``path`` is looked up from the current directory first, then
from the sheet's own folder.

One input listed under two sample names would count its cells twice: refused when two rows resolve to
the same path (symbolic links and ``matrix.mtx`` vs its folder included), name the same file (hard
link: device and inode), or hold what looks like one file copied (same size and modification time and
the same first and last 64 KiB; checked only when size and time agree, so it costs nothing otherwise).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from atlasflow.errors import InputError
from atlasflow.pp.filter import CELL_THRESHOLDS

REQUIRED = ("sample", "path")
MTX_NAMES = ("matrix.mtx.gz", "matrix.mtx")  # as atlasflow.io.tenx (imported from there it would be a cycle)
EDGE_BYTES = 64 << 10
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
    _refuse_repeated_inputs(path, list(names), resolved)
    meta_cols = [c for c in table.columns if c not in REQUIRED and c not in THRESHOLD_COLUMNS]
    return [
        Sample(name=names.iloc[i], path=resolved[i], metadata={c: table[c].iloc[i] for c in meta_cols})
        for i in range(len(table))
    ]


def _data_file(path: Path) -> Path:
    """The file that holds an input's matrix: the path itself, or a 10x folder's matrix.mtx(.gz)."""
    if path.is_dir():
        return next((path / n for n in MTX_NAMES if (path / n).is_file()), path)
    return path


def _edges(path: Path, size: int) -> str:
    """Digest of the first and last EDGE_BYTES of a file (its whole content when smaller)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        h.update(fh.read(EDGE_BYTES))
        if size > EDGE_BYTES:
            fh.seek(max(EDGE_BYTES, size - EDGE_BYTES))
            h.update(fh.read())
    return h.hexdigest()


def _refuse_repeated_inputs(sheet: Path, names: list[str], paths: list[Path]) -> None:
    """InputError naming the samples of the first input listed twice (same path, same file, or a copy)."""
    seen_path, seen_inode, seen_copy = {}, {}, {}
    for name, path in zip(names, paths, strict=True):
        where = path.resolve()
        if where.name in MTX_NAMES:
            where = where.parent  # a 10x folder may be given as the folder or as its matrix file
        if where in seen_path:
            raise InputError(f"sample sheet {sheet}: samples {seen_path[where]} and {name} are the same input "
                             f"({where}); list each input once")
        seen_path[where] = name
        data = _data_file(where)
        st = os.stat(data)
        inode = (st.st_dev, st.st_ino)
        if inode in seen_inode:
            other = seen_inode[inode]
            raise InputError(f"sample sheet {sheet}: samples {other[0]} and {name} are the same file "
                             f"({other[1]} and {data} are links to one file); list each input once")
        seen_inode[inode] = (name, data)
        if not data.is_file():
            continue
        stamp = (st.st_size, st.st_mtime_ns)
        for other_name, other_data in seen_copy.get(stamp, []):
            if _edges(other_data, st.st_size) == _edges(data, st.st_size):
                raise InputError(
                    f"sample sheet {sheet}: samples {other_name} and {name} look like copies of one input "
                    f"({other_data} and {data}: same size, modification time and first/last 64 KiB); "
                    "list each input once"
                )
        seen_copy.setdefault(stamp, []).append((name, data))
