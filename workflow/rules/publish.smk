# Upload a run's final model, tokenizer and model card to the Hugging Face Hub
# (runs with publish.repo_id, or a sweep's best member; publish.dry_run writes the folder
# only). Needs the internet:
# a local rule, like the downloads (the login node in the cluster profiles).


rule publish_run:
    input:
        unpack(publish_inputs),
        script=f"{SCRIPTS}/publish.py",
    output:
        folder=directory("results/{run}/publish"),
        receipt="results/{run}/publish.json",
    log:
        "logs/publish/{run}.log",
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    params:
        run=published_run,
        spec=publish_spec,
        settings=publish_settings,
        metrics=publish_metrics_arg,
    shell:
        "python {input.script} --run {params.run} --spec {params.spec:q}"
        " --model {input.model} {params.metrics} --settings {params.settings:q}"
        " --out {output.folder} --receipt {output.receipt} > {log} 2>&1"


# `snakemake publish` (or --until publish): every run and sweep with publish.repo_id.
rule publish:
    input:
        publish_targets,
