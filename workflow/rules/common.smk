"""Helpers for the rule files (config checking, datasets) and what every stage rule needs.

A stage rule is written with these helpers only; rules/preprocess.smk is the model to copy. Its named
input `input` is the previous stage's store(...), its named outputs are `output` (the directory() of
store(stage)) and `summary` (summary_json(stage)); params are **stage_params(stage); log, benchmark,
threads and resources come from log_file, benchmark_file, rule_threads, rule_mem_mb, rule_gpus and
rule_runtime; conda is conda_env(stage) (envs/cpu.yaml, or envs/gpu.yaml for a GPU job) and script
../../scripts/<stage>.py (paths relative to the rule file). A
rule file appends its stages to PIPELINE in workflow order, and the `all` target builds the last one.

The names of `input`, `output`, `summary` and of every param are the argparse destinations of the stage
script (atlasflow.cli.args_from_snakemake). Inputs with other names (`gene_lists`, `samples`) are only
there so that Snakemake re-runs a stage when those files change; the script ignores them.
"""

import copy
import difflib
import math
import os
import re
import sys
from pathlib import Path

import yaml
from snakemake.exceptions import WorkflowError

#: The repository root (the folder holding workflow/, scripts/, resources/).
ROOT = Path(workflow.basedir).resolve().parent
SCHEMA_FILE = ROOT / "workflow" / "schemas" / "config.schema.yaml"
SAMPLES_SCHEMA_FILE = ROOT / "workflow" / "schemas" / "samples.schema.yaml"
# envs/cpu.post-deploy.sh installs atlasflow from here into a rule's conda environment
os.environ.setdefault("ATLASFLOW_ROOT", str(ROOT))
with open(SCHEMA_FILE) as _fh:
    SCHEMA = yaml.safe_load(_fh)

#: Top-level config sections that are not stage parameters.
GLOBAL_SECTIONS = ("datasets", "chunk_rows", "backend", "dask", "gpu", "resources")
#: Stage sections: every other top-level object of the schema (its keys are the stage's argparse dests).
STAGE_SECTIONS = tuple(
    k for k, v in SCHEMA["properties"].items() if k not in GLOBAL_SECTIONS and v.get("type") == "object"
)
#: Stages in workflow order; each rule file appends its stages. `rule all` builds the last one.
PIPELINE = []
#: Further targets of `rule all`, as patterns with {dataset} (plots, reports, ...).
EXTRA_TARGETS = []
#: Where a raw store comes from: the rule that makes it.
SOURCES = ("simulate", "path", "sample_sheet")


# ------------------------------------------------------------------------------------------ config


def _section_schema(name):
    """A stand-alone schema for one top-level section (keeps the shared $defs)."""
    return {"$schema": SCHEMA["$schema"], "$defs": SCHEMA.get("$defs", {}), **SCHEMA["properties"][name]}


