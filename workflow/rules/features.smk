# Features and embedding: hvg -> subset -> [regress_out] -> scale -> pca, plus optional gene scores.
# hvg marks genes on the full log1p store (seurat_v3/poisson flavors read the filter store's counts);
# subset writes the smaller matrix; scale writes dense X; pca adds obsm X_pca, varm PCs, uns pca (computed
# from scale's sparse input, scaled on the fly, when it is sparse).


PIPELINE.extend(["hvg", "subset", "scale", "pca"])


rule hvg:
    input:
        unpack(hvg_inputs),
    output:
        output=directory(store("hvg")),
        summary=summary_json("hvg"),
    params:
        **stage_params("hvg"),
    log:
        log_file("hvg"),
    benchmark:
        benchmark_file("hvg")
    threads: rule_threads("hvg")
    resources:
        mem_mb=rule_mem_mb("hvg"),
        gpu=rule_gpus("hvg"),
        runtime=rule_runtime("hvg"),
    conda:
        conda_env("hvg")
    script:
        "../../scripts/hvg.py"


rule subset:
    input:
        input=store("hvg"),
    output:
        output=directory(store("subset")),
        summary=summary_json("subset"),
    params:
        **stage_params("subset"),
    log:
        log_file("subset"),
    benchmark:
        benchmark_file("subset")
    threads: rule_threads("subset")
    resources:
        mem_mb=rule_mem_mb("subset"),
        gpu=rule_gpus("subset"),
        runtime=rule_runtime("subset"),
    conda:
        conda_env("subset")
    script:
        "../../scripts/subset.py"


rule regress_out:
    input:
        input=store("subset"),
    output:
        output=directory(store("regress_out")),
        summary=summary_json("regress_out"),
    params:
        **stage_params("regress_out", exclude=["enabled"]),
    log:
        log_file("regress_out"),
    benchmark:
        benchmark_file("regress_out")
    threads: rule_threads("regress_out")
    resources:
        mem_mb=rule_mem_mb("regress_out"),
        gpu=rule_gpus("regress_out"),
        runtime=rule_runtime("regress_out"),
    conda:
        conda_env("regress_out")
    script:
        "../../scripts/regress_out.py"


rule scale:
    input:
        input=scale_input,
    output:
        output=directory(store("scale")),
        summary=summary_json("scale"),
    params:
        **stage_params("scale"),
    log:
        log_file("scale"),
    benchmark:
        benchmark_file("scale")
    threads: rule_threads("scale")
    resources:
        mem_mb=rule_mem_mb("scale"),
        gpu=rule_gpus("scale"),
        runtime=rule_runtime("scale"),
    conda:
        conda_env("scale")
    script:
        "../../scripts/scale.py"


rule pca:
    input:
        input=store("scale"),
        unscaled=scale_input,  # when sparse, PCA scales it on the fly instead of reading dense X
    output:
        output=directory(store("pca")),
        summary=summary_json("pca"),
    params:
        **stage_params("pca"),
    log:
        log_file("pca"),
    benchmark:
        benchmark_file("pca")
    threads: rule_threads("pca")
    resources:
        mem_mb=rule_mem_mb("pca"),
        gpu=rule_gpus("pca"),
        runtime=rule_runtime("pca"),
    conda:
        conda_env("pca")
    script:
        "../../scripts/pca.py"


rule score_genes:
    input:
        input=store("log1p"),
        gene_lists=score_genes_files,
    output:
        output=directory(store("score_genes")),
        summary=summary_json("score_genes"),
    params:
        **stage_params("score_genes", exclude=["enabled", "gene_list", "s_genes", "g2m_genes"]),
        gene_list=_resolved("score_genes", "gene_list"),
        s_genes=_resolved("score_genes", "s_genes"),
        g2m_genes=_resolved("score_genes", "g2m_genes"),
    log:
        log_file("score_genes"),
    benchmark:
        benchmark_file("score_genes")
    threads: rule_threads("score_genes")
    resources:
        mem_mb=rule_mem_mb("score_genes"),
        gpu=rule_gpus("score_genes"),
        runtime=rule_runtime("score_genes"),
    conda:
        conda_env("score_genes")
    script:
        "../../scripts/score_genes.py"
