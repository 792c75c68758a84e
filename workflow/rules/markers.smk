# Markers and pseudobulk: rank_genes_groups on the log1p store (labels from the leiden store),
# aggregate (pseudobulk) of the filter stage's raw counts by obs keys (e.g. leiden, sample).


EXTRA_TARGETS.extend([store("rank_genes_groups"), "results/{dataset}/rank_genes_groups.csv", store("aggregate")])


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
        csv="results/{dataset}/aggregate.sum.csv",
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