def _allowed_keys(schema):
    """Keys a schema accepts, following one $ref (for the did-you-mean hint)."""
    if "$ref" in schema:
        schema = SCHEMA["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
    return list(schema.get("properties", {}))


def config_error(lines):
    """Stop the run on configuration problems: one line each, first on stderr, exit status 1.

    A WorkflowError raised while the Snakefile is parsed would be printed by Snakemake as
    'WorkflowError in file .../common.smk, line N:' with the message and a trace through the rule
    files under it, and, in a dry run, on stdout (Snakemake 9 logs a dry run there). Printing the
    lines ourselves and exiting puts them first and alone; Snakemake has nothing to clean up yet.
    """
    print("\n".join(lines), file=sys.stderr, flush=True)
    sys.exit(1)


def check_site_placeholders():
    """Refuse a profile whose site values are still the placeholders profiles/slurm ships (`<your-partition>`),
    one line: SLURM would reject every job, or silently queue it nowhere, after the DAG is built."""
    args = getattr(workflow.resource_settings.default_resources, "args", None) or []
    left = [a for a in args if re.search(r"<your-[\w-]+>", str(a))]
    if left:
        config_error([f"default-resources: {', '.join(left)} is a placeholder of profiles/slurm: set your site's "
                      "value in the profile (sinfo -s lists partitions; see profiles/slurm/README.md)"])


def _deref(schema):
    """A schema with its $ref (into the config schema's $defs) resolved; sibling keys win."""
    if isinstance(schema, dict) and "$ref" in schema:
        target = SCHEMA["$defs"][schema["$ref"].rsplit("/", 1)[-1]]
        return {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema if isinstance(schema, dict) else {}


def _non_finite(instance, schema, where):
    """NaN and infinite numbers (YAML .nan/.inf, "inf" in a sheet), one line each: JSON Schema's bounds
    let NaN through (every comparison with it is false). A key whose schema has `x-allow-non-finite: true`
    may hold them. Dataset overrides are judged against their stage section's schema."""
    lines = []

    def walk(value, sub, path):
        sub = _deref(sub)
        if isinstance(value, float) and not math.isfinite(value):
            if not sub.get("x-allow-non-finite"):
                lines.append(f"{path}: {value} is not a finite number")
        elif isinstance(value, dict):
            props, extra = sub.get("properties", {}), sub.get("additionalProperties")
            for key, item in value.items():
                if sub is _OVERRIDES_SCHEMA and key in SCHEMA["properties"]:
                    walk(item, SCHEMA["properties"][key], f"{path}.{key}")
                else:
                    walk(item, props.get(key, extra), f"{path}.{key}")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, sub.get("items"), f"{path}.{i}")

    walk(instance, schema, where)
    return lines


_OVERRIDES_SCHEMA = SCHEMA["$defs"]["dataset"]["properties"]["overrides"]


def _config_errors(instance, schema, where="config"):
    """Every schema violation of `instance`, one line each, naming the offending key by its dotted path
    (and every NaN or infinite number, which the schema's bounds cannot catch)."""
    from jsonschema import Draft202012Validator

    lines = _non_finite(instance, schema, where)
    for err in sorted(Draft202012Validator(schema).iter_errors(instance), key=lambda e: list(map(str, e.path))):
        path = ".".join([where, *map(str, err.absolute_path)])
        if err.validator == "additionalProperties" and isinstance(err.instance, dict):
            allowed = _allowed_keys(err.schema)
            for key in sorted(set(err.instance) - set(allowed)):
                hint = difflib.get_close_matches(key, allowed, n=1)
                hint = f" (did you mean {hint[0]!r}?)" if hint else ""
                known = f"; known keys: {', '.join(allowed)}" if allowed else ""
                lines.append(f"{path}.{key}: unknown key{hint}{known}")
        elif err.validator == "propertyNames":
            lines.append(f"{path}: invalid name {err.instance!r} ({err.message})")
        elif err.validator == "not" and isinstance(err.validator_value, dict) and "const" in err.validator_value:
            lines.append(f"{path}: must not be {err.validator_value['const']!r}")
        elif _is_non_finite(err.instance):
            continue  # reported once by _non_finite (NaN fails some checks, e.g. const, with odd messages)
        elif err.validator in _BOUNDS:
            lines.append(f"{path}: must be {_BOUNDS[err.validator]} {err.validator_value}, not {err.instance!r}")
        else:
            lines.append(f"{path}: {err.message}")
    return sorted(lines)


#: JSON Schema's bound keywords as the comparison a value must pass (the stage scripts word them alike).
_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}


def _is_non_finite(value):
    return isinstance(value, float) and not math.isfinite(value)


def check_config(cfg):
    """Fail with every config problem at once (unknown keys, wrong types, values out of bounds, NaN),
    before defaults are filled.

    fill_defaults() validates too, but stops at the first error; this check
    runs first so a user sees all mistakes, each as ``config.<dotted.key>: problem`` (config_error).
    """
    coerce_command_line_values(cfg, SCHEMA)
    errors = _config_errors(cfg, SCHEMA)
    if errors:
        config_error(errors)


