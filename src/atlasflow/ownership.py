"""Which existing paths an output may replace: only what atlasflow itself wrote, never a user's data.

An output path that exists is replaced only when atlasflow recognises it as its own, by something it wrote:

* a **store** (a folder) by the ``atlasflow`` entry (with a ``store_id``) in its root Zarr attributes, and
  only while it holds nothing but AnnData's elements (a user's file dropped into it keeps it safe);
* a **file** (summary JSON, CSV, PNG, h5ad) by a hidden sidecar ``.<name>.atlasflow`` written beside it,
  which holds the file's size and a digest of its content: a file a user put there, or edited since, does
  not match and is kept.

Anything else is refused with one line naming the path (``OutputError``), before any work when the stage
script checks its outputs up front (``check_outputs``), and again at the moment of replacing.
An output must also never be, contain or lie inside one of the stage's inputs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

from atlasflow.errors import OutputError

#: Root attribute key of an atlasflow store (store.META_KEY is the same name).
STORE_KEY = "atlasflow"
#: Entries of an AnnData Zarr store's root folder (zarr v3 and v2 metadata, anndata's elements).
STORE_ENTRIES = frozenset({"zarr.json", ".zattrs", ".zgroup", ".zmetadata", "X", "obs", "var", "obsm", "varm",
                           "obsp", "varp", "layers", "uns", "raw"})
#: Bytes hashed at each end of a file for its digest (the whole file when smaller than twice this).
_DIGEST_SPAN = 1 << 20


def store_attrs(path: Path) -> dict | None:
    """The root attributes of a Zarr group folder (v3 ``zarr.json`` or v2 ``.zattrs``), None when not one."""
    for meta, key in (("zarr.json", "attributes"), (".zattrs", None)):
        try:
            doc = json.loads((path / meta).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            attrs = doc.get(key, {}) if key else doc
            return attrs if isinstance(attrs, dict) else {}
    return None


def is_atlasflow_store(path: str | os.PathLike) -> bool:
    """True for a folder atlasflow wrote as a store and that holds nothing else."""
    path = Path(path)
    if not path.is_dir() or path.is_symlink():
        return False
    attrs = store_attrs(path)
    own = attrs.get(STORE_KEY) if attrs else None
    if not isinstance(own, dict) or "store_id" not in own:
        return False
    return all(entry.name in STORE_ENTRIES for entry in os.scandir(path))


def _sidecar(path: Path) -> Path:
    return path.with_name(f".{path.name}.atlasflow")


def _digest(path: Path) -> dict:
    size = path.stat().st_size
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as fh:
        if size <= 2 * _DIGEST_SPAN:
            h.update(fh.read())
        else:
            h.update(fh.read(_DIGEST_SPAN))
            fh.seek(size - _DIGEST_SPAN)
            h.update(fh.read(_DIGEST_SPAN))
    return {"size": size, "blake2b": h.hexdigest()}


def is_atlasflow_file(path: str | os.PathLike) -> bool:
    """True for a regular file whose sidecar says atlasflow wrote exactly this content."""
    path = Path(path)
    if not path.is_file() or path.is_symlink():
        return False
    try:
        recorded = json.loads(_sidecar(path).read_text())
        return isinstance(recorded, dict) and recorded.get("written_by") == "atlasflow" and \
            {k: recorded.get(k) for k in ("size", "blake2b")} == _digest(path)
    except (OSError, ValueError):
        return False


def check_replaceable(path: str | os.PathLike, kind: str = "store") -> None:
    """Refuse (``OutputError``) to write ``path`` when something atlasflow did not write is there.

    ``kind``: ``"store"`` (a store folder, replaced whole), ``"file"``, or ``"folder"`` (a folder atlasflow
    writes files into, such as the plots: it may exist; each file in it is checked as a ``"file"``).
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    if kind == "folder":
        if path.is_dir():
            return
        what = "not a folder"
    elif kind == "store":
        if is_atlasflow_store(path):
            return
        what = "a file" if path.is_file() else "a symbolic link" if path.is_symlink() else \
            "a folder that is not a store atlasflow wrote"
    else:
        if is_atlasflow_file(path):
            return
        what = "a folder" if path.is_dir() else "a file atlasflow did not write (or one changed since)"
    raise OutputError(f"output {path} already exists and is {what}: atlasflow replaces only its own outputs; "
                      "move it away or choose another output path")


def record_file(path: str | os.PathLike) -> None:
    """Write the sidecar that lets a later run recognise ``path`` as atlasflow's (after it is in place)."""
    path = Path(path)
    side = _sidecar(path)
    tmp = side.with_name(f"{side.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps({"written_by": "atlasflow", **_digest(path)}) + "\n")
    os.replace(tmp, side)


def replace_file(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move a finished temporary file onto ``path`` (refused when ``path`` is not atlasflow's) and record it."""
    path = Path(path)
    check_replaceable(path, "file")
    os.replace(tmp, path)
    record_file(path)
    return path


def _overlap(a: Path, b: Path) -> bool:
    return a == b or a in b.parents or b in a.parents


def check_outputs(outputs: Iterable[tuple[str, str | os.PathLike, str]], inputs: Iterable[str | os.PathLike]) -> None:
    """Before a stage starts: every output is replaceable and none is, holds or lies inside an input.

    ``outputs``: (argument name, path, kind) triples; ``inputs``: the paths the stage reads.
    """
    ins = [Path(os.path.realpath(p)) for p in inputs if p]
    for name, path, kind in outputs:
        if not path:
            continue
        real = Path(os.path.realpath(path))
        for src in ins:
            if _overlap(real, src):
                relation = "is" if real == src else "holds" if real in src.parents else "lies inside"
                raise OutputError(f"--{name.replace('_', '-')} {path} {relation} the input {src}: "
                                  "writing it would destroy what the stage reads; choose another path")
        check_replaceable(path, kind)
