# All runs side by side.


rule report:
    input:
        unpack(report_inputs),
        script=f"{SCRIPTS}/report.py",
    output:
        summary=report(
            "results/summary.tsv", caption="../report/summary.rst", category="Summary"
        ),
        html=report(
            "results/summary.html", caption="../report/summary.rst", category="Summary"
        ),
        curves=report(
            directory("results/loss_curves"),
            patterns=["{run}.svg"],
            caption="../report/loss_curve.rst",
            category="Loss curves",
        ),
    log:
        "logs/report/report.log",
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    params:
        runs=stages.as_json(config["runs"]),
        cleaned=stages.as_json(targets.cleaned_reports(config)),
    shell:
        "python {input.script} --runs {params.runs:q} --summary {output.summary}"
        " --curves {output.curves} --html {output.html} --cleaned {params.cleaned:q}"
        " > {log} 2>&1"
