# From the final DeepSpeed checkpoint to a verified Hugging Face model (and merged LoRA).


rule convert_checkpoint:
    input:
        unpack(convert_inputs),
        script=f"{SCRIPTS}/convert_checkpoint.py",
        checkpoint="results/{run}/train/final_checkpoint",
        trained="results/{run}/train/model",
        probe="results/{run}/train/probe.safetensors",
        base=run_model,
    output:
        model=directory("results/{run}/{export}"),
    log:
        "logs/convert_checkpoint/{run}.{export}.log",
    benchmark:
        "benchmarks/convert_checkpoint/{run}.{export}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=planned_mem_mb("convert_checkpoint"),
        runtime=240,
    params:
        method=run_adapter_kind,
        max_shard_size=lookup(dpath="runs/{run}/export/max_shard_size", within=config),
        dtype=lookup(dpath="runs/{run}/export/dtype", within=config),
    shell:
        "python {input.script} --method {params.method} --checkpoint {input.checkpoint}"
        " --trained {input.trained} --base {input.base} --probe {input.probe} --out {output.model}"
        " --max-shard-size {params.max_shard_size:q} --dtype {params.dtype} > {log} 2>&1"


rule merge_lora:
    input:
        script=f"{SCRIPTS}/merge_lora.py",
        adapter="results/{run}/lora_adapters",
        probe="results/{run}/train/probe.safetensors",
        base=run_model,
    output:
        model=directory("results/{run}/merged_model"),
    log:
        "logs/merge_lora/{run}.log",
    benchmark:
        "benchmarks/merge_lora/{run}.tsv"
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=planned_mem_mb("merge_lora"),
        runtime=240,
    params:
        max_shard_size=lookup(dpath="runs/{run}/export/max_shard_size", within=config),
        dtype=lookup(dpath="runs/{run}/export/dtype", within=config),
    shell:
        "python {input.script} --base {input.base} --adapter {input.adapter} --probe {input.probe}"
        " --out {output.model} --max-shard-size {params.max_shard_size:q} --dtype {params.dtype}"
        " > {log} 2>&1"