def fill_defaults(cfg):
    """Validate cfg against the config schema and fill the schema's defaults into it, in place.

    Snakemake's validate() does the same in the main process, but before Snakemake 9.15 it returns at once
    inside a cluster job (workflow.remote_exec), so a SLURM job saw the config without its defaults and
    failed parsing the Snakefile (KeyError on a section the user left out). Filling them here, the same
    way (jsonschema's documented default-filling validator), gives every process the same config.
    """
    from jsonschema import Draft202012Validator, validators

    check_properties = Draft202012Validator.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for key, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(key, copy.deepcopy(sub["default"]))
        yield from check_properties(validator, properties, instance, schema)

    filling = validators.extend(Draft202012Validator, {"properties": properties_with_defaults})
    filling(SCHEMA).validate(cfg)


def coerce_command_line_values(value, schema):
    """Read text where the schema wants a number, boolean or null as YAML, in place.

    `snakemake --config leiden='{resolution: 0.8}'` gives {'resolution': '0.8'}: Snakemake reads nested
    command-line values with YAML's BaseLoader, which keeps every scalar as text. A value read back as a
    type its key accepts (and the key does not accept text) is replaced; anything else is left to the
    schema's one-line error.
    """
    schema = _deref(schema)
    if isinstance(value, dict):
        props, extra = schema.get("properties", {}), schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key, extra if isinstance(extra, dict) else {})
            if isinstance(item, str):
                value[key] = _typed(item, sub)
            else:
                coerce_command_line_values(item, sub)
    elif isinstance(value, list):
        items = schema.get("items", {})
        for i, item in enumerate(value):
            if isinstance(item, str):
                value[i] = _typed(item, items)
            else:
                coerce_command_line_values(item, items)


def _typed(text, schema):
    schema = _deref(schema)
    types = schema.get("type", [])
    types = [types] if isinstance(types, str) else list(types)
    for option in schema.get("anyOf", []) + schema.get("oneOf", []):
        option_type = _deref(option).get("type", [])
        types += [option_type] if isinstance(option_type, str) else list(option_type)
    if not types or "string" in types:
        return text
    try:
        parsed = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    kinds = {"number": (int, float), "integer": (int,), "boolean": (bool,), "null": (type(None),),
             "array": (list,), "object": (dict,)}
    ok = any(isinstance(parsed, kinds.get(t, ())) and not (t in ("number", "integer") and isinstance(parsed, bool))
             for t in types)
    if ok and isinstance(parsed, (list, dict)):
        coerce_command_line_values(parsed, schema)
    return parsed if ok else text


#: Cut-off pairs no value can pass when low > high: (section, low key, high key, what it means).
ORDERED_KEYS = (
    ("filter", "min_genes", "max_genes", "no cell can pass both"),
    ("filter", "min_counts", "max_counts", "no cell can pass both"),
    ("hvg", "min_mean", "max_mean", "no gene can pass both"),
    ("hvg", "min_disp", "max_disp", "no gene can pass both"),
    ("umap", "min_dist", "spread", "UMAP needs min_dist <= spread"),
)


def _order_errors(cfg):
    """ORDERED_KEYS pairs the wrong way round, globally and per dataset (with its overrides), naming both keys."""
    lines = []
    for section, low, high, why in ORDERED_KEYS:
        checks = [(None, cfg[section])]
        checks += [(name, dataset_config(name, section)) for name, spec in DATASETS.items()
                   if section in spec.get("overrides", {})]
        for name, values in checks:
            lo, hi = values.get(low), values.get(high)
            if lo is None or hi is None or not lo > hi:
                continue
            own = DATASETS[name].get("overrides", {}).get(section, {}) if name else {}
            if name and low not in own and high not in own:
                continue  # the global pair, reported once
            where = {k: f"config.datasets.{name}.overrides.{section}.{k}" if k in own else f"config.{section}.{k}"
                     for k in (low, high)}
            lines.append(f"{where[low]} ({lo}) is above {where[high]} ({hi}): {why}")
    return lines


