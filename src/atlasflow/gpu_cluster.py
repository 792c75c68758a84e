"""Local GPU clusters: one Dask worker per GPU, with the two presets of the rapids-singlecell out-of-core guide.

* ``performance``: UCX between workers, an RMM pool of 80 % of each GPU, no managed memory: fastest
  while the data fit on the GPUs.
* ``capacity``: TCP, RMM managed memory (the GPU can spill to host memory): the largest data.

Both use ``threads_per_worker=1`` and make CuPy allocate through RMM. UCX never goes with managed memory
(:class:`ConfigError`). With dask-cuda installed, :func:`local_cuda_cluster` starts a
``dask_cuda.LocalCUDACluster``; without it (CuPy only), a plain Dask cluster of one worker process per GPU,
each seeing its own GPU first through ``CUDA_VISIBLE_DEVICES``, and CuPy's managed-memory allocator for
``capacity`` instead of RMM's. No CuPy or dask-cuda import happens at import time.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import os

from atlasflow.errors import ConfigError

log = logging.getLogger(__name__)

PRESETS: dict[str, dict] = {
    "performance": {"protocol": "ucx", "rmm_pool_size": "80%", "rmm_managed_memory": False,
                    "rmm_allocator_external_lib": "cupy", "threads_per_worker": 1},
    "capacity": {"protocol": "tcp", "rmm_pool_size": None, "rmm_managed_memory": True,
                 "rmm_allocator_external_lib": "cupy", "threads_per_worker": 1},
}
#: Environment variable telling a fallback worker (no dask-cuda) to allocate CuPy memory as managed memory.
MANAGED_ENV = "ATLASFLOW_CUPY_MANAGED"


def preset_options(preset: str, **overrides) -> dict:
    """The options of a preset, with ``overrides`` (None values ignored); validates the combination."""
    if preset not in PRESETS:
        raise ConfigError(f"gpu.preset: {preset!r} is not one of {', '.join(PRESETS)}")
    unknown = set(overrides) - set(PRESETS[preset])
    if unknown:
        raise ConfigError(f"gpu cluster: unknown option(s) {sorted(unknown)}; known: {sorted(PRESETS[preset])}")
    opts = {**PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    if opts["protocol"] not in ("tcp", "ucx"):
        raise ConfigError(f"gpu cluster: protocol {opts['protocol']!r} is not one of tcp, ucx")
    if opts["protocol"] == "ucx" and opts["rmm_managed_memory"]:
        raise ConfigError("gpu cluster: UCX cannot be combined with RMM managed memory; use the capacity preset "
                          "(TCP + managed memory) or the performance preset (UCX + RMM pool)")
    if int(opts["threads_per_worker"]) < 1:
        raise ConfigError(f"gpu cluster: threads_per_worker must be >= 1, got {opts['threads_per_worker']}")
    return opts


def parse_devices(devices=None) -> list[str]:
    """GPU ids to use: ``devices`` ("0,1", [0, 1], 2), else ``CUDA_VISIBLE_DEVICES``, else all CuPy sees."""
    if devices is None:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env is not None and env.strip():
            devices = env
        else:
            from atlasflow.gpu import device_count

            devices = list(range(device_count()))
    if isinstance(devices, int):
        devices = [devices]
    if isinstance(devices, str):
        devices = [d for d in devices.split(",") if d.strip()]
    out = [str(d).strip() for d in devices]
    if not out:
        raise ConfigError("backend gpu: no CUDA device visible (check the driver, CUDA_VISIBLE_DEVICES or gpu.devices)")
    return out


@functools.lru_cache(maxsize=None)
def dask_cuda_available() -> bool:
    """True when dask-cuda imports (installed but broken, e.g. without its CUDA libraries, counts as absent)."""
    if importlib.util.find_spec("dask_cuda") is None:
        return False
    try:
        import dask_cuda  # noqa: F401
    except Exception as exc:  # noqa: BLE001
        log.warning("dask-cuda is installed but does not import (%s: %s): treating it as absent",
                    type(exc).__name__, exc)
        return False
    return True


def ucx_available() -> bool:
    """True when Dask can talk UCX (distributed-ucxx, or the older ucx-py)."""
    return any(importlib.util.find_spec(m) is not None for m in ("distributed_ucxx", "ucp"))


def dask_cuda_kwargs(opts: dict, accepted) -> dict:
    """``LocalCUDACluster`` keyword arguments for preset options, for the parameter names it ``accepted``.

    dask-cuda spells the external-allocator option ``rmm_allocator_external_lib_list`` (a list; recent
    releases) or ``rmm_allocator_external_lib`` (older); it is dropped, with a warning, where neither exists.
    """
    kw = {"protocol": opts["protocol"], "rmm_managed_memory": bool(opts["rmm_managed_memory"]),
          "threads_per_worker": int(opts["threads_per_worker"])}
    pool = opts.get("rmm_pool_size")
    if pool is not None:  # dask-cuda takes a fraction of the GPU's memory as a float, not "80%"
        kw["rmm_pool_size"] = float(pool[:-1]) / 100 if isinstance(pool, str) and pool.endswith("%") else pool
    lib = opts.get("rmm_allocator_external_lib")
    if lib:
        if "rmm_allocator_external_lib_list" in accepted:
            kw["rmm_allocator_external_lib_list"] = [lib] if isinstance(lib, str) else list(lib)
        elif "rmm_allocator_external_lib" in accepted:
            kw["rmm_allocator_external_lib"] = lib
        else:
            log.warning("this dask-cuda cannot make %s allocate through RMM; it keeps its own allocator", lib)
    return kw


def worker_memory_limit(memory_limit, n_workers: int):
    """Host memory per worker: ``auto``/None = the job's memory (SLURM allocation, else the machine) / workers."""
    if memory_limit not in (None, "auto"):
        return memory_limit
    from atlasflow.allocation import allocation_memory

    total = allocation_memory()
    if total is None:
        from distributed.system import MEMORY_LIMIT

        total = MEMORY_LIMIT
    return int(total / max(1, n_workers))


