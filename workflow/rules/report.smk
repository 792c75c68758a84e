# Results people look at: PNG figures (results/{dataset}/plots/*.png), the final AnnData
# (results/{dataset}/final.zarr, optional final.h5ad) and the marker / pseudobulk tables, all in
# `snakemake --report report.html`. Include this file after every other rule file: what it builds depends
# on which rules exist (no umap rule: no UMAP figure; no rank_genes_groups rule: no marker figures).
#
# Settings: config sections `plots` and `final` when the schema has them, else REPORT_DEFAULTS below.


include: "report_helpers.smk"


rule plots:
    input:
        unpack(plot_inputs),
    output:
        **{name: report(plot_file(name), caption=f"../report/{FIGURES[name][0]}", category=FIGURES[name][1],
                        subcategory="{dataset}") for name in FIGURES_MADE},
        summary=summary_json("plots"),
    params:
        output="results/{dataset}/plots",
        plots=FIGURES_MADE,
        thresholds=qc_thresholds,
        batch_keys=batch_keys,
        **{k: report_setting("plots", k) for k in REPORT_DEFAULTS["plots"]},
        **runtime_params(),
    log:
        log_file("plots"),
    benchmark:
        benchmark_file("plots")
    threads: rule_threads("plots")
    resources:
        mem_mb=rule_mem_mb("plots"),
        gpu=rule_gpus("plots"),
        runtime=rule_runtime("plots"),
    conda:
        conda_env("plots")
    script:
        "../../scripts/plots.py"


rule final:
    input:
        unpack(final_inputs),
    output:
        output=directory(store("final")),
        summary=summary_json("final"),
    params:
        h5ad=final_h5ad,
        h5ad_max_gb=report_setting("final", "h5ad_max_gb"),
        **runtime_params(),
    log:
        log_file("final"),
    benchmark:
        benchmark_file("final")
    threads: rule_threads("final")
    resources:
        mem_mb=rule_mem_mb("final"),
        gpu=rule_gpus("final"),
        runtime=rule_runtime("final"),
    conda:
        conda_env("final")
    script:
        "../../scripts/final.py"


# Tables: every .csv output of the rank_genes_groups / aggregate rules, hard-linked (or copied) into
# results/{dataset}/report/ so that they appear in the report without touching those rules.
REPORT_TABLE_FILES = []
for _rule_name, (_prefix, _caption, _category) in TABLES.items():
    if not has_rule(_rule_name):
        continue
    for _csv in [str(f) for f in workflow.get_rule(_rule_name).output if str(f).endswith(".csv")]:
        _suffix = _Path(_csv).name[: -len(".csv")].split(".", 1)
        _table = _prefix + (f"_{_suffix[1]}" if len(_suffix) > 1 else "")
        _target = f"results/{{dataset}}/report/{_table}.csv"
        REPORT_TABLE_FILES.append(_target)

        rule:
            name:
                f"report_table_{_table}"
            input:
                csv=_csv,
            output:
                report(_target, caption=f"../report/{_caption}", category=_category, subcategory="{dataset}"),
            log:
                f"logs/{{dataset}}/report_table_{_table}.log",
            localrule: True
            conda:
                "../../envs/cpu.yaml"
            shell:
                "(ln -f {input.csv} {output} || cp {input.csv} {output}) 2> {log}"


PIPELINE.extend(["plots", "final"])  # `all` builds final (check_resources accepts resources.plots/final)
EXTRA_TARGETS.extend([plot_file(name) for name in FIGURES_MADE] + REPORT_TABLE_FILES)
