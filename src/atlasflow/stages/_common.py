"""Small helpers shared by stage modules: argument types and store facts."""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import zarr

from atlasflow.errors import ConfigError

log = logging.getLogger(__name__)


def json_arg(text):
    """argparse type: a JSON value on the command line (dicts/lists from Snakemake pass through)."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"not valid JSON: {text!r} ({exc.msg})") from exc


def optional_bool(text):
    """argparse type: true/false, or none/null for 'as scanpy decides' (bools from Snakemake pass through)."""
    if text is None or isinstance(text, bool):
        return text
    t = str(text).lower()
    if t in ("none", "null", ""):
        return None
    if t in ("true", "yes", "1"):
        return True
    if t in ("false", "no", "0"):
        return False
    raise ConfigError(f"expected true, false or none, not {text!r}")


class BadValue(ConfigError):
    """A value outside a Number's bounds, naming its key (one line from the stage script, exit non-zero)."""


def _is_none(value) -> bool:
    return value is None or (isinstance(value, str) and value.strip().lower() in ("none", "null", ""))


class Number:
    """argparse type: a number within bounds (an int with ``integer=True``; none/null = not set with
    ``nullable=True``). NaN is always refused, infinities unless ``allow_inf``. These are the stage
    scripts' counterparts of the bounds in workflow/schemas/config.schema.yaml.

    ``type=positive_float.named("span")`` refuses a bad ``--span`` with a ConfigError naming ``span``
    (stage_main prints it as one line and exits 2); unnamed, argparse reports ``argument --span: ...``
    under its usage. The same object checks values that reach ``run`` unconverted (Snakemake params are
    not parsed): ``positive_float(args.span, "span")`` returns the number or raises the ConfigError.
    """

    def __init__(self, *, integer: bool = False, nullable: bool = False, gt=None, ge=None, le=None,
                 ne=None, allow_inf: bool = False, key: str | None = None):
        self.integer, self.nullable, self.allow_inf = integer, nullable, allow_inf
        self.gt, self.ge, self.le, self.ne, self.key = gt, ge, le, ne, key
        self.__name__ = "number"  # what argparse calls the type in its own messages

    def named(self, key: str) -> Number:
        """The same type, naming ``key`` in its errors (the argparse dest, which is the config key)."""
        return Number(integer=self.integer, nullable=self.nullable, gt=self.gt, ge=self.ge, le=self.le,
                      ne=self.ne, allow_inf=self.allow_inf, key=key)

    def describe(self) -> str:
        """What the type accepts, e.g. 'a number > 0 (or none)'."""
        what = "an integer" if self.integer else "a number"
        if self.ge is not None and self.le is not None:
            what += f" in [{self.ge}, {self.le}]"
        else:
            what += "".join(f" {op} {v}" for op, v in ((">", self.gt), (">=", self.ge), ("<=", self.le))
                            if v is not None)
        if self.ne is not None:
            what += f" other than {self.ne}"
        return what + (" (or none)" if self.nullable else "")

    def __call__(self, value, name: str | None = None):
        if self.nullable and _is_none(value):
            return None
        number = self._convert(value)
        if number is None or not self._within(number):
            if self._non_finite(number):
                problem = f"must be a finite number, not {value!r}"
            else:
                problem = f"must be {self.describe()}, not {value!r}"
            name = name or self.key
            if name is None:
                raise argparse.ArgumentTypeError(problem)
            raise BadValue(f"{name}: {problem}")
        return number

    def _non_finite(self, x) -> bool:
        return isinstance(x, float) and (math.isnan(x) or (math.isinf(x) and not self.allow_inf))

    def _convert(self, value):
        if isinstance(value, bool):
            return None
        try:
            number = float(value)
        except (TypeError, ValueError):
            return None
        if not self.integer:
            return number
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                return None
        return int(number) if math.isfinite(number) and number.is_integer() else None

    def _within(self, x) -> bool:
        if self._non_finite(x):
            return False
        return not ((self.gt is not None and not x > self.gt) or (self.ge is not None and not x >= self.ge)
                    or (self.le is not None and not x <= self.le) or (self.ne is not None and x == self.ne))


class Choice:
    """argparse type: one of ``choices``, the error naming the key as Number's does (one line, not argparse's
    usage and `invalid choice`); ``Choice(...)(value, "key")`` checks a Snakemake param."""

    def __init__(self, choices, key: str | None = None):
        self.choices, self.key = tuple(choices), key
        self.__name__ = "choice"

    def named(self, key: str) -> Choice:
        return Choice(self.choices, key)

    def __call__(self, value, name: str | None = None):
        if value in self.choices:
            return value
        problem = f"{value!r} is not one of {', '.join(self.choices)}"
        name = name or self.key
        if name is None:
            raise argparse.ArgumentTypeError(problem)
        raise BadValue(f"{name}: {problem}")


#: a float, or none/null for 'not set'
optional_float = Number(nullable=True)
#: an int, or none/null for 'not set'
optional_int = Number(integer=True, nullable=True)
positive_float = Number(gt=0)
optional_positive_float = Number(gt=0, nullable=True)
non_negative_float = Number(ge=0)
optional_non_negative_float = Number(ge=0, nullable=True)
#: a fraction in (0, 1]
fraction = Number(gt=0, le=1)
unit_interval = Number(ge=0, le=1)
#: a percentage in [0, 100], or none
optional_percent = Number(ge=0, le=100, nullable=True)
positive_int = Number(integer=True, ge=1)
optional_positive_int = Number(integer=True, ge=1, nullable=True)
non_negative_int = Number(integer=True, ge=0)
#: a logarithm base (> 0 and not 1), or none for the natural log
log_base = Number(gt=0, ne=1, nullable=True)


def to_int(value, name: str) -> int:
    """``value`` as an int (Snakemake params arrive unconverted), or a ConfigError naming ``name``."""
    return Number(integer=True)(value, name)


def check_order(values, low: str, high: str) -> None:
    """Refuse ``values[low] > values[high]`` (a cut-off pair no value can pass), naming both keys."""
    lo, hi = values.get(low), values.get(high)
    if lo is not None and hi is not None and float(lo) > float(hi):
        raise ConfigError(f"{low} ({lo}) is above {high} ({hi}): no value can pass both cut-offs")


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


def excluded_genes(var, columns, what: str) -> np.ndarray:
    """Genes flagged in any of the boolean var ``columns`` present (logged with ``what``); absent ones are skipped."""
    mask = np.zeros(len(var), dtype=bool)
    for col in columns or ():
        if col in var:
            mask |= var[col].fillna(False).to_numpy(dtype=bool)
    if mask.any():
        log.info("%s: %d genes of var[%s]", what, int(mask.sum()), ", ".join(c for c in columns if c in var))
    return mask


def load_graph(adata, obsp: str | None, neighbors_key: str | None) -> None:
    """For a store opened with ``skip=("obsp",)``: read the one graph a stage needs, ``obsp[obsp]``, else the
    connectivities of ``uns[neighbors_key]`` (a missing one is left to the stage's own one-line error)."""
    from atlasflow.store import load_element, unread_elements

    info = adata.uns.get(neighbors_key or "neighbors")
    key = obsp if obsp is not None else (info.get("connectivities_key", "connectivities")
                                          if isinstance(info, Mapping) else None)
    if key is not None and f"obsp/{key}" in dict(unread_elements(adata)):
        load_element(adata, f"obsp/{key}")
