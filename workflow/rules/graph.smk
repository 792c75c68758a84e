# Graph: [harmony ->] neighbors -> leiden and neighbors -> umap on obsm X_pca (or X_pca_harmony with harmony.enabled;
# in memory; X is linked, never read), louvain optional. With harmony.enabled and harmony.plot_uncorrected, the
# same two stages also run on the uncorrected X_pca (neighbors_uncorrected -> umap_uncorrected), only for the
# before/after figure umap_batch.


PIPELINE.extend(["neighbors", "leiden", "umap"])


rule harmony:
    input:
        input=store("pca"),
    output:
        output=directory(store("harmony")),
        summary=summary_json("harmony"),
    params:
        **stage_params("harmony", exclude=["enabled", "plot_uncorrected"]),
    log:
        log_file("harmony"),
    benchmark:
        benchmark_file("harmony")
    threads: rule_threads("harmony")
    resources:
        mem_mb=rule_mem_mb("harmony"),
        gpu=rule_gpus("harmony"),
        runtime=rule_runtime("harmony"),
    conda:
        conda_env("harmony")
    script:
        "../../scripts/harmony.py"


rule neighbors:
    input:
        input=neighbors_input,
    output:
        output=directory(store("neighbors")),
        summary=summary_json("neighbors"),
    params:
        **stage_params("neighbors", exclude=["use_rep"]),
        use_rep=neighbors_use_rep,
    log:
        log_file("neighbors"),
    benchmark:
        benchmark_file("neighbors")
    threads: rule_threads("neighbors")
    resources:
        mem_mb=rule_mem_mb("neighbors"),
        gpu=rule_gpus("neighbors"),
        runtime=rule_runtime("neighbors"),
    conda:
        conda_env("neighbors")
    script:
        "../../scripts/neighbors.py"


rule leiden:
    input:
        input=store("neighbors"),
    output:
        output=directory(store("leiden")),
        summary=summary_json("leiden"),
        metrics_csv="results/{dataset}/leiden.metrics.csv",
    params:
        **stage_params("leiden"),
    log:
        log_file("leiden"),
    benchmark:
        benchmark_file("leiden")
    threads: rule_threads("leiden")
    resources:
        mem_mb=rule_mem_mb("leiden"),
        gpu=rule_gpus("leiden"),
        runtime=rule_runtime("leiden"),
    conda:
        conda_env("leiden")
    script:
        "../../scripts/leiden.py"


rule umap:
    input:
        input=store("neighbors"),  # the graph, not the labels: a new resolution does not re-run umap
    output:
        output=directory(store("umap")),
        summary=summary_json("umap"),
    params:
        **stage_params("umap"),
    log:
        log_file("umap"),
    benchmark:
        benchmark_file("umap")
    threads: rule_threads("umap")
    resources:
        mem_mb=rule_mem_mb("umap"),
        gpu=rule_gpus("umap"),
        runtime=rule_runtime("umap"),
    conda:
        conda_env("umap")
    script:
        "../../scripts/umap.py"


# The same rules on the uncorrected X_pca (threads, resources, conda and script inherited).
use rule neighbors as neighbors_uncorrected with:
    input:
        input=store("pca"),
    output:
        output=directory(store("neighbors_uncorrected")),
        summary=summary_json("neighbors_uncorrected"),
    params:
        **stage_params("neighbors", exclude=["use_rep"]),
        use_rep="X_pca",
    log:
        log_file("neighbors_uncorrected"),
    benchmark:
        benchmark_file("neighbors_uncorrected")


use rule umap as umap_uncorrected with:
    input:
        input=store("neighbors_uncorrected"),
    output:
        output=directory(store("umap_uncorrected")),
        summary=summary_json("umap_uncorrected"),
    log:
        log_file("umap_uncorrected"),
    benchmark:
        benchmark_file("umap_uncorrected")


rule louvain:
    input:
        input=store("neighbors"),
    output:
        output=directory(store("louvain")),
        summary=summary_json("louvain"),
    params:
        **stage_params("louvain", exclude=["enabled"]),
    log:
        log_file("louvain"),
    benchmark:
        benchmark_file("louvain")
    threads: rule_threads("louvain")
    resources:
        mem_mb=rule_mem_mb("louvain"),
        gpu=rule_gpus("louvain"),
        runtime=rule_runtime("louvain"),
    conda:
        conda_env("louvain")
    script:
        "../../scripts/louvain.py"
