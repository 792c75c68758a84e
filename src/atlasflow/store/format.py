"""The on-disk form of every store: Zarr format 3, zstd with checksums, every chunk written, one index
dtype per CSR matrix, and atlasflow's bookkeeping key. Importing it applies the Zarr and anndata settings."""

from __future__ import annotations

import os
import warnings

import anndata as ad
import numpy as np
import zarr
import zarr.core.array

warnings.filterwarnings("ignore", message=".*autosharding.*")
warnings.filterwarnings("ignore", message="Consolidated metadata is currently not part")
# uns entries that anndata writes as NumPy structured arrays (rank_genes_groups' names/scores/pvals, one
# field per group) or fixed-length strings have no Zarr v3 data-type specification yet: zarr-python warns on
# every such array. They are what scanpy reads back (sc.get.rank_genes_groups_df, sc.pl.rank_genes_groups),
# anndata reads them on both stacks, and our tests read them back; see config/README.md, "Stored form".
warnings.filterwarnings("ignore", message=".*does not have a Zarr V3 specification.*")
# anndata 0.13 asks pandas 3 for its deprecated `future.infer_string` option on every string column it reads or
# writes (a Pandas4Warning each time); the option's value is pandas 3's default, so nothing changes for us.
warnings.filterwarnings("ignore", message="The 'future.infer_string' option is deprecated")
# Zarr format 3 everywhere (anndata's coming default); anndata >= 0.11 and scanpy read it.
ad.settings.zarr_write_format = 3
# One on-disk layout whichever anndata writes (0.12 or 0.13, so a store opens and extends on either):
# anndata 0.13 would shard every small element (obs/var columns, uns) into one file with an index and write
# pandas 3's str columns as nullable-string arrays; 0.12 does neither. Our own X/layers writer never shards:
# row-block reads map to whole chunks. (The settings do not exist before anndata 0.13.)
for _setting, _value in (("auto_shard_zarr_v3", False), ("allow_write_nullable_strings", False)):
    if hasattr(ad.settings, _setting):
        setattr(ad.settings, _setting, _value)

#: Write every chunk, even all-zero ones, so a missing chunk file always means damage (see check_complete).
#: Set globally too: arrays reopened on the workers do not keep a per-array runtime config.
FULL_CHUNKS = {"write_empty_chunks": True}
zarr.config.set({"array.write_empty_chunks": True})
INT32_MAX = int(np.iinfo(np.int32).max)


def index_dtype(nnz: int, n_cols: int) -> np.dtype:
    """The one dtype of a stored CSR's ``indptr`` and ``indices``: int32 while every offset and column fits,
    else int64, as scipy builds them. A loaded matrix whose two differ (int64 indptr, int32 indices) makes
    scipy's sparse routines fail ("Output dtype not compatible with inputs"), e.g. in scanpy's
    rank_genes_groups or ``X.eliminate_zeros()``."""
    return np.dtype(np.int32 if max(int(nnz), int(n_cols)) <= INT32_MAX else np.int64)


#: Zarr chunks encoded or decoded at once per read/write call. Zarr's default (10) keeps ~10 chunks of
#: buffers alive per call (~67 MiB extra to write a 9.6M-element block, measured); 4 costs no speed
#: on local or parallel filesystems here and cuts that to ~30 MiB. Env ATLASFLOW_ZARR_CONCURRENCY.
zarr.config.set({"async.concurrency": int(os.environ.get("ATLASFLOW_ZARR_CONCURRENCY", "4"))})
#: Every chunk atlasflow writes carries zstd's content checksum (xxh64 of the chunk, checked when it is
#: decompressed), so a flipped bit is a read error, not a silently changed value. Zarr 3 hard-codes its
#: default compressor (zstd level 0, no checksum) in ``zarr.core.array.default_compressors_v3``: this replaces
#: that default for every array created in this process (ours and anndata's); tests/test_store.py checks
#: that the stored metadata of every array of a written store says ``checksum: true``.
def _checksummed_zstd(dtype=None):
    return (zarr.codecs.ZstdCodec(level=0, checksum=True),)


zarr.core.array.default_compressors_v3 = _checksummed_zstd
#: Key under the root attributes where atlasflow keeps its bookkeeping.
META_KEY = "atlasflow"
