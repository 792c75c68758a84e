# Markers and pseudobulk: rank_genes_groups on the log1p store (labels from the leiden store),
# aggregate (pseudobulk) of the filter stage's raw counts by obs keys (e.g. leiden, sample).


# The aggregate rule's CSV outputs, one per aggregate.func: <csv_prefix>.<func>.csv, the prefix a pattern with
# {dataset} (default results/{dataset}/aggregate). The stage writes exactly these paths (its --csv).
# Outputs are patterns shared by every dataset, so a dataset cannot override func or csv_prefix.
for _name, _spec in DATASETS.items():
    for _key in ("func", "csv_prefix"):
        _own = _spec.get("overrides", {}).get("aggregate", {})
        if _key in _own and _own[_key] != config["aggregate"][_key]:
            raise WorkflowError(f"config.datasets.{_name}.overrides.aggregate.{_key}: cannot differ from "
                                f"config.aggregate.{_key} (they name the rule's CSV outputs)")
_prefix = config["aggregate"]["csv_prefix"]
if _prefix is None:
    _prefix = "results/{dataset}/aggregate"
elif _prefix.endswith(os.sep) or Path(_prefix).name in ("", ".", ".."):
    _folder = _prefix.rstrip(os.sep) or _prefix
    _example = os.path.join(_folder, *([] if "{dataset}" in _folder else ["{dataset}"]), "aggregate")
    raise WorkflowError(f"config.aggregate.csv_prefix: {_prefix!r} is a folder; the CSVs are "
                        f"<csv_prefix>.<func>.csv, so give a prefix of file names, e.g. {_example}")
elif "{dataset}" not in _prefix or any(c in _prefix.replace("{dataset}", "") for c in "{}"):
    raise WorkflowError(f"config.aggregate.csv_prefix: {_prefix!r} must contain {{dataset}} (and no other "
                        "braces): each dataset writes its own CSVs, e.g. results/{dataset}/pseudobulk")
AGGREGATE_CSVS = [f"{_prefix}.{func}.csv" for func in config["aggregate"]["func"]]
EXTRA_TARGETS.extend([store("rank_genes_groups"), "results/{dataset}/rank_genes_groups.csv", store("aggregate"),
                      *AGGREGATE_CSVS])


rule rank_genes_groups:
    input:
        input=store("log1p"),
        groups_store=store("leiden"),
    output:
        output=directory(store("rank_genes_groups")),
        summary=summary_json("rank_genes_groups"),
        markers_csv="results/{dataset}/rank_genes_groups.csv",
    params:
        **stage_params("rank_genes_groups"),
    log:
        log_file("rank_genes_groups"),
    benchmark:
        benchmark_file("rank_genes_groups")
    threads: rule_threads("rank_genes_groups")
    resources:
        mem_mb=rule_mem_mb("rank_genes_groups"),
        gpu=rule_gpus("rank_genes_groups"),
        runtime=rule_runtime("rank_genes_groups"),
    conda:
        conda_env("rank_genes_groups")
    script:
        "../../scripts/rank_genes_groups.py"


rule aggregate:
    input:
        input=store("filter"),
        groups_store=store("leiden"),
    output:
        output=directory(store("aggregate")),
        summary=summary_json("aggregate"),
        csv=AGGREGATE_CSVS,
    params:
        **stage_params("aggregate"),
    log:
        log_file("aggregate"),
    benchmark:
        benchmark_file("aggregate")
    threads: rule_threads("aggregate")
    resources:
        mem_mb=rule_mem_mb("aggregate"),
        gpu=rule_gpus("aggregate"),
        runtime=rule_runtime("aggregate"),
    conda:
        conda_env("aggregate")
    script:
        "../../scripts/aggregate.py"
