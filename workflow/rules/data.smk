# From raw rows to per-node training shards.


# A dataset with `clean` (snaketune.data.cleaning): each part of its rows signed by a job
# of its own (the parts of its tokenization), then one job deciding which rows go and why;
# the tokenize jobs read the sources without them.
rule clean_signatures:
    input:
        unpack(clean_inputs),
        script=f"{SCRIPTS}/clean_dataset.py",
    output:
        signatures="results/cleaned/{ckey}/signatures-{part}.parquet",
    log:
        "logs/clean_signatures/{ckey}/{part}.log",
    benchmark:
        "benchmarks/clean_signatures/{ckey}/{part}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=4000,
        runtime=240,
    params:
        spec=clean_spec,
    shell:
        "python {input.script} --spec {params.spec:q} --part {wildcards.part}"
        " --data {input.data} --heldout {input.heldout} --out {output.signatures} > {log} 2>&1"


rule clean_dataset:
    input:
        unpack(clean_inputs),
        signatures=clean_signatures,
        script=f"{SCRIPTS}/clean_dataset.py",
    output:
        removed="results/cleaned/{ckey}/removed.parquet",
        report="results/cleaned/{ckey}/report.json",
        provenance="results/cleaned/{ckey}/provenance.json",
    log:
        "logs/clean_dataset/{ckey}.log",
    benchmark:
        "benchmarks/clean_dataset/{ckey}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=8000,
        runtime=240,
    params:
        spec=clean_spec,
    shell:
        "python {input.script} --spec {params.spec:q} --heldout {input.heldout}"
        " --signatures {input.signatures} --out {output.removed} --report {output.report}"
        " > {log} 2>&1"


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
        removed=tokenize_removed,
    shell:
        "RAYON_NUM_THREADS={threads} python {input.script} --spec {params.spec:q}"
        " --data {input.data} --model {input.model} --out {output.data}"
        " --stats {output.stats} {params.removed} > {log} 2>&1"


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
        removed=tokenize_removed,
    shell:
        "RAYON_NUM_THREADS={threads} python {input.script} --spec {params.spec:q}"
        " --part {wildcards.part} --data {input.data} --model {input.model}"
        " --out {output.data} --stats {output.stats} {params.removed} > {log} 2>&1"


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
