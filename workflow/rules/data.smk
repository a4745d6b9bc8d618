# From raw rows to per-node training shards.


rule tokenize_dataset:
    input:
        unpack(tokenize_inputs),
        script=f"{SCRIPTS}/tokenize_dataset.py",
    output:
        data="results/tokenized/{key}/data.parquet",
        stats="results/tokenized/{key}/stats.json",
        provenance="results/tokenized/{key}/provenance.json",
    log:
        "logs/tokenize_dataset/{key}.log",
    benchmark:
        "benchmarks/tokenize_dataset/{key}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: 8
    resources:
        mem_mb=8000,
        runtime=240,
    params:
        spec=tokenize_spec,
    shell:
        "RAYON_NUM_THREADS={threads} python {input.script} --spec {params.spec:q}"
        " --data {input.data} --model {input.model} --out {output.data}"
        " --stats {output.stats} > {log} 2>&1"


# A dataset with parts: N (snaketune.core.parts): N jobs of the same script, each on its own
# rows, and their index; the stages read the parts through the index, where they are.
rule tokenize_part:
    input:
        unpack(tokenize_inputs),
        script=f"{SCRIPTS}/tokenize_dataset.py",
    output:
        data="results/tokenized/{key}/part-{part}.parquet",
        stats="results/tokenized/{key}/part-{part}.stats.json",
        provenance="results/tokenized/{key}/part-{part}.provenance.json",
    log:
        "logs/tokenize_part/{key}/{part}.log",
    benchmark:
        "benchmarks/tokenize_part/{key}/{part}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    threads: 8
    resources:
        mem_mb=8000,
        runtime=240,
    params:
        spec=tokenize_spec,
    shell:
        "RAYON_NUM_THREADS={threads} python {input.script} --spec {params.spec:q}"
        " --part {wildcards.part} --data {input.data} --model {input.model}"
        " --out {output.data} --stats {output.stats} > {log} 2>&1"


rule index_parts:
    input:
        unpack(index_inputs),
        script=f"{SCRIPTS}/index_parts.py",
    output:
        index="results/tokenized/{key}/parts.json",
        provenance="results/tokenized/{key}/parts.provenance.json",
    log:
        "logs/index_parts/{key}.log",
    benchmark:
        "benchmarks/index_parts/{key}.tsv"
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        spec=tokenize_spec,
    shell:
        "python {input.script} --spec {params.spec:q} --model {input.model}"
        " --parts {input.parts} --out {output.index} > {log} 2>&1"


rule shard_dataset:
    input:
        unpack(shard_inputs),
        script=f"{SCRIPTS}/shard_dataset.py",
    # manifest: the shards' manifest again, beside them; the train stage reads the shards
    # through it, so shards cut again byte for byte (same manifest, same checksum) retrain
    # nothing (Snakemake compares a small input's checksum before its mtime)
    output:
        shards=directory("results/{run}/shards"),
        manifest="results/{run}/shards.manifest.json",
    log:
        "logs/shard_dataset/{run}.log",
    benchmark:
        "benchmarks/shard_dataset/{run}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        layout=shard_layout,
        packing=shard_packing_arg,
        attention=lookup(dpath="runs/{run}/attn_implementation", within=config),
        eval=shard_eval_arg,
    shell:
        "python {input.script} --tokenized {input.tokenized} {params.layout}"
        " {params.packing} --model {input.model} --attn-implementation {params.attention}"
        " {params.eval} --run {wildcards.run} --out {output.shards}"
        " --manifest {output.manifest} > {log} 2>&1"
