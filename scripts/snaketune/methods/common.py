"""What every training method shares, and the interface a method fills in.

A method (snaketune.methods.sft, .grpo, .dpo) is a ``Method``: what it is, in one module,
its config block's schema included (``schema``: snaketune.methods.compose_schema puts it
into workflow/schemas/config.schema.yaml's run schema when the schema is read). Config validation,
the shard, memory and disk plans, the stages and publish ask it; none names a method. Its
module stays light to import (Snakemake reads it when it parses the workflow): torch,
transformers and TRL are imported inside the functions that train.

What the config side asks (the "story"): its own config block, the data kind it trains on,
whether it trains an adapter, its cross-key checks, what its plans count, the stages it
needs. What the worker asks: its data for this rank (from the rank's planned rows), its
trainer (a transformers Trainer subclass reading the planned batches through
``batches.planned_loader``, built on snaketune.methods.training), the extra
fields of its per-step record, and how many rows of a step one planned example becomes.
The worker (snaketune.train.worker) does the rest the same way for all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from snaketune.methods.needs import Need
from snaketune.methods.outputs import Panel, no_figures, no_warnings

if TYPE_CHECKING:
    from snaketune.data.batches import Data, PlanBatches

# Whether a method trains a LoRA adapter: always, never (every weight), or when the run has
# a `lora` block.
ADAPTERS = ("lora", "full", "optional")


def no_check(where: str, run: Mapping[str, Any], config: Mapping[str, Any]) -> None:
    return None


def nothing(run: Mapping[str, Any], on_gpu: bool) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class RankRows:
    """What a method's ``data`` builds this rank's data from: the run, its planned rows
    (``table``) and batches, the tokenizer, the attention kernel, where the trained example
    ids are logged, and the outputs of its needs' stages (``inputs``, by the need's name)."""

    run: Mapping[str, Any]
    table: Any
    batches: PlanBatches
    tokenizer: Any
    kernel: str
    ids_log: Path | None
    inputs: Mapping[str, str]

    @property
    def pad(self) -> int:
        from snaketune.core.rows import pad_id

        return pad_id(self.tokenizer)

    def collated(self, collator: Any, table: Any = None) -> Data:
        """The rank's data: its rows (``table``, else the planned ones) by ``collator``."""
        from snaketune.data.batches import Data

        return Data(self.table if table is None else table, self.batches, collator)

    def scored(self, need: Need, read: Callable[[str], Mapping], noun: str) -> Mapping:
        """A need's stage output read (``read``), holding every planned example (``noun``)."""
        scores = read(self.inputs[need.name])
        missing = [i for i in self.table["example_id"] if i not in scores]
        if missing:
            raise RuntimeError(
                f"{len(missing)} planned {noun} have no {need.label} (first: {missing[0]}); "
                f"rerun rule {need.name}"
            )
        return scores


