"""Break the product on purpose, one known defect at a time, and show that the fast tests
turn red (docs/testing.md keeps the last result)::

    python tests/mutations.py              # each mutation against the fast tests named for it
    python tests/mutations.py --tier       # each against the whole fast tier (-m "not slow")
    python tests/mutations.py --only weighting

Each mutation replaces one exact piece of source (it must occur exactly once) and is undone
afterwards, also when the run is interrupted. A mutation the tests do not catch is a
missing test: the script exits 1 naming it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIB = "scripts/snaketune"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # the tests that catch it; at least one in the CI tier
    # extended tests that catch it as well (a mutation only those catch names them here, and
    # its tests above may be empty: tests/test_mutations.py checks one or the other)
    extended: tuple[str, ...] = ()


MUTATIONS = (
    Mutation(
        "group-std", "a reward model's per-group z-score divides by the population std, not the sample std TRL uses",
        f"{LIB}/evaluation/model_rewards.py",
        "        var = sum((x - mean) ** 2 for x in chunk) / max(1, len(chunk) - 1)\n",
        "        var = sum((x - mean) ** 2 for x in chunk) / len(chunk)\n",
        ("tests/test_model_rewards.py::test_group_normalisation_is_a_z_score_within_each_prompt_s_completions",),
    ),
    Mutation(
        "prompt-turns", "a reward model reads only the prompt's last turn (the dataset's system prompt dropped)",
        f"{LIB}/evaluation/model_rewards.py",
        "            turns[(name, row)] = tuple(conv[:last])\n",
        "            turns[(name, row)] = tuple(conv[last - 1 : last])\n",
        ("tests/test_model_rewards.py::test_the_prompt_s_turns_come_from_its_source_row",),
    ),
    Mutation(
        "last-token", "pair_batch leaves each side's last response token out of the scored tokens",
        f"{LIB}/data/pairs.py",
        "        completion[i, :n] = torch.as_tensor(np.asarray(labels) != IGNORE_INDEX, dtype=torch.long)\n",
        "        completion[i, :n] = torch.as_tensor(np.asarray(labels) != IGNORE_INDEX, dtype=torch.long)\n"
        "        completion[i, int(np.flatnonzero(np.asarray(labels) != IGNORE_INDEX)[-1])] = 0\n",
        ("tests/test_dpo.py::test_pair_batch_labels_written_out_by_hand",
         "tests/test_dpo.py::test_dpo_loss_of_hand_computed_pairs_equals_trls",
         "tests/test_dpo.py::test_reference_stage_log_probs_equal_the_full_logits"),
    ),
    Mutation(
        "weighting", "PlannedPairs.compute_loss (DPO's and reward models' trainers) without the per-pair weighting",
        f"{LIB}/methods/training.py",
        "        return loss * self.pairs_in(inputs) / self.micro_batch_size",
        "        return loss",
        ("tests/test_dpo.py::test_unequal_micro_batches_give_the_global_batch_mean",
         "tests/test_reward_model.py::test_margins_and_centring_of_unequal_micro_batches_give_the_global_batch_mean"),
    ),
    Mutation(
        "score-at-pad", "a new score head reads no pad id: the score is taken at the last position, padding or not",
        f"{LIB}/evaluation/heads.py",
        "        text.pad_token_id = pad_id_of(model_dir)\n",
        "        text.pad_token_id = None\n        return model\n",
        ("tests/test_reward_model.py::test_the_score_is_read_at_the_last_real_token_of_a_padded_batch",
         "tests/test_reward_model.py::test_a_new_score_head_is_drawn_from_the_seed_and_reads_the_pad_id"),
    ),
    Mutation(
        "eval-examples", "the held-out loss (the evaluate stage's and the pass while training) divides by examples, not tokens",
        f"{LIB}/evaluation/evaluate.py",
        "    loss = total / max(count, 1)",
        "    loss = total / max(len(rows), 1)",
        ("tests/test_oracles.py::test_evaluate_stage_loss_is_the_token_mean_of_the_label_nll",
         "tests/test_oracles.py::test_heldout_pass_loss_is_the_token_mean_of_the_label_nll"),
    ),
    Mutation(
        "share-order", "a sharded evaluation joins the ranks' shares rank after rank, not in the eval set's order",
        f"{LIB}/evaluation/sharded.py",
        "        return [every[i % self.world][i // self.world] for i in range(total)]",
        "        return [x for part in every for x in part]",
        ("tests/test_big_models.py::test_every_rank_share_joins_back_in_the_eval_sets_order",),
    ),
    Mutation(
        "kept-best", "runspec.kept_best inverts greater-is-better",
        f"{LIB}/plan/runspec.py",
        "    return metric, greater_is_better(metric)",
        "    return metric, not greater_is_better(metric)",
        ("tests/test_heldout.py::test_the_checkpoint_a_run_keeps_as_best",),
    ),
    Mutation(
        "eval-save-multiple", "eval_steps/save_steps' multiple check reversed",
        f"{LIB}/core/heldout.py",
        '    if best and steps % run["save_steps"]:',
        '    if best and run["save_steps"] % steps:',
        ("tests/test_heldout.py::test_export_best_needs_evaluations_on_saved_steps",),
    ),
    Mutation(
        "double-quant", "the memory plan assumes double quantization always",
        f"{LIB}/budget/fit.py",
        '        double_quant=bool(spec.quantized and spec.quantization["double_quant"]),',
        "        double_quant=True,",
        ("tests/test_memplan.py::test_4bit_weights_are_what_bitsandbytes_holds",),
    ),
    Mutation(
        "ragged", "the ragged gather passes unequal rank counts straight to the all-gather",
        f"{LIB}/core/collective.py",
        "        if min(sizes) == width:",
        "        if True:",
        ("tests/test_dpo.py::test_a_ragged_gather_joins_unequal_rank_counts",),
    ),
    Mutation(
        "active-experts", "the plan counts a mixture's active experts only (the issue's 3.3B for Qwen3-30B-A3B)",
        f"{LIB}/core/modelshape.py",
        "            self.experts * self.expert_params\n",
        "            self.experts_per_token * self.expert_params\n",
        ("tests/test_moe.py::test_a_tiny_model_of_each_family_is_counted_exactly",
         "tests/test_moe.py::test_each_familys_published_model_is_counted_within_a_percent"),
    ),
    Mutation(
        "router-adapted", "the routers get adapters without lora.adapt_router",
        f"{LIB}/core/lora_targets.py",
        '    every, router = targets == "all-linear", bool(lora.get("adapt_router", False))',
        '    every, router = targets == "all-linear", True',
        ("tests/test_moe.py::test_adapters_reach_the_experts_and_the_router_only_when_asked",),
    ),
    Mutation(
        "expert-order", "the experts' merge reads B's stacked ranks expert-major, as A's",
        f"{LIB}/export/experts.py",
        "        b = self.b.float().reshape(self.b.shape[0], -1, experts)",
        "        b = self.b.float().reshape(self.b.shape[0], experts, -1).transpose(1, 2)",
        ("tests/test_moe.py::test_each_experts_change_merged_gives_the_adapter_models_logits",),
    ),
    Mutation(
        "sp-slice", "a sequence-parallel GPU takes its data-parallel rank's slice, not its place in its group",
        f"{LIB}/data/sequence.py",
        "        return split(self._inner(examples), self._n, self._rank % self._n, self._pad)",
        "        return split(self._inner(examples), self._n, self._rank // self._n, self._pad)",
        ("tests/test_sequence.py::test_each_gpu_of_a_group_cuts_its_own_slice_and_only_the_first_counts",),
    ),
    Mutation(
        "router-accumulation", "the MoE router term is not divided by gradient accumulation",
        f"{LIB}/methods/training.py",
        "        return self.coef * self.aux(outputs, mask) / self.accumulation",
        "        return self.coef * self.aux(outputs, mask)",
        ("tests/test_moe.py::test_the_router_term_is_the_coefficient_times_the_mean_of_a_step_s_micro_batches",),
    ),
    Mutation(
        "user-columns", "a user's reward function is no longer given the source row's columns",
        f"{LIB}/evaluation/rewards.py",
        '        x.update({k: v for k, v in columns[x["example_id"]].items() if k not in x})',
        "        pass",
        ("tests/test_rewards.py::test_the_source_rows_other_columns_reach_the_function",),
    ),
    Mutation(
        "user-columns-unused", "GRPO's trainer never hands the step's inputs their source rows' columns",
        f"{LIB}/methods/rollout_trainer.py",
        "            rewards.add_columns(inputs, columns)",
        "            pass",
        # the CI tier's GRPO chain: config/rewards/arith.py reads the `question` column
        ("tests/test_grpo.py::test_publish_dry_run_writes_the_folder_with_a_model_card",),
    ),
    Mutation(
        "rloo-normalized", "RLOO's advantages scaled to unit spread where the run did not ask",
        f"{LIB}/methods/rloo.py",
        "RLOOConfig, normalize_advantages=normalize\n",
        "RLOOConfig, normalize_advantages=True\n",
        ("tests/test_rloo.py::test_rloo_on_two_nodes_equals_the_oracle",),
    ),
    Mutation(
        "rollouts-other-rank", "the rollouts log records another rank's rewards",
        f"{LIB}/methods/rollout_trainer.py",
        "    mine = scored[at : at + len(inputs)]",
        "    mine = scored[: len(inputs)]",
        ("tests/test_rloo.py::test_rloo_on_two_nodes_equals_the_oracle",),
    ),
    Mutation(
        "teacher-position", "the teacher stage stores the distribution at the label's own position, not the one before",
        f"{LIB}/evaluation/topk.py",
        "            logp = torch.log_softmax(logits[j, t - 1].float(), dim=-1)",
        "            logp = torch.log_softmax(logits[j, t].float(), dim=-1)",
        ("tests/test_distill.py::test_the_teacher_stage_stores_the_teachers_own_log_softmax_top_k",),
    ),
    Mutation(
        "teacher-order", "the teacher's top-k laid out in the examples' order where packed rows reorder them",
        f"{LIB}/data/packing.py",
        '    if layout != "rows":',
        "    if True:",
        ("tests/test_distill.py::test_the_collator_puts_each_teachers_top_k_beside_its_target",),
    ),
    Mutation(
        "kl-direction", "the forward KL computed as the student's, KL(student || teacher)",
        f"{LIB}/evaluation/topk.py",
        "    forward = (t.exp() * (t - s)).sum(-1)",
        "    forward = (s.exp() * (s - t)).sum(-1)",
        ("tests/test_distill.py::test_each_divergence_is_the_papers",),
    ),
    Mutation(
        "distill-rank-mean", "the distillation loss averaged over each rank's own label tokens",
        f"{LIB}/methods/distill.py",
        "            items = num_items_in_batch if num_items_in_batch is not None else max(n, 1)",
        "            items = max(n, 1) * self.accelerator.num_processes",
        ("tests/test_distill.py::test_a_two_rank_distillation_step_logs_the_loss_written_out_in_plain_torch",),
    ),
    Mutation(
        "text-marked-wrong", "the report marks a free-text sample right or wrong (no checker)",
        f"{LIB}/app/report.py",
        "        if s.get(\"reference_answer\") is not None:\n            ok",
        "        if True:\n            ok",
        ("tests/test_task_eval.py::"
         "test_the_report_shows_the_reference_text_and_marks_only_what_a_checker_decides",),
    ),
    Mutation(
        "steps-without-accumulation", "the plan's steps forget gradient accumulation",
        f"{LIB}/budget/cost.py",
        '        run["gradient_accumulation_steps"],\n',
        "        1,\n",
        ("tests/test_cost.py::test_steps_per_epoch_are_the_examples_over_one_step_s_examples",),
    ),
    Mutation(
        "stage-download-again", "the plan counts a model's download that is done already",
        f"{LIB}/budget/stagecost.py",
        '        if shape is not None and not done and f"download_model {model}" not in out:',
        '        if shape is not None and f"download_model {model}" not in out:',
        ("tests/test_cost.py::"
         "test_each_stage_of_a_gpu_run_without_calibration_is_worked_out_by_hand",),
    ),
    Mutation(
        "sigint-not-a-stop", "Ctrl-C is not a stop for the ranks (they train on)",
        f"{LIB}/train/progress.py",
        '    STOPS = ("SIGTERM", "SIGINT")',
        '    STOPS = ("SIGTERM",)',
        ("tests/test_train_units.py::"
         "test_sigint_saves_and_stops_like_sigterm_and_a_repeat_is_the_same_request",),
    ),
    Mutation(
        "vitals-one-step", "a run is warned about after one flat step, not five",
        f"{LIB}/methods/outputs.py",
        "    return len(values) >= WINDOW and all(",
        "    return len(values) >= 1 and all(",
        ("tests/test_train_units.py::"
         "test_a_run_that_cannot_learn_is_warned_about_in_its_first_steps",),
    ),
    Mutation(
        "failed-log-whole", "the terminal prints a failed job's whole log (a training's is all of it)",
        f"{LIB}/app/terminal.py",
        "        out += (errors or text)[-lines:]",
        "        out += text",
        ("tests/test_terminal.py::"
         "test_a_failed_job_is_one_line_with_its_log_and_the_log_s_error_lines",),
    ),
    Mutation(
        "simpo-no-margin", "SimPO's collator leaves out the target margin gamma",
        f"{LIB}/methods/simpo.py",
        "        self.margin = gamma / beta",
        "        self.margin = 0.0",
        ("tests/test_dpo.py::test_simpo_of_unequal_micro_batches_equals_the_paper_s_loss",),
    ),
    Mutation(
        "orpo-labels-whole", "ORPO's collator labels each side whole (the odds over the prompt too)",
        f"{LIB}/methods/orpo.py",
        "                labels[i, : len(seq)] = torch.as_tensor(lab, dtype=torch.long)",
        "                labels[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)",
        ("tests/test_dpo.py::test_orpo_of_unequal_micro_batches_equals_the_paper_s_loss",),
    ),
    Mutation(
        "kto-own-partner", "KTO's KL sequence of a pair is its own prompt and response (no mismatch)",
        f"{LIB}/methods/kto.py",
        "        return self.table[(self.row_of[example_id] + 1) % len(self.table)]",
        "        return self.table[self.row_of[example_id]]",
        ("tests/test_dpo.py::test_kto_of_unequal_micro_batches_equals_the_paper_s_loss",),
    ),
    Mutation(
        "labelled-flipped", "a labelled dataset's rows are tokenized with their label flipped",
        f"{LIB}/data/labelled.py",
        "    kept = [desirable[i] for i in table.column(\"example_id\").to_pylist()]",
        "    kept = [not desirable[i] for i in table.column(\"example_id\").to_pylist()]",
        ("tests/test_kto.py::"
         "test_labelled_responses_tokenize_with_their_label_and_only_the_completion_labelled",),
    ),
    Mutation(
        "pairs-every-rank", "a sharded evaluation scores every pair on every rank (not its share)",
        f"{LIB}/evaluation/preference.py",
        "    mine, out = share.mine(rows), []",
        "    mine, out = rows, []",
        ("tests/test_dpo.py::test_each_rank_scores_only_its_share_of_the_held_out_pairs",),
    ),
    Mutation(
        "cpu-plan-dtype", "the CPU-memory plan counts the checkpoint's dtype, not the run's precision",
        f"{LIB}/budget/memplan.py",
        "    return p * s.bytes_per_weight * s.gpus_per_node",
        "    return p * (shape.saved_bytes or s.bytes_per_weight) * s.gpus_per_node",
        ("tests/test_memplan.py::test_cpu_memory_per_node_is_counted_in_the_run_s_precision",),
    ),
    Mutation(
        "gate-up-swap", "an expert merge swaps gate and up (the stacked change's halves)",
        f"{LIB}/export/experts.py",
        '    return {"gate_proj": delta[e, :half], "up_proj": delta[e, half:], "down_proj": delta[e]}[which]',
        '    return {"gate_proj": delta[e, half:], "up_proj": delta[e, :half], "down_proj": delta[e]}[which]',
        ("tests/test_moe.py::test_each_expert_s_gate_up_and_down_are_the_stacked_change_s_parts_at_peft_s_scale",),
    ),
    Mutation(
        "rslora-scale", "an expert merge ignores rsLoRA's scale (alpha / r, not alpha / sqrt(r))",
        f"{LIB}/export/experts.py",
        '    return alpha / r**0.5 if adapter_config.get("use_rslora") else alpha / r',
        "    return alpha / r",
        ("tests/test_moe.py::test_each_expert_s_gate_up_and_down_are_the_stacked_change_s_parts_at_peft_s_scale",),
    ),
    Mutation(
        "micro-accumulation", "the pair trainers' (DPO's, reward models') micro batch multiplied by accumulation",
        f"{LIB}/methods/training.py",
        '        self.planned, self.micro_batch_size = planned, run["micro_batch_size"]',
        '        self.planned, self.micro_batch_size = planned, run["micro_batch_size"] * run["gradient_accumulation_steps"]',
        ("tests/test_dpo.py::test_unequal_micro_batches_give_the_global_batch_mean",
         "tests/test_reward_model.py::test_margins_and_centring_of_unequal_micro_batches_give_the_global_batch_mean"),
    ),
    Mutation(
        "expert-dropout", "a mixture of experts' LoRA config given the run's dropout (peft refuses it)",
        f"{LIB}/methods/training.py",
        '    dropout = 0.0 if targets.get("target_parameters") else lora["dropout"]',
        '    dropout = lora["dropout"]',
        ("tests/test_moe.py::test_the_schemas_default_dropout_builds_on_a_mixture_of_experts",),
    ),
    Mutation(
        "router-logits-export", "an export keeps training's router logits and KV cache switches",
        f"{LIB}/export/convert.py",
        "        if hasattr(config, key) and getattr(config, key) != want:",
        "        if False:",
        ("tests/test_moe.py::test_an_export_has_the_bases_inference_settings_back",
         "tests/test_export.py::test_full_zero3_converts_to_a_model_transformers_loads"),
    ),
    Mutation(
        "omp-passive-always", "the local launcher makes OpenMP threads sleep for every launch",
        f"{LIB}/train/agents.py",
        "    if threads > cores:",
        "    if True:",
        ("tests/test_train_units.py::test_openmp_threads_sleep_only_where_the_ranks_threads_outnumber_the_cores",),
    ),
    Mutation(
        "prompted-markup", "a template that is not prefix-stable: the markup the model writes after the generation prompt (an opened thought block's end, a channel header) is left untrained",
        f"{LIB}/data/fullrender.py",
        "        if before <= prompted <= start:\n",
        "        if False:\n",
        ("tests/test_templates.py::test_each_familys_template_trains_the_assistant_turns_as_transformers_renders_them",),
    ),
    Mutation(
        "end-of-turn", "a template that is not prefix-stable: the end-of-turn token after an assistant message is left untrained",
        f"{LIB}/data/fullrender.py",
        "            return end + stop\n",
        "            return end\n",
        ("tests/test_templates.py::test_each_familys_template_trains_the_assistant_turns_as_transformers_renders_them",),
    ),
    Mutation(
        "aux-free-term", "a family without an auxiliary loss (DeepSeek-V3) gets transformers' default balance term anyway",
        f"{LIB}/methods/training.py",
        "            coef = 0.0\n",
        "            coef = 0.001\n",
        ("tests/test_families.py::test_each_family_trains_on_its_own_template_and_exports_a_model_that_generates",),
    ),
    Mutation(
        "pictures-dropped", "a batch's pictures never reach the model (no pixel_values beside the image tokens)",
        f"{LIB}/data/pictures.py",
        "    if flat:\n        made = processor.image_processor(",
        "    if not flat:\n        made = processor.image_processor(",
        ("tests/test_pictures.py::test_a_tiny_vlm_trains_on_pictures_and_its_heldout_loss_is_plain_transformers",),
    ),
    Mutation(
        "picture-labels-shifted", "the labels are not carried onto the processor's expanded tokens (kept at their unexpanded places)",
        f"{LIB}/data/pictures.py",
        "            out[j1:j2] = labels[i1:i2]\n",
        "            out[i1:i2] = labels[i1:i2]\n",
        ("tests/test_pictures.py::test_the_tokens_are_the_processors_and_only_the_answer_is_trained",),
    ),
    Mutation(
        "tool-results-trained", "a tool's result in a chat row is trained like an assistant turn (the full-render path)",
        f"{LIB}/data/fullrender.py",
        '        if turn[0] != "assistant":',
        '        if turn[0] not in ("assistant", "tool"):',
        ("tests/test_toolcalls.py::test_a_tool_call_rows_calls_and_answers_are_trained_and_its_tool_results_are_not",),
    ),
    Mutation(
        "tool-call-found-by-name", "a call's place in a render found by its function's name (Gemma 4 prints it again in the tool's result)",
        f"{LIB}/data/toolcalls.py",
        '    calls[-1]["function"]["arguments"][f"{before}{after}"] = ""',
        '    calls[-1]["function"]["name"] = f"{before}{calls[-1][\'function\'][\'name\']}{after}"',
        ("tests/test_toolcalls.py::test_a_tool_call_rows_calls_and_answers_are_trained_and_its_tool_results_are_not",),
    ),
    Mutation(
        "falsy-argument-dropped", "a tool call's argument that is present but falsy (0, \"\", false) dropped with Arrow's nulls: add(a=0, b=3) trains as add(b=3)",
        f"{LIB}/data/toolcalls.py",
        "            arguments = {key: v for key, v in arguments.items() if v is not None}\n",
        "            arguments = {key: v for key, v in arguments.items() if v}\n",
        ("tests/test_toolcalls.py::test_an_argument_present_but_falsy_is_kept_where_a_null_is_dropped",),
    ),
    Mutation(
        "falsy-value-downloaded-away", "the download's struct cleaning drops a falsy value with the nulls Arrow filled in",
        f"{LIB}/data/sources.py",
        "        kept = {k: _no_empty(v) for k, v in value.items() if v is not None}\n",
        "        kept = {k: _no_empty(v) for k, v in value.items() if v}\n",
        ("tests/test_toolcalls.py::test_an_argument_present_but_falsy_is_kept_where_a_null_is_dropped",),
    ),
    Mutation(
        "picture-set-by-prefix", "the disk plan takes any tokenized set whose name starts with the dataset and model for the run's own (another model's, or another max_length's)",
        f"{LIB}/budget/pictureplan.py",
        '            "tokenized": parts.exists(root / tokenized(config, name, key == "eval_dataset")),\n',
        '            "tokenized": any((root / "results/tokenized").glob(f"{dataset}__{run[\'model\']}__*/data.parquet")),\n',
        ("tests/test_pictures.py::test_the_disk_plan_counts_the_pictures_the_tokenized_files_and_shards_will_hold",),
    ),
    Mutation(
        "hung-tool-blocks", "a tool that hangs holds its rank until it returns (no time limit in effect)",
        f"{LIB}/tools/toolrunner.py",
        "        if not self._conn.poll(self.timeout_s):",
        "        if not self._conn.poll(self.timeout_s * 40):",
        ("tests/test_toolrunner.py::test_each_kind_of_failing_tool_is_told_to_the_model_counted_and_survived",),
    ),
    Mutation(
        "grpo-tool-limits-ignored", "GRPO's tool runner ignores grpo.tool_timeout_s and tool_max_chars",
        f"{LIB}/tools/tooluse.py",
        '            b["tools"], b["tool_timeout_s"], b["tool_max_chars"], b.get("environment")',
        '            b["tools"], environment=b.get("environment")',
        ("tests/test_agents.py::test_grpo_with_tools_after_sft_survives_failing_tools_and_counts_them",),
    ),
    Mutation(
        "vision-never-adapted", "lora.adapt_vision: true leaves the vision tower without adapters",
        f"{LIB}/core/lora_targets.py",
        "            if vision and linear and targeted(name, every, names):",
        "            if False and linear and targeted(name, every, names):",
        ("tests/test_pictures.py::test_lora_adapts_the_language_model_alone_unless_adapt_vision_says_so",),
    ),
    Mutation(
        "picture-reference-blind", "the reference stage scores picture pairs without their pictures (image tokens with no pixels)",
        f"{LIB}/evaluation/logps.py",
        "            scored.update(inputs_of(model, part, batch[\"input_ids\"]))",
        "            scored.update({})",
        ("tests/test_pictures.py::test_a_picture_pair_batch_and_its_reference_log_probs_are_plain_transformers",),
    ),
    Mutation(
        "picture-pairs-rejected-blind", "a picture pair's rejected side is collated without the prompt's pictures",
        f"{LIB}/data/picture_pairs.py",
        "        return pictures.model_inputs(processor, rows * 2, ids)",
        "        return pictures.model_inputs(processor, rows + [[] for _ in rows], ids)",
        ("tests/test_pictures.py::test_a_picture_pair_batch_and_its_reference_log_probs_are_plain_transformers",),
    ),
    Mutation(
        "piece-overlap", "a long document's pieces overlap by a token (a piece starts at its predecessor's last token)",
        f"{LIB}/data/text.py",
        "    for a in range(0, len(doc), size):\n",
        "    for a in range(0, len(doc), size - 1):\n",
        ("tests/test_text.py::test_documents_are_the_tokenizers_tokens_and_end_of_text_with_every_token_kept",),
    ),
    Mutation(
        "no-end-of-text", "a document gets no end-of-text token where the tokenizer adds none",
        f"{LIB}/data/text.py",
        "    return before, after if after[-1:] == [eos] else [*after, eos]\n",
        "    return before, after\n",
        ("tests/test_text.py::test_documents_are_the_tokenizers_tokens_and_end_of_text_with_every_token_kept",),
    ),
    Mutation(
        "part-overlap", "a part reads one row past its end (the next part's first row twice)",
        f"{LIB}/core/parts.py",
        "    return part * total // parts, (part + 1) * total // parts\n",
        "    return part * total // parts, min(total, (part + 1) * total // parts + 1)\n",
        ("tests/test_text.py::test_the_parts_of_a_set_cover_every_row_once",
         "tests/test_text.py::test_a_set_tokenized_in_parts_is_the_set_tokenized_whole"),
    ),
    Mutation(
        "labels-unfilled", "a text row's missing labels are read back as no labels (nothing trained)",
        f"{LIB}/core/rows.py",
        "    filled = pc.if_else(pc.is_null(labels), table.column(\"input_ids\"), labels)\n",
        "    filled = labels\n",
        ("tests/test_text.py::test_with_labels_fills_only_the_rows_without_labels",),
    ),
)  # fmt: skip


def run_tests(tests: list[str]) -> tuple[bool, float, str]:
    """(passed, seconds, last line) of pytest over ``tests``, stopping at the first failure."""
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *tests], cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    return proc.returncode == 0, time.monotonic() - began, lines[-1] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--tier", action="store_true",
                        help='run the whole fast tier (-m "not slow") against each mutation')  # fmt: skip
    parser.add_argument("--only", action="append", help="run only this mutation (repeatable)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    missed = []
    for m in chosen:
        path = ROOT / m.path
        original = path.read_text()
        if original.count(m.old) != 1:
            print(
                f"{m.name}: the source to mutate is not found once in {m.path}; update tests/mutations.py"
            )
            return 2
        tests = ["-m", "not slow", "tests"] if args.tier else [*m.tests, *m.extended]
        baseline, _, line = run_tests(tests) if not args.tier else (True, 0.0, "")
        if not baseline:
            print(f"{m.name}: the tests fail before the mutation ({line}); fix them first")
            return 2
        try:
            path.write_text(original.replace(m.old, m.new))
            passed, seconds, line = run_tests(tests)
        finally:
            path.write_text(original)
        verdict = "MISSED" if passed else "caught"
        print(f"{m.name:20s} {verdict:6s} {seconds:6.1f} s  {m.what}: {line}")
        if passed:
            missed.append(m.name)
    if missed:
        print(f"not caught: {', '.join(missed)}")
        return 1
    print(f"all {len(chosen)} mutations caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