def fallback_worker_specs(devices: list[str], *, threads_per_worker: int = 1, memory_limit=None,
                          managed: bool = False) -> dict:
    """``SpecCluster`` worker specs: one Nanny per GPU, each seeing its own GPU first (as dask-cuda does)."""
    from distributed import Nanny

    specs = {}
    for i, dev in enumerate(devices):
        env = {"CUDA_VISIBLE_DEVICES": ",".join(devices[i:] + devices[:i])}
        if managed:
            env[MANAGED_ENV] = "1"
        specs[f"gpu-{dev}"] = {"cls": Nanny, "options": {
            "nthreads": int(threads_per_worker), "memory_limit": memory_limit, "env": env,
            "preload": ["atlasflow.gpu_cluster"],
        }}
    return specs


def dask_setup(worker) -> None:
    """Worker preload of the fallback cluster: CuPy allocates managed memory when the worker's env asks for it."""
    if os.environ.get(MANAGED_ENV) != "1":
        return
    import cupy

    cupy.cuda.set_allocator(cupy.cuda.MemoryPool(cupy.cuda.malloc_managed).malloc)
    log.info("worker %s: CuPy allocates managed memory", getattr(worker, "name", "?"))


def local_cuda_cluster(preset: str = "capacity", n_workers: int | None = None, devices=None, *,
                       memory_limit="auto", use_dask_cuda: bool | None = None, **overrides):
    """A local cluster of one single-threaded worker per GPU with a preset's settings (see module doc).

    ``devices``: GPU ids ("0,1", [0, 1]); default ``CUDA_VISIBLE_DEVICES`` or all GPUs. ``n_workers`` above
    the number of GPUs is lowered to it (one worker per GPU). ``overrides`` change single preset options
    (``protocol``, ``rmm_pool_size``, ``rmm_managed_memory``, ``threads_per_worker``, ...).
    ``use_dask_cuda``: None = when installed.
    """
    import logging as _logging

    opts = preset_options(preset, **overrides)
    devs = parse_devices(devices)
    n = len(devs) if n_workers is None else int(n_workers)
    if n < 1:
        raise ConfigError(f"gpu cluster: n_workers must be >= 1, got {n}")
    if n > len(devs):
        log.info("gpu cluster: %d workers asked, %d GPU(s) visible: one worker per GPU", n, len(devs))
        n = len(devs)
    devs = devs[:n]
    memory_limit = worker_memory_limit(memory_limit, n)
    if use_dask_cuda is None:
        use_dask_cuda = dask_cuda_available()
    if use_dask_cuda:
        if opts["protocol"] == "ucx" and not ucx_available():
            raise ConfigError("gpu preset performance uses UCX, which is not installed (pip install "
                              "distributed-ucxx-cu12 or -cu13); use --gpu-preset capacity")
        from dask_cuda import LocalCUDACluster

        kw = dask_cuda_kwargs(opts, inspect.signature(LocalCUDACluster).parameters)
        cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=",".join(devs), n_workers=n, memory_limit=memory_limit,
                                   dashboard_address=":0", silence_logs=_logging.ERROR, **kw)
        log.info("started a dask-cuda cluster (%s preset: %s) with %d worker(s) on GPU(s) %s",
                 preset, ", ".join(f"{k}={v}" for k, v in kw.items()), n, ",".join(devs))
        return cluster
    from distributed import Scheduler, SpecCluster

    log.warning("dask-cuda is not installed: plain Dask cluster, one worker per GPU (%s) with its own "
                "CUDA_VISIBLE_DEVICES, TCP, CuPy's %s allocator (no RMM, no UCX)", ",".join(devs),
                "managed-memory" if opts["rmm_managed_memory"] else "default pool")
    specs = fallback_worker_specs(devs, threads_per_worker=opts["threads_per_worker"], memory_limit=memory_limit,
                                  managed=bool(opts["rmm_managed_memory"]))
    return SpecCluster(workers=specs, scheduler={"cls": Scheduler, "options": {"dashboard_address": ":0"}},
                       silence_logs=_logging.ERROR, name="atlasflow-gpu")
