"""Which store element a lazy array was read from unchanged: ``write_store`` links such elements instead of
rewriting them, and the GPU move keeps the record (its blocks are the same values)."""

from __future__ import annotations

# dask array name -> (store path, element path)
SOURCES: dict[str, tuple[str, str]] = {}


def remember(x, path, key: str) -> None:
    """Record that the lazy array ``x`` holds ``path``/``key`` as stored."""
    SOURCES[x.name] = (str(path), key)


def source_of(x) -> tuple[str, str] | None:
    """The (store, element) a lazy array was read from unchanged, or None if it was computed."""
    return SOURCES.get(getattr(x, "name", None))


def inherit(new, old) -> None:
    """``new`` holds the same stored values as ``old`` (e.g. the same blocks on another device)."""
    src = source_of(old)
    if src is not None:
        SOURCES[new.name] = src