def _merge(base, update):
    """Deep merge of two dicts (update wins); neither input is modified."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def prepare_config(cfg):
    """After fill_defaults(): datasets, per-dataset overrides, sample sheets, GPUs."""
    global DATASETS, SIMULATED, INGESTED, SAMPLE_SHEETS
    DATASETS = {name: spec for name, spec in cfg["datasets"].items() if spec is not None}
    if not DATASETS:
        config_error(["config.datasets: no dataset is configured (all are missing or null)"])
    errors = []
    for name, spec in DATASETS.items():
        given = [k for k in SOURCES if k in spec]
        if len(given) != 1:
            errors.append(f"config.datasets.{name}: give exactly one of {', '.join(SOURCES)} "
                          f"(found {', '.join(given) or 'none'})")
        for stage, values in spec.get("overrides", {}).items():
            where = f"config.datasets.{name}.overrides.{stage}"
            if stage not in STAGE_SECTIONS:
                hint = difflib.get_close_matches(stage, STAGE_SECTIONS, n=1)
                errors.append(f"{where}: unknown stage section" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                              + f"; known: {', '.join(STAGE_SECTIONS)}")
            else:
                errors += _config_errors(values, _section_schema(stage), where)
        if "path" in spec and not os.path.exists(spec["path"]) and not os.path.exists(store("ingest").format(
                dataset=name)):  # once ingested, a raw file that is gone is not needed (unless ingest reruns)
            errors.append(f"config.datasets.{name}.path: {spec['path']} not found "
                          f"(relative paths are from the working directory, {os.getcwd()})")
    if not errors:
        errors = _order_errors(cfg)
    if errors:
        config_error(errors)
    SIMULATED = sorted(n for n, s in DATASETS.items() if "simulate" in s)
    INGESTED = sorted(n for n in DATASETS if n not in SIMULATED)
    SAMPLE_SHEETS = {n: _read_sample_sheet(n, s["sample_sheet"]) for n, s in DATASETS.items() if "sample_sheet" in s}
    devices = cfg["gpu"]["devices"]
    if devices is not None:  # set, not read: local jobs inherit it, SLURM's default --export=ALL passes it on
        visible = ",".join(map(str, devices)) if isinstance(devices, list) else str(devices)
        os.environ.update(CUDA_VISIBLE_DEVICES=visible)


def _read_sample_sheet(dataset, sheet):
    """Validate a sample sheet (samples.schema.yaml) and return its samples' data paths that exist."""
    import pandas as pd

    path = Path(sheet)
    if not path.is_file():
        config_error([f"config.datasets.{dataset}.sample_sheet: {sheet} not found"])
    table = pd.read_csv(path, sep="\t", dtype={"sample": str, "path": str}, comment="#")
    table.columns = [str(c).strip() for c in table.columns]
    with open(SAMPLES_SCHEMA_FILE) as fh:
        schema = yaml.safe_load(fh)
    errors = []
    missing = [c for c in schema["required"] if c not in table.columns]
    if missing:
        errors.append(f"missing column(s) {', '.join(missing)} (has: {', '.join(table.columns)}; "
                      "the sheet must be tab-separated)")
    else:
        numeric = [k for k, v in schema["properties"].items() if v.get("type") == "number"]
        for i, row in enumerate(table.to_dict("records")):
            row = {k: v for k, v in row.items() if pd.notnull(v)}  # an empty cell = not given
            for key in numeric:  # a column with one bad value is read as text: judge each cell
                if isinstance(row.get(key), str):
                    try:
                        row[key] = float(row[key])
                    except ValueError:
                        pass
            errors += [e.replace(f"line {i + 2}.", f"line {i + 2}, column ", 1)
                       for e in _config_errors(row, schema, where=f"line {i + 2}")]
        dups = sorted(table.loc[table["sample"].duplicated(), "sample"].unique())
        if dups:
            errors.append(f"duplicate sample name(s) {', '.join(dups)}")
    if errors:
        config_error([f"config.datasets.{dataset}.sample_sheet: {sheet}: {e}" for e in errors])
    paths = []
    for entry in table["path"]:  # looked up as atlasflow.io.samplesheet does: working dir, then the sheet's folder
        for base in (Path.cwd(), path.parent):
            if (base / entry).exists():
                paths.append(str(base / entry))
                break
    return paths


