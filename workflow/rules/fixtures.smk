# Offline fixtures for the demo and the tests: a tiny Llama model, the demo's arithmetic task
# and a GSM8K-like dataset.


rule make_fixtures:
    input:
        script=f"{SCRIPTS}/make_fixtures.py",
    output:
        model=directory("resources/fixtures/tiny-llama"),
        train="resources/fixtures/gsm8k-demo/train.jsonl",
        test="resources/fixtures/gsm8k-demo/test.jsonl",
        arith_train="resources/fixtures/arith-demo/train.jsonl",
        arith_test="resources/fixtures/arith-demo/test.jsonl",
        pairs_train="resources/fixtures/arith-demo/pairs-train.jsonl",
        pairs_test="resources/fixtures/arith-demo/pairs-test.jsonl",
    log:
        "logs/make_fixtures/make_fixtures.log",
    benchmark:
        "benchmarks/make_fixtures/make_fixtures.tsv"
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python {input.script} --out resources/fixtures > {log} 2>&1"


# The agent demo's (config/agent_demo.yaml): a tiny model with Llama 3.2's chat template,
# tool-call transcripts and the questions.
rule make_agent_fixtures:
    input:
        script=f"{SCRIPTS}/make_fixtures.py",
    output:
        model=directory("resources/fixtures/tiny-agent"),
        transcripts="resources/fixtures/agent-demo/transcripts.jsonl",
        train="resources/fixtures/agent-demo/train.jsonl",
        test="resources/fixtures/agent-demo/test.jsonl",
    log:
        "logs/make_fixtures/make_agent_fixtures.log",
    benchmark:
        "benchmarks/make_fixtures/make_agent_fixtures.tsv"
    localrule: True
    conda:
        "../../envs/snaketune.yaml"
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "python {input.script} --agent --out resources/fixtures > {log} 2>&1"