@dataclass(frozen=True)
class Method:
    """A training method: what the config side and the worker ask of it."""

    name: str
    # this rank's planned rows (a RankRows) -> the data it trains on
    data: Callable[[RankRows], Data]
    # (ctx, model, data, callbacks) -> a Trainer
    trainer: Callable[..., Any]
    # the step's logs -> the method's own figures for metrics.jsonl
    step_fields: Callable[[dict[str, Any]], dict[str, Any]]
    # rows of a step that one planned example becomes (GRPO: its completions)
    rows_per_example: Callable[[dict[str, Any]], int]
    # a start-up log line of what the method does this run ("" for none)
    describe: Callable[[dict[str, Any], dict[str, Any]], str]
    # the held-out figure that decides the best checkpoint and early stopping by default
    # (export.metric: auto; snaketune.core.heldout): loss, or exact_match of greedy generations
    heldout_metric: str = "loss"
    # --- the config side
    # what it does, a sentence fragment for the schema's `method` description
    summary: str = ""
    # its config block's JSON Schema (YAML text: `description`, `type: object`,
    # `properties` with their defaults), None when it has no block
    schema: str | None = None
    # the kind of data it trains on (snaketune.data.kinds.KINDS): supervised rows (a prompt
    # and its response), prompts (it generates its own responses: a prompt_response or
    # alpaca set gives each prompt its reference answer) or pairs of responses to one prompt
    trains_on: str = "rows"
    adapter: str = "optional"  # one of ADAPTERS
    # its own config block (runs.<run>.<block>: defaults from the schema), None for none
    block: str | None = None
    # whether it may start from another run's model (init_from)
    starts_from_runs: bool = False
    # whether its rows may be packed (packing: false is forced where not)
    packs: bool = True
    # whether it trains on its kind's examples with pictures (a dataset with columns.images:
    # snaketune.data.pictures, snaketune.data.picture_pairs), its collator building the
    # pictures' model inputs
    takes_pictures: bool = False
    # whether its sequences may be split across GPUs (sequence_parallel): not where it
    # scores whole sequences (pairs, rollouts)
    splits_sequences: bool = False
    # (where, run, config): its cross-key checks (a ConfigError of one line each); `where`
    # is the run's place in the config (runs.<run>)
    check: Callable[[str, Mapping[str, Any], Mapping[str, Any]], None] = no_check
    # (run, on_gpu) -> what the memory plan counts besides the update and the micro batch:
    # snaketune.budget.memplan.Setup's fields (sequences per example, completion length, a
    # reference model, vLLM's share) and fused_loss (False: its loss reads the whole
    # logits, Liger or not)
    memory: Callable[[Mapping[str, Any], bool], dict[str, Any]] = nothing
    # (run) -> what the run needs besides its rows and model, each record of the registry
    # (snaketune.methods.needs) with what it asks of it: the precomputed reference log-probs
    # ({}), a teacher's top-k (`teacher`, the model or run that teaches, `top_k`, the
    # log-probs kept per token), reward models (`runs`, the runs that trained them)
    needs: Callable[[Mapping[str, Any]], Mapping[Need, Mapping[str, Any]]] = lambda run: {}
    # --- what its outputs show (the report, plots, summary, card and export ask these)
    # (run) -> the evaluate stage's settings of its own: `beta`, the beta held-out pairs'
    # implicit rewards are scored with (DPO); `seed`, a new score head's (a reward model)
    eval_settings: Callable[[Mapping[str, Any]], dict[str, Any]] = lambda run: {}
    # its own figures, first in its headline (snaketune.evaluation.figures): the end line,
    # summary, report, card and a sweep's `auto` lead with them, then its data's
    headline: tuple[str, ...] = ()
    # whether its model writes text (next-token logits): evaluation generates and scores,
    # the card shows generation, the merge checks it; else the model scores what it reads
    # (a reward model: held-out pairs scored, one forward pass each, a classification card)
    writes_text: bool = True
    # its training plot's first panel (snaketune.methods.outputs.Panel; None: the loss,
    # with the held-out loss where measured)
    panel: Panel | None = None
    # (its metrics.jsonl rows) -> its own columns of summary.tsv, the fixed ones named in
    # `summary_columns` (a GRPO run's reward by quarter; a preference run's margin)
    summary_figures: Callable[[list[dict[str, Any]]], dict[str, Any]] = no_figures
    summary_columns: tuple[str, ...] = ()
    # (run, its first steps' rows) -> its own early warnings by name (snaketune.train.vitals:
    # GRPO's rewards equal within every group, completions all cut)
    vitals: Callable[[Mapping[str, Any], list[dict[str, Any]]], dict[str, str]] = no_warnings
    # (run) -> sha256 of the user's code the run calls, by the key naming it (GRPO's reward
    # functions): the train job's spec carries it (code_sha256), so changed code retrains
    code: Callable[[Mapping[str, Any]], dict[str, str]] = lambda run: {}
    # what the model it trains outputs (snaketune.evaluation.heads): `lm`, next-token logits, or
    # `score`, one per sequence (a reward model: every stage loads it as one)
    head: str = "lm"
    # its own starting model is scored on its eval set (rule evaluate_start), not shared
    # with other runs of that base (a reward model's start has its new head)
    evaluates_start: bool = False
    # its block as a model card shows it (local paths left out)
    card_block: Callable[[dict[str, Any]], dict[str, Any]] = field(default=lambda b: b)

    @property
    def reward_model(self) -> bool:
        """Whether it trains a reward model: its model outputs one score per sequence, which
        every stage loads, evaluates, exports and reports as such."""
        return self.head == "score"

    def adapter_of(self, run: Mapping[str, Any]) -> str:
        """`lora` or `full`: what a run of this method trains (its checkpoint holds): an
        adapter when the method always does, or may and the run has a `lora` block."""
        lora = self.adapter == "lora" or (self.adapter == "optional" and "lora" in run)
        return "lora" if lora else "full"