def dataset_config(dataset, section):
    """The config section as it applies to one dataset (global values, then the dataset's overrides)."""
    spec = DATASETS[dataset]
    if section == "simulate":
        return spec["simulate"]
    return _merge(config[section], spec.get("overrides", {}).get(section, {}))


def resolve_resource(path):
    """A relative path from the config, as found: the working directory first, then the repository."""
    if path is None or os.path.isabs(path) or os.path.exists(path):
        return path
    repo = ROOT / path
    return str(repo) if repo.exists() else path


# ------------------------------------------------------------------------------------------ paths


def store(stage):
    """The Zarr store a stage writes, as a pattern with {dataset}."""
    return f"results/{{dataset}}/{stage}.zarr"


def summary_json(stage):
    """The JSON summary beside a stage's store."""
    return f"results/{{dataset}}/{stage}.json"


def log_file(stage):
    return f"logs/{{dataset}}/{stage}.log"


def benchmark_file(stage):
    return f"logs/{{dataset}}/{stage}.benchmark.tsv"


def regex_of(names):
    """A wildcard constraint matching exactly these dataset names (nothing when empty)."""
    return "|".join(re.escape(n) for n in names) if names else "(?!x)x"


# ------------------------------------------------------------------------------------------ inputs


def raw_store(wildcards):
    """The first store of a dataset: simulated or ingested."""
    stage = "simulate" if wildcards.dataset in SIMULATED else "ingest"
    return store(stage).format(dataset=wildcards.dataset)


def ingest_inputs(wildcards):
    """ingest reads `input` (one path) or `sample_sheet`; `samples` only tracks the sheet's data files."""
    spec = DATASETS[wildcards.dataset]
    if "path" in spec:
        return {"input": spec["path"]}
    return {"sample_sheet": spec["sample_sheet"], "samples": SAMPLE_SHEETS[wildcards.dataset]}


def gene_list_files(wildcards):
    """QC gene lists given as files (tracked as inputs so that editing one re-runs qc)."""
    sets = dataset_config(wildcards.dataset, "qc")["gene_sets"]
    specs = [spec for s in sets.values() for spec in (s, s.get("mouse") or {})]
    return [resolve_resource(s[k]) for s in specs for k in ("genes_file", "ids_file") if s.get(k)]


def per_sample_input(wildcards):
    """filter's per-sample thresholds TSV as a named input `per_sample` (or nothing)."""
    value = dataset_config(wildcards.dataset, "filter")["per_sample"]
    if value is True:
        sheet = DATASETS[wildcards.dataset].get("sample_sheet")
        return {"per_sample": sheet} if sheet else {}
    return {"per_sample": resolve_resource(value)} if value else {}


# ------------------------------------------------------------------------------------------ params


def _value_of(stage, key):
    def value(wildcards):
        v = dataset_config(wildcards.dataset, stage)[key]
        if stage == "qc" and key == "gene_sets":
            v = {name: _resolved_gene_set(s) for name, s in v.items()}
        return v

    return value


def _resolved_gene_set(spec):
    """A QC gene set with its list files (and those of its mouse rules) resolved as resources."""
    spec = {**spec, **{k: resolve_resource(spec[k]) for k in ("genes_file", "ids_file") if spec.get(k)}}
    if spec.get("mouse"):
        spec["mouse"] = _resolved_gene_set(spec["mouse"])
    return spec


def _execution(value):
    """An execution setting as a param that does not trigger re-runs.

    Snakemake re-runs a job when a param's value changes, except for params computed by a function
    that takes `threads` (or input/output/resources): those count as derived from what is tracked
    anyway. Where and how a stage computes (cluster, workers, memory, backend, chunking) does not
    change its result beyond floating-point rounding, so these params take `threads`.
    """

    def get(wildcards, threads):
        return value(wildcards, threads) if callable(value) else value

    return get


def _chunk_rows(wildcards, threads):
    own = DATASETS[wildcards.dataset].get("chunk_rows")
    return own if own is not None else config["chunk_rows"]


