# Fetch models and datasets. Local rules: they run where snakemake runs (the login node),
# since compute nodes are often offline.


rule download_model:
    input:
        unpack(model_source),
        script=f"{SCRIPTS}/download_model.py",
    output:
        model=directory("resources/models/{model}"),
    log:
        "logs/download_model/{model}.log",
    benchmark:
        "benchmarks/download_model/{model}.tsv"
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=4000,
        runtime=240,
    params:
        spec=model_spec,
    shell:
        "python {input.script} --name {wildcards.model} --spec {params.spec:q}"
        " --out {output.model} > {log} 2>&1"


rule download_dataset:
    input:
        unpack(dataset_source),
        script=f"{SCRIPTS}/download_dataset.py",
    output:
        data="resources/datasets/{dataset}/data.parquet",
        provenance="resources/datasets/{dataset}/provenance.json",
    log:
        "logs/download_dataset/{dataset}.log",
    benchmark:
        "benchmarks/download_dataset/{dataset}.tsv"
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=4000,
        runtime=240,
    params:
        spec=dataset_spec,
    shell:
        "python {input.script} --name {wildcards.dataset} --spec {params.spec:q}"
        " --out-dir resources/datasets/{wildcards.dataset} > {log} 2>&1"
