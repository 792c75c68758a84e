# The first store of every dataset: results/{dataset}/simulate.zarr (datasets with `simulate:`) or
# results/{dataset}/ingest.zarr (datasets with `path:` or `sample_sheet:`). Later stages start from
# raw_store(), which picks the right one.


rule simulate:
    output:
        output=directory(store("simulate")),
        summary=summary_json("simulate"),
    params:
        **stage_params("simulate"),
    log:
        log_file("simulate"),
    benchmark:
        benchmark_file("simulate")
    wildcard_constraints:
        dataset=regex_of(SIMULATED),
    threads: rule_threads("simulate")
    resources:
        mem_mb=rule_mem_mb("simulate"),
        gpu=rule_gpus("simulate"),
        runtime=rule_runtime("simulate"),
    conda:
        conda_env("simulate")
    script:
        "../../scripts/simulate.py"


rule ingest:
    input:
        unpack(ingest_inputs),
    output:
        output=directory(store("ingest")),
        summary=summary_json("ingest"),
    params:
        **stage_params("ingest"),
    log:
        log_file("ingest"),
    benchmark:
        benchmark_file("ingest")
    wildcard_constraints:
        dataset=regex_of(INGESTED),
    threads: rule_threads("ingest")
    resources:
        mem_mb=rule_mem_mb("ingest"),
        gpu=rule_gpus("ingest"),
        runtime=rule_runtime("ingest"),
    conda:
        conda_env("ingest")
    script:
        "../../scripts/ingest.py"