def _memory_limit(wildcards, threads, resources):
    """Per-worker memory of a local cluster: auto = the rule's mem_mb split over its workers."""
    limit = config["dask"]["memory_limit"]
    if limit is None:
        return "auto"  # Dask's choice (the SLURM allocation when there is one)
    if limit == "auto":
        workers = config["dask"]["n_workers"] or threads or 1
        return int(resources.mem_mb) * 1_000_000 // int(workers)
    return limit


def runtime_params():
    """Params every stage script takes: chunking, cluster to attach to or start, backend (not re-run triggers)."""
    return {
        "chunk_rows": _execution(_chunk_rows),
        "scheduler_file": _execution(config["dask"]["scheduler_file"]),
        "address": _execution(config["dask"]["address"]),
        "n_workers": _execution(config["dask"]["n_workers"]),
        "memory_limit": _memory_limit,
        "backend": _execution(config["backend"]),
        "gpu_preset": _execution(config["gpu"]["preset"]),
    }


#: Param names Snakemake reserves; atlasflow.cli maps `<name>_` back to the stage's `<name>`.
RESERVED_NAMES = ("keys", "items", "values", "get", "size")


def stage_params(stage, exclude=()):
    """Rule params of a stage: its config section (keys = argparse dests, per dataset) + runtime_params()."""
    if stage == "simulate":
        keys = list(SCHEMA["$defs"]["simulate"]["properties"])
    else:
        keys = list(config[stage])
    # a few names are reserved by Snakemake (keys, items, ...): such a param travels as `<name>_`
    params = {(f"{key}_" if key in RESERVED_NAMES else key): _value_of(stage, key) for key in keys if key not in exclude}
    params.update(runtime_params())
    return params


# ------------------------------------------------------------------------------------------ resources


def _resource(stage, key):
    res = config["resources"]
    own = res.get(stage) or {}
    return own[key] if key in own else res["default"][key]


def rule_threads(stage):
    return _resource(stage, "threads")


def rule_mem_mb(stage):
    """mem_mb of a stage's job; a retried job (`--retries`, attempt n) asks for n x the configured value."""
    mem_mb = _resource(stage, "mem_mb")
    return lambda wildcards, attempt: mem_mb * attempt


#: Stages that compute with the configured backend (the others only read files or plot). With backend gpu
#: their jobs ask for a GPU and run in envs/gpu.yaml. Every stage rule asks rule_gpus/conda_env, so this
#: list is the one place that decides.
GPU_STAGES = ("qc", "filter", "normalize", "log1p", "hvg", "subset", "regress_out", "scale", "pca", "score_genes",
              "neighbors", "leiden", "louvain", "umap", "rank_genes_groups", "aggregate")


def rule_gpus(stage):
    """GPUs a stage's job asks for (Snakemake resource `gpu`): 1 with backend gpu, else 0.

    The SLURM executor turns gpu=1 into `--gpus=1` (SLURM then sets CUDA_VISIBLE_DEVICES to the job's card);
    locally, profiles/local's `resources: gpu: 1` lets one GPU job run at a time, so two never share a card.
    backend auto asks for none: it uses a GPU only where the job happens to see one.
    """
    return 1 if config["backend"] == "gpu" and stage in GPU_STAGES else 0


def conda_env(stage):
    """Conda environment of a stage's job, relative to the rules folder: envs/gpu.yaml for GPU jobs, else cpu."""
    return "../../envs/gpu.yaml" if rule_gpus(stage) else "../../envs/cpu.yaml"


def rule_runtime(stage):
    """runtime (minutes) of a stage's job, growing with the attempt like rule_mem_mb."""
    runtime = _resource(stage, "runtime")
    return lambda wildcards, attempt: runtime * attempt


# ------------------------------------------------------------------------------------------ shared cluster

#: Where the per-run shared clusters (dask.shared_cluster) keep their files, in the working directory: one
#: folder per run, run-<pid>-<start>/ (scheduler.json, its .pids.json record, logs), so that two runs on
#: different targets in one folder (Snakemake's lock allows them) never touch each other's cluster.
SHARED_CLUSTER_DIR = Path(".snakemake", "atlasflow")
#: Scheduler file of this run's shared cluster: set by start_shared_cluster(), None while it started none.
SHARED_SCHEDULER_FILE = None


