# Preprocessing: qc -> [scrublet ->] filter -> normalize -> log1p, each results/{dataset}/<stage>.zarr + .json
# (scrublet with scrublet.enabled: doublet scores per sample on the raw counts; filter may drop the doublets).


PIPELINE.extend(["qc", "filter", "normalize", "log1p"])


rule qc:
    input:
        input=raw_store,
        gene_lists=gene_list_files,
    output:
        output=directory(store("qc")),
        summary=summary_json("qc"),
    params:
        **stage_params("qc"),
    log:
        log_file("qc"),
    benchmark:
        benchmark_file("qc")
    threads: rule_threads("qc")
    resources:
        mem_mb=rule_mem_mb("qc"),
        gpu=rule_gpus("qc"),
        runtime=rule_runtime("qc"),
    conda:
        conda_env("qc")
    script:
        "../../scripts/qc.py"


rule scrublet:
    input:
        input=store("qc"),
    output:
        output=directory(store("scrublet")),
        summary=summary_json("scrublet"),
    params:
        **stage_params("scrublet", exclude=["enabled"]),
    log:
        log_file("scrublet"),
    benchmark:
        benchmark_file("scrublet")
    threads: rule_threads("scrublet")
    resources:
        mem_mb=rule_mem_mb("scrublet"),
        gpu=rule_gpus("scrublet"),
        runtime=rule_runtime("scrublet"),
    conda:
        conda_env("scrublet")
    script:
        "../../scripts/scrublet.py"


rule filter:
    input:
        unpack(per_sample_input),
        input=filter_input,
    output:
        output=directory(store("filter")),
        summary=summary_json("filter"),
    params:
        **stage_params("filter", exclude=["per_sample"]),
    log:
        log_file("filter"),
    benchmark:
        benchmark_file("filter")
    threads: rule_threads("filter")
    resources:
        mem_mb=rule_mem_mb("filter"),
        gpu=rule_gpus("filter"),
        runtime=rule_runtime("filter"),
    conda:
        conda_env("filter")
    script:
        "../../scripts/filter.py"


rule normalize:
    input:
        input=store("filter"),
    output:
        output=directory(store("normalize")),
        summary=summary_json("normalize"),
    params:
        **stage_params("normalize"),
    log:
        log_file("normalize"),
    benchmark:
        benchmark_file("normalize")
    threads: rule_threads("normalize")
    resources:
        mem_mb=rule_mem_mb("normalize"),
        gpu=rule_gpus("normalize"),
        runtime=rule_runtime("normalize"),
    conda:
        conda_env("normalize")
    script:
        "../../scripts/normalize.py"


rule log1p:
    input:
        input=store("normalize"),
    output:
        output=directory(store("log1p")),
        summary=summary_json("log1p"),
    params:
        **stage_params("log1p"),
    log:
        log_file("log1p"),
    benchmark:
        benchmark_file("log1p")
    threads: rule_threads("log1p")
    resources:
        mem_mb=rule_mem_mb("log1p"),
        gpu=rule_gpus("log1p"),
        runtime=rule_runtime("log1p"),
    conda:
        conda_env("log1p")
    script:
        "../../scripts/log1p.py"
