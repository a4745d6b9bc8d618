# The best member of each sweep (runs.<name>.sweep; snaketune/plan/sweep.py): results/<name>/best.json.
# A checkpoint: a run that starts from the sweep (init_from) and the sweep's publish read
# the choice once it is made.


checkpoint select_sweep:
    input:
        unpack(sweep_inputs),
        script=f"{SCRIPTS}/select_sweep.py",
    output:
        "results/{sweep}/best.json",
    log:
        "logs/select_sweep/{sweep}.log",
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    params:
        members=sweep_members,
    shell:
        "python {input.script} --sweep {wildcards.sweep} --members {params.members:q}"
        " --out {output} > {log} 2>&1"