def start_shared_cluster():
    """onstart: with dask.shared_cluster, one Dask cluster for every stage job of this (local) run.

    Its scheduler file, in this run's own folder under SHARED_CLUSTER_DIR, goes to the jobs through
    ATLASFLOW_SCHEDULER_FILE (local jobs inherit the environment). Its owner is this Snakemake process: a
    watchdog stops the cluster within shared_cluster.ORPHAN_WITHIN_S seconds once the process is gone,
    however it ended (SIGKILL included); the folders of runs that are gone are removed here. Skipped, with a
    log line, where it cannot serve the jobs: under a cluster executor (onstart runs on the submit host),
    when dask.scheduler_file/address already name a cluster, for the gpu/auto backends, or when the stages
    run in another Python (conda/apptainer) or atlasflow is not importable here.
    """
    from snakemake.logging import logger

    if not config["dask"]["shared_cluster"]:
        return
    if not workflow.local_exec:
        logger.warning("atlasflow: dask.shared_cluster is ignored under a cluster executor (it would run on the "
                       "submit host): each job starts its own cluster, or set dask.scheduler_file to a cluster "
                       "started for the run (hpc/dask_cluster.sbatch)")
        return
    if config["dask"]["scheduler_file"] or config["dask"]["address"] or os.environ.get("ATLASFLOW_SCHEDULER_FILE"):
        logger.info("atlasflow: dask.shared_cluster not started: the stages attach to the cluster named by "
                    "dask.scheduler_file/address (or ATLASFLOW_SCHEDULER_FILE)")
        return
    if config["backend"] != "cpu":  # the shared workers are CPU workers
        logger.info(f"atlasflow: dask.shared_cluster not started for backend {config['backend']}: each stage "
                    "starts its own (GPU) cluster")
        return
    if workflow.deployment_settings.deployment_method:  # conda/apptainer: the stages' Python is not this one
        logger.info("atlasflow: dask.shared_cluster not started: stages run in conda/apptainer environments, "
                    "the cluster would run in Snakemake's; each stage starts its own cluster")
        return
    try:
        from atlasflow import shared_cluster
        from distributed.system import MEMORY_LIMIT
    except ImportError as exc:
        logger.warning(f"atlasflow: dask.shared_cluster not started ({exc}): each stage starts its own cluster")
        return
    from atlasflow.cluster import check_memory_limit
    from atlasflow.errors import AtlasflowError

    global SHARED_SCHEDULER_FILE
    n_workers = config["dask"]["n_workers"] or workflow.cores
    limit = config["dask"]["memory_limit"]
    try:
        check_memory_limit(limit, "dask.memory_limit (--memory-limit)")  # before any process starts
    except AtlasflowError as exc:
        raise WorkflowError(f"invalid configuration: {exc}") from None
    if limit in (None, "auto"):  # the run's mem_mb budget (--resources), else the machine, over the workers
        budget = getattr(workflow.global_resources.get("mem_mb"), "value", None)
        limit = int(budget * 1_000_000 if isinstance(budget, int) else MEMORY_LIMIT) // int(n_workers)
    owner = os.getpid()  # this Snakemake process: its cluster ends when it does
    shared_cluster.prune_runs(SHARED_CLUSTER_DIR)
    scheduler_file = shared_cluster.run_dir(SHARED_CLUSTER_DIR, owner) / "scheduler.json"
    try:
        shared_cluster.start(scheduler_file, n_workers=int(n_workers), memory_limit=str(limit), owner_pid=owner)
    except AtlasflowError as exc:
        raise WorkflowError(f"atlasflow: the shared Dask cluster did not start: {exc}") from None
    SHARED_SCHEDULER_FILE = scheduler_file
    os.environ.update(ATLASFLOW_SCHEDULER_FILE=str(scheduler_file.resolve()))  # what the jobs attach to
    logger.info(f"atlasflow: shared Dask cluster with {n_workers} workers ({scheduler_file})")


