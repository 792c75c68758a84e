"""Checks of a stored AnnData before a stage reads it: every array's chunk files and every element's shape.

Zarr reads a missing chunk file as the array's fill value, so a deleted ``obsm/X_pca`` chunk would give
cells an all-zero embedding and a deleted ``obs/leiden/codes`` chunk every cell cluster 0, with no error.
atlasflow writes every chunk (``write_empty_chunks``), so in a store it wrote a missing chunk file is always
damage. ``verify_store`` counts each array's chunk files against its shape (every array of an atlasflow
store; only X and layers of a store from another tool, which may leave empty chunks out) and checks the
shapes of the elements against each other (obs/var lengths, CSR ``indptr``/``data``/``indices``), so an
edited ``shape`` in a ``zarr.json`` is caught too. It reads only metadata files (no chunk is decoded).
Each problem is one line naming the store, the array and the stage to re-run.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from atlasflow.errors import StoreError

#: Root attribute key of atlasflow's bookkeeping (store.META_KEY).
META_KEY = "atlasflow"
#: Metadata files of Zarr v3 and v2 nodes (never chunks).
_META_FILES = {"zarr.json", ".zarray", ".zattrs", ".zgroup", ".zmetadata"}


def _meta(folder: Path) -> dict | None:
    """A node's metadata: v3 ``zarr.json``, or v2 ``.zarray``/``.zgroup`` (+ ``.zattrs``) as v3-like keys."""
    try:
        return json.loads((folder / "zarr.json").read_text())
    except FileNotFoundError:
        pass
    for name, kind in ((".zarray", "array"), (".zgroup", "group")):
        try:
            doc = json.loads((folder / name).read_text())
        except FileNotFoundError:
            continue
        try:
            attrs = json.loads((folder / ".zattrs").read_text())
        except FileNotFoundError:
            attrs = {}
        if kind == "array":
            doc = {"shape": doc["shape"], "chunk_grid": {"configuration": {"chunk_shape": doc["chunks"]}}}
        return {**doc, "node_type": kind, "attributes": attrs, "zarr_format": 2}
    return None


def _nodes(path: Path) -> dict[str, dict]:
    """Every group and array of a store by its key ('' for the root), from the metadata files alone."""
    nodes = {}
    for dirpath, dirnames, _ in os.walk(path):
        folder = Path(dirpath)
        try:
            meta = _meta(folder)
        except (OSError, ValueError, KeyError) as exc:
            raise StoreError(f"{path} is damaged: the metadata of {folder.relative_to(path) or 'its root'} "
                             f"is unreadable ({exc}); delete it and re-run {_writer(path, nodes)}") from exc
        if meta is None:
            dirnames[:] = []  # chunk folders (c/0/...) or foreign files: not nodes
            continue
        rel = folder.relative_to(path).as_posix()
        nodes["" if rel == "." else rel] = meta
        if meta.get("node_type") == "array":
            dirnames[:] = []
    return nodes


def _writer(path: Path, nodes: dict) -> str:
    stage = nodes.get("", {}).get("attributes", {}).get(META_KEY, {}).get("provenance", {}).get("stage")
    return f"the {stage} stage" if stage else "the stage that wrote it"


def _chunk_files(folder: Path) -> int:
    return sum(1 for _, _, files in os.walk(folder) for f in files if f not in _META_FILES)


