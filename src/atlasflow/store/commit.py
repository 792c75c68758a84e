"""Making outputs appear whole: temporary siblings renamed into place, hard-linked trees, atomic summaries."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pandas as pd

from atlasflow import ownership, progress
from atlasflow.errors import StoreError


def temporary_sibling(path: Path) -> Path:
    """A fresh hidden name beside ``path`` to write it under before renaming it into place.

    Temporaries of ``path`` that a killed earlier run left behind are removed first (Snakemake's lock
    ensures no other run is writing the same output).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success replace ``path`` by it, on failure remove it.

    ``path`` may only be absent or a store atlasflow wrote (``ownership``); anything else is refused.
    """
    path = Path(path)
    ownership.check_replaceable(path, "store")  # a user's folder or file is never replaced
    tmp = None  # stays None when the output's folder cannot even be created
    try:
        tmp = temporary_sibling(path)
        tmp.mkdir()
        yield tmp
        ownership.check_replaceable(path, "store")  # again: something may have appeared there meanwhile
        if os.path.lexists(path):
            shutil.rmtree(path)
        os.rename(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            if isinstance(exc, Exception):  # not on Ctrl-C: stop now; the next run removes what is left
                progress.wait_for_idle_workers()  # a task still running could write into tmp after its removal
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT,
                                                      errno.EPERM):
            raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
        raise


def link_tree(src: Path, dst: Path) -> None:
    """Recreate ``src`` under ``dst`` with hard links to its files (copies where linking fails)."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_file():
        _link_or_copy(src, dst)
        return
    for dirpath, _dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for fname in filenames:
            _link_or_copy(Path(dirpath) / fname, dst / rel / fname)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES):
            raise
        shutil.copy2(src, dst)


def write_summary(path: str | os.PathLike, summary: dict) -> Path:
    """Write a stage's JSON summary atomically (temporary file, then rename); refused over a user's file."""
    path = Path(path)
    ownership.check_replaceable(path, "file")
    tmp = temporary_sibling(path)
    try:
        tmp.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True) + "\n")
        ownership.replace_file(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, pd.Series):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    return obj