def stop_shared_cluster(success=True):
    """onsuccess/onerror: stop the cluster this run's start_shared_cluster() started, and no other.

    After a success its folder goes too; after an error its logs stay (the next run removes them).
    """
    global SHARED_SCHEDULER_FILE
    if SHARED_SCHEDULER_FILE is None:
        return
    scheduler_file, SHARED_SCHEDULER_FILE = SHARED_SCHEDULER_FILE, None
    if os.environ.get("ATLASFLOW_SCHEDULER_FILE") == str(scheduler_file.resolve()):
        os.environ.pop("ATLASFLOW_SCHEDULER_FILE")
    import shutil

    from atlasflow import shared_cluster

    shared_cluster.stop(scheduler_file, quiet=True)
    if success:
        shutil.rmtree(scheduler_file.parent, ignore_errors=True)


# ------------------------------------------------------------------------------------------ targets


def final_targets(wildcards):
    """Targets of the `all` rule (the last stage's store and summary of every dataset, plus EXTRA_TARGETS)."""
    if not PIPELINE:
        raise WorkflowError("no stage rules are included")
    targets = []
    for name in DATASETS:
        targets += [store(PIPELINE[-1]).format(dataset=name), summary_json(PIPELINE[-1]).format(dataset=name)]
        targets += [pattern.format(dataset=name) for pattern in EXTRA_TARGETS]
    return targets


def check_resources():
    """resources.<stage> must name a stage of the workflow (called once all rule files are included)."""
    known = ["default", "simulate", "ingest", *PIPELINE]
    unknown = [k for k in config["resources"] if k not in known]
    if unknown:
        lines = []
        for key in unknown:
            hint = difflib.get_close_matches(key, known, n=1)
            lines.append(f"config.resources.{key}: unknown stage" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                         + f"; known: {', '.join(known)}")
        config_error(lines)


# ------------------------------------------------------------------------------------------ features.smk inputs


def hvg_inputs(wildcards):
    """hvg reads log1p; the count-based flavors also read the filter stage's raw counts as `counts`."""
    flavor = dataset_config(wildcards.dataset, "hvg")["flavor"]
    inputs = {"input": store("log1p").format(**wildcards)}
    if flavor in ("seurat_v3", "seurat_v3_paper", "poisson_gene_selection"):
        inputs["counts"] = store("filter").format(**wildcards)
    return inputs


def filter_input(wildcards):
    """filter reads scrublet's store (qc's obs plus doublet scores; X linked) when scrublet.enabled, else qc's."""
    stage = "scrublet" if dataset_config(wildcards.dataset, "scrublet")["enabled"] else "qc"
    return store(stage).format(**wildcards)


def harmony_enabled(dataset):
    return bool(dataset_config(dataset, "harmony")["enabled"])


def neighbors_input(wildcards):
    """neighbors reads harmony's store (X_pca and X_pca_harmony) when harmony.enabled, else pca's."""
    return store("harmony" if harmony_enabled(wildcards.dataset) else "pca").format(**wildcards)


def neighbors_use_rep(wildcards):
    """neighbors.use_rep; unset with harmony.enabled: harmony's corrected embedding (else X_pca)."""
    use_rep = dataset_config(wildcards.dataset, "neighbors")["use_rep"]
    if use_rep is None and harmony_enabled(wildcards.dataset):
        return dataset_config(wildcards.dataset, "harmony")["adjusted_basis"]
    return use_rep


def scale_input(wildcards):
    """scale reads regress_out's store when regress_out.enabled, else subset's."""
    stage = "regress_out" if dataset_config(wildcards.dataset, "regress_out")["enabled"] else "subset"
    return store(stage).format(**wildcards)


def score_genes_files(wildcards):
    """Gene-list files of score_genes, tracked so that editing one re-runs the stage."""
    cfg = dataset_config(wildcards.dataset, "score_genes")
    return [resolve_resource(cfg[k]) for k in ("gene_list", "s_genes", "g2m_genes")
            if cfg[k] and os.path.exists(str(resolve_resource(cfg[k])))]


def _resolved(stage, key):
    return lambda wildcards: resolve_resource(dataset_config(wildcards.dataset, stage)[key])