def _expected_chunks(meta: dict) -> int:
    shape = meta["shape"]
    chunks = meta["chunk_grid"]["configuration"]["chunk_shape"]
    return math.prod(-(-int(s) // int(c)) for s, c in zip(shape, chunks, strict=True)) if math.prod(shape) else 0


def verify_store(path: str | os.PathLike, keys: tuple[str, ...] | None = None) -> None:
    """Fail (StoreError, one line) if an array of the store has missing chunk files or elements disagree
    in shape. ``keys``: check only these elements (and obs/var), e.g. ``("X",)``; default: all."""
    path = Path(path)
    nodes = _nodes(path)
    root = nodes.get("", {})
    ours = isinstance(root.get("attributes", {}).get(META_KEY), dict)
    rerun = f"delete it and re-run {_writer(path, nodes)}"

    def wanted(key: str) -> bool:
        top = key.split("/")[0]
        return keys is None or top in ("obs", "var") or any(key == k or key.startswith(f"{k}/") for k in keys)

    for key, meta in nodes.items():
        if meta.get("node_type") != "array" or not wanted(key):
            continue
        if not ours and key.split("/")[0] not in ("X", "layers"):
            continue
        if meta.get("attributes", {}).get("encoding-type") == "null":  # anndata's None: metadata, no chunk
            continue
        expected, found = _expected_chunks(meta), _chunk_files(path / key)
        if found != expected:
            raise StoreError(f"{path} is damaged: {key} has {found} of {expected} chunk files "
                             f"(for shape {tuple(meta['shape'])}); {rerun}")
    _check_shapes(path, nodes, wanted, rerun)


def _length(nodes: dict, axis: str) -> int | None:
    """Number of obs (or var) names, from the index array's shape."""
    index = nodes.get(axis, {}).get("attributes", {}).get("_index")
    arr = nodes.get(f"{axis}/{index}") if index else None
    return int(arr["shape"][0]) if arr and arr.get("shape") else None


def _element_shape(nodes: dict, key: str, path: Path, rerun: str) -> tuple[int, ...] | None:
    """Shape of an element: a dense array's, a sparse group's checked against its arrays, else None."""
    meta = nodes[key]
    if meta.get("node_type") == "array":
        return tuple(int(s) for s in meta["shape"])
    attrs = meta.get("attributes", {})
    enc = attrs.get("encoding-type")
    if enc not in ("csr_matrix", "csc_matrix"):
        return None
    shape = tuple(int(s) for s in attrs["shape"])
    parts = {p: nodes.get(f"{key}/{p}") for p in ("data", "indices", "indptr")}
    if any(v is None for v in parts.values()):
        missing = [p for p, v in parts.items() if v is None]
        raise StoreError(f"{path} is damaged: {key} lacks {', '.join(missing)}; {rerun}")
    n_ptr = shape[0] if enc == "csr_matrix" else shape[1]
    if int(parts["indptr"]["shape"][0]) != n_ptr + 1:
        raise StoreError(f"{path} is damaged: {key}/indptr has {parts['indptr']['shape'][0]} entries for shape "
                         f"{shape} (needs {n_ptr + 1}); {rerun}")
    if parts["data"]["shape"] != parts["indices"]["shape"]:
        raise StoreError(f"{path} is damaged: {key}/data has {parts['data']['shape'][0]} entries but "
                         f"{key}/indices {parts['indices']['shape'][0]}; {rerun}")
    return shape


def _check_shapes(path: Path, nodes: dict, wanted, rerun: str) -> None:
    n_obs, n_var = _length(nodes, "obs"), _length(nodes, "var")

    def need(key: str, got: int, want: int | None, what: str) -> None:
        if want is not None and got != want:
            raise StoreError(f"{path} is damaged: {key} has {got} {what} but the store has {want}; {rerun}")

    for axis, n in (("obs", n_obs), ("var", n_var)):  # columns (categorical codes, nullable values/mask)
        for key, meta in nodes.items():
            parts = key.split("/")
            if parts[0] != axis or meta.get("node_type") != "array" or len(parts) > 3:
                continue
            if len(parts) == 3 and parts[2] not in ("codes", "values", "mask"):
                continue
            need(key, int(meta["shape"][0]), n, f"{axis} entries")
    for key in nodes:
        parts = key.split("/")
        if len(parts) != (1 if parts[0] == "X" else 2) or not wanted(key):
            continue
        top = parts[0]
        if top not in ("X", "layers", "obsm", "varm", "obsp", "varp"):
            continue
        shape = _element_shape(nodes, key, path, rerun)
        if shape is None:
            continue
        rows = n_var if top in ("varm", "varp") else n_obs
        need(key, shape[0], rows, "rows")
        if top in ("X", "layers") and len(shape) > 1:
            need(key, shape[1], n_var, "columns (genes)")
        if top in ("obsp", "varp") and len(shape) > 1:
            need(key, shape[1], rows, "columns")
