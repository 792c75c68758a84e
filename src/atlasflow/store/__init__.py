"""AnnData Zarr stores out of core: lazy open, block-wise writes on the workers, linking, atomic commit.

A store is a plain AnnData Zarr group (``anndata.read_zarr`` opens it). We read and write the large
elements (``X`` and ``layers/*``) ourselves so that

* reading gives a Dask array of row chunks (CSR chunks for sparse, ndarray chunks for dense) and nothing
  is loaded until a task needs its rows;
* writing runs on the Dask workers, one task per row block, never gathering the matrix on the client;
* an element a stage did not change is hard-linked (file by file, copying where links are impossible)
  from the input store instead of being rewritten;
* the output appears under its final name only once complete (write to a temporary sibling, rename).

Small elements (obs, var, obsm, varm, obsp, uns) go through anndata's own reader and writer; obs, var and the
obsm/varm/obsp/varp entries a stage left unchanged, or never read (``open_store(skip=...)``), are hard-linked
like X.

The modules: ``format`` (the on-disk form, applied on import), ``read`` (lazy opening, the registry of
what was read unchanged, chunk checks), ``write`` (block-wise writers), ``commit`` (atomic directories,
hard-linked trees, summaries). Every public name is re-exported here; a module-level setting
(``DEFAULT_BACKEND``, ``FLAT_CHUNK``) is read from its own module.
"""

from atlasflow.store.format import (  # noqa: F401
    FULL_CHUNKS,
    INT32_MAX,
    index_dtype,
    META_KEY,
)
from atlasflow.store.read import (  # noqa: F401
    DEFAULT_BACKEND,
    open_store,
    load_element,
    unread_elements,
    remember_read,
    read_unchanged,
    read_partial,
    open_matrix,
    lazy_elem,
    check_complete,
    provenance,
    writer_of,
    require,
    stored_row_sums,
    row_bounds,
)
from atlasflow.store.commit import (  # noqa: F401
    temporary_sibling,
    atomic_dir,
    link_tree,
    write_summary,
)
from atlasflow.store.write import (  # noqa: F401
    FLAT_CHUNK,
    write_store,
    write_matrix,
    MAPPED_CHUNKS_PER_TASK,
    write_mapped_values,
    write_csr_dask,
    save_npy,
    write_dense_dask,
    write_csr_blocks,
    copy_by_chunk,
)
